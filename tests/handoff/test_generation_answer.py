"""SGLang's answer shape (handoff/protocol/generation.py): finish reasons, meta_info, cumulative and incremental streams."""

from __future__ import annotations

from handoff.protocol.generation import (LogprobShape, SequenceAnswer, SequenceChunk, finish_abort,
                                         finish_abort_waiting, finish_length, finish_stop, finish_type,
                                         logprob_entries)


def test_finish_reasons_are_sglang_objects() -> None:
    assert finish_stop(2) == {"type": "stop", "matched": 2}
    assert finish_stop("###") == {"type": "stop", "matched": "###"}
    assert finish_length(16) == {"type": "length", "length": 16}
    assert finish_abort() == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert finish_abort_waiting() == {"type": "abort", "message": "Abort in waiting queue"}
    assert finish_type(None) is None and finish_type(finish_length(1)) == "length"


def _chunk(text: str, ids: list[int], done: bool = False, **logprobs) -> SequenceChunk:
    return SequenceChunk(text=text, output_ids=ids, prompt_tokens=4, completion_tokens=0,
                         finish_reason=finish_length(3) if done else None, **logprobs)


def test_cumulative_and_incremental_events_carry_the_same_answer() -> None:
    shape = LogprobShape(top_logprobs=True)
    parts = [("He", [1], [[-0.5, 1, None]], [[[-0.5, 1, None]]]),
             ("llo", [2, 3], [[-1.0, 2, None], [-2.0, 3, None]], [[[-1.0, 2, None]], [[-2.0, 3, None]]])]
    cumulative = SequenceAnswer("r", weight_version="v1", logprobs=shape)
    incremental = SequenceAnswer("r", weight_version="v1", logprobs=shape)
    events_c, events_i = [], []
    for n, (text, ids, lps, tops) in enumerate(parts):
        for answer, events in ((cumulative, events_c), (incremental, events_i)):
            chunk = _chunk(text, ids, done=n == len(parts) - 1, output_token_logprobs=lps, output_top_logprobs=tops,
                           input_token_logprobs=[[None, 7, None]] if n == 0 else None,
                           input_top_logprobs=[None] if n == 0 else None)
            chunk.completion_tokens = len(answer.output_ids) + len(ids)
            answer.add(chunk)
            events.append(answer.event(incremental=events is events_i))
    assert [e["text"] for e in events_c] == ["He", "Hello"]
    assert [e["text"] for e in events_i] == ["He", "llo"]
    assert "".join(e["text"] for e in events_i) == events_c[-1]["text"]
    assert [t for e in events_i for t in e["output_ids"]] == events_c[-1]["output_ids"] == [1, 2, 3]
    assert [x for e in events_i for x in e["meta_info"]["output_token_logprobs"]] == \
        events_c[-1]["meta_info"]["output_token_logprobs"]
    assert events_i[1]["meta_info"]["output_top_logprobs"] == parts[1][3]
    assert events_c[-1]["meta_info"]["input_token_logprobs"] == [[None, 7, None]]
    assert events_c[-1]["meta_info"]["output_token_logprobs_length"] == 3
    assert events_c[0]["meta_info"]["finish_reason"] is None and "e2e_latency" not in events_c[0]["meta_info"]
    assert events_c[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert events_c[-1]["meta_info"]["e2e_latency"] >= 0


def test_meta_info_without_logprobs_has_no_logprob_keys() -> None:
    answer = SequenceAnswer("r", weight_version="v")
    answer.add(SequenceChunk(text="x", output_ids=[5], prompt_tokens=3, completion_tokens=1, cached_tokens=2,
                             finish_reason=finish_stop(5)))
    meta = answer.answer()["meta_info"]
    assert not any("logprob" in key for key in meta)
    assert meta["cached_tokens"] == 2 and meta["cached_tokens_details"] == {"device": 2, "host": 0}
    assert logprob_entries([-1.0], [5], ["x"]) == [[-1.0, 5, "x"]]
