"""PD answers carry the prompt's input logprobs from the prefill node: merged into the decode node's answer
(whole) or into each event of its stream (matched to the prefill's first event of the same prompt, by
``index``, for a batch). A peer's odd value is left as it sent it; a prefill event that cannot be read is an
error (never an answer without its logprobs)."""

from __future__ import annotations

import json
from typing import Any

from handoff.protocol.sse import DONE, EventSplitter, EventTooLarge, data_event, event_data
from handoff.service.json_pieces import drop_in_pieces, gc_paused, render_in_pieces
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.relay import ChunkTransform

INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def merge_input_logprobs(prefill: Any, decode: Any) -> None:
    """Put the prefill answer's input logprobs in front of the decode answer's, in place (batches too)."""
    if isinstance(prefill, list) and isinstance(decode, list):
        for prefill_item, decode_item in zip(prefill, decode):
            merge_input_logprobs(prefill_item, decode_item)
        return
    if not isinstance(prefill, dict) or not isinstance(decode, dict):
        return
    prefill_meta, decode_meta = prefill.get("meta_info"), decode.get("meta_info")
    if not isinstance(prefill_meta, dict) or not isinstance(decode_meta, dict):
        return
    for key in INPUT_LOGPROB_KEYS:
        ours, theirs = prefill_meta.get(key), decode_meta.get(key)
        if isinstance(ours, list) and (theirs is None or isinstance(theirs, list)):
            decode_meta[key] = ours + (theirs or [])


def merged_answer(prefill_raw: bytes, decode_raw: bytes) -> bytes:
    """The decode node's whole answer with the prefill's input logprobs in front of its own; raises
    :class:`PeerJSONError`. Made to run on a thread for a large answer: parsed and written in small steps
    (:mod:`handoff.service.json_pieces`), so the event loop keeps its turns meanwhile."""
    with gc_paused():  # the trees are acyclic and gone before the block ends
        merged, prefill = loads_bounded(decode_raw, in_turns=True), loads_bounded(prefill_raw, in_turns=True)
        merge_input_logprobs(prefill, merged)
        # a prompt's logprob lists, in pieces: below meta_info (one answer) or below each item's (a batch)
        body = render_in_pieces(merged, piece_depth=3 if isinstance(merged, list) else 2).encode()
        drop_in_pieces(merged)
        drop_in_pieces(prefill)
        return body


def first_events(raw: bytes) -> dict[int, Any]:
    """The JSON of the first ``data:`` event of each prompt (its ``index``: a batch streams its prompts'
    events mixed; 0 without one) in an SSE body. An event that cannot be read (past the event bound, not
    JSON within bounds) raises :class:`PeerJSONError`: its prompt's input logprobs would be missing from an
    answer that looks whole."""
    try:
        events = EventSplitter().feed(raw)
    except EventTooLarge as exc:
        raise PeerJSONError(str(exc)) from exc
    firsts: dict[int, Any] = {}
    for event in events:
        data = event_data(event)
        if data is None or data.strip() == DONE:
            continue
        payload = loads_bounded(data)
        firsts.setdefault(_event_index(payload), payload)
    return firsts


def _event_index(payload: Any) -> int:
    index = payload.get("index", 0) if isinstance(payload, dict) else 0
    return index if type(index) is int else -1  # a peer's odd index matches no prompt


class MergeInputLogprobs(ChunkTransform):
    """Rewrites each ``data:`` event of the decode stream to carry its prompt's input logprobs from the prefill
    (matched by ``index``, for a batch)."""

    def __init__(self, prefill_events: dict[int, Any]) -> None:
        self._prefill_events = prefill_events
        self._splitter = EventSplitter()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._rewrite(event) for event in self._splitter.feed(chunk))

    def finish(self) -> bytes:
        return self._splitter.finish()

    def _rewrite(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None or data.strip() == DONE:
            return event
        try:
            payload = loads_bounded(data)
        except PeerJSONError:
            return event
        merge_input_logprobs(self._prefill_events.get(_event_index(payload)), payload)
        return data_event(json.dumps(payload).encode())
