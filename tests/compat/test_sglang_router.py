"""sglang-router in front of handoff: the requests it rebuilds, its answer types, the endpoints it probes.

The router (sgl-model-gateway, Rust) deserializes every ``/generate`` request
into its own ``GenerateRequest`` and serializes that to the worker: fields
with a serde default but no ``skip_serializing_if`` are always sent, at their
default when the client left them out. The bodies below are what that
serialization produces, from ``sgl-project/sglang``:

- ``sgl-model-gateway/src/protocols/generate.rs`` at commit 199315be
  (``model`` null, ``return_text_in_logprobs``, ``stream``, ``log_metrics``
  true, ``return_hidden_states``, ``return_routed_experts``, ``background``,
  ``no_logs``, ``return_bytes``, ``return_entropy``; ``Option`` fields left out
  when ``None``); its ``GenerateResponse`` / ``GenerateMetaInfo`` /
  ``GenerateFinishReason`` say what it reads back (``e2e_latency`` and
  ``weight_version`` required, ``finish_reason`` tagged by ``type``);
- ``sgl-router/src/protocols/generate/request.rs`` at commit e63b9ff0, the
  router before the rename (``stream``, ``return_logprob``,
  ``return_hidden_states`` always sent);
- ``sgl-model-gateway/src/protocols/sampling_params.rs`` (every sampling field
  optional, left out when unset).

The real router beside the LB (worker management, the cluster calls): ``test_sglang_router_live.py``.
"""

from __future__ import annotations

from typing import Any

GATEWAY_DEFAULTS = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                    "return_hidden_states": False, "return_routed_experts": False, "background": False,
                    "no_logs": False, "return_bytes": False, "return_entropy": False}
OLD_ROUTER_DEFAULTS = {"stream": False, "return_logprob": False, "return_hidden_states": False}


def gateway_body(**fields: Any) -> dict[str, Any]:
    return {**GATEWAY_DEFAULTS, **{k: v for k, v in fields.items() if v is not None}}


def check_generate_response(answer: dict[str, Any]) -> dict[str, Any]:
    """``GenerateResponse`` as serde reads it: these fields, these types (or it fails the whole answer)."""
    assert isinstance(answer["text"], str)
    assert all(isinstance(i, int) and i >= 0 for i in answer["output_ids"])
    meta = answer["meta_info"]
    for key, kind in (("id", str), ("prompt_tokens", int), ("weight_version", str), ("completion_tokens", int),
                      ("cached_tokens", int), ("e2e_latency", float)):
        assert isinstance(meta[key], kind), key
    reason = meta["finish_reason"]
    assert reason["type"] in ("length", "stop", "abort")
    if reason["type"] == "length":
        assert isinstance(reason["length"], int)
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:  # Option<Vec<Vec<Option<f64>>>>: the text slot must be null here (not a string)
            assert all(isinstance(e[0], float) or e[0] is None for e in meta[key])
    return meta


def test_the_gateways_rebuilt_requests(http) -> None:
    plain = http.post("/generate", json=gateway_body(text="routed", sampling_params={"max_new_tokens": 4,
                                                                                    "temperature": 0}))
    assert plain.status_code == 200, plain.text
    check_generate_response(plain.json())
    full = http.post("/generate", json=gateway_body(
        input_ids=[256, 1, 2, 3], return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
        sampling_params={"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                         "frequency_penalty": 0.1, "presence_penalty": 0.1, "repetition_penalty": 1.1,
                         "min_new_tokens": 1, "stop_token_ids": [257], "no_stop_trim": False, "n": 1,
                         "sampling_seed": 3, "skip_special_tokens": True}))
    assert full.status_code == 200, full.text
    meta = check_generate_response(full.json())
    assert len(meta["output_token_logprobs"]) == len(full.json()["output_ids"])
    old = http.post("/generate", json={**OLD_ROUTER_DEFAULTS, "text": "routed",
                                     "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert old.status_code == 200 and old.json()["output_ids"] == plain.json()["output_ids"]


def test_the_gateways_n_answers_a_list(http) -> None:
    answers = http.post("/generate", json=gateway_body(text="routed", sampling_params={
        "max_new_tokens": 3, "n": 2, "temperature": 0.9, "sampling_seed": 1})).json()
    assert isinstance(answers, list) and len(answers) == 2
    for answer in answers:
        check_generate_response(answer)


def test_what_the_gateway_probes_on_a_worker(http) -> None:
    """A worker is added after ``/health`` and read with ``/get_model_info`` / ``/get_server_info``."""
    assert http.get("/health").status_code == 200
    info = http.get("/get_model_info").json()
    # model_path names the checkpoint loaded last, as SGLang's does: another test of the session may have reloaded
    assert info["tokenizer_path"] == "builtin:tiny" and info["model_path"] and info["is_generation"] is True
    server = http.get("/get_server_info").json()
    assert server["served_model_name"] == "builtin:tiny" and server["handoff_cluster"]["total"] == 2
    assert server["handoff_cluster"]["answered_by"].startswith("http://127.0.0.1:")
    assert http.get("/health_generate").json()["healthy"] is True
