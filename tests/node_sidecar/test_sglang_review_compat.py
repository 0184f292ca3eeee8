"""SGLang 0.5.23 compatibility of the control and weight calls, as a framework sees them through a sidecar and the
LB (found by a hostile review): real engine, sidecar and LB processes on loopback."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from handoff.client import HandoffClient
from tests.support.procs import ServerProcess, wait_until

KEY = "gen-only-key-7"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(proc_log_dir: Path):
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver"],
                         log_dir=proc_log_dir, name="engine")
    proc.start()
    yield proc
    proc.stop()


def start_sidecar(engine: ServerProcess, log_dir: Path, name: str, *flags: str,
                  env: dict[str, str] | None = None) -> ServerProcess:
    proc = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2", *flags],
                         log_dir=log_dir, name=name, env=env)
    proc.start()
    wait_until(lambda: httpx.get(proc.url + "/ready").status_code == 200, timeout=15, what="sidecar ready")
    return proc


@pytest.fixture(scope="module")
def sidecar(engine: ServerProcess, proc_log_dir: Path):
    proc = start_sidecar(engine, proc_log_dir, "sidecar")
    yield proc
    proc.stop()


def test_an_api_key_alone_guards_control_and_weight_calls_as_in_sglang(engine: ServerProcess,
                                                                        proc_log_dir: Path) -> None:
    """SGLang 0.5.23 (``utils/auth.py``, ``AuthLevel.ADMIN_OPTIONAL``): with only ``--api-key`` set, its control and
    weight endpoints take that key; open only when no key is set at all. Before: a sidecar and an LB started with
    only ``--api-key`` let anyone release the node's memory or rename its weights, and the LB, sending its nodes no
    token, could not generate through them."""
    sidecar = start_sidecar(engine, proc_log_dir, "sidecar-apikey", env={"HANDOFF_API_KEY": KEY})
    lb = ServerProcess("lb", ["--node", sidecar.url, "--health-interval", "0.2", "--health-timeout", "1"],
                       log_dir=proc_log_dir, name="lb-apikey", env={"HANDOFF_API_KEY": KEY})
    lb.start()
    try:
        for url in (sidecar.url, lb.url):
            for path, body in (("/release_memory_occupation", {"tags": ["kv_cache"]}),
                               ("/update_weight_version", {"new_version": "hijacked"}),
                               ("/pause_generation", {}), ("/abort_request", {"abort_all": True}),
                               ("/flush_cache", None)):
                r = httpx.post(url + path, json=body, timeout=30)
                assert r.status_code == 401, (url, path, r.text)
                assert r.json()["error"]["type"] == "unauthorized"
        occupation = httpx.get(sidecar.url + "/memory_occupation", timeout=10).json()
        assert occupation["serving"] and occupation["weight_version"] != "hijacked"
        # the key opens them, as on an SGLang server started with --api-key
        r = httpx.post(sidecar.url + "/flush_cache", headers=BEARER, timeout=30)
        assert r.status_code == 200, r.text
        wait_until(lambda: httpx.get(lb.url + "/nodes", timeout=10).json()["nodes"][0]["routable"], timeout=15,
                   what="the LB sees its node serving")
        r = httpx.post(lb.url + "/flush_cache", headers=BEARER, timeout=30)
        assert r.status_code == 200, r.text
        # the Python client given only the key sends it with control calls too
        with HandoffClient(lb.url, api_key=KEY) as cluster:
            assert cluster.flush_cache().total == 1
        # and the LB reaches its node with it: generation through the LB works
        r = httpx.post(lb.url + "/generate", headers=BEARER, timeout=30,
                       json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
    finally:
        lb.stop()
        sidecar.stop()
        for path, body in (("/continue_generation", {}), ("/resume_memory_occupation", {}),
                           ("/update_weight_version", {"new_version": "default"})):
            httpx.post(engine.url + path, json=body, timeout=30)  # what a failing run changed, undone


@pytest.mark.parametrize("body", [
    {"rid": "not-running", "http_worker_ipc": None},
    {"rid": "not-running", "abort_message": "stopped by the trainer"},
    {"abort_all": False, "rid": "r", "finished_reason": {"type": "abort", "message": "x", "status_code": 400},
     "weight_versions": None},
])
def test_abort_request_takes_every_field_of_sglangs_abortreq(sidecar: ServerProcess, engine: ServerProcess,
                                                             body: dict) -> None:
    """SGLang's ``AbortReq`` (``io_struct.py``) is a ``BaseReq`` with ``http_worker_ipc``, ``abort_message``,
    ``finished_reason`` and ``weight_versions``; its handler reads ``rid`` and ``abort_all`` and drops the rest.
    Before: each was a 400 ``unknown field`` (docs/api.md promises ``http_worker_ipc`` on every SGLang-shaped body)."""
    for url in (sidecar.url, engine.url):
        r = httpx.post(url + "/abort_request", json=body, timeout=10)
        assert r.status_code == 200, (url, r.text)
        assert r.json()["success"] is True


def test_init_weights_update_group_takes_areals_pp_rank(sidecar: ServerProcess) -> None:
    """AReaL 1.0.4 (``areal/engine/sglang_remote.py``, PP > 1) sends ``pp_rank``; SGLang 0.5.23 drops fields its
    struct lacks. Before: 400 ``pp_rank: unknown field``. Now the body is taken and the call goes on to the engine
    (which refuses nccl on CPU, a 400 about the backend, and joins nothing)."""
    body = {"master_address": "127.0.0.1", "master_port": 29599, "rank_offset": 1, "world_size": 2,
            "backend": "nccl", "group_name": "update_weight_group_0", "pp_rank": 0}
    r = httpx.post(sidecar.url + "/init_weights_update_group", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "pp_rank" not in r.json()["error"]["message"]
    assert "nccl" in r.json()["error"]["message"]
    bad = httpx.post(sidecar.url + "/init_weights_update_group", json={**body, "pp_rank": -1}, timeout=30)
    assert bad.status_code == 400 and "pp_rank" in bad.json()["error"]["message"]


def test_an_unknown_tag_is_not_echoed_back_whole(sidecar: ServerProcess, engine: ServerProcess) -> None:
    """A 4 MB tag name (or 100000 of them) was echoed whole in the 400's message: an answer as large as the
    body. Now the first few names are shown, each cut short."""
    for tags in (["y" * 4_000_000], [f"x{i}" for i in range(100_000)]):
        for url in (sidecar.url, engine.url):
            r = httpx.post(url + "/release_memory_occupation", json={"tags": tags}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request"
            assert len(r.content) < 2048, (url, len(r.content))
    occupation = httpx.get(sidecar.url + "/memory_occupation", timeout=10).json()
    assert all(tag["state"] == "resident" for tag in occupation["tags"].values())
