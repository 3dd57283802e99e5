"""A table of kpx's in nft, rendered from its objects: written anew, or in place over the last.

Why two ways. Anew (declare the table, delete it, write it, in one
transaction) makes whatever is there vanish, a crashed kpx's leftover or
an older layout, so it is how a table is first written. It is no way to
change one:

- Deleting a table deletes its base chains, and unregistering a netfilter
  hook makes the kernel drop every packet waiting in any queue of the
  namespace (``nf_queue_nf_hook_drop``): another program's, or kpx's own.
- The commit is one, but a new connection can still slip between the two
  tables of a nat chain: rewriting anew a table whose nat rule looks up a
  set refused now and then a SYN it should have DNATed (docs/PERFORMANCE.md,
  "Rewriting an nft table"); changed in place, never.

In place, as kube-proxy's nftables mode changes its table: declare each
object (nothing happens to one that is there), flush each, delete the ones
no longer wanted, and fill the rest again, in one transaction. The base
chains and their hooks stay.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

Object = tuple[str, str, str, str]
"""``(kind, name, head, contents)``: kind ``set``, ``map`` or ``chain``; a set's or map's
head is its declaration (``type inet_service;``) and its contents ``elements = {...};``
or nothing; a chain's head is its hook line (or nothing, a regular chain) and its
contents its rules, one per line, each ending in a newline."""


def elements(items: Iterable[str]) -> str:
    """A set's or map's contents: `` elements = { a, b };``, or nothing for none."""
    body = ", ".join(items)
    return f" elements = {{ {body} }};" if body else ""


def _object(kind: str, name: str, head: str, contents: str) -> str:
    if kind == "chain":
        return f"  chain {name} {{\n" + (f"    {head}\n" if head else "") + f"{contents}  }}\n"
    return f"  {kind} {name} {{ {head}{contents} }}\n"


@dataclass(frozen=True, slots=True)
class NftTable:
    """One table as kpx wants it, rendered once (a big one is megabytes); pure, any thread."""

    ref: str
    """How nft names it: ``ip kpx_vips``."""
    heads: tuple[tuple[str, str, str], ...]
    """Every object's ``(kind, name, head)``, in the order declared."""
    filled: str
    """The table with every element and rule: ``table ip kpx_vips { ... }``."""

    @classmethod
    def render(cls, family: str, name: str, objects: Iterable[Object]) -> NftTable:
        objects = list(objects)
        ref = f"{family} {name}"
        filled = "".join([f"table {ref} {{\n", *(_object(*o) for o in objects), "}\n"])
        return cls(ref, tuple((kind, n, head) for kind, n, head, _ in objects), filled)

    @property
    def names(self) -> frozenset[tuple[str, str]]:
        """Its objects' ``(kind, name)``: what ``in_place`` is told the table held."""
        return frozenset((kind, name) for kind, name, _ in self.heads)

    def anew(self) -> str:
        """The transaction that replaces whatever table of this name is there with this one."""
        return f"table {self.ref}\ndelete table {self.ref}\n{self.filled}"

    def in_place(self, before: Iterable[tuple[str, str]] = ()) -> str:
        """The transaction that turns a table holding the objects ``before`` (and ours, if
        there) into this one, keeping every object both have, so every base chain.

        nft refuses it as a whole if the table holds an object of another
        type or hook than ours: the caller then writes it ``anew``.
        """
        skeleton = "".join([f"table {self.ref} {{\n",
                            *(_object(kind, name, head, "") for kind, name, head in self.heads),
                            "}\n"])
        flush = "".join(f"flush {kind} {self.ref} {name}\n" for kind, name, _ in self.heads)
        # Chains first: a set or map goes once no rule of a going chain looks it up.
        going = sorted(set(before) - self.names, key=lambda o: (o[0] != "chain", o))
        delete = "".join(f"delete {kind} {self.ref} {name}\n" for kind, name in going)
        return skeleton + flush + delete + self.filled
