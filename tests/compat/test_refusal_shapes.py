"""How a refused generation looks to a client through the LB and the sidecar, as it looks from SGLang 0.5.23.

- ``/generate`` with ``"stream": true``: SGLang answers 200 before its tokenizer manager checks the request, so
  a refusal (bad sampling values, a prompt too long, ``max_new_tokens`` beyond the context) is one error event,
  ``{"error": {"message", "type", "code": 400, "retryable": false}}``, then ``[DONE]``
  (``http_server.py`` ``serve_generate_request``/``stream_results``). Without a stream it is a 400.
- The OpenAI routes refuse before streaming (``serving_chat.py``/``serving_completions.py``
  ``_handle_streaming_request`` starts the generator first) with ``ErrorResponse``'s ``object``, ``param`` and
  ``code`` (``serving_base.py`` ``create_error_response``): what the ``openai`` client reads as ``code``/``param``.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.sse import DONE, iter_events

MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def sdk(lb_url: str):
    with openai.OpenAI(base_url=lb_url + "/v1", api_key="none", timeout=60, max_retries=0) as client:
        yield client


@pytest.mark.parametrize(("sampling", "words"), [
    ({"max_new_tokens": 4, "temperature": -1}, "temperature"),
    ({"max_new_tokens": 1_000_000}, "Requested token count exceeds"),
])
def test_a_refused_generate_stream_is_an_error_event_then_done(http: httpx.Client, sampling: dict,
                                                               words: str) -> None:
    body = {"text": "refuse me", "sampling_params": sampling}
    with http.stream("POST", "/generate", json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200, streamed.read()
        assert streamed.headers["content-type"].startswith("text/event-stream")
        payloads = list(iter_events(streamed))
    assert payloads[-1] == DONE and len(payloads) == 2, payloads
    error = json.loads(payloads[0])["error"]
    assert error["type"] == "invalid_request" and words in error["message"], error
    assert error["code"] == 400 and error["retryable"] is False
    whole = http.post("/generate", json=body)  # not streamed: the 400
    assert whole.status_code == 400 and whole.json()["error"]["type"] == "invalid_request", whole.text


def test_a_malformed_generate_stream_body_stays_a_400(http: httpx.Client) -> None:
    """A malformed body is refused before any stream, as SGLang's schema check refuses it."""
    r = http.post("/generate", json={"text": "x", "stream": True, "sampling_params": {"max_new_tokens": "many"}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_refusal_carries_sglang_error_fields(sdk, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=1_000_000, stream=stream)
    error = info.value
    # the client types ``code`` as a string: SGLang's 400 reads "400"
    assert error.code == "400" and error.param is None and error.type == "invalid_request"
    assert error.body["object"] == "error" and "Requested token count exceeds" in error.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1,
                                    max_tokens=2, stream=stream)
    assert info.value.code == "400" and info.value.body["object"] == "error"


@pytest.mark.parametrize(("path", "body"), [
    # AReaL 1.0.4's LoRA disk update (engine/sglang_remote.py) and its clean-up of an old version
    ("/load_lora_adapter", {"lora_name": "policy-v3", "lora_path": "/ckpt/lora/v3"}),
    ("/unload_lora_adapter", {"lora_name": "policy-v1"}),
    # verl 0.9.1's LoRA push (sglang_rollout/http_server_engine.py load_lora_adapter_from_tensor)
    ("/load_lora_adapter_from_tensors", {"lora_name": "verl_lora", "config_dict": {"r": 8},
                                         "serialized_named_tensors": ["AAAA"]}),
])
def test_a_lora_call_is_refused_as_unsupported_saying_why(cluster, path: str, body: dict) -> None:
    """SGLang started without --enable-lora refuses these with a 400 (``tokenizer_control_mixin.py:667``); a handoff
    node serves no LoRA adapter, so the LB and each sidecar refuse them the same way, saying what to do instead,
    where they were a bare 404 that reads like a wrong URL."""
    for url in (cluster.url, cluster.nodes[0].url):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400, (url, r.text)
        error = r.json()["error"]
        assert error["type"] == "unsupported" and error["endpoint"] == path, error
        assert "LoRA" in error["message"] and "update_weights_from_tensor" in error["message"], error
