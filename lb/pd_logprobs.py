"""PD answers carry the prompt's input logprobs from the prefill node: merged into the decode node's answer
(whole) or into each event of its stream (matched to the prefill's first event of the same prompt, by
``index``, for a batch). A peer's odd value is left as it sent it; a prefill event that cannot be read, or a prefill
answer without an ``input_token_logprobs`` list for a prompt the decode node answered, is an error (never an answer
without its logprobs)."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Iterator

from handoff.protocol.sse import DONE, EventSplitter, EventTooLarge, data_event, event_data
from handoff.service.json_pieces import drop_in_pieces, gc_paused, render_in_pieces
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.relay import ChunkTransform
from handoff.service.upstream_errors import ProtocolError

INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
# answers larger than this are merged on a thread (a stream's: its prefill answer parsed and encoded there): 64 KiB
# parse and write in about a millisecond, while tens of megabytes of logprobs held the event loop, every other
# request with it, for seconds
MERGE_ON_LOOP_BYTES = 64 * 1024
_ITEMS_PER_CALL = 256  # items of a prompt's logprob list per encoder call
_PIECE_BYTES = 64 * 1024  # rewritten events gathered up to this size for one send


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


def has_input_logprobs(answer: Any) -> bool:
    """Whether a prefill answer (one prompt's, or one event of its stream) holds that prompt's input logprobs."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    return isinstance(meta, dict) and isinstance(meta.get("input_token_logprobs"), list)


def check_fits(prefill: Any, decode: Any) -> None:
    """Raise :class:`PeerJSONError` unless the prefill answer holds the input logprobs of each prompt the decode
    answer holds: one answer for one, a list as long for a batch (merged item by item, by position)."""
    if isinstance(decode, list) != isinstance(prefill, list):
        raise PeerJSONError(f"the prefill answered {_shape(prefill)} for the decode node's {_shape(decode)}")
    if isinstance(decode, list) and len(decode) != len(prefill):
        raise PeerJSONError(f"the prefill answered {_shape(prefill)} for the decode node's {_shape(decode)}")
    for i, item in enumerate(prefill if isinstance(prefill, list) else [prefill]):
        if not has_input_logprobs(item):
            raise PeerJSONError(f"the prefill answer has no input_token_logprobs list for prompt {i}")


def _shape(answer: Any) -> str:
    return f"a list of {len(answer)} answers" if isinstance(answer, list) else "one answer"


def merged_answer(prefill_raw: bytes, decode_raw: bytes) -> bytes:
    """The decode node's whole answer with the prefill's input logprobs in front of its own; raises
    :class:`PeerJSONError` (also for a prefill answer that does not fit the decode's, :func:`check_fits`). Made to
    run on a thread for a large answer: parsed and written in small steps (:mod:`handoff.service.json_pieces`), so
    the event loop keeps its turns meanwhile."""
    with gc_paused():  # the trees are acyclic and gone before the block ends
        merged, prefill = loads_bounded(decode_raw, in_turns=True), loads_bounded(prefill_raw, in_turns=True)
        try:
            check_fits(prefill, merged)
            merge_input_logprobs(prefill, merged)
            # a prompt's logprob lists, in pieces: below meta_info (one answer) or below each item's (a batch)
            return render_in_pieces(merged, piece_depth=3 if isinstance(merged, list) else 2).encode()
        finally:
            drop_in_pieces(merged)
            drop_in_pieces(prefill)


def first_events(raw: bytes, *, in_turns: bool = False) -> dict[int, Any]:
    """The JSON of the first ``data:`` event of each prompt (its ``index``: a batch streams its prompts'
    events mixed; 0 without one) in an SSE body. An event that cannot be read (past the event bound, not
    JSON within bounds) raises :class:`PeerJSONError`: its prompt's input logprobs would be missing from an
    answer that looks whole. ``in_turns``: as :func:`loads_bounded`'s, for a thread."""
    try:
        events = EventSplitter().feed(raw)
    except EventTooLarge as exc:
        raise PeerJSONError(str(exc)) from exc
    firsts: dict[int, Any] = {}
    for event in events:
        data = event_data(event)
        if data is None or data.strip() == DONE:
            continue
        payload = loads_bounded(data, in_turns=in_turns)
        firsts.setdefault(_event_index(payload), payload)
    return firsts


def stream_merge(prefill_raw: bytes, *, in_turns: bool = False) -> MergeInputLogprobs:
    """The transform merging the prefill's streamed answer (an SSE body) into the decode stream; raises
    :class:`PeerJSONError` (also for a prefill answer of no event with input logprobs). ``in_turns``: made to run on
    a thread for a large answer (parsed and encoded in small steps, the parsed events freed a few items at a time)."""
    with gc_paused():  # the events' trees are acyclic and gone before the block ends
        events = first_events(prefill_raw, in_turns=in_turns)
        if not any(has_input_logprobs(event) for event in events.values()):
            raise PeerJSONError("the prefill answer has no event with an input_token_logprobs list")
        merge = MergeInputLogprobs(events)
        drop_in_pieces([event for event in events.values() if isinstance(event, dict)])  # a list one is kept
        return merge


def _event_index(payload: Any) -> int:
    index = payload.get("index", 0) if isinstance(payload, dict) else 0
    return index if type(index) is int else -1  # a peer's odd index matches no prompt


def _encoded_items(items: list[Any]) -> bytes:
    """``json.dumps(items)`` without its brackets, as the stream's events are written (default separators), by
    encoder calls of bounded size (:func:`render_in_pieces`' reason: a thread leaves the event loop its turns)."""
    return ", ".join(json.dumps(items[i:i + _ITEMS_PER_CALL])[1:-1]
                     for i in range(0, len(items), _ITEMS_PER_CALL)).encode()


class _PromptLogprobs:
    """One prompt's input logprob lists from the prefill, each encoded once (its items without the brackets) and
    spliced into every decode event of that prompt. SGLang repeats a prompt's input logprobs in each event of its
    stream (``add_logprob_to_meta_info``), so parsing and writing them again per event cost the prompt's size
    times the tokens streamed, on the event loop."""

    def __init__(self, meta: dict[str, Any], nonce: str) -> None:
        self._items = {key: _encoded_items(meta[key]) for key in INPUT_LOGPROB_KEYS if isinstance(meta.get(key), list)}
        self._markers = {key: f"{nonce}{i}" for i, key in enumerate(INPUT_LOGPROB_KEYS)}
        self._marker_pattern = re.compile(f'"({nonce}[0-9])"')

    def event(self, payload: dict[str, Any], meta: dict[str, Any]) -> bytes:
        """The event of ``payload`` (whose ``meta_info`` is ``meta``) with these lists in front of its own, as
        :func:`merge_input_logprobs` and ``json.dumps`` write it; changes ``meta``."""
        spliced: dict[str, tuple[str, bytes]] = {}
        for key, ours in self._items.items():
            theirs = meta.get(key)
            if theirs is not None and not isinstance(theirs, list):
                continue  # a peer's odd value, left as sent
            if not ours:
                meta[key] = list(theirs or [])
                continue
            # a marker string first: its quoted form is replaced by our items (``, `` before theirs, if any)
            meta[key] = [self._markers[key], *(theirs or [])]
            spliced[self._markers[key]] = (key, ours)
        parts = self._marker_pattern.split(json.dumps(payload))
        if sorted(parts[1::2]) != sorted(spliced):  # a peer's string the marker's exact spelling: never in practice
            for key, ours in spliced.values():
                meta[key] = json.loads(b"[" + ours + b"]") + meta[key][1:]
            return data_event(json.dumps(payload).encode())
        pieces = [b"data: "]
        for i, part in enumerate(parts):
            pieces.append(spliced[part][1] if i % 2 else part.encode())
        pieces.append(b"\n\n")
        return b"".join(pieces)


class MissingInputLogprobs(ProtocolError):
    """A decode event of a prompt (its ``index``) the prefill answer holds no input logprobs for."""

    def __init__(self, index: int) -> None:
        super().__init__(f"the prefill answer has no input_token_logprobs list for prompt {index}")
        self.index = index


class MergeInputLogprobs(ChunkTransform):
    """Rewrites each ``data:`` event of the decode stream to carry its prompt's input logprobs from the prefill
    (matched by ``index``, for a batch), given the prefill's first event of each prompt (:func:`first_events`);
    keeps them encoded, not parsed (an event of the prefill that is a list, which no node sends, is kept). A
    decode event with a ``meta_info`` object of a prompt the prefill sent no input logprobs for raises
    :class:`MissingInputLogprobs` (the events before it handed out first) and sets :attr:`missing_index`."""

    def __init__(self, prefill_events: dict[int, Any]) -> None:
        nonce = secrets.token_hex(16)  # never sent: a peer cannot spell a marker of it
        self._prompts = {index: _PromptLogprobs(event["meta_info"], nonce) for index, event in prefill_events.items()
                         if isinstance(event, dict) and isinstance(event.get("meta_info"), dict)}
        self._lists = {index: event for index, event in prefill_events.items() if isinstance(event, list)}
        self._has_logprobs = {index for index, event in prefill_events.items() if has_input_logprobs(event)}
        self._splitter = EventSplitter()
        self.missing_index: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self.feed_pieces(chunk))

    def feed_pieces(self, chunk: bytes) -> Iterator[bytes]:
        """The rewritten events, a piece at most as large as one of them or :data:`_PIECE_BYTES`: a long prompt's
        logprobs make megabytes of each event, and one read of the decode stream may hold hundreds."""
        pieces: list[bytes] = []
        num_bytes = 0
        for event in self._splitter.feed(chunk):
            try:
                pieces.append(self._rewrite(event))
            except MissingInputLogprobs as exc:
                self.missing_index = exc.index
                if pieces:
                    yield b"".join(pieces)
                raise
            num_bytes += len(pieces[-1])
            if num_bytes >= _PIECE_BYTES:
                yield b"".join(pieces)
                pieces, num_bytes = [], 0
        if pieces:
            yield b"".join(pieces)

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
        index = _event_index(payload)
        prompt = self._prompts.get(index)
        meta = payload.get("meta_info") if isinstance(payload, dict) else None
        if isinstance(meta, dict) and index not in self._has_logprobs:
            raise MissingInputLogprobs(index)
        if prompt is not None and isinstance(meta, dict):
            return prompt.event(payload, meta)
        merge_input_logprobs(self._lists.get(index), payload)  # a list of a list, merged item by item
        return data_event(json.dumps(payload).encode())
