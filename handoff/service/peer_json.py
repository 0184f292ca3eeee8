"""JSON from a peer (a node's answer, an engine's answer), parsed within bounds.

A peer is not trusted: its answer may be huge, malformed, or nested deeply
enough to exhaust the interpreter's recursion (``[[[[...`` a million deep), or
carry what JSON has no place for: numbers (``NaN``, ``Infinity``, ``1e999``)
and lone UTF-16 surrogates (``"\\ud800"``), which Python's ``json`` reads and
an answer built from them could then not be written.
:func:`loads_bounded` refuses all of it with :class:`PeerJSONError`, one clear
error for that peer, so the caller can count the peer as failed and go on
with the others.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

MAX_DEPTH = 64
# a string, or an unterminated one to the end; possessive, so no input makes it backtrack
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_OPENERS = re.compile(rb"\[+")
# a float past a double's range (about 1.8e308) has an exponent of 3+ digits, or, with one of at most 99, 210+ digits
# before its point: ``2`` and 250 zeros ``e60`` is one
_MAYBE_OUT_OF_RANGE = re.compile(rb"[eE]\+?0*[1-9][0-9]{2}|[0-9]{210}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # paired ones decode to one character, lone ones stay


class PeerJSONError(ValueError):
    """A peer's body is not JSON within bounds (too large, too deep, or malformed)."""


def nests_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether ``raw``'s arrays and objects nest more than ``limit`` deep.

    Strings are cut out, the brackets kept, and innermost pairs removed one
    level per pass: every step is a C loop over the bytes, and a document of
    depth d costs d passes (a million-deep one, ``limit + 1``). Unbalanced
    brackets stop the pairing; the JSON parser refuses them afterwards.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # cannot nest deeper than its brackets: no scan needed
    brackets = _STRING.sub(b"", raw).translate(_BRACKETS_ONLY, _NOT_BRACKETS)
    depth = 0
    while brackets and depth <= limit:
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets):  # unbalanced: its longest run of openers still counts
            return depth + max(map(len, _OPENERS.findall(brackets)), default=0) > limit
        brackets = inner
        depth += 1
    return depth > limit


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of a float's range")
    return value


def loads_bounded(raw: bytes | str, *, max_bytes: int | None = None, max_depth: int = MAX_DEPTH,
                  parse_int: Callable[[str], Any] | None = None,
                  object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
                  in_turns: bool = False) -> Any:
    """``json.loads`` for a peer's body; raises :class:`PeerJSONError` naming what is wrong.

    ``bytes`` are UTF-8, a ``str`` is parsed as text (no encoding is guessed from the first bytes, a BOM is an
    error);
    ``parse_int``, ``object_pairs_hook``: as ``json.loads``'s (a ValueError or OverflowError they raise is a
    PeerJSONError).
    ``in_turns``: for a thread parsing a large body while an event loop runs. The byte scans (the nesting, the
    floats out of range) are one C call each over the whole body, holding the GIL for a second on tens of
    megabytes; instead every number is read by a Python function (the interpreter hands the GIL to a waiting
    thread between them) and the nesting is measured on the parsed value (the parser's own recursion bound
    stops a document nested without end first).
    """
    data = raw.encode() if isinstance(raw, str) else raw
    if max_bytes is not None and len(data) > max_bytes:
        raise PeerJSONError(f"{len(data)} bytes of JSON, over the {max_bytes}-byte limit")
    if not in_turns and nests_deeper_than(data, max_depth):
        raise PeerJSONError(f"JSON nesting arrays or objects more than {max_depth} deep")
    try:
        # a float past its range needs an exponent of 3+ digits or 210+ digits in a row: only then is each float
        # parsed through Python (otherwise the C scanner's own float parsing stays the only cost)
        check_floats = _finite_float if in_turns or _MAYBE_OUT_OF_RANGE.search(data) else None
        # bytes are UTF-8 (RFC 8259), decoded strictly: json.loads would guess UTF-16 or 32 (which the checks on
        # ``data`` do not read) and decode with "surrogatepass" (UTF-8 for a lone surrogate would pass); an escaped
        # one (\ud800) is looked for in every string, a key given twice included
        text = raw if isinstance(raw, str) else data.decode("utf-8")
        has_surrogates = _SURROGATE_ESCAPE.search(data) is not None
        pairs_hook = _checking_pairs(object_pairs_hook) if has_surrogates else object_pairs_hook
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=check_floats,
                           parse_int=parse_int or (_int if in_turns else None), object_pairs_hook=pairs_hook)
        if has_surrogates:
            _check_strings(value)
    except RecursionError:  # in turns: the parser's own bound (about 1000 levels) came first
        raise PeerJSONError(f"JSON nesting arrays or objects more than {max_depth} deep") from None
    except (UnicodeError, ValueError, OverflowError) as exc:
        raise PeerJSONError(f"not valid JSON: {exc}") from exc
    if in_turns and _value_deeper_than(value, max_depth):
        raise PeerJSONError(f"JSON nesting arrays or objects more than {max_depth} deep")
    return value


def _int(text: str) -> int:
    return int(text)


def _value_deeper_than(value: Any, limit: int) -> bool:
    """Whether a parsed value's lists and dicts nest more than ``limit`` deep (a Python loop: it gives other
    threads their turns). A dict that keeps its ``pairs`` as written (an ``object_pairs_hook``'s) is measured over
    all of them: a key given twice too, whose first value a dict drops but a parser such as serde's reads."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            pairs = getattr(item, "pairs", None)
            children = item.values() if pairs is None else [child for _, child in pairs]
        else:
            children = item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return False


def _checking_pairs(hook: Callable[[list[tuple[str, Any]]], Any] | None) -> Callable[[list[tuple[str, Any]]], Any]:
    """An ``object_pairs_hook`` that checks every key and string of an object as it is made, those of a key given
    twice too (the object keeps only the last; the ``safetensors`` library reads both): UnicodeEncodeError names
    a lone surrogate. An object inside is checked when it is made."""
    def checked(pairs: list[tuple[str, Any]]) -> Any:
        for key, item in pairs:
            key.encode("utf-8")
            _check_strings(item)
        return dict(pairs) if hook is None else hook(pairs)
    return checked


def _check_strings(value: Any) -> None:
    """Every string of ``value`` outside its objects (each checked as it was made) is valid Unicode."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            item.encode("utf-8")
        elif isinstance(item, list):
            pending.extend(item)
