"""SGLang's ``/generate`` answer, torch-free: finish reasons, logprob lists, ``meta_info``, stream events.

Written once for every process that builds or reads these answers: the engine,
and a sidecar that translates another engine's output into SGLang's shape.
The shapes follow SGLang 0.5.23: ``managers/schedule_batch.py`` (``FINISH_*``
``to_json``), ``managers/tokenizer_manager.py`` (``_handle_batch_output``,
``add_logprob_to_meta_info``, ``detokenize_logprob_tokens``).

An answer is ``{"text", "output_ids", "meta_info"}``. ``meta_info.finish_reason``
is ``None`` until the sequence ends, then an object whose ``type`` is ``stop``,
``length`` or ``abort``. A logprob list holds one ``[logprob, token_id, text]``
triple per token (``text`` is ``None`` unless ``return_text_in_logprobs``); a
top-logprob list holds one list of triples per position (``None`` where there
is none: the first prompt token).

Streams: by default every event carries the whole answer so far (SGLang's
default); with incremental streaming (SGLang's ``--incremental-streaming-output``)
each event carries only what is new, the output logprob lists included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

FinishReason = dict[str, Any]
LogprobEntry = list  # [logprob | None, token_id, text | None]

ABORTED_MESSAGE = "Aborted"                           # a running request aborted (FINISH_ABORT's default)
ABORTED_WAITING_MESSAGE = "Abort in waiting queue"    # aborted before it ever ran

# meta_info keys that hold per-output-token lists (sliced in incremental streams)
OUTPUT_LIST_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def finish_stop(matched: int | str | None) -> FinishReason:
    """Ended on a stop token (``matched`` is its id) or a stop string (the string)."""
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> FinishReason:
    """Ended at ``max_new_tokens`` (``length``)."""
    return {"type": "length", "length": length}


def finish_abort(message: str = ABORTED_MESSAGE, *, status_code: int | None = None,
                 err_type: str | None = None) -> FinishReason:
    """Aborted while running (``/abort_request``, a client that left, a release in ``abort`` mode)."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


def finish_abort_waiting() -> FinishReason:
    """Aborted before it was scheduled (SGLang answers these without ``status_code``/``err_type``)."""
    return {"type": "abort", "message": ABORTED_WAITING_MESSAGE}


def finish_type(reason: Optional[FinishReason]) -> str | None:
    """``stop`` / ``length`` / ``abort``, or ``None`` while running."""
    return None if reason is None else reason.get("type")


def finish_matched(reason: Optional[FinishReason]) -> int | str | None:
    return None if reason is None else reason.get("matched")


def logprob_entries(values: Sequence[float | None], token_ids: Sequence[int],
                    texts: Sequence[str] | None = None) -> list[LogprobEntry]:
    """``[[logprob, token_id, text], ...]``; ``texts`` None gives ``null`` texts."""
    if texts is None:
        return [[value, token_id, None] for value, token_id in zip(values, token_ids, strict=True)]
    return [[value, token_id, text] for value, token_id, text in zip(values, token_ids, texts, strict=True)]


@dataclass
class SequenceChunk:
    """What one sequence produced since its previous chunk, in SGLang's terms.

    Logprob lists are already SGLang triples. ``input_*`` lists come once (the
    chunk in which the prompt's prefill ended); ``None`` means "not in this chunk".
    """

    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    output_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    output_token_ids_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_token_ids_logprobs: list[list[LogprobEntry] | None] | None = None
    weight_version: str | None = None   # the version serving when this chunk came (None: unchanged)
    weight_versions: list[dict[str, Any]] | None = None  # a final chunk's: which output tokens each version made


@dataclass(frozen=True)
class LogprobShape:
    """Which logprob lists an answer carries: all of them are present from the first event on."""

    top_logprobs: bool = False      # top_logprobs_num > 0
    token_ids: bool = False         # token_ids_logprob was given


class SequenceAnswer:
    """One sequence's answer as it grows, and its SGLang events.

    ``logprobs`` None: the request did not ask for logprobs (no logprob keys in
    ``meta_info``). ``started`` is the request's arrival (``time.monotonic()``),
    for ``e2e_latency``.
    """

    def __init__(self, rid: str, *, weight_version: str, logprobs: LogprobShape | None = None,
                 started: float | None = None) -> None:
        self.rid = rid
        self.weight_version = weight_version
        self.logprobs = logprobs
        self.started = time.monotonic() if started is None else started
        self.text = ""
        self.output_ids: list[int] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.num_retractions = 0
        self.finish_reason: FinishReason | None = None
        self.weight_versions: list[dict[str, Any]] | None = None
        self._lists: dict[str, list] = {}
        if logprobs is not None:
            keys = ["input_token_logprobs", "output_token_logprobs"]
            if logprobs.top_logprobs:
                keys += ["input_top_logprobs", "output_top_logprobs"]
            if logprobs.token_ids:
                keys += ["input_token_ids_logprobs", "output_token_ids_logprobs"]
            self._lists = {key: [] for key in keys}
        self._last_text_len = 0   # what the previous incremental event had carried
        self._last_ids_len = 0
        self._last_output_lists_len = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: SequenceChunk) -> None:
        self.text += chunk.text
        self.output_ids.extend(chunk.output_ids)
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens
        self.num_retractions = chunk.num_retractions
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.weight_version is not None:  # the version that produced the latest tokens, as SGLang reports
            self.weight_version = chunk.weight_version
        if chunk.weight_versions is not None:
            self.weight_versions = chunk.weight_versions
        for key, values in self._lists.items():
            new = getattr(chunk, key)
            if new:
                values.extend(new)

    def meta_info(self, *, output_lists_from: int = 0) -> dict[str, Any]:
        """``meta_info`` as SGLang builds it (``output_lists_from``: slice the per-output-token lists)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "weight_version": self.weight_version,
            "num_retractions": self.num_retractions,
        }
        for key, values in self._lists.items():  # copies: an event must not change once built
            meta[key] = values[output_lists_from:] if key in OUTPUT_LIST_KEYS else list(values)
        if self.logprobs is not None:
            meta["output_token_logprobs_length"] = len(self._lists["output_token_logprobs"])
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = self.completion_tokens
        meta["cached_tokens"] = self.cached_tokens
        if self.weight_versions is not None:  # SGLang 0.5.23: a final answer's, which tokens each version made
            meta["weight_versions"] = [dict(span) for span in self.weight_versions]
        if self.cached_tokens:
            meta["cached_tokens_details"] = {"device": self.cached_tokens, "host": 0}
        if self.finish_reason is not None:
            meta["e2e_latency"] = round(time.monotonic() - self.started, 6)
        return meta

    def answer(self) -> dict[str, Any]:
        """The whole answer (a non-stream answer, or a cumulative stream event)."""
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta_info()}

    def event(self, *, incremental: bool) -> dict[str, Any]:
        """The next stream event: the whole answer so far, or (``incremental``) what is new since the last one."""
        if not incremental:
            return self.answer()
        event = {"text": self.text[self._last_text_len:], "output_ids": self.output_ids[self._last_ids_len:],
                 "meta_info": self.meta_info(output_lists_from=self._last_output_lists_len)}
        self._last_text_len = len(self.text)
        self._last_ids_len = len(self.output_ids)
        if self.logprobs is not None:
            self._last_output_lists_len = len(self._lists["output_token_logprobs"])
        return event


def weight_version_spans(events: list[tuple[str, int]], current: str,
                         num_output_tokens: int) -> list[dict[str, Any]]:
    """Which output tokens each weight version made, as SGLang 0.5.23 reports them in ``meta_info.weight_versions``
    (``compute_weight_version_spans`` and ``add_weight_versions_to_meta_info`` in its ``utils/weight_versions.py``):
    ``{"version", "start", "end"}`` in order, adjacent spans of one version merged; never empty."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, num_output_tokens)]:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans
