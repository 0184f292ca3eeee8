"""Scheduler planning on CPU: admission, chunked prefill, decode, preemption, finishing."""

from __future__ import annotations

import pytest

from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.request import FinishReason, IllegalTransition, Request, RequestState
from node_engine.sampling import SamplingParams
from node_engine.scheduler import Scheduler, SchedulerConfig
from node_engine.step import StepKind
from node_engine.tokenizer import Tokenizer

TOKENIZER = Tokenizer.builtin_bytes()


def make_scheduler(*, num_slots: int = 65, max_running: int = 4, max_batch_tokens: int = 16,
                   context_len: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_running_requests=max_running, max_batch_tokens=max_batch_tokens,
                                     context_len=context_len, eos_token_ids=(257,)),
                     SlotAllocator(num_slots), RowAllocator(max_running))


def make_request(rid: str, num_prompt: int, max_new: int = 8, **params) -> Request:
    return Request(rid=rid, prompt_ids=[65] * num_prompt, params=SamplingParams(max_new_tokens=max_new, **params),
                   detokenizer=IncrementalDetokenizer(TOKENIZER, tuple(params.get("stop", ())),
                                                      no_stop_trim=params.get("no_stop_trim", False)),
                   on_output=lambda _: None)


def test_prefill_is_chunked_by_the_token_budget() -> None:
    s = make_scheduler(max_batch_tokens=16)
    r = make_request("a", 40)
    s.add(r)
    spans = []
    while len(spans) < 10:  # a prefill that never ends fails the comparison below
        step = s.schedule()
        assert step is not None
        spans.append((step.kind, step.entries[0].start, step.entries[0].end))
        if step.entries[0].samples:
            break
    assert spans == [(StepKind.PREFILL, 0, 16), (StepKind.PREFILL, 16, 32), (StepKind.PREFILL, 32, 40)]


def test_new_requests_join_at_the_next_step() -> None:
    s = make_scheduler()
    a = make_request("a", 4)
    s.add(a)
    step = s.schedule()
    s.postprocess(step, [70])
    step = s.schedule()
    assert step.kind is StepKind.DECODE  # a decodes
    s.postprocess(step, [72])
    b = make_request("b", 4)
    s.add(b)
    step = s.schedule()
    assert step.kind is StepKind.PREFILL and [e.request.rid for e in step.entries] == ["b"]
    s.postprocess(step, [71])
    step = s.schedule()
    assert step.kind is StepKind.DECODE and {e.request.rid for e in step.entries} == {"a", "b"}


def test_max_running_requests_bounds_admission() -> None:
    s = make_scheduler(max_running=2)
    for rid in "abc":
        s.add(make_request(rid, 2))
    step = s.schedule()
    assert [e.request.rid for e in step.entries] == ["a", "b"]
    assert [r.rid for r in s.waiting] == ["c"]


def test_finish_on_length_eos_stop_token_and_stop_string() -> None:
    s = make_scheduler()
    length = make_request("len", 2, max_new=2)
    eos = make_request("eos", 2)
    stop_tok = make_request("tok", 2, stop_token_ids=(99,))
    stop_str = make_request("str", 2, stop=("bc",))
    for r in (length, eos, stop_tok, stop_str):
        s.add(r)
    step = s.schedule()
    s.postprocess(step, [70, 257, 99, ord("a")])
    assert eos.finish_reason is FinishReason.STOP and eos.matched_stop == 257
    assert stop_tok.finish_reason is FinishReason.STOP and stop_tok.matched_stop == 99
    step = s.schedule()
    assert {e.request.rid for e in step.entries} == {"len", "str"}
    s.postprocess(step, [71, ord("b")])
    assert length.finish_reason is FinishReason.LENGTH
    step = s.schedule()
    s.postprocess(step, [ord("c")])
    assert stop_str.finish_reason is FinishReason.STOP and stop_str.matched_stop == "bc"
    assert stop_str.detokenizer.text == "a"
    assert not s.has_work and s.slots.num_used == 0 and s.rows.num_free == 4
    assert eos.finish_json == {"type": "stop", "matched": 257} and stop_str.finish_json == {"type": "stop",
                                                                                             "matched": "bc"}
    assert length.finish_json == {"type": "length", "length": 2}
    assert stop_tok.output_ids == [99] and stop_tok.detokenizer.text == ""  # the stop token's text is cut


def test_no_stop_trim_keeps_the_stop_and_ignore_eos_ignores_stop_tokens() -> None:
    s = make_scheduler()
    kept_tok = make_request("tok", 2, stop_token_ids=(99,), no_stop_trim=True)
    kept_str = make_request("str", 2, stop=("bc",), no_stop_trim=True)
    ignoring = make_request("ign", 2, max_new=2, stop_token_ids=(99,), ignore_eos=True)
    for r in (kept_tok, kept_str, ignoring):
        s.add(r)
    s.postprocess(s.schedule(), [99, ord("b"), 99])
    assert kept_tok.finish_json == {"type": "stop", "matched": 99} and kept_tok.detokenizer.text == "c"
    s.postprocess(s.schedule(), [ord("c"), 257])
    assert kept_str.detokenizer.text == "bc" and kept_str.finish_json["matched"] == "bc"
    assert ignoring.output_ids == [99, 257] and ignoring.finish_json == {"type": "length", "length": 2}


def test_abort_reports_whether_the_request_ran() -> None:
    s = make_scheduler(max_running=1)
    running, waiting = make_request("run", 2), make_request("wait", 2)
    s.add(running)
    s.add(waiting)
    s.schedule()
    s.finish(running, FinishReason.ABORT)
    s.finish(waiting, FinishReason.ABORT)
    assert running.finish_json == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert waiting.finish_json == {"type": "abort", "message": "Abort in waiting queue"}


def test_decode_preempts_the_newest_request_when_the_pool_is_full() -> None:
    """Admission reserves a decoding request only ``new_token_ratio`` of its tokens left (SGLang's estimate, low
    here as after many decode steps): when they really are generated the pool runs out, and decode preempts the
    newest request (its tokens kept, its KV recomputed later); the ratio becomes SGLang's estimate after a
    retraction. (Before admission reserved tokens, two 4 + 6 requests were admitted together into 10 slots.)"""
    s = make_scheduler(num_slots=11, max_batch_tokens=64)  # 10 usable slots
    s.new_token_ratio.current = s.new_token_ratio.min
    a, b = make_request("a", 2, max_new=8), make_request("b", 1, max_new=5)
    s.add(a)
    s.postprocess(s.schedule(), [70])               # a decodes: 8 * 0.098 of its tokens reserved
    s.add(b)
    step = s.schedule()                              # b: 1 + 5 + a page fit beside that
    assert [e.request.rid for e in step.entries] == ["b"]
    s.postprocess(step, [70])
    for used in (5, 7, 9):
        step = s.schedule()
        assert [e.request.rid for e in step.entries] == ["a", "b"] and s.slots.num_used == used
        s.postprocess(step, [71, 71])
    step = s.schedule()                              # no room for 2: b is preempted
    assert [e.request.rid for e in step.entries] == ["a"]
    assert b.state is RequestState.WAITING and b.num_cached == 0 and b.output_ids == [70, 71, 71, 71]
    assert s.num_preemptions == 1 and s.new_token_ratio.current == 1.0  # (4 decoded + 20) / (8 + 1), at most 1


def test_partial_prefills_holding_the_pool_do_not_deadlock() -> None:
    s = make_scheduler(num_slots=21, max_batch_tokens=8, context_len=64)  # 20 usable slots
    a, b = make_request("a", 16, max_new=2), make_request("b", 16, max_new=2)
    s.add(a)
    s.add(b)
    for _ in range(20):
        step = s.schedule()
        if step is None:
            break
        s.postprocess(step, [70] * sum(e.samples for e in step.entries))
    assert a.state is RequestState.FINISHED and b.state is RequestState.FINISHED


def test_abort_frees_everything() -> None:
    s = make_scheduler()
    r = make_request("a", 10)
    s.add(r)
    s.schedule()
    assert s.slots.num_used == 10
    s.finish(r, FinishReason.ABORT)
    assert s.slots.num_used == 0 and s.rows.num_free == 4 and r.finish_reason is FinishReason.ABORT
    with pytest.raises(IllegalTransition, match="finished"):
        r.transition(RequestState.RUNNING)
