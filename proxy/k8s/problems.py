"""``StateError``, and the escaping that keeps every problem one printable line.

Owns: ``StateError``, the one exception a state is refused with, listing
every problem at once; and ``_quote`` and ``_escape``, through which
whatever a problem quotes from a state passes.

Never: put a line break or other unprintable character from a state into a
problem.

Hostile input: every problem is one printable line. Input is quoted by
``_quote``, with control and other unprintable characters escaped as
``repr`` does, an object whose name is not plain is named quoted
(``Service "default/a b"``, see ``fields._shown``), and ``StateError``
escapes whatever else slips through.
"""

from __future__ import annotations

from collections.abc import Iterable


class StateError(ValueError):
    """A state that kpx refuses to apply; ``problems`` lists every reason.

    Every problem is one line: whatever a message quotes from the state is
    escaped where it is quoted (``_quote``), and anything unprintable that
    still reaches a problem (a YAML error's text, a caller's message) is
    escaped here, so no state can forge a line in a log that prints them.
    """

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems: list[str] = [p if p.isprintable() else _escape(p) for p in problems]
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)


def _escape(text: str) -> str:
    """``text`` with each unprintable character escaped as ``repr`` escapes it.

    ``\\n``, ``\\x1b``, ``\\u2028``: line breaks of every kind, terminal
    escapes and invisible format characters (bidi overrides) are what let
    text from a state pose as another log line, or hide in one.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


_QUOTE_ESCAPES = {'"': '\\"', "\\": "\\\\"}


def _quote(text: str) -> str:
    """``text`` from a state, double-quoted for a problem, escaped so that it stays one line.

    Plain text (nearly all of it) is only wrapped in quotes; a quote or a
    backslash inside is escaped too, so the quoted form is unambiguous.
    """
    if text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return '"' + "".join(_QUOTE_ESCAPES.get(ch) or _escape(ch) for ch in text) + '"'
