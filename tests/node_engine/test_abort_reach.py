"""An abort reaches every request the engine accepted, whatever its stage, as in SGLang: one still in the
engine's inbox while the engine thread is mid-step, and the ``n`` samples of a prompt still being prefilled
(found by review: both ran to their full length after an abort answered ``aborted: []`` or ``all``); an abort of
one sample reaches that sample only. The same stalled step shows on ``/health``: a step that runs past
``--health-step-timeout`` is a 503 (a liveness probe restarts a hung engine), and a 200 again once it returns."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    folder = tmp_path_factory.mktemp("abort_reach")
    drill = folder / "drill.json"
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--fault-drill-file", str(drill),
                                         "--health-step-timeout", "1"], log_dir=folder)
    proc.start()
    yield proc, drill
    proc.stop()


def in_background(client: httpx.Client, body: dict) -> tuple[threading.Thread, dict]:
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(r=client.post("/generate", json=body)))
    thread.start()
    return thread, answer


def test_an_abort_reaches_a_request_still_in_the_engines_inbox(engine) -> None:
    proc, drill = engine
    stall_s = 8.0
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        drill.write_text(json.dumps({"kind": "stall", "at": "decode", "delay_s": stall_s}))  # its first decode step
        busy, _ = in_background(client, {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 64, "ignore_eos": True, "temperature": 0}})
        wait_until(lambda: drill.with_name("drill.json.fired").exists(), timeout=30, what="the engine thread stalled")
        stalled_at = time.monotonic()
        victim, answer = in_background(client, {"rid": "victim", "input_ids": [8, 9], "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True, "temperature": 0}})
        # An abort before the victim is accepted is a no-op ("aborted": []), so it is asked until it takes. The
        # engine thread cannot take anything from its inbox before the stall ends: an abort that takes before
        # then reached a request still in the inbox (before the fix it took only once the stall was over).
        wait_until(lambda: client.post("/abort_request", json={"rid": "victim"}).json()["aborted"] == ["victim"],
                   timeout=stall_s, what="the abort taken")
        assert time.monotonic() - stalled_at < stall_s - 1
        victim.join(60)
        busy.join(60)
        meta = answer["r"].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0, meta
    drill.with_name("drill.json.fired").unlink()


def samples_held_in_prefill(client: httpx.Client, *, n: int, max_new_tokens: int):
    """``n`` samples of request ``X`` sent while an ``in_place`` pause holds their shared prompt's prefill,
    queued; the sending thread and its answer."""
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    run, answer = in_background(client, {"rid": "X", "input_ids": [5, 6, 7, 8, 9], "sampling_params": {
        "n": n, "max_new_tokens": max_new_tokens, "temperature": 0.7, "ignore_eos": True}})
    wait_until(lambda: client.get("/memory_occupation").json()["queued_requests"] == 1, timeout=10,
               what="the shared prompt's prefill queued")
    return run, answer


@pytest.mark.parametrize("abort", [{"abort_all": True}, "pause"])
def test_an_abort_during_the_shared_prompt_prefill_ends_every_sample(engine, abort) -> None:
    proc, _ = engine
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        run, answer = samples_held_in_prefill(client, n=2, max_new_tokens=200)
        if abort == "pause":
            assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        else:
            assert client.post("/abort_request", json=abort).json()["aborted"] == "all"
        assert client.post("/continue_generation", json={}).status_code == 200
        run.join(60)
        outputs = answer["r"].json()
        assert [o["meta_info"]["finish_reason"]["type"] for o in outputs] == ["abort", "abort"], outputs
        assert all(o["meta_info"]["completion_tokens"] == 0 for o in outputs)
        assert client.get("/memory_occupation").json()["queued_requests"] == 0
        # the ids are free again, and the engine serves them
        r = client.post("/generate", json={"rid": "X", "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text


def test_an_abort_of_one_sample_during_the_shared_prompt_prefill_ends_only_that_sample(engine) -> None:
    """An abort naming ``X_1`` while the prompt of ``X``'s samples was prefilled answered ``abort`` for every
    sample, ``X_0`` and ``X_2`` with no token (found by review): an abort reaches the request it names (SGLang's
    ``TokenizerManager.abort_request``), at that stage as once the samples run."""
    proc, _ = engine
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        run, answer = samples_held_in_prefill(client, n=3, max_new_tokens=8)
        assert client.post("/abort_request", json={"rid": "X_1"}).json()["aborted"] == ["X_1"]
        assert client.post("/continue_generation", json={}).status_code == 200
        run.join(60)
        outputs = answer["r"].json()
        assert [(o["meta_info"]["id"], o["meta_info"]["finish_reason"]["type"], o["meta_info"]["completion_tokens"])
                for o in outputs] == [("X_0", "length", 8), ("X_1", "abort", 0), ("X_2", "length", 8)], outputs
        occupation = client.get("/memory_occupation").json()
        assert occupation["queued_requests"] == 0 and occupation["running_requests"] == 0
        # every id is free again
        r = client.post("/generate", json={"rid": ["X_0", "X_1", "X_2"], "input_ids": [[5], [6], [7]],
                                           "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text


def test_a_shared_prompt_prefill_never_takes_another_clients_id(engine) -> None:
    """The prefill of ``n`` samples ran under "<rid>_0-prefill", an id a client may use: a request of that id was
    ended by the prefill's clean-up abort (found by review: ``abort`` after 379 of 400 tokens). The engine's own
    requests now have ids of their own, and an id in flight is never held twice."""
    proc, _ = engine
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        other, answer = in_background(client, {"rid": "job_0-prefill", "input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 400, "ignore_eos": True, "temperature": 0}})
        wait_until(lambda: client.get("/memory_occupation").json()["running_requests"] == 1, timeout=20,
                   what="the other client's request running")
        assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200  # it keeps running
        run, samples = in_background(client, {"rid": "job", "input_ids": [8, 9, 10], "sampling_params": {
            "n": 2, "max_new_tokens": 2, "ignore_eos": True}})
        wait_until(lambda: client.get("/memory_occupation").json()["queued_requests"] == 1, timeout=10,
                   what="the shared prompt's prefill queued")
        assert client.post("/continue_generation", json={}).status_code == 200
        run.join(60)
        other.join(60)
        assert [o["meta_info"]["finish_reason"]["type"] for o in samples["r"].json()] == ["length", "length"]
        meta = answer["r"].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 400, meta


def test_a_step_that_hangs_past_the_bound_makes_health_a_503_until_it_returns(engine) -> None:
    """Before: ``/health`` was 200 while the engine thread lived, a step hung in a collective or on the device
    included (SGLang's ``/health`` runs a one-token generation and answers 503 past 20 s)."""
    proc, drill = engine
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        drill.with_name("drill.json.fired").unlink(missing_ok=True)
        drill.write_text(json.dumps({"kind": "stall", "at": "decode", "delay_s": 5.0}))
        busy, answer = in_background(client, {"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True, "temperature": 0}})
        wait_until(lambda: drill.with_name("drill.json.fired").exists(), timeout=30, what="the step stalled")
        wait_until(lambda: client.get("/health").status_code == 503, timeout=4, what="/health a 503")
        status = client.get("/health").json()["status"]
        assert "--health-step-timeout" in status, status
        busy.join(60)
        assert answer["r"].status_code == 200 and len(answer["r"].json()["output_ids"]) == 4
        assert client.get("/health").status_code == 200
