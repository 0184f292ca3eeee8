"""SGLang ``/generate`` ↔ vLLM completions, on answers recorded from vLLM 0.32.0 (CPU) for these requests.

The same translation runs against a live vLLM server in ``tests/vllm`` (``make test-vllm``); these check its
rules without one: every field mapped or refused, the answer's SGLang shape, streams put together per choice.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from pathlib import Path

import pytest

from handoff.protocol import ignored_fields
from handoff.protocol.sse import DONE, EventSplitter, event_data
from handoff.service.errors import InvalidRequest, ServiceError, Unsupported
from node_sidecar.engines.vllm import VllmEngine
from node_sidecar.engines.vllm_answer import GenerateRequest, Translator
from node_sidecar.engines.vllm_choice import ChoiceState
from node_sidecar.engines.vllm_generate import to_completion
from node_sidecar.engines.vllm_versions import MAX_RENAMES, ServedVersions

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_completions.json").read_text())
ANSWERS = RECORDED["answers"]


def completion(body: dict) -> dict:
    raw, _ = to_completion(json.dumps(body).encode())
    return json.loads(raw)


def translate(name: str, request: GenerateRequest) -> object:
    return json.loads(Translator(request, ServedVersions("v7")).answer(ANSWERS[name].encode()))


def stream_events(name: str, request: GenerateRequest, piece: int = 7) -> list[bytes]:
    """The recorded stream fed in small pieces, as a relay would; the translated events' payloads."""
    transform = Translator(request, ServedVersions("v7")).stream()
    raw = ANSWERS[name].encode()
    out = b"".join(transform.feed(raw[i:i + piece]) for i in range(0, len(raw), piece)) + transform.finish()
    splitter = EventSplitter()
    events = [event_data(e) for e in splitter.feed(out)]
    assert splitter.finish() == b""  # every event whole
    return events


def test_request_fields_are_mapped_with_sglang_defaults() -> None:
    body = completion({"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "top_k": -1, "top_p": 0.9, "stop": ["x"], "stop_token_ids": [7],
        "ignore_eos": True, "min_new_tokens": 1, "no_stop_trim": True, "sampling_seed": 3, "regex": None},
        "rid": "r1", "bootstrap_room": 5})
    assert body == {"prompt": [1, 2], "return_token_ids": True, "stream": False, "max_tokens": 5, "temperature": 0,
                    "top_p": 0.9, "stop": ["x"], "stop_token_ids": [7], "ignore_eos": True, "min_tokens": 1,
                    "include_stop_str_in_output": True, "seed": 3, "request_id": "r1", "top_k": 0, "min_p": 0.0,
                    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
    assert completion({"text": "hi"})["max_tokens"] == 128  # SGLang's default, not vLLM's 16
    batch = completion({"text": ["a", "b"], "stream": True})
    assert batch["prompt"] == ["a", "b"] and batch["stream"] is True
    logprobs = completion({"input_ids": [[1], [2]], "return_logprob": True, "top_logprobs_num": 3,
                           "logprob_start_len": 0})
    assert logprobs["logprobs"] == 3 and logprobs["prompt_logprobs"] == 3 and logprobs["return_tokens_as_token_ids"]
    assert "prompt_logprobs" not in completion({"input_ids": [1], "return_logprob": True})
    # what sglang-router sends when it rebuilds a request: SGLang's fields at their defaults, all accepted
    rebuilt = {"input_ids": [1], "image_data": None, "lora_path": None, "return_hidden_states": False,
               "log_metrics": True, "no_logs": False, "return_logprob": False, "logprob_start_len": -1,
               "top_logprobs_num": 0, "token_ids_logprob": None, "custom_logit_processor": None,
               "return_text_in_logprobs": False, "background": False, "return_bytes": False, "modalities": [],
               "sampling_params": {"n": 1, "json_schema": None, "regex": None, "stop_regex": None}}
    assert completion(rebuilt)["prompt"] == [1]


@pytest.mark.parametrize("body, error, name", [
    ({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, Unsupported, "sampling_params.json_schema"),
    ({"input_ids": [1], "lora_path": "adapter"}, Unsupported, "lora_path"),
    ({"input_ids": [1], "image_data": "x.png"}, Unsupported, "image_data"),
    ({"input_ids": [[1], [2]], "rid": ["a", "b"]}, Unsupported, "rid"),
    ({"input_ids": [1], "sampling_params": [{}]}, Unsupported, "sampling_params"),
    ({"input_ids": [1], "return_logprob": True, "return_text_in_logprobs": True}, Unsupported,
     "return_text_in_logprobs"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 0, "stream": True}, Unsupported,
     "logprob_start_len"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, InvalidRequest, "sampling_params.n"),
    ({"input_ids": [[1]] * 2, "sampling_params": {"n": 129}}, InvalidRequest, "256 sequences"),
    ({"input_ids": [1], "return_bytes": True}, Unsupported, "return_bytes"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokenz": 2}}, InvalidRequest, "max_new_tokenz"),
    ({"input_ids": [1], "surprise": 1, "sampling_params": {"surprise": 2}}, InvalidRequest, "surprise"),
    ({"text": "a", "input_ids": [1]}, InvalidRequest, "exactly one"),
    ({"input_ids": []}, InvalidRequest, "input_ids"),
    ({"input_ids": [1, -2]}, InvalidRequest, "input_ids"),
    ({"input_ids": [1], "top_logprobs_num": "3"}, InvalidRequest, "top_logprobs_num"),
])
def test_what_vllm_cannot_serve_is_refused_naming_the_field(body: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name.replace("[", r"\[")):
        to_completion(json.dumps(body).encode())
    assert to_completion(json.dumps({"input_ids": [1], "lora_path": None, "return_hidden_states": False}).encode())


def test_an_unknown_top_level_key_is_ignored_and_never_sent_to_vllm(caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """As SGLang's contract ignores a top-level key it does not know, so does a vLLM node (its name logged), and the
    completion, built field by field, does not carry it. Before: a 400 ``unknown field``."""
    caplog.set_level(logging.WARNING, logger=ignored_fields.__name__)
    monkeypatch.setattr(ignored_fields, "_logged", set())
    plain = completion({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
    sent = completion({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "surprise_vllm": {"a": 1},
                       "echo": True})
    assert sent == plain and "surprise_vllm" not in json.dumps(sent) and "echo" not in sent
    assert any("surprise_vllm" in r.getMessage() for r in caplog.records)


def test_sglangs_sampling_defaults_are_always_sent() -> None:
    """vLLM fills a field left out or null from the model's generation_config.json; SGLang's /generate uses its
    SamplingParams defaults: each is sent, a null as SGLang's default."""
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "repetition_penalty": 1.0}
    for params in ({}, dict.fromkeys(defaults)):
        body = completion({"input_ids": [1], "sampling_params": params})
        assert {k: body.get(k) for k in defaults} == defaults


def test_max_new_tokens_null_asks_for_the_whole_context() -> None:
    raw, _ = to_completion(json.dumps({"text": "a", "sampling_params": {"max_new_tokens": None}}).encode(),
                           max_model_len=4096)
    assert json.loads(raw)["max_tokens"] == 4096  # vLLM caps it at what the prompt leaves
    with pytest.raises(Unsupported, match="sampling_params.max_new_tokens"):
        to_completion(json.dumps({"text": "a", "sampling_params": {"max_new_tokens": None}}).encode())


def test_temperature_below_sglangs_greedy_threshold_is_greedy_and_above_vllms_range_refused() -> None:
    greedy = completion({"input_ids": [1], "sampling_params": {"temperature": 5e-7, "n": 2}})
    assert greedy["temperature"] == 0 and greedy["prompt"] == [[1], [1]] and "n" not in greedy
    assert completion({"input_ids": [1], "sampling_params": {"temperature": 1e-6}})["temperature"] == 1e-6
    with pytest.raises(Unsupported, match="sampling_params.temperature"):
        completion({"input_ids": [1], "sampling_params": {"temperature": 2.5}})


def test_max_new_tokens_0_is_served_as_sglang_does() -> None:
    """SGLang serves max_new_tokens 0 (a prompt scored: output_ids [], finish length 0; with top_logprobs_num
    the row after the prompt, its scoring request); vLLM refuses max_tokens 0: it is asked for one token, the
    answer drops it."""
    raw, request = to_completion(json.dumps({"input_ids": [72, 101], "sampling_params": {"max_new_tokens": 0},
                                             "return_logprob": True, "top_logprobs_num": 1,
                                             "logprob_start_len": 0}).encode())
    assert json.loads(raw)["max_tokens"] == 1 and json.loads(raw)["prompt_logprobs"] == 1
    answer = {"choices": [{"index": 0, "text": "7", "finish_reason": "length", "stop_reason": None,
                           "token_ids": [55], "prompt_token_ids": [72, 101],
                           "prompt_logprobs": [None, {"101": {"logprob": -2.0, "rank": 1}}],
                           "logprobs": {"token_logprobs": [-3.5], "top_logprobs": [{"token_id:55": -3.5}]}}]}
    result = json.loads(Translator(request, ServedVersions("v7")).answer(json.dumps(answer).encode()))
    meta = result["meta_info"]
    assert result["text"] == "" and result["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["output_token_logprobs"] == []
    assert meta["output_top_logprobs"] == [[[-3.5, 55, None]]]
    assert [row[1] for row in meta["input_token_logprobs"]] == [72, 101]
    plain, request = to_completion(json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 0}}).encode())
    assert json.loads(plain)["max_tokens"] == 1 and request.prompt_only
    assert not to_completion(json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 5}}).encode())[1] \
        .prompt_only


LOGPROBS = {"input_ids": [72, 101], "return_logprob": True, "top_logprobs_num": 2}


@pytest.mark.parametrize(("mode", "params", "refused_for"), [
    (None, {"temperature": 1.0, "top_p": 0.9, "top_k": 5}, None),  # raw: before filtering, as SGLang's
    (None, {"temperature": 0, "max_new_tokens": 4}, None),  # greedy: temperature 1 in SGLang too
    (None, {"temperature": 0.7}, "a temperature other than 1"),
    ("raw_logprobs", {"temperature": 1.0, "repetition_penalty": 1.2}, "penalties"),
    ("raw_logprobs", {"temperature": 0, "logit_bias": {"5": 2.0}}, "logit_bias"),
    ("raw_logprobs", {"min_new_tokens": 2}, "min_new_tokens"),
    ("processed_logprobs", {"temperature": 0.7, "frequency_penalty": 0.5}, None),  # after both, as SGLang's
    ("processed_logprobs", {"temperature": 0.7, "top_p": 0.9}, "top_p"),
    ("processed_logprobs", {"temperature": 0, "top_k": 5}, None),  # greedy: no filter applies
    ("raw_logits", {"temperature": 1.0}, "logits, not logprobs"),
])
def test_logprobs_of_another_distribution_than_sglangs_are_refused(mode: str | None, params: dict,
                                                                   refused_for: str | None) -> None:
    """vLLM answers logprobs from one distribution per server (``--logprobs-mode``), SGLang from the logits after
    penalties over the temperature, before filtering: a request whose logprobs would be of another distribution
    (an RL loop's importance ratios built on them) is a 400 naming the mode that serves it, never answered."""
    body = json.dumps({**LOGPROBS, "sampling_params": params}).encode()
    if refused_for is None:
        assert json.loads(to_completion(body, logprobs_mode=mode)[0])["logprobs"] == 2
        return
    with pytest.raises(Unsupported, match=refused_for) as refused:
        to_completion(body, logprobs_mode=mode)
    assert refused.value.extra["field"] == "return_logprob"
    to_completion(json.dumps({"input_ids": [72], "sampling_params": params}).encode(), logprobs_mode=mode)


def test_a_prompt_only_request_scores_untempered_in_any_logprobs_mode() -> None:
    """SGLang's row after the prompt of a max_new_tokens 0 request is untempered and its token dropped: vLLM is
    asked to sample plainly, so raw and processed logprobs are both SGLang's."""
    for mode in (None, "processed_logprobs"):
        raw, _ = to_completion(json.dumps({**LOGPROBS, "sampling_params": {
            "max_new_tokens": 0, "temperature": 0.5, "top_p": 0.5, "repetition_penalty": 1.3}}).encode(),
            logprobs_mode=mode)
        sent = json.loads(raw)
        assert (sent["temperature"], sent["top_p"], sent["repetition_penalty"]) == (1.0, 1.0, 1.0)


def test_n_samples_in_sglangs_order() -> None:
    """n > 1: vLLM's n when sampling (its choices are prompt-major, as SGLang's answers); each prompt n times
    when greedy (vLLM refuses n > 1 there); a list answer either way."""
    sampled, request = to_completion(json.dumps({"input_ids": [[1], [2]], "rid": None,
                                                 "sampling_params": {"n": 3, "temperature": 0.8}}).encode())
    assert json.loads(sampled)["n"] == 3 and json.loads(sampled)["prompt"] == [[1], [2]] and request.is_batch
    greedy, request = to_completion(json.dumps({"text": "a", "rid": "r",
                                                "sampling_params": {"n": 2, "temperature": 0}}).encode())
    assert json.loads(greedy)["prompt"] == ["a", "a"] and "n" not in json.loads(greedy) and request.is_batch
    assert json.loads(greedy)["request_id"] == "r"
    one, request = to_completion(json.dumps({"text": "a", "sampling_params": {"n": 1}}).encode())
    assert json.loads(one)["prompt"] == "a" and not request.is_batch


def test_answer_in_sglang_shape_with_logprobs() -> None:
    request = GenerateRequest(is_batch=False, rid="req-1", return_logprob=True, top_logprobs_num=2,
                              logprob_start_len=0)
    answer = translate("logprobs", request)
    vllm = json.loads(ANSWERS["logprobs"])["choices"][0]
    meta = answer["meta_info"]
    assert answer["output_ids"] == vllm["token_ids"] and answer["text"] == vllm["text"]
    assert meta["id"] == "req-1" and meta["weight_version"] == "v7"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4 and meta["cached_tokens"] == 0
    assert meta["output_token_logprobs"] == [[lp, t, None] for lp, t in
                                             zip(vllm["logprobs"]["token_logprobs"], vllm["token_ids"])]
    for top, row in zip(meta["output_top_logprobs"], vllm["logprobs"]["top_logprobs"]):
        assert sorted((t, lp) for lp, t, _ in top) == sorted((int(k.split(":")[1]), v) for k, v in row.items())
        assert top[0][0] == max(row.values())
    assert meta["input_token_logprobs"][0] == [None, 72, None]
    assert meta["input_token_logprobs"][1] == [vllm["prompt_logprobs"][1]["101"]["logprob"], 101, None]
    assert meta["input_top_logprobs"][0] is None
    assert all(len(row) == 2 and [r[1] for r in row] != [] for row in meta["input_top_logprobs"][1:])
    start_at_2 = translate("logprobs", GenerateRequest(False, None, True, 0, 2))["meta_info"]
    assert [t for _, t, _ in start_at_2["input_token_logprobs"]] == [108] and "input_top_logprobs" not in start_at_2


def test_a_finished_answer_says_its_e2e_latency_as_sglang_does() -> None:
    """SGLang's finished answers carry ``meta_info.e2e_latency`` (sglang-router's ``GenerateMetaInfo`` requires
    it); a stream's unfinished events do not."""
    _, request = to_completion(json.dumps({"input_ids": [72, 101],
                                           "sampling_params": {"max_new_tokens": 1}}).encode())
    answer = {"choices": [{"index": 0, "text": "7", "finish_reason": "length", "stop_reason": None,
                           "token_ids": [55], "prompt_token_ids": [72, 101]}]}
    meta = json.loads(Translator(request, ServedVersions("v7")).answer(json.dumps(answer).encode()))["meta_info"]
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] >= 0
    unfinished = Translator(request, ServedVersions("v7")).result(0, ChoiceState())
    assert "e2e_latency" not in unfinished["meta_info"]


def test_finish_reasons_and_batches() -> None:
    stop = translate("stop_token", GenerateRequest(False, None, False, 0, -1, return_prompt_token_ids=True))
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": 191}
    assert stop["prompt_token_ids"] == [72, 101]
    batch = translate("batch", GenerateRequest(True, None, False, 0, -1, num_choices=2))
    vllm = json.loads(ANSWERS["batch"])["choices"]
    assert [a["output_ids"] for a in batch] == [c["token_ids"] for c in sorted(vllm, key=lambda c: c["index"])]
    assert [a["meta_info"]["prompt_tokens"] for a in batch] == [2, 3]
    assert len({a["meta_info"]["id"] for a in batch}) == 2
    with pytest.raises(ServiceError, match="not JSON"):
        Translator(GenerateRequest(False, None, False, 0, -1), ServedVersions()).answer(b"<html>")


def test_streams_carry_the_whole_answer_so_far_and_end_with_done() -> None:
    request = GenerateRequest(False, "s", True, 2, -1)
    events = stream_events("logprobs_stream", request)
    assert events[-1] == DONE
    payloads = [json.loads(e) for e in events[:-1]]
    assert [len(p["output_ids"]) for p in payloads] == [1, 2, 3, 4]
    whole = translate("logprobs", GenerateRequest(False, "s", True, 2, -1))
    assert payloads[-1]["output_ids"] == whole["output_ids"] and payloads[-1]["text"] == whole["text"]
    assert payloads[-1]["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    assert payloads[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert all(p["meta_info"]["finish_reason"] is None for p in payloads[:-1])
    batch_request = GenerateRequest(True, None, False, 0, -1, num_choices=2)
    batch = [json.loads(e) for e in stream_events("batch_stream", batch_request, 3)
             if e != DONE]
    finals = {p["index"]: p for p in batch if p["meta_info"]["finish_reason"]}
    whole_batch = translate("batch", GenerateRequest(True, None, False, 0, -1, num_choices=2))
    assert [finals[i]["output_ids"] for i in (0, 1)] == [a["output_ids"] for a in whole_batch]


@pytest.mark.parametrize("choice", [
    {"index": "zero", "text": "a"}, {"index": None}, {"index": -1}, {"text": 5}, {"token_ids": "12"},
    {"token_ids": [1, "2"]}, {"prompt_token_ids": 7}, {"prompt_logprobs": {"a": 1}},
    {"logprobs": {"token_logprobs": 3}}, "not a choice"])
def test_a_malformed_vllm_answer_is_an_upstream_error_never_a_crash(choice: object) -> None:
    """Each field the translation reads is checked: a 502 naming the engine's answer (a 500 before)."""
    translator = Translator(GenerateRequest(False, None, True, 2, 0), ServedVersions())
    with pytest.raises(ServiceError) as info:
        translator.answer(json.dumps({"choices": [choice]}).encode())
    assert info.value.kind.name == "upstream_error"
    stream = translator.stream()
    good = b"data: " + json.dumps({"choices": [{"index": 0, "text": "a", "token_ids": [5]}]}).encode() + b"\n\n"
    out = stream.feed(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n" + good + b"data: [DONE]\n\n")
    out += stream.finish()
    payloads = [event_data(e) for e in EventSplitter().feed(out)]
    # the error (a choice that is not an object too: skipping it would drop a prompt's answer), then [DONE] as
    # SGLang ends a failed stream; what the engine sent after it is not translated
    assert len(payloads) == 2 and payloads[1] == DONE, payloads
    assert json.loads(payloads[0])["error"]["type"] == "upstream_error"


def test_prompt_logprobs_shorter_than_the_prompt_leave_the_rest_empty() -> None:
    answer = {"choices": [{"index": 0, "text": "x", "token_ids": [5], "prompt_token_ids": [1, 2, 3],
                           "prompt_logprobs": [None, {"2": {"logprob": -0.5, "rank": 1}}],
                           "logprobs": {"token_logprobs": [-1.0], "top_logprobs": [None]},
                           "finish_reason": "length"}]}
    result = json.loads(Translator(GenerateRequest(False, None, True, 0, 0), ServedVersions())
                        .answer(json.dumps(answer).encode()))
    assert result["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-0.5, 2, None], [None, 3, None]]


def test_n_null_still_bounds_the_batch() -> None:
    from handoff.protocol.generate_request import MAX_SEQUENCES

    prompts = [[1]] * (MAX_SEQUENCES + 1)
    with pytest.raises(InvalidRequest, match="sequences"):
        to_completion(json.dumps({"input_ids": prompts, "sampling_params": {"n": None}}).encode())
    raw, request = to_completion(json.dumps({"input_ids": [[1], [2]], "sampling_params": {"n": None}}).encode())
    assert json.loads(raw)["prompt"] == [[1], [2]] and request.is_batch


def test_output_top_logprobs_hold_top_logprobs_num_entries_when_the_sampled_token_is_added() -> None:
    """vLLM adds the sampled token to a row when it is not among the top k (found by review: rows of k + 1,
    which break code stacking them into [T, k]); SGLang answers exactly k."""
    answer = json.loads(ANSWERS["logprobs"])
    row = answer["choices"][0]["logprobs"]["top_logprobs"][0]
    row["token_id:65000"] = min(row.values()) - 1.0  # the sampled token, below the top 2
    request = GenerateRequest(is_batch=False, rid=None, return_logprob=True, top_logprobs_num=2, logprob_start_len=-1)
    meta = json.loads(Translator(request, ServedVersions()).answer(json.dumps(answer).encode()))["meta_info"]
    assert len(row) == 3 and all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert 65000 not in [t for _, t, _ in meta["output_top_logprobs"][0]]


class RecordingEngine:
    """vLLM as the adapter's calls see it: each call recorded, answered ``{"aborted": []}``."""

    base_url = "http://127.0.0.1:9"  # never called: only the calls' bodies are looked at

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []

    async def call(self, method: str, path: str, body: object = None, **_: object) -> dict:
        self.calls.append((method, path, body))
        return {"aborted": []}


async def test_an_abort_by_id_reaches_every_copy_of_a_greedy_n_request() -> None:
    """A greedy ``n`` goes to vLLM as the prompt n times (vLLM refuses greedy n > 1), so one id became n vLLM
    requests; the abort named only the first and the others ran on (found by review)."""
    engine = RecordingEngine()
    adapter = VllmEngine(engine)
    for body in ({"text": "hi", "rid": "R", "sampling_params": {"n": 3, "temperature": 0}},
                 {"text": "hi", "rid": "S", "sampling_params": {"n": 3, "temperature": 1}},
                 {"text": "hi", "rid": "T"}):
        adapter.generation_call("/generate", json.dumps(body).encode(), "")
    for rid in ("R", "S", "T", "unknown"):
        await adapter.abort(rid=rid, abort_all=False)
    assert [body["request_ids"] for _, _, body in engine.calls] == [
        ["cmpl-R-0", "cmpl-R-1", "cmpl-R-2"], ["cmpl-S-0"], ["cmpl-T-0"], ["cmpl-unknown-0"]]


def feed_stream(request: GenerateRequest, events: list[object], tail: bytes = b"") -> list[bytes]:
    """``events`` (objects as JSON, bytes as they are) through a stream translation; the payloads out."""
    transform = Translator(request, ServedVersions("v1")).stream()
    raw = b"".join(e if isinstance(e, bytes) else b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    out = transform.feed(raw + tail) + transform.finish()
    return [event_data(e) for e in EventSplitter().feed(out)]


def piece(index: int, tokens: list[int], **more: object) -> dict:
    return {"choices": [{"index": index, "text": "x" * len(tokens), "token_ids": tokens, **more}]}


def assert_upstream_error(payloads: list[bytes]) -> None:
    assert payloads[-1] == DONE and json.loads(payloads[-2])["error"]["type"] == "upstream_error", payloads


@pytest.mark.parametrize("choices", [
    [{"index": 0, "text": "a", "token_ids": [1]}, {"index": 0, "text": "b", "token_ids": [2]}],  # a duplicate
    [{"index": 0, "text": "a", "token_ids": [1]}],  # one of two missing
    [{"index": 0, "text": "a", "token_ids": [1]}, {"index": 7, "text": "b", "token_ids": [2]}],  # past the batch
    [{"index": 0, "text": "a", "token_ids": [1]}, None],  # a choice that is not one
])
def test_a_batch_answer_must_hold_each_asked_choice_once(choices: list) -> None:
    """Found by review: a duplicate index was merged into one answer (texts run together), a missing or extra
    choice gave a batch of the wrong length, a null choice was dropped: all passed as success."""
    translator = Translator(GenerateRequest(True, None, False, 0, -1, num_choices=2), ServedVersions())
    with pytest.raises(ServiceError) as info:
        translator.answer(json.dumps({"choices": choices}).encode())
    assert info.value.kind.name == "upstream_error"
    one = Translator(GenerateRequest(False, None, False, 0, -1), ServedVersions())
    with pytest.raises(ServiceError):  # a single prompt's answer: index 3 of 1
        one.answer(json.dumps({"choices": [{"index": 3, "text": "a", "token_ids": [1]}]}).encode())


@pytest.mark.parametrize("bad", [
    {"logprobs": {"token_logprobs": [-1.0], "top_logprobs": [None]}},  # 1 logprob for 2 tokens
    {"logprobs": {"token_logprobs": ["-1", "x"], "top_logprobs": [None, None]}},  # not numbers
    {"logprobs": None},  # none at all, though asked for
    {"finish_reason": {"type": "length"}},  # not vLLM's string
    {"finish_reason": "stop", "stop_reason": [1, 2]},
    {"token_ids": [-5, 2]}, {"token_ids": [2**40, 2]},
])
def test_logprobs_finish_reasons_and_token_ids_of_the_wrong_shape_are_an_upstream_error(bad: dict) -> None:
    """Found by review: logprobs shorter than the tokens were cut by zip, non-number logprobs and odd stop_reason
    or finish_reason values were passed on, negative or huge token ids were output_ids: all as success."""
    choice = {"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": "length", **bad}
    translator = Translator(GenerateRequest(False, None, True, 0, -1), ServedVersions())
    with pytest.raises(ServiceError) as info:
        translator.answer(json.dumps({"choices": [choice]}).encode())
    assert info.value.kind.name == "upstream_error"
    assert_upstream_error(feed_stream(GenerateRequest(False, None, True, 0, -1), [{"choices": [choice]}],
                                      b"data: [DONE]\n\n"))


def test_a_stream_without_done_ends_with_an_error_and_nothing_passes_after_done() -> None:
    """Found by review: a stream the engine closed without [DONE] ended in silence, and events after [DONE]
    were translated and sent after it."""
    request = GenerateRequest(False, None, False, 0, -1)
    payloads = feed_stream(request, [piece(0, [1]), piece(0, [2])])
    assert [json.loads(p)["output_ids"] for p in payloads[:2]] == [[1], [1, 2]]
    assert_upstream_error(payloads)
    after = feed_stream(request, [piece(0, [1], finish_reason="length")], b"data: [DONE]\n\n" + b"data: "
                        + json.dumps(piece(0, [9])).encode() + b"\n\n")
    assert len(after) == 2 and after[-1] == DONE


@pytest.mark.parametrize("event", [b"data: hello\n\n", b"data: {\"choices\": null}\n\n", b"data: [1, 2]\n\n",
                                   json.dumps(piece(4, [1])).encode().join([b"data: ", b"\n\n"])])
def test_a_stream_event_that_is_not_a_completion_chunk_is_an_error_not_passed_on(event: bytes) -> None:
    """Found by review: an event that was not JSON, or JSON without choices, reached the SGLang client as the
    engine wrote it, and a choice index past the request's made a state of its own (unbounded)."""
    payloads = feed_stream(GenerateRequest(False, None, False, 0, -1), [event], b"data: [DONE]\n\n")
    assert len(payloads) == 2
    assert_upstream_error(payloads)
    engine_error = {"error": {"type": "BadRequestError", "message": "no"}}
    assert json.loads(feed_stream(GenerateRequest(False, None, False, 0, -1), [engine_error])[0]) == engine_error


def test_a_streams_answer_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a stream's choices were put together without bound (the sidecar's memory grew with
    whatever the engine streamed); past the bound the stream ends with an error."""
    from node_sidecar.engines import vllm_answer

    monkeypatch.setattr(vllm_answer, "MAX_STREAM_ANSWER_BYTES", 10_000)
    payloads = feed_stream(GenerateRequest(False, None, False, 0, -1), [piece(0, [1] * 100)] * 50)
    assert_upstream_error(payloads)
    assert len(payloads) < 50


def test_a_requests_choice_count_is_prompts_times_n() -> None:
    for body, count in [({"text": "a"}, 1), ({"text": ["a", "b"]}, 2),
                        ({"text": ["a", "b"], "sampling_params": {"n": 3, "temperature": 1}}, 6),
                        ({"text": ["a", "b"], "sampling_params": {"n": 3, "temperature": 0}}, 6)]:
        assert to_completion(json.dumps(body).encode())[1].num_choices == count


def test_a_finished_answer_carries_sglangs_weight_versions_span() -> None:
    """SGLang 0.5.23's final answers carry ``meta_info.weight_versions`` (``utils/weight_versions.py``
    ``add_weight_versions_to_meta_info``, ``tokenizer_manager.py:2560-2567``); a stream's unfinished events do not."""
    _, request = to_completion(json.dumps({"input_ids": [72, 101], "sampling_params": {"max_new_tokens": 2}}).encode())
    answer = {"choices": [{"index": 0, "text": "ab", "finish_reason": "length", "token_ids": [55, 56],
                           "prompt_token_ids": [72, 101]}]}
    meta = json.loads(Translator(request, ServedVersions("v7")).answer(json.dumps(answer).encode()))["meta_info"]
    assert meta["weight_versions"] == [{"version": "v7", "start": 0, "end": 2}] and meta["weight_version"] == "v7"
    payloads = feed_stream(request, [piece(0, [55]), piece(0, [56], finish_reason="length"), b"data: [DONE]\n\n"])
    first, last = (json.loads(p)["meta_info"] for p in payloads[:2])
    assert "weight_versions" not in first and first["weight_version"] == "v1"
    assert last["weight_versions"] == [{"version": "v1", "start": 0, "end": 2}]


async def test_an_answer_ended_by_a_version_update_keeps_the_version_it_ran_under() -> None:
    """``/update_weight_version`` aborts running requests (SGLang's default), then renames: SGLang answers the
    aborts first, with the old version (``http_server.py:1527-1540``). The aborted answer reached the sidecar after
    the rename and said the new one, which never ran it."""
    adapter = VllmEngine(RecordingEngine())
    await adapter.weight_call("/update_weight_version", {"new_version": "v7"})
    body = json.dumps({"input_ids": [72, 101], "sampling_params": {"max_new_tokens": 8}}).encode()
    call = adapter.generation_call("/generate", body, "")
    await adapter.weight_call("/update_weight_version", {"new_version": "v8", "abort_all_requests": True})
    aborted = {"choices": [{"index": 0, "text": "ab", "finish_reason": "abort", "token_ids": [55, 56],
                            "prompt_token_ids": [72, 101]}]}
    meta = json.loads(call.answer(json.dumps(aborted).encode()))["meta_info"]
    assert meta["weight_version"] == "v7" and meta["weight_versions"] == [{"version": "v7", "start": 0, "end": 2}]
    later = json.loads(adapter.generation_call("/generate", body, "").answer(json.dumps(aborted).encode()))
    assert later["meta_info"]["weight_versions"] == [{"version": "v8", "start": 0, "end": 2}]


async def test_a_rename_under_a_running_stream_splits_its_spans_where_the_sidecar_saw_it() -> None:
    """Without ``abort_all_requests`` a request runs on across the rename: SGLang reports two spans (the old
    version's tokens first) and the new version; the sidecar splits at the tokens it had relayed by then."""
    adapter = VllmEngine(RecordingEngine())
    await adapter.weight_call("/update_weight_version", {"new_version": "v7"})
    body = json.dumps({"input_ids": [72, 101], "stream": True, "sampling_params": {"max_new_tokens": 4}}).encode()
    transform = adapter.generation_call("/generate", body, "").stream()

    def feed(event: dict) -> dict:
        (payload,) = [event_data(e) for e in EventSplitter().feed(transform.feed(
            b"data: " + json.dumps(event).encode() + b"\n\n"))]
        return json.loads(payload)["meta_info"]

    assert feed(piece(0, [55, 56]))["weight_version"] == "v7"
    await adapter.weight_call("/update_weight_version", {"new_version": "v8", "abort_all_requests": False})
    meta = feed(piece(0, [57, 58], finish_reason="length"))
    assert meta["weight_versions"] == [{"version": "v7", "start": 0, "end": 2}, {"version": "v8", "start": 2, "end": 4}]
    assert meta["weight_version"] == "v8"


def test_a_relayed_piece_does_not_walk_the_rename_history() -> None:
    """Every piece of a stream follows the renames since the last one: with a long training run's renames kept
    (one a step, up to MAX_RENAMES), walking them all cost each piece 20 us or more, however few came since. The
    history here refuses a walk from its oldest end: a piece walks nothing when no rename came, else the new ones."""

    class NoWalkFromTheOldest(deque):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise AssertionError("every rename kept was walked")

    long = ServedVersions("v0")
    for i in range(MAX_RENAMES):
        long.rename(f"v{i + 1}")
    long._renames = NoWalkFromTheOldest(list(deque.__iter__(long._renames)), maxlen=MAX_RENAMES)
    trail = long.trail()
    trail.follow(long, 3)
    long.rename("next")
    trail.follow(long, 3)
    assert trail.version == "next" and trail.events == [(f"v{MAX_RENAMES}", 3)]


@pytest.mark.parametrize("row", [{"2": {"logprob": "-0.5", "rank": 1}}, {"2": {"logprob": {"x": 1}, "rank": 1}},
                                 {"2": {"logprob": True, "rank": 1}}, {"2": {"logprob": -0.5, "rank": "1"}}])
def test_prompt_logprobs_of_the_wrong_type_are_an_upstream_error(row: dict) -> None:
    """Found by review: the output logprobs were checked to be numbers, the prompt's were passed on as they came
    (a string or an object in ``input_token_logprobs``, as success)."""
    choice = {"index": 0, "text": "x", "token_ids": [5], "prompt_token_ids": [1, 2], "prompt_logprobs": [None, row],
              "logprobs": {"token_logprobs": [-1.0], "top_logprobs": [{"token_id:5": -1.0}]},
              "finish_reason": "length"}
    translator = Translator(GenerateRequest(False, None, True, 1, 0), ServedVersions())
    with pytest.raises(ServiceError) as info:
        translator.answer(json.dumps({"choices": [choice]}).encode())
    assert info.value.kind.name == "upstream_error"
