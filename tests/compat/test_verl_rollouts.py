"""verl 0.9.1 against the LB: its request bodies and its answer parsing, replayed.

verl's client modules do not import without their heavy dependencies (``verl``
imports ``ray`` on import, ``http_server_engine`` imports ``sglang``), so the
bodies and the parsing are replayed here, transcribed from:

- ``verl/workers/rollout/sglang_rollout/http_server_engine.py``:
  ``AsyncHttpServerAdapter.generate`` (payload, ``None`` values dropped, POSTed
  as JSON to ``/generate``, ``raise_for_status``, JSON answer);
- ``verl/workers/rollout/sglang_rollout/async_sglang_server.py``:
  ``SGLangHttpServer.generate`` (the ``GenerateReqInput`` fields it sets:
  ``rid``, ``input_ids``, ``sampling_params`` from the agent loop with
  ``max_new_tokens``, ``return_logprob``, ``image_data``/``video_data`` null,
  ``logprob_start_len``/``top_logprobs_num`` for prompt logprobs) and its
  parsing (``finish_reason["type"]``, logprobs from ``output_token_logprobs``
  checked against ``output_ids``), and ``_extract_prompt_logprobs_sglang``;
- ``http_server_engine.py``'s ``abort_request`` (``{"rid": rid, "abort_all": false}``);
- ``verl/experimental/agent_loop/agent_loop.py``: the sampling parameters
  (``temperature``, ``top_p``, ``top_k``, ``repetition_penalty`` 1.0,
  ``logprobs``; greedy: top_p 1, top_k -1, temperature 0).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import pytest

from tests.support.procs import wait_until

PROMPT_IDS = [256] + [ord(c) for c in "The rollout starts here"]
MAX_MODEL_LEN, PROMPT_LENGTH, RESPONSE_LENGTH = 4096, 64, 24


def adapter_payload(prompt: str | None = None, sampling_params: dict | None = None, input_ids: list[int] | None = None,
                    image_data: Any = None, return_logprob: bool = False, logprob_start_len: int | None = None,
                    top_logprobs_num: int | None = None, token_ids_logprob: list[int] | None = None,
                    lora_path: str | None = None, custom_logit_processor: Any = None) -> dict[str, Any]:
    """``AsyncHttpServerAdapter.generate``'s payload."""
    payload = {"text": prompt, "sampling_params": sampling_params, "input_ids": input_ids, "image_data": image_data,
               "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
               "top_logprobs_num": top_logprobs_num, "token_ids_logprob": token_ids_logprob, "lora_path": lora_path,
               "custom_logit_processor": custom_logit_processor}
    return {k: v for k, v in payload.items() if v is not None}


def agent_loop_sampling_params(*, greedy: bool, calculate_log_probs: bool = True) -> dict[str, Any]:
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=calculate_log_probs)
    if greedy:
        params.update(top_p=1.0, top_k=-1, temperature=0)
    return params


def server_request(request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> tuple[dict, bool, Any]:
    """``SGLangHttpServer.generate``: the request it builds (sent here as a ``/generate`` body)."""
    sampling_params = dict(sampling_params)
    max_possible_tokens = MAX_MODEL_LEN - len(prompt_ids)
    if "max_new_tokens" in sampling_params:
        max_new_tokens = sampling_params.pop("max_new_tokens")
    elif "max_tokens" in sampling_params:
        max_new_tokens = sampling_params.pop("max_tokens")
    else:
        max_new_tokens = min(RESPONSE_LENGTH, PROMPT_LENGTH + RESPONSE_LENGTH - len(prompt_ids))
    sampling_params["max_new_tokens"] = max(0, min(max_new_tokens, max_possible_tokens))
    return_logprob = sampling_params.pop("logprobs", False)
    prompt_logprobs = sampling_params.pop("prompt_logprobs", None)
    if prompt_logprobs is not None:
        return_logprob = True
    request = {"rid": request_id, "input_ids": prompt_ids, "sampling_params": sampling_params,
               "return_logprob": return_logprob, "image_data": None, "video_data": None}
    if prompt_logprobs is not None:
        request["logprob_start_len"] = 0
        if prompt_logprobs > 0:
            request["top_logprobs_num"] = prompt_logprobs
    return request, return_logprob, prompt_logprobs


def parse(output: dict[str, Any], return_logprob: bool) -> tuple[list[int], list[float] | None, str | None]:
    """``SGLangHttpServer.generate``'s parsing of the answer: token ids, logprobs, stop reason."""
    meta_info = output.get("meta_info", {})
    finish_reason = meta_info.get("finish_reason")
    finish_reason = finish_reason["type"] if finish_reason else None
    if return_logprob:
        token_ids = list(output.get("output_ids", []))
        output_token_logprobs = meta_info.get("output_token_logprobs") or []
        if output_token_logprobs and len(output_token_logprobs) == len(token_ids):
            log_probs = [float(log_prob) for log_prob, _, _ in output_token_logprobs]
        else:
            token_ids, log_probs = [], []
    else:
        token_ids, log_probs = output["output_ids"], None
    return token_ids, log_probs, finish_reason


def extract_prompt_logprobs(meta_info: dict, num_prompt_logprobs: int, sequence_length: int) -> dict[str, list]:
    """``_extract_prompt_logprobs_sglang``: entry 0 has no logprob; a trailing dummy row keeps the length."""
    input_token_logprobs = meta_info.get("input_token_logprobs") or []
    input_top_logprobs = meta_info.get("input_top_logprobs") or [] if num_prompt_logprobs > 0 else []
    prompt_ids_ls, prompt_logprobs_ls = [], []
    for position in range(1, len(input_token_logprobs)):
        if num_prompt_logprobs == 0:
            logprob, token_id, _ = input_token_logprobs[position]
            prompt_ids_ls.append([int(token_id)])
            prompt_logprobs_ls.append([float(logprob)])
        else:
            top_entries = input_top_logprobs[position]
            ids = [int(tok_id) for _, tok_id, _ in top_entries]
            assert len(ids) == num_prompt_logprobs
            prompt_ids_ls.append(ids)
            prompt_logprobs_ls.append([float(logprob) for logprob, _, _ in top_entries])
    pad_width = max(num_prompt_logprobs, 1)
    prompt_ids_ls.append([0] * pad_width)
    prompt_logprobs_ls.append([0.0] * pad_width)
    assert len(prompt_ids_ls) == sequence_length
    return {"prompt_ids": prompt_ids_ls, "prompt_logprobs": prompt_logprobs_ls}


def post(http: httpx.Client, payload: dict[str, Any]) -> dict[str, Any]:
    response = http.post("/generate", json=payload)
    response.raise_for_status()
    return response.json()


def test_the_http_adapter_generate_payloads(http) -> None:
    sampling = {"max_new_tokens": 8, "temperature": 0}
    by_ids = post(http, adapter_payload(input_ids=PROMPT_IDS, sampling_params=sampling, return_logprob=True,
                                      top_logprobs_num=2))
    token_ids, log_probs, reason = parse(by_ids, return_logprob=True)
    assert len(token_ids) == len(log_probs) == 8 and reason in ("length", "stop")
    by_text = post(http, adapter_payload(prompt="The rollout starts here", sampling_params=sampling))
    assert by_text["output_ids"] == by_ids["output_ids"]  # the byte tokenizer adds the same BOS


def test_rollouts_greedy_and_sampled_with_logprobs(http) -> None:
    for greedy in (True, False):
        request, return_logprob, _ = server_request(uuid.uuid4().hex, PROMPT_IDS,
                                                    agent_loop_sampling_params(greedy=greedy))
        token_ids, log_probs, reason = parse(post(http, request), return_logprob)
        assert len(token_ids) == len(log_probs) > 0 and all(lp <= 0 for lp in log_probs)
        assert reason in ("length", "stop")
        if reason == "length":
            assert len(token_ids) == request["sampling_params"]["max_new_tokens"]


@pytest.mark.parametrize("topk", [3, 128])  # 128: DistillationLossConfig.topk's default (a 400 before the fix)
def test_prompt_logprobs_for_the_distillation_teacher(http, topk: int) -> None:
    params = {**agent_loop_sampling_params(greedy=True, calculate_log_probs=False), "prompt_logprobs": topk,
              "max_new_tokens": 1}
    request, _, prompt_logprobs = server_request(uuid.uuid4().hex, PROMPT_IDS, params)
    answer = post(http, request)
    extracted = extract_prompt_logprobs(answer["meta_info"], prompt_logprobs, len(PROMPT_IDS))
    rows = extracted["prompt_logprobs"][:-1]
    assert len(rows) == len(PROMPT_IDS) - 1 and all(len(ids) == topk for ids in extracted["prompt_ids"])
    assert all(row == sorted(row, reverse=True) and row[0] <= 0 for row in rows)  # best first
    actual = [entry[0] for entry in answer["meta_info"]["input_token_logprobs"][1:]]
    assert all(value <= row[0] + 1e-6 for value, row in zip(actual, rows))  # no prompt token beats the best


@pytest.mark.parametrize("through", ["lb", "sidecar"])  # the adapter's host:port: the LB, or a node's own door
def test_abort_request_by_rid_ends_that_request_with_parsable_logprobs(cluster, through: str) -> None:
    """``abort_request(rid)``'s body, ``{"rid": rid, "abort_all": false}``: the request ends as ``abort`` with
    one logprob per token it made (verl drops a sample whose lengths differ); a second abort changes nothing."""
    with httpx.Client(base_url=cluster.url if through == "lb" else cluster.nodes[0].url, timeout=60) as http:
        _abort_by_rid(http)


def _abort_by_rid(http: httpx.Client) -> None:
    request_id = uuid.uuid4().hex
    request, return_logprob, _ = server_request(request_id, PROMPT_IDS, {
        **agent_loop_sampling_params(greedy=False), "max_new_tokens": 3000, "ignore_eos": True})
    result: dict[str, Any] = {}

    def run() -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=120) as client:
            result["answer"] = post(client, request)

    thread = threading.Thread(target=run)
    thread.start()
    body = {"rid": request_id, "abort_all": False}

    def aborted_by(response: httpx.Response) -> list[str]:
        assert response.status_code == 200, response.text
        answer = response.json()  # the LB's answer holds each node's
        return [rid for body in ([r["body"] for r in answer["results"]] if "results" in answer else [answer])
                for rid in body["aborted"]]

    # once its node admitted it (an abort before that finds no such request)
    wait_until(lambda: aborted_by(http.post("/abort_request", json=body)) == [request_id], timeout=30,
               what="the request aborted")
    thread.join(120)
    assert aborted_by(http.post("/abort_request", json=body)) == []
    token_ids, log_probs, reason = parse(result["answer"], return_logprob)
    assert reason == "abort" and len(token_ids) == len(log_probs) == len(result["answer"]["output_ids"]) < 3000
