"""A node's ``/get_server_info`` through a real sidecar and a real LB keeps the engine's secrets in.

SGLang 0.5.23 answers its server arguments, ``api_key`` and ``admin_api_key``
among them, and its command line (``launch_command``, ``--api-key X`` in it);
vLLM's ``/server_info`` its config (``hf_token``) and environment. The sidecar
and the LB passed that on to anyone: the LB's ``/get_server_info`` is open, and
a plain SGLang node's key is the LB's own token to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from handoff.service.errors import ServiceError
from node_sidecar.routes_views import _relayable_info
from tests.lb.behaviours import reply
from tests.lb.lbproc import LB, set_members
from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(60)

API_KEY = "sk-secret-4f1c9e"
ADMIN_KEY = "adm-secret-9d2e71"
NESTED_TOKEN = "hf-nested-7a3b05"
URL_PASSWORD = "pw-secret-c0ffee"
SECRETS = (API_KEY, ADMIN_KEY, NESTED_TOKEN, URL_PASSWORD)
EXTRA = {
    "model_config": {"hf_token": NESTED_TOKEN, "tokenizer_path": "/models/tok", "max_total_tokens": 4096,
                     "hf_token_enabled": True},
    "internal_states_extra": [{"auth_token": NESTED_TOKEN, "last_gen_throughput": 1.5}],
    "kv_events_endpoint": f"tcp://user:{URL_PASSWORD}@10.0.0.1:5557",
    "bucket_time_to_first_token": [0.1, 0.5],
}


@pytest.fixture(scope="module")
def sglang(proc_log_dir: Path) -> Iterator[ServerProcess]:
    """A fake SGLang 0.5.23 started with both keys and a nested token."""
    fake = ServerProcess("tests.support.sglang_fake",
                         ["--tag-mib", "1", "--api-key", API_KEY, f"--admin-api-key={ADMIN_KEY}",
                          "--server-info-extra", json.dumps(EXTRA)],
                         log_dir=proc_log_dir, name="sglang-secrets", health_path="/model_info").start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def sidecar(sglang: ServerProcess, proc_log_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess("node_sidecar", ["--engine-url", sglang.url, "--engine-poll-interval", "0.2"],
                         log_dir=proc_log_dir, name="sidecar-secrets").start()
    wait_until(lambda: httpx.get(proc.url + "/ready").status_code == 200, timeout=20, what="sidecar ready")
    yield proc
    proc.stop()


def engine_info(sglang: ServerProcess) -> dict[str, Any]:
    """The fake's own answer: every secret is in it (else this test would prove nothing)."""
    raw = httpx.get(sglang.url + "/get_server_info", timeout=10)
    assert all(secret in raw.text for secret in SECRETS), raw.text
    return raw.json()


def assert_relayed_without_secrets(answer: httpx.Response, engine: dict[str, Any]) -> None:
    assert answer.status_code == 200, answer.text
    assert not [secret for secret in SECRETS if secret in answer.text], answer.text
    info = answer.json()
    assert info["api_key"] is None and info["admin_api_key"] is None
    assert info["model_config"] == {"hf_token": None, "tokenizer_path": "/models/tok", "max_total_tokens": 4096,
                                    "hf_token_enabled": True}
    assert info["internal_states_extra"] == [{"auth_token": None, "last_gen_throughput": 1.5}]
    assert info["kv_events_endpoint"] == "tcp://user:<redacted>@10.0.0.1:5557"
    command = info["launch_command"]
    assert "--api-key <redacted> --admin-api-key=<redacted>" in command and "--tag-mib 1" in command, command
    secret_fields = {"api_key", "admin_api_key", "model_config", "internal_states_extra", "kv_events_endpoint",
                     "launch_command"}
    kept = {key: value for key, value in engine.items() if key not in secret_fields}
    assert {key: info[key] for key in kept} == kept  # every other field as the engine answered it
    assert kept["bucket_time_to_first_token"] == [0.1, 0.5] and kept["tp_size"] == 1


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_the_sidecar_relays_sglang_server_info_without_its_keys(sglang: ServerProcess, sidecar: ServerProcess,
                                                                 path: str) -> None:
    assert_relayed_without_secrets(httpx.get(sidecar.url + path, timeout=10), engine_info(sglang))


@pytest.mark.parametrize("through_sidecar", [True, False], ids=["sidecar-node", "plain-sglang-node"])
def test_the_lb_relays_server_info_without_the_nodes_keys(sglang: ServerProcess, sidecar: ServerProcess,
                                                          shared_lb: LB, through_sidecar: bool) -> None:
    """Through a sidecar, and straight from a plain SGLang node (no sidecar redacts there: the LB must)."""
    node = sidecar.url if through_sidecar else sglang.url
    set_members(shared_lb, node)
    shared_lb.wait_routable([node])
    for path in ("/get_server_info", "/server_info"):
        answer = shared_lb.http.get(path)
        assert_relayed_without_secrets(answer, engine_info(sglang))
        assert answer.json()["handoff_cluster"]["answered_by"] == node


def test_the_lb_relays_a_vllm_server_info_without_its_token(module_fakes, shared_lb: LB) -> None:
    """vLLM's ``/server_info`` (dev mode) has its config (``hf_token``) and environment; ``vllm_config`` is
    text unless asked for JSON."""
    node = module_fakes.start_one(is_sidecar=False)
    vllm_info = {
        "vllm_config": {"model_config": {"model": "m", "hf_token": NESTED_TOKEN, "max_model_len": 2048},
                        "parallel_config": {"worker_extension_cls": "x.Y", "tensor_parallel_size": 1}},
        "vllm_env": {"VLLM_USE_V1": True, "VLLM_PORT": None},
        "system_env": {"env_vars": f"HF_TOKEN={NESTED_TOKEN}\nCUDA_VISIBLE_DEVICES=0", "torch_version": "2.8"},
        "text_config": f"model='m', hf_token='{NESTED_TOKEN}', seed=0",
    }
    node.handlers["/server_info"] = reply(200, vllm_info)
    set_members(shared_lb, node.url)
    shared_lb.wait_routable([node.url])
    answer = shared_lb.http.get("/server_info")
    assert answer.status_code == 200 and NESTED_TOKEN not in answer.text, answer.text
    info = answer.json()
    assert info["vllm_config"]["model_config"] == {"model": "m", "hf_token": None, "max_model_len": 2048}
    assert info["vllm_config"]["parallel_config"] == vllm_info["vllm_config"]["parallel_config"]
    assert info["vllm_env"] == vllm_info["vllm_env"]
    assert info["system_env"] == {"env_vars": "HF_TOKEN=<redacted>\nCUDA_VISIBLE_DEVICES=0", "torch_version": "2.8"}
    assert info["text_config"] == "model='m', hf_token='<redacted>', seed=0"


def test_an_engine_answer_that_cannot_be_redacted_is_not_relayed() -> None:
    """A 2xx ``/get_server_info`` that is not JSON cannot be searched for secrets: the sidecar answers 502."""
    assert _relayable_info(b'{"api_key": "sk-zz9", "tp_size": 2}') == {"api_key": None, "tp_size": 2}
    for raw in (b"api_key=sk-zz9", b'{"api_key": "sk-zz9"', b"[" * 100 + b"]" * 100):
        with pytest.raises(ServiceError) as caught:
            _relayable_info(raw)
        assert caught.value.status == 502 and "sk-zz9" not in caught.value.message
