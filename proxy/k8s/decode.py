"""Text -> documents: PyYAML's one door, with nesting measured first; JSON; plain scalars.

Owns: ``_pyyaml``, the only door to PyYAML's loader, and the nesting bound in
front of it (``_could_nest_deeply``, ``_too_deep``); how a YAML error is
worded (``_yaml_problem``); what a plain scalar means (``_plain``, by
PyYAML's own resolver rules and constructors, which the subset reader and
the JSON road share); and the JSON road (``_json_document``).

Never: let PyYAML compose a text that nests deeper than ``_MAX_DEPTH``, or
decode a text to anything but what PyYAML would make of it.

Hostile input: nesting is bounded before PyYAML composes anything
(``_pyyaml``, the only door to its loader): its C extension recurses once
per level with no limit, and against a libyaml without one (Debian's 0.2.5)
~100 KB of ``[`` or ``- - -`` overflow the C stack. More than ``_MAX_DEPTH``
levels of collections are refused. A cheap bound (``_could_nest_deeply``:
bracket counts and line prefixes, in C) clears nearly every text; the rest
are measured exactly by counting libyaml's events, which never recurse
(``_too_deep``). The block subset reader (``subset``) declines what could
reach the limit, so the same texts are refused in the same words on every
road; ``json``'s own recursion limit turns deeper JSON into a decline too.

Decoding, fastest first:

- JSON (``kubectl -o json``, text starting with ``{``) goes to ``json.loads``,
  ~20x faster than PyYAML. JSON is YAML, and hooks make the two agree where
  YAML 1.1 reads differently (``1e3`` and ``NaN`` are strings to PyYAML);
  text where they could still differ (tabs, surrogate escapes, characters
  YAML treats as line breaks) goes to PyYAML instead.
- The block-style subset that kubectl, ``yaml.safe_dump`` and the kpx tools
  print is read by the fast reader in ``subset`` (see there).
- PyYAML (libyaml's ``CSafeLoader`` when present) decodes the rest, and is
  the only one that ever reports a syntax error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import yaml
from yaml.nodes import ScalarNode

from proxy.k8s.problems import StateError

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader is ~10x faster than the pure-Python one; same safety."""

_CONSTRUCT_ERRORS = (ValueError, TypeError, KeyError, AttributeError, OverflowError)
"""What PyYAML's scalar constructors raise on text their resolver let through:
``2020-13-45`` (a timestamp by its regex), a 5,000-digit int, ``!!int zz``."""


class _ValueError(yaml.constructor.ConstructorError):
    """A scalar PyYAML parsed but cannot build: well-formed YAML, a value wrong for its tag."""


class _Loader(_LOADER):  # type: ignore[misc, valid-type]
    """``_LOADER`` whose constructor errors are YAML errors at the value's line and column.

    One Python frame more per node built, on PyYAML's road only (the subset reader
    builds most documents without it): what it costs is within a parse's spread.
    """

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except _CONSTRUCT_ERRORS as err:
            value = node.value if isinstance(node.value, str) else ""
            shown = value if len(value) <= 40 else value[:37] + "..."
            tag = node.tag.rsplit(":", 1)[-1]
            raise _ValueError(None, None, f"cannot read {shown!r} as {tag}: {err}",
                              node.start_mark) from None


# -- decoding ---------------------------------------------------------------------------


def _mark(mark: Any, line_offset: int) -> str:
    return f"line {mark.line + 1 + line_offset}, column {mark.column + 1}"


def _yaml_error_detail(err: yaml.MarkedYAMLError, line_offset: int = 0) -> str:
    """``line 27, column 28: did not find expected key (while parsing ... at line 25, ...)``.

    ``line_offset`` counts the lines above the text PyYAML was given, so a
    chunk's error names its line in the whole file.
    """
    mark = err.problem_mark or err.context_mark
    detail = (
        f"{_mark(mark, line_offset) if mark else 'an unknown place'}: {err.problem or err.context}"
    )
    if err.problem and err.context:
        detail += f" ({err.context}"
        context_mark = err.context_mark
        if context_mark and (
            mark is None or (context_mark.line, context_mark.column) != (mark.line, mark.column)
        ):
            detail += f" that starts at {_mark(context_mark, line_offset)}"
        detail += ")"
    return detail


def _yaml_problem(err: yaml.YAMLError, line_offset: int = 0) -> StateError:
    if isinstance(err, yaml.MarkedYAMLError):
        what = "value" if isinstance(err, _ValueError) else "syntax"
        return StateError([f"YAML {what} error at {_yaml_error_detail(err, line_offset)}"])
    return StateError([f"YAML error: {err}"])


# Nesting. PyYAML's C extension builds each collection by a C call inside its
# parent's (``CParser._compose_node``), with no limit of its own: against a
# libyaml without one (Debian's 0.2.5, which distro PyYAML links) ~100 KB of
# ``[`` or of ``- - - `` overflow the C stack and the process dies of SIGSEGV,
# taking every listener with it. libyaml's *events*, though, come from a loop
# with a heap stack, and are safe at any depth. So every text is measured
# before PyYAML builds it, and refused past ``_MAX_DEPTH``.

_MAX_DEPTH = 100
"""Collections nested in collections, at most. kubectl's output for Nodes, Services and
EndpointSlices nests under 30 deep (managedFields included), and no Kubernetes object
comes near 100; while 100 is far below where any decoder kpx uses gets into trouble:
libyaml's composer overflows an 8 MiB stack at ~30,000 levels, the pure-Python
loader reaches Python's recursion limit at ~300 and ``json`` at ~1,000."""

_SHALLOW_INDENT = 20
_SHALLOW_OPENERS = _MAX_DEPTH // 2 - _SHALLOW_INDENT - 1
"""The cheap test (``_could_nest_deeply``) passes a text with at most this many ``[``
and ``{`` and no line that starts with ``_SHALLOW_INDENT`` indentation or
indicator characters: such a text cannot nest past ``_MAX_DEPTH`` (see there)."""
_DEEP_LINE = re.compile(rf"(?:\A|[\n\r\x85\u2028\u2029])\ufeff?[-?: \t]{{{_SHALLOW_INDENT}}}")
_COLLECTION_EVENTS: dict[type, int] = {
    yaml.MappingStartEvent: 1,
    yaml.SequenceStartEvent: 1,
    yaml.MappingEndEvent: -1,
    yaml.SequenceEndEvent: -1,
}


def _could_nest_deeply(text: str) -> bool:
    """False when ``text`` certainly nests at most ``_MAX_DEPTH`` collections deep.

    A bound that costs a few scans in C, so that the exact measure
    (``_too_deep``) only runs for the rare text it cannot vouch for. Flow
    collections nest at most two per ``[`` or ``{`` (a ``[a: b]`` pair is a
    mapping of its own). A block collection starts at a column where a key,
    ``-``, ``?`` or ``:`` stands, and only behind the indentation and
    indicators that begin its line (an optional byte-order mark aside); the
    columns of the block collections open at once increase strictly, and
    each may hold one more sequence at its own column (``key:`` then ``- a``).
    So with at most ``_SHALLOW_OPENERS`` brackets and every line's leading
    run of spaces, tabs, ``-``, ``?`` and ``:`` shorter than
    ``_SHALLOW_INDENT``, the depth is at most
    ``2 * _SHALLOW_OPENERS + 2 * (_SHALLOW_INDENT + 1) <= _MAX_DEPTH``.
    """
    return (
        text.count("[") + text.count("{") > _SHALLOW_OPENERS
        or _DEEP_LINE.search(text) is not None
    )


def _too_deep(text: str) -> Any:
    """Where ``text`` first nests deeper than ``_MAX_DEPTH``, as a YAML mark, or None.

    Counts libyaml's collection events, which cost about a tenth of what
    building the documents does and never recurse; it stops at the first
    event past the limit. A syntax error ends the count quietly: PyYAML
    then stops at that same error, no deeper than the count got.
    """
    loader = _LOADER(text)
    try:
        depth = 0
        steps = _COLLECTION_EVENTS
        while loader.check_event():
            event = loader.get_event()
            depth += steps.get(type(event), 0)
            if depth > _MAX_DEPTH:
                return event.start_mark
    except yaml.YAMLError:
        pass
    finally:
        loader.dispose()
    return None


def _pyyaml(text: str, line_offset: Callable[[], int] = int) -> list[object]:
    """Every document of ``text``, by PyYAML, unless it nests deeper than ``_MAX_DEPTH``.

    The one door to PyYAML's loader. ``StateError`` if too deep (``line_offset()``
    counts the lines above ``text``, only then); ``yaml.YAMLError`` for the rest.
    """
    if _could_nest_deeply(text):
        mark = _too_deep(text)
        if mark is not None:
            raise StateError(
                [
                    f"YAML nested too deep at {_mark(mark, line_offset())}: more than "
                    f"{_MAX_DEPTH} levels of collections, where no Kubernetes object comes "
                    "near; refused before decoding, so that no YAML parser can run out of stack"
                ]
            )
    try:
        return list(yaml.load_all(text, Loader=_Loader))
    except RecursionError:
        # Only the pure-Python loader recurses in Python; ``_MAX_DEPTH`` keeps it
        # far from the limit, unless the caller's own stack is already deep.
        raise StateError(["YAML nested too deep to decode"]) from None


def _load_all(text: str) -> list[object]:
    try:
        return _pyyaml(text)
    except yaml.YAMLError as err:
        raise _yaml_problem(err) from err


# Plain scalars, as PyYAML reads them.

_SCALARS: Any = _LOADER("")
"""A loader over nothing, used only for PyYAML's resolver and scalar constructors."""
_STR_TAG = "tag:yaml.org,2002:str"
_PLAIN_CONSTRUCTORS = {
    tag: _SCALARS.yaml_constructors[tag]
    for tag in (
        "tag:yaml.org,2002:null",
        "tag:yaml.org,2002:bool",
        "tag:yaml.org,2002:int",
        "tag:yaml.org,2002:float",
        "tag:yaml.org,2002:timestamp",
    )
}
"""Tags whose value is a pure function of the scalar's text (merge keys and
``=`` are not; the readers below decline those and leave them to PyYAML)."""

_DECLINE: Any = object()
"""A reader's answer for "not mine, ask PyYAML"."""
_MISSING: Any = object()
"""Not in a memo (whose values may be None or ``_DECLINE``)."""


_RESOLVE_ALL = None in _SCALARS.yaml_implicit_resolvers or bool(_SCALARS.yaml_path_resolvers)


def _one_rule(
    rules: list[tuple[str, re.Pattern[str]]],
) -> tuple[re.Pattern[str], dict[int | None, str]]:
    """PyYAML's rules for one first character as one regex, and the tag of each group.

    ``resolve`` tries the rules in order and takes the first that matches;
    an alternation of them does the same in one call. Each rule sits in a
    group of its own, which closes after any group inside it, so
    ``lastindex`` names the rule that matched. Rules it cannot join safely
    (different flags, a verbose ``#``) are left to ``resolve``.
    """
    flags = {regexp.flags for _, regexp in rules}
    if len(flags) != 1 or any("#" in regexp.pattern for _, regexp in rules):
        raise ValueError("rules that cannot be joined")
    parts: list[str] = []
    tags: dict[int | None, str] = {}
    group = 1
    for tag, regexp in rules:
        parts.append(f"({regexp.pattern})")
        tags[group] = tag
        group += 1 + regexp.groups
    return re.compile("|".join(parts), flags.pop()), tags


def _joined_rules() -> dict[str, tuple[re.Pattern[str], dict[int | None, str]] | None]:
    joined: dict[str, tuple[re.Pattern[str], dict[int | None, str]] | None] = {}
    for first, rules in _SCALARS.yaml_implicit_resolvers.items():
        if first:
            try:
                joined[first] = _one_rule(rules)
            except (ValueError, re.error):
                joined[first] = None
    return joined


_RULES = _joined_rules()
"""``_one_rule`` by first character; None where ``resolve`` must decide."""


def _plain(text: str) -> object:
    """What PyYAML makes of an untagged plain scalar, or ``_DECLINE``."""
    if text and not _RESOLVE_ALL:
        rule = _RULES.get(text[0], _MISSING)
        if rule is _MISSING:
            return text  # Half of a state's names: no resolver to ask.
        if rule is not None:
            match = rule[0].match(text)
            tag = _STR_TAG if match is None else rule[1][match.lastindex]
        else:
            tag = _SCALARS.resolve(ScalarNode, text, (True, False))
    else:
        tag = _SCALARS.resolve(ScalarNode, text, (True, False))
    if tag == _STR_TAG:
        return text
    construct = _PLAIN_CONSTRUCTORS.get(tag)
    if construct is None:
        return _DECLINE
    try:
        return construct(_SCALARS, ScalarNode(tag, text))
    except _CONSTRUCT_ERRORS:
        return _DECLINE  # PyYAML reports it, with its line (``_Loader``).


# JSON.


def _json_number(text: str) -> object:
    """A JSON number (or ``NaN``/``Infinity``) as the same text is to PyYAML.

    YAML 1.1 wants a dot in a float and a sign in its exponent, so PyYAML
    reads ``1e3`` and ``NaN`` as strings; so must kpx, whatever the format.
    """
    value = _plain(text)
    if value is _DECLINE:
        raise ValueError(f"{text} is not a YAML scalar")
    return value


_JSON = json.JSONDecoder(parse_float=_json_number, parse_constant=_json_number)
_JSON_START = re.compile(r"[ \n\r]*\{")
_JSON_ODD = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffe\uffff]")
"""Characters YAML refuses (or takes for line breaks) that JSON lets through."""
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""JSON joins escaped surrogate pairs; libyaml refuses them."""


def _json_document(text: str) -> object:
    """``text`` as one JSON document, or ``_DECLINE`` if YAML must decide.

    JSON is YAML, so this is only a faster road to PyYAML's answer. It is
    declined where the two could differ: tabs (libyaml takes them as flow
    whitespace, PyYAML refuses them), ``_JSON_ODD`` characters, surrogate
    escapes, and anything ``json`` refuses (comments, YAML syntax, errors:
    PyYAML reports those). Known gaps: a key longer than 1024 characters,
    which YAML cannot read as an implicit key, and the API server never
    writes; and nesting: ``json`` is safe at any depth (past ~1,000 levels
    it raises RecursionError, and the text goes on to ``_pyyaml``, which
    refuses it), so JSON between ``_MAX_DEPTH`` and that is decoded here
    although ``_pyyaml`` would refuse it. Measuring every JSON state for it
    would cost more than decoding it; the judges read only known fields, at
    fixed depths, so what lies deeper is never looked at.
    """
    if not _JSON_START.match(text) or "\t" in text or "\x7f" in text:
        return _DECLINE
    if not text.isascii() and _JSON_ODD.search(text):
        return _DECLINE
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        return _DECLINE
    try:
        return _JSON.decode(text)
    except (ValueError, RecursionError):
        return _DECLINE
