"""AReaL 1.0.4 against the LB: its remote SGLang engine's request bodies and answer parsing, replayed.

``areal.engine.sglang_remote`` does not import without AReaL's dependencies
(``ray``, ``hydra``, ``torchdata``, ``flask``, ... found installing them one by
one with ``--no-deps``), so it is replayed here, transcribed from:

- ``areal/engine/sglang_remote.py``: ``SGLangBackend.build_generation_request``
  (``sample_params`` with every field of ``GenerationHyperparameters``, among
  them ``top_k`` 1e8, ``stop_token_ids`` [], ``frequency_penalty`` 0.0;
  ``image_data`` null, ``return_logprob`` true, ``stream`` false),
  ``parse_generation_response`` (``finish_reason["type"]`` and ``["message"]``,
  tokens and logprobs from ``output_token_logprobs``), ``build_score_request`` /
  ``parse_score_response`` (prompt logprobs from ``logprob_start_len``);
- ``areal/infra/remote_inf_engine.py``: the rollout loop that resumes an
  aborted generation (``input_ids += output_tokens``, ``max_new_tokens -=`` what
  came) until ``stop``/``length``, across ``/pause_generation`` (abort) and
  ``/continue_generation``; ``arequest_with_retry`` (a call repeated after a timeout),
  ``check_health`` (``GET /health`` with a JSON body ``{}``);
- ``areal/api/cli_args.py``: ``GenerationHyperparameters``' defaults.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.support.procs import wait_until

PROMPT_IDS = [256] + [ord(c) for c in "An AReaL rollout"]
GCONFIG = {"n_samples": 1, "max_new_tokens": 16, "min_new_tokens": 0, "greedy": False, "top_p": 1.0,
           "top_k": int(1e8), "temperature": 1.0, "stop_token_ids": [], "ignore_eos": False,
           "skip_special_tokens": True, "stop": None, "frequency_penalty": 0.0}


def build_generation_request(input_ids: list[int], gconfig: dict[str, Any]) -> dict[str, Any]:
    """``SGLangBackend.build_generation_request`` (no LoRA, no routed experts)."""
    sample_params = {
        "top_p": gconfig["top_p"], "top_k": gconfig["top_k"], "max_new_tokens": gconfig["max_new_tokens"],
        "temperature": 0.0 if gconfig["greedy"] else gconfig["temperature"],
        "stop_token_ids": gconfig["stop_token_ids"], "ignore_eos": gconfig["ignore_eos"],
        "skip_special_tokens": gconfig["skip_special_tokens"], "frequency_penalty": gconfig["frequency_penalty"],
    }
    if gconfig["stop"]:
        sample_params["stop"] = gconfig["stop"]
    return {"input_ids": input_ids.copy(), "image_data": None, "sampling_params": sample_params,
            "return_logprob": True, "stream": False}


def parse_generation_response(response: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """``SGLangBackend.parse_generation_response``: output tokens, their logprobs, the stop reason."""
    meta_info = response["meta_info"]
    finish_reason = meta_info["finish_reason"]
    stop_reason = finish_reason["type"]
    stop_message = finish_reason.get("message", "")
    if stop_reason == "abort" and stop_message.startswith("Abort before prefill"):
        return [], [], stop_reason
    return ([x[1] for x in meta_info["output_token_logprobs"]], [x[0] for x in meta_info["output_token_logprobs"]],
            stop_reason)


def build_score_request(input_ids: list[int], target_len: int) -> dict[str, Any]:
    return {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": max(0, len(input_ids) - target_len - 1),
            "top_logprobs_num": 0, "stream": False}


def parse_score_response(response: dict[str, Any], target_len: int) -> list[float]:
    all_logprobs = [float(x[0]) for x in response["meta_info"].get("input_token_logprobs", [])]
    assert len(all_logprobs) >= target_len
    return all_logprobs[-target_len:]


def rollout(http: httpx.Client, input_ids: list[int], gconfig: dict[str, Any],
            between: Any = None) -> tuple[list[int], list[float], list[str]]:
    """``RemoteInfEngine``'s loop: generate, and after an abort go on from what came, until stop or length."""
    gconfig = dict(gconfig)
    input_ids = list(input_ids)
    tokens: list[int] = []
    logprobs: list[float] = []
    reasons: list[str] = []
    original = gconfig["max_new_tokens"]
    stop_reason = None
    while stop_reason not in ("stop", "tool_calls", "length") and len(tokens) < original:
        assert len(reasons) < 100, f"no end after {len(reasons)} calls: {reasons[-5:]}"  # AReaL's loop has no bound
        response = http.post("/generate", json=build_generation_request(input_ids, gconfig))
        response.raise_for_status()
        out_tokens, out_logprobs, stop_reason = parse_generation_response(response.json())
        reasons.append(stop_reason)
        tokens += out_tokens
        logprobs += out_logprobs
        input_ids += out_tokens
        gconfig["max_new_tokens"] -= len(out_tokens)
        if between is not None:
            between(stop_reason)
    return tokens, logprobs, reasons


def test_generation_with_areal_defaults(http) -> None:
    tokens, logprobs, reasons = rollout(http, PROMPT_IDS, GCONFIG)
    assert 0 < len(tokens) == len(logprobs) <= 16 and reasons[-1] in ("stop", "length")
    greedy, _, _ = rollout(http, PROMPT_IDS, {**GCONFIG, "greedy": True, "ignore_eos": True})
    again, _, _ = rollout(http, PROMPT_IDS, {**GCONFIG, "greedy": True, "ignore_eos": True})
    assert greedy == again and len(greedy) == 16


def test_score_request_returns_sglangs_prompt_logprobs(http) -> None:
    """SGLang 0.5.23 answers a null logprob for the token at ``logprob_start_len`` (here one before the
    target), and so does handoff; AReaL 1.0.4's ``parse_score_response`` calls ``float`` on it and raises
    against SGLang too. What AReaL keeps, the last ``target_len`` values, is there and well formed."""
    answer = http.post("/generate", json=build_score_request(PROMPT_IDS, 5)).json()
    entries = answer["meta_info"]["input_token_logprobs"]
    assert len(entries) == 6 and entries[0][0] is None and [e[1] for e in entries] == PROMPT_IDS[-6:]
    answer["meta_info"]["input_token_logprobs"] = entries[1:]
    scores = parse_score_response(answer, 5)
    assert len(scores) == 5 and all(s <= 0 for s in scores)


def test_a_rollout_interrupted_by_pause_resumes_to_its_length(http) -> None:
    """Weight-update interruption: /pause_generation (abort) ends the request with what it had; AReaL resumes."""
    gconfig = {**GCONFIG, "max_new_tokens": 600, "ignore_eos": True}
    result: dict[str, Any] = {}

    def resume_after_abort(stop_reason: str) -> None:
        if stop_reason == "abort":
            http.post("/continue_generation").raise_for_status()

    def run() -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=120) as client:
            result["out"] = rollout(client, PROMPT_IDS, gconfig, between=resume_after_abort)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: any((n.get("in_flight") or 0) > 0 for n in http.get("/nodes").json()["nodes"]), timeout=30)
    paused = http.post("/pause_generation", json={"mode": "abort"})
    assert paused.status_code == 200, paused.text
    thread.join(120)
    http.post("/continue_generation")
    tokens, logprobs, reasons = result["out"]
    assert len(tokens) == len(logprobs) == 600
    assert reasons[0] == "abort" and reasons[-1] == "length"


def test_stop_token_ids_and_stop_strings_end_a_rollout(http) -> None:
    """AReaL reads the tokens from ``output_token_logprobs``: the one that matched a stop is among them, as
    in SGLang's ``output_ids``, and the rollout loop ends on ``stop``. ``ignore_eos`` turns stop tokens off
    too (SGLang's ``Req._check_token_based_finish``, ``schedule_batch.py:1857``), not stop strings."""
    greedy = {**GCONFIG, "greedy": True}
    expected, _, _ = rollout(http, PROMPT_IDS, {**greedy, "ignore_eos": True})
    stop_id = expected[2]
    tokens, logprobs, reasons = rollout(http, PROMPT_IDS, {**greedy, "stop_token_ids": [stop_id]})
    assert reasons == ["stop"] and tokens == expected[:expected.index(stop_id) + 1] and len(logprobs) == len(tokens)
    tokens, _, reasons = rollout(http, PROMPT_IDS, {**greedy, "stop_token_ids": [stop_id], "ignore_eos": True})
    assert reasons == ["length"] and tokens == expected
    printable = [t for t in expected if 32 < t < 127]
    assert printable, f"no ASCII token to stop on in {expected}"
    request = build_generation_request(PROMPT_IDS, {**greedy, "ignore_eos": True, "stop": [chr(printable[0])]})
    answer = http.post("/generate", json=request).json()
    tokens, logprobs, reason = parse_generation_response(answer)
    assert reason == "stop" and answer["meta_info"]["finish_reason"]["matched"] == chr(printable[0])
    assert tokens == expected[:expected.index(printable[0]) + 1] and len(logprobs) == len(tokens)


@pytest.mark.parametrize("through", ["lb", "sidecar"])  # AReaL's addresses: the LB, or each node's own door
def test_the_health_check_and_repeated_pause_and_continue(cluster, through: str) -> None:
    """``get_health_check_request``: a GET with a JSON body ``{}``; ``arequest_with_retry`` repeats a call that
    timed out, so a second pause or continue must succeed and change nothing."""
    url = cluster.url if through == "lb" else cluster.nodes[0].url
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.request("GET", "/health", json={}).status_code == 200
        for endpoint in ("/pause_generation", "/pause_generation", "/continue_generation", "/continue_generation"):
            assert http.post(endpoint, json={}).status_code == 200
        tokens, logprobs, reasons = rollout(http, PROMPT_IDS, {**GCONFIG, "ignore_eos": True})
        assert len(tokens) == len(logprobs) == 16 and reasons == ["length"]
