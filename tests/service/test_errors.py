"""The shared error envelope and limits, on a real server process."""

from __future__ import annotations

import httpx
import pytest

from tests.support.procs import ServerProcess


@pytest.fixture(scope="module")
def server(proc_log_dir):
    proc = ServerProcess("tests.support.error_app", [], log_dir=proc_log_dir, name="error_app")
    proc.start()
    yield proc
    proc.stop()


def test_a_bug_is_a_500_envelope_and_the_connection_survives(server) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for _ in range(3):
            r = client.post("/bug", json={})
            assert r.status_code == 500
            assert r.json() == {"error": {"type": "internal_error", "message": "RuntimeError: internal error"}}
        assert client.post("/echo", json={"a": 1}).json() == {"a": 1}
    assert "a bug" not in r.text


def test_service_errors_carry_type_and_extra_fields(server) -> None:
    r = httpx.post(server.url + "/conflict", timeout=10)
    assert r.status_code == 409
    assert r.json() == {"error": {"type": "conflict", "message": "busy", "in_flight": 3}}


def test_validation_and_routing_errors_use_the_envelope(server) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/echo", content=b"[1]").json()["error"]["type"] == "invalid_request"
        assert client.get("/missing").json()["error"]["type"] == "not_found"
        assert client.get("/echo").json()["error"]["type"] == "method_not_allowed"


def test_body_limit_declared_and_chunked(server) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        r = client.post("/echo", content=b"x" * 5000)
        assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"

        def chunks():
            for _ in range(10):
                yield b"x" * 1000
        r = client.post("/echo", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"
