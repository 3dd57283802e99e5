"""The fast reader of the block-style YAML subset that kubectl prints; PyYAML reads the rest.

Owns: ``_read_subset`` and what it is made of: the line reader
(``_read_line``), the block builder (``_build``) and the compiler of
document shapes (``_compile``); and its off switch, ``KPX_NO_FAST_YAML``.

Never: guess. What is outside the subset is declined (None) and goes to
PyYAML, so an error is always PyYAML's to report; what the reader does
read is exactly what PyYAML would build from it.

Theory: the block-style subset that kubectl, ``yaml.safe_dump`` and the kpx
tools print (``key: value`` lines, ``- `` items, single-line plain or quoted
scalars, ``{}`` and ``[]``) is read by ``_read_subset``, about 10x faster than
PyYAML with libyaml: most lines of a state repeat verbatim from object to
object, so each distinct line is read once per parse, and documents that
differ only in names and numbers have the same shape, which is compiled
once into a program that builds them without a branch per line. Plain
scalars are resolved and built by PyYAML's own resolver rules (joined into
one regex per first character) and constructors (``decode._plain``), so
``yes``, ``0o17`` or ``2024-05-01`` mean exactly what they mean to PyYAML.
Anything else (flow collections, multi-line scalars, anchors, tags,
escapes, comments after a value, non-ASCII text) is declined and the
chunk goes to PyYAML. What could nest past ``decode._MAX_DEPTH`` is
declined too (``_MAX_SUBSET_STACK``), so PyYAML's door measures it and
refuses it in its own words.

The off switch: ``KPX_NO_FAST_YAML``, set in the environment to anything but
empty or ``0``, sends every YAML chunk to PyYAML (as aiohttp's
``AIOHTTP_NO_EXTENSIONS`` selects its pure-Python parser): for ruling the
reader out when a state reads unexpectedly, or for measuring it. It is read
once, at import, into ``FAST_YAML``; ``use_fast_yaml`` sets that at run time
(the tests run over both readers with it). Both roads give the same
snapshots and the same problems, word for word: the reader never reports
anything itself. JSON states are not YAML chunks, and keep their own road.

Code built at run time (``_compile``), and why it is safe: for a document
shape seen ``_COMPILE_AFTER`` times, ``_compile`` writes the source of one
function and ``exec``s it. For a document of these nine lines (and the empty
string after its last line break, which ``split`` yields as a tenth)::

    kind: Service
    metadata:
      name: web
      labels: {}
    spec:
      ports:
      - port: 80
        protocol: TCP
      - 8080

it writes exactly this (``...`` stands for the same pattern for lines 2 to 7)::

    def build(r):
        (_, _, _, k0, v0), (_, _, _, k1, v1), ..., (_, _, _, k8, v8), _, = r
        return {k0: v0, k1: {k2: v2, k3: {}}, k4: {k5: [{k6: v6, k7: v7}, v8]}}

What goes into that source: the fixed words ``def build(r):``, ``= r``,
``return`` and ``None``; the names ``_``, ``k<n>`` and ``v<n>``, where
``<n>`` is a line's index, an ``int`` from ``enumerate``; and brackets,
braces, colons, commas, spaces and line breaks. Nothing else: before
``_build`` lays out the tree, every key and value of the readings is
replaced by a ``_Slot`` whose only text is its generated name, so the tree
that ``_source`` writes out holds ``_Slot``s, ``None``, dicts and lists, and
no text of the document (nor the shape ints, which only chose the
structure). The document's keys and values reach the built objects only
when the function runs, as the values that ``r``, the list of readings,
unpacks into ``k<n>`` and ``v<n>``: data, never code. So nothing needs
escaping, and no state can make kpx run code of its choosing. The
program's size is bounded (``_MAX_COMPILED_LINES`` lines,
``_MAX_COMPILED_DEPTH`` levels), and a shape whose source Python's compiler
refuses stays with ``_build``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from itertools import compress
from operator import itemgetter, not_
from typing import Any, cast

from proxy.k8s.decode import _DECLINE, _MAX_DEPTH, _MISSING, _plain

FAST_YAML: bool = os.environ.get("KPX_NO_FAST_YAML", "") in ("", "0")
"""Whether YAML chunks are offered to ``_read_subset`` before PyYAML (see the module
docstring); False when ``KPX_NO_FAST_YAML`` is set, non-empty and not ``0``."""


def use_fast_yaml(on: bool) -> bool:
    """Offer YAML chunks to the fast reader (True) or send them all to PyYAML (False)
    from the next parse on; returns what it was, so a caller can put it back."""
    global FAST_YAML
    was, FAST_YAML = FAST_YAML, on
    return was


# The block-style subset.

_SUBSET_UNSAFE = re.compile(r"[^\n -~]")
"""Anything but LF and printable ASCII: tabs, CR, control and non-ASCII characters."""
_PLAIN_FIRST = r"(?:[A-Za-z0-9_./~+(\\$^]|-(?=[A-Za-z0-9_.]))"
_PLAIN_WORD = r"[^:\n ]*(?::[^: \n][^:\n ]*)*"
"""No space, and a ``:`` only before another character (``a:b``, not ``a:``)."""
_PLAIN_KEY = _PLAIN_FIRST + _PLAIN_WORD
_PLAIN_VALUE = rf"{_PLAIN_FIRST}{_PLAIN_WORD}(?: +[^ \n#:]{_PLAIN_WORD})*"
"""A one-line plain scalar: no indicator first, no ``: `` or `` #`` inside, no ``:`` last."""
_QUOTED = r"'[^'\n]*(?:''[^'\n]*)*'|\"[^\"\\\n]*\""
"""Single-quoted, or double-quoted without escapes."""
_VALUE = rf"{_PLAIN_VALUE}|{_QUOTED}|\{{\}}|\[\]"
_SUBSET_LINE = re.compile(rf"( *)(- +)?(?:({_PLAIN_KEY}|{_QUOTED}):(?: +({_VALUE}))?|({_VALUE})) *")
"""One content line: indent, ``- ``, and ``key:``, ``key: value`` or ``value``."""
_SIMPLE_LINE = re.compile(r"( *)([A-Za-z][-A-Za-z0-9_./]*): ([A-Za-z0-9][-A-Za-z0-9_.]*)")
"""The commonest line, ``  key: value`` with a plain word for each, three times cheaper
to match. Its lines are ``_SUBSET_LINE`` lines, read into the same groups."""
_MAX_KEY = 1000
"""libyaml and PyYAML refuse an implicit key longer than 1024 characters."""

# What a line reads as, where it is not a plain value: ``{}`` and ``[]`` (a new
# container each time they are used), ``key:`` (whatever block follows), an
# item line that has no key.
_NEW_MAPPING: Any = object()
_NEW_SEQUENCE: Any = object()
_OPEN: Any = object()
_NO_KEY: Any = object()

_Line = tuple[int, int, int, object, object]
"""A line, read: its shape (see ``_read_line``), indent, width of its ``- `` (0 if none),
key (``_NO_KEY`` for an item that is a scalar) and value."""
_SKIP_LINE: _Line = (-1, 0, 0, None, None)
"""A blank or comment line."""
_DECLINE_LINE: _Line = (-2, 0, 0, None, None)
"""A line outside the subset."""


def _scalar(text: str) -> object:
    """What a ``_VALUE`` means: a string, a resolved plain scalar, or a ``_NEW_*`` marker."""
    first = text[0]
    if first == "'":
        return text[1:-1].replace("''", "'")
    if first == '"':
        return text[1:-1]
    if first == "{":
        return _NEW_MAPPING
    if first == "[":
        return _NEW_SEQUENCE
    return _plain(text)


def _read_line(line: str, scalars: dict[str, object]) -> _Line:
    """One line of the subset, read; ``_SKIP_LINE`` for blanks and comments, ``_DECLINE_LINE``
    if it is not in the subset.

    ``scalars`` remembers what each key and value text means: keys (``name``,
    ``nodePort``) repeat on thousands of distinct lines, and PyYAML's resolver
    is most of a line's cost. Every answer is immutable, so sharing one is safe.

    The first item of a reading is the line's *shape*: all of it that
    ``_build`` looks at besides the key and value, as one int. Lines of equal
    shapes build the same containers in the same places, so a document's
    shapes decide its structure (``_compile``). The int is exact: no ``str``
    is longer than ``sys.maxsize`` < 2**64, so the indent never reaches the
    dash's bits.
    """
    match = _SIMPLE_LINE.fullmatch(line)  # Printable ASCII only, like the subset.
    if match is not None:
        # What the general case below does for this form, with what cannot
        # happen left out: plain words, so ``_plain`` directly; no dash; a
        # value that starts with a letter or digit is never a ``_NEW_*``.
        indent_text, key, key_value = match.groups()
        name = scalars.get(key, _MISSING)
        if name is _MISSING:
            name = scalars[key] = _plain(key)
        value = scalars.get(key_value, _MISSING)
        if value is _MISSING:
            value = scalars[key_value] = _plain(key_value)
        if type(name) is not str or value is _DECLINE or len(key) > _MAX_KEY:
            return _DECLINE_LINE
        indent = len(indent_text)
        return indent << 3, indent, 0, name, value
    if not (line.isascii() and line.isprintable()):
        return _DECLINE_LINE  # ``_SUBSET_UNSAFE``, faster: a line holds no LF.
    match = _SUBSET_LINE.fullmatch(line)
    if match is None:
        content = line.lstrip(" ")
        return _SKIP_LINE if not content or content[0] == "#" else _DECLINE_LINE
    indent_text, dash_text, key, key_value, item = match.groups()
    indent = len(indent_text)
    dash = len(dash_text) if dash_text else 0
    if key is None:
        if not dash:
            return _DECLINE_LINE  # A scalar on a line of its own continues a multi-line one.
        name = _NO_KEY
        value = scalars.get(item, _MISSING)
        if value is _MISSING:
            value = scalars[item] = _scalar(item)
    else:
        if len(key) > _MAX_KEY:
            return _DECLINE_LINE
        name = scalars.get(key, _MISSING)
        if name is _MISSING:
            name = scalars[key] = _scalar(key)
        if type(name) is not str:
            return _DECLINE_LINE  # ``1:``, ``true:``, ``<<:``: PyYAML builds those.
        if key_value is None:
            value = _OPEN
        else:
            value = scalars.get(key_value, _MISSING)
            if value is _MISSING:
                value = scalars[key_value] = _scalar(key_value)
    if value is _DECLINE:
        return _DECLINE_LINE
    kind = (
        1 if value is _OPEN else 2 if value is _NEW_MAPPING else 3 if value is _NEW_SEQUENCE else 0
    )
    shape = (dash << 64 | indent) << 3 | (name is _NO_KEY) << 2 | kind
    return shape, indent, dash, name, value


_MAX_SUBSET_STACK = _MAX_DEPTH - 2
"""Blocks around the one being filled, at most: with it and a ``{}`` or ``[]`` inside,
a document ``_build`` reads stays within ``_MAX_DEPTH``. Deeper ones are declined,
and PyYAML's door (``_pyyaml``) measures and refuses them, in its own words."""


def _build(reads: list[_Line]) -> Any:
    """The root mapping that the lines of one document spell, None if they hold no
    content, or ``_DECLINE``.

    The block being filled is ``(column, container, is_sequence)`` in
    locals, the blocks around it on ``stack`` (``_MAX_SUBSET_STACK`` at most).
    ``pending`` is a ``key:`` whose value is whatever block the next line
    opens, or null if none.
    """
    stack: list[tuple[int, Any, bool]] = []
    column, block, in_sequence = 0, cast(Any, None), False
    root: Any = None
    pending: object = None
    for shape, indent, dash, key, value in reads:
        if shape < 0:
            if shape == -1:
                continue  # _SKIP_LINE
            return _DECLINE
        if value is _NEW_MAPPING:
            value = {}
        elif value is _NEW_SEQUENCE:
            value = []
        if block is None:
            if dash or key is _NO_KEY or indent:
                return _DECLINE  # Only a mapping at column 0 can be a Kubernetes object.
            root = block = {}
        else:
            if pending is not None:
                if (indent >= column) if dash else (indent > column):
                    if len(stack) >= _MAX_SUBSET_STACK:
                        return _DECLINE
                    opened: Any = [] if dash else {}
                    block[pending] = opened
                    stack.append((column, block, in_sequence))
                    column, block, in_sequence = indent, opened, bool(dash)
                pending = None
            # Close the blocks this line is not part of: deeper ones, and a
            # sequence at its own column when the line is not an item.
            while column > indent or (in_sequence and column == indent and not dash):
                if not stack:
                    return _DECLINE
                column, block, in_sequence = stack.pop()
            if column != indent:
                return _DECLINE
            if dash:
                if not in_sequence:
                    return _DECLINE
                if key is _NO_KEY:
                    block.append(value)
                    continue
                if len(stack) >= _MAX_SUBSET_STACK:
                    return _DECLINE
                opened = {}
                block.append(opened)
                stack.append((column, block, in_sequence))
                column, block, in_sequence = indent + dash, opened, False
            elif in_sequence or key is _NO_KEY:
                return _DECLINE
        if value is _OPEN:
            block[key] = None
            pending = key
        else:
            block[key] = value
    return root


class _Slot:
    """A name in ``_compile``'s program: ``k3`` and ``v3`` hold the key and value of line 3."""

    __slots__ = ("source",)

    def __init__(self, source: str) -> None:
        self.source = source


class _TooDeep(Exception):
    """Nesting Python's compiler might refuse; such a shape stays with ``_build``."""


_MAX_COMPILED_DEPTH = 50
"""CPython's parser gives up at 200 nested brackets; no Kubernetes object nears 50."""
_MAX_COMPILED_LINES = 5000
"""Beyond this a document is rarely repeated, and its program would be slow to compile."""


def _source(node: object, depth: int) -> str:
    """The Python expression that builds ``node``, a tree of ``_Slot`` leaves."""
    if type(node) is _Slot:
        return node.source
    if node is None:
        return "None"
    if depth > _MAX_COMPILED_DEPTH:
        raise _TooDeep
    if type(node) is dict:
        entries = (f"{_source(k, depth)}: {_source(v, depth + 1)}" for k, v in node.items())
        return "{" + ", ".join(entries) + "}"
    return "[" + ", ".join(_source(v, depth + 1) for v in cast(list[object], node)) + "]"


def _compile(reads: list[_Line]) -> Callable[[list[_Line]], Any]:
    """``_build`` for every document of the same shapes as ``reads``, as one expression.

    ``_build`` runs once on stand-ins (``_Slot``) for the keys and values; the
    tree it returns, written out as nested dict and list displays, builds the
    same containers in C with no per-line branches; the readings come in by
    one unpacking of the whole list, cheaper than subscripts. Duplicate keys
    behave as in ``_build``: a display stores its entries in order, exactly
    like ``block[key] = value`` (first position, last value). The source
    holds only brackets and generated names, never text from the document.
    """
    stand_ins = [
        read
        if read[0] < 0
        else (
            read[0],
            read[1],
            read[2],
            read[3] if read[3] is _NO_KEY else _Slot(f"k{i}"),
            read[4]
            if read[4] is _OPEN or read[4] is _NEW_MAPPING or read[4] is _NEW_SEQUENCE
            else _Slot(f"v{i}"),
        )
        for i, read in enumerate(reads)
    ]
    tree = _build(stand_ins)
    if tree is _DECLINE or len(reads) > _MAX_COMPILED_LINES:
        return _build
    unpack = ", ".join(
        "_" if read[0] < 0 else f"(_, _, _, k{i}, v{i})" for i, read in enumerate(reads)
    )
    namespace: dict[str, Any] = {}
    try:
        exec(f"def build(r):\n    {unpack}, = r\n    return {_source(tree, 0)}\n", namespace)
    except (_TooDeep, SyntaxError, RecursionError, MemoryError):
        return _build
    return cast(Callable[[list[_Line]], Any], namespace["build"])


_COMPILE_AFTER = 100
"""Sightings of a document shape that ``_build`` reads before it is compiled.

Compiling a 25-line document costs about 90 readings by ``_build`` and saves
three quarters of each later one, so it pays back after about 120; waiting
for 100 first means a shape never costs much more than twice what ``_build``
alone would have (rent, then buy), and one seen once (a ``kind: List``) costs
nothing extra."""
_SHAPE = itemgetter(0)


def _read_subset(
    chunk: str,
    lines: dict[str, _Line],
    scalars: dict[str, object] | None = None,
    shapes: dict[tuple[int, ...], Any] | None = None,
) -> list[object] | None:
    """The documents of ``chunk`` if it is in the block-style subset, else None.

    The subset is what YAML printers emit for Kubernetes objects: a root
    mapping at column 0; ``key: value`` and ``key:`` lines; ``- `` items at
    or beyond their key's column; single-line scalars, ``{}`` and ``[]``;
    blank and comment lines. Every line must fit (``_SUBSET_LINE``) and sit
    at a column that opens, continues or closes a block exactly as YAML's
    indentation rules say (``_build``); whatever does not is declined, never
    guessed, so an error is always PyYAML's to report.

    ``lines`` caches each line's reading by its text: in a state most lines
    repeat verbatim from one object to the next (``    protocol: TCP``), so
    most of them cost one dict lookup instead of a regex and a resolver.
    ``scalars`` does the same for keys and values (see ``_read_line``). A
    character outside the subset (``_SUBSET_UNSAFE``) is caught line by line
    too, so only new lines are ever scanned for one.

    ``shapes`` counts the documents of each shape, the tuple of their lines'
    shapes (see ``_read_line``): thousands of Services print alike, apart
    from names and numbers. A shape seen ``_COMPILE_AFTER`` times is compiled
    (``_compile``) and its program builds every later document of that shape.
    Without ``scalars`` and ``shapes`` the call shares neither.
    """
    texts = chunk.split("\n")
    marked = chunk.startswith("---") and chunk[3:4] in ("", " ", "\n")
    if marked:
        rest = texts[0][3:].lstrip(" ")
        if rest and (rest[0] != "#" or _SUBSET_UNSAFE.search(rest)):
            return None  # Content on the marker line, or a comment the subset cannot hold.
        del texts[0]
    # No ``cast`` here or below: it is a call, and this runs for every document.
    reads: list[Any] = list(map(lines.get, texts))
    if not all(reads):  # A reading is a non-empty tuple: some line is new.
        if scalars is None:
            scalars = {}
        for i in compress(range(len(reads)), map(not_, reads)):
            text = texts[i]
            read = lines.get(text)  # It may repeat within the chunk.
            if read is None:
                read = lines[text] = _read_line(text, scalars)
            reads[i] = read
    if shapes is None:
        root = _build(reads)
    else:
        shape = tuple(map(_SHAPE, reads))
        program = shapes.get(shape, 0)
        if type(program) is int:
            if program + 1 < _COMPILE_AFTER:
                shapes[shape] = program + 1
                root = _build(reads)
            else:
                program = shapes[shape] = _compile(reads)
                root = program(reads)
        else:
            root = program(reads)
    if root is _DECLINE:
        return None
    if marked:
        return [root]  # A marker starts a document, empty or not.
    return [] if root is None else [root]
