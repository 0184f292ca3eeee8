"""One choice of a vLLM completion read, whole or a stream's piece at a time (:class:`ChoiceState`), every field
type-checked (:class:`MalformedChoice` otherwise), and vLLM's logprob rows in SGLang's ``[logprob, token_id, null]``
shape; :mod:`node_sidecar.engines.vllm_answer` builds SGLang's answer from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_sidecar.engines.vllm_versions import VersionTrail


class MalformedChoice(ValueError):
    """A choice of the engine's answer holds a field of the wrong type."""


MAX_TOKEN_ID = 2**31  # a vocabulary's ids fit an int32
# what reading a malformed answer raises (the helpers below, and a value of an unexpected type met on the way)
MALFORMED = (MalformedChoice, TypeError, ValueError, AttributeError)


@dataclass
class ChoiceState:
    """One prompt's answer so far (a stream's pieces put together)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    trail: VersionTrail | None = None  # the versions its tokens were made under (the translator's)

    def add(self, choice: dict[str, Any]) -> None:
        """One choice (or a stream's piece of it) added; :class:`MalformedChoice` for a field of the wrong type."""
        self.text += _typed(choice, "text", str) or ""
        self.token_ids += _token_list(choice, "token_ids")
        if choice.get("prompt_token_ids"):
            self.prompt_token_ids = _token_list(choice, "prompt_token_ids")
        if choice.get("prompt_logprobs") is not None:
            self.prompt_logprobs = list(_typed(choice, "prompt_logprobs", list))
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self.token_logprobs += _typed(logprobs, "token_logprobs", list) or []
            self.top_logprobs += _typed(logprobs, "top_logprobs", list) or []
        if choice.get("finish_reason") is not None:
            self.finish_reason = _typed(choice, "finish_reason", str)
            stop_reason = choice.get("stop_reason")
            if stop_reason is not None and (not isinstance(stop_reason, (int, str)) or isinstance(stop_reason, bool)):
                raise MalformedChoice(f"stop_reason is {type(stop_reason).__name__}, not a token id or a string")
            self.stop_reason = stop_reason


def _typed(mapping: dict[str, Any], key: str, kind: type) -> Any:
    value = mapping.get(key)
    if value is not None and not isinstance(value, kind):
        raise MalformedChoice(f"{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _token_list(choice: dict[str, Any], key: str) -> list[int]:
    values = _typed(choice, key, list) or []
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_TOKEN_ID for v in values):
        raise MalformedChoice(f"{key} holds something other than token ids")
    return list(values)


def read_choice_index(choice: dict[str, Any]) -> int:
    """A choice's ``index`` (0 when absent); :class:`MalformedChoice` for one that is not a whole number >= 0."""
    index = choice.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise MalformedChoice(f"a choice's index is {index!r}")
    return index


def peer_object(raw: bytes) -> dict[str, Any]:
    """The engine's answer (or event) as a JSON object, read within bounds; ValueError otherwise."""
    try:
        value = loads_bounded(raw)
    except PeerJSONError as exc:
        raise ValueError(f"the engine's answer is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("the engine's answer is not a JSON object")
    return value


def _token_id(key: str) -> int | None:
    """``token_id:123`` (``return_tokens_as_token_ids``) → 123."""
    prefix, _, number = key.partition(":")
    return int(number) if prefix == "token_id" and number.isdigit() else None


def top_rows(row: dict[str, float] | None, num: int) -> list[list[Any]] | None:
    """The ``num`` likeliest tokens at an output position (vLLM's row may hold the sampled token as one more)."""
    if not row or not isinstance(row, dict):
        return None
    pairs = [(lp, _token_id(key)) for key, lp in row.items() if isinstance(lp, (int, float))]
    return [[lp, token, None] for lp, token in sorted(pairs, key=lambda p: -p[0]) if token is not None][:num]


def prompt_logprob(row: Any, token: int) -> float | None:
    """The logprob of the prompt's ``token`` in vLLM's row for its position (None: the row has none)."""
    if not isinstance(row, dict):
        return None
    entry = row.get(str(token))
    return _entry_logprob(entry) if isinstance(entry, dict) else None


def prompt_top(row: Any, num: int) -> list[list[Any]] | None:
    """The ``num`` likeliest tokens at a prompt position (vLLM's row also holds the actual token, at its rank)."""
    if not isinstance(row, dict):
        return None
    ranked = sorted(((entry.get("rank", 0), int(key), _entry_logprob(entry)) for key, entry in row.items()
                     if isinstance(entry, dict) and key.isdigit()), key=lambda r: r[0])
    return [[lp, tok, None] for rank, tok, lp in ranked if rank <= num][:num]


def _entry_logprob(entry: dict[str, Any]) -> float | None:
    """A prompt position's entry's ``logprob``; :class:`MalformedChoice` for one that is not a number."""
    logprob = entry.get("logprob")
    if logprob is not None and (not isinstance(logprob, (int, float)) or isinstance(logprob, bool)):
        raise MalformedChoice(f"a prompt logprob is {type(logprob).__name__}, not a number")
    return logprob
