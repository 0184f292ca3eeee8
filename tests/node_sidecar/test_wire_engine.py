"""Issue 13's wire findings through a real sidecar: a fake engine writes the raw bytes of a broken answer.

The sidecar calls its engine with the same upstream client as the LB calls its nodes
(``tests/service/test_upstream_wire.py`` pins each rule, ``tests/lb/test_wire_answers.py`` shows them through
the LB); these show the sidecar's callers get their own answer, never another request's, and a 502 for an
answer that is not HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.lb.fakes import FakeCluster, FakeNode
from tests.lb.test_wire_answers import answer, answers_in_turn
from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine_and_sidecar(proc_log_dir: Path) -> Iterator[tuple[FakeNode, str]]:
    with FakeCluster() as fakes:
        engine = fakes.start_one()
        sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-kind", "handoff",
                                                 "--engine-poll-interval", "0.2"],
                                log_dir=proc_log_dir, name="sidecar-raw-engine").start()
        try:
            wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="ready")
            yield engine, sidecar.url
        finally:
            sidecar.stop()


def test_found_1_a_continue_before_the_answer_never_crosses_to_the_next_request(
        engine_and_sidecar: tuple[FakeNode, str]) -> None:
    engine, url = engine_and_sidecar
    engine.handlers["/generate"] = answers_in_turn([b"HTTP/1.1 100 Continue\r\n\r\n", 0.3, answer(b'{"n": 1}')])
    with httpx.Client(base_url=url, timeout=20) as client:
        first = client.post("/generate", json={"text": "a"})
        second = client.post("/generate", json={"text": "b"})
    assert (first.status_code, first.json()) == (200, {"n": 1})
    assert (second.status_code, second.json()) == (200, {"n": 2})


def test_found_1_two_answers_in_one_segment_are_one_answer(engine_and_sidecar: tuple[FakeNode, str]) -> None:
    engine, url = engine_and_sidecar
    engine.handlers["/generate"] = answers_in_turn([answer(b'{"n": 1}') + answer(b'{"n": "stray"}')])
    with httpx.Client(base_url=url, timeout=20) as client:
        assert client.post("/generate", json={"text": "a"}).json() == {"n": 1}
        assert client.post("/generate", json={"text": "b"}).json() == {"n": 2}


@pytest.mark.parametrize("status", [b"999", b"000", b"101"])
def test_found_3_an_odd_status_is_a_clear_503_and_the_node_recovers(
        engine_and_sidecar: tuple[FakeNode, str], status: bytes) -> None:
    engine, url = engine_and_sidecar
    engine.handlers["/generate"] = answers_in_turn([b"HTTP/1.1 " + status + b" Odd\r\nContent-Length: 2\r\n\r\n{}"])
    with httpx.Client(base_url=url, timeout=20) as client:
        odd = client.post("/generate", json={"text": "a"})
        assert odd.status_code == 503 and odd.json()["error"]["type"] == "engine_unavailable", odd.text
        assert "invalid HTTP response" in odd.json()["error"]["message"]
        wait_until(lambda: client.get("/ready").status_code == 200, timeout=20, what="serving again")
        assert client.post("/generate", json={"text": "b"}).json() == {"n": 2}
