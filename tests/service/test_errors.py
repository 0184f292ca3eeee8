"""The shared error envelope and limits, on a real server process."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from handoff.service.logs import TRACEBACK_INDENT, RateLimit
from tests.support.procs import ServerProcess

RECORD = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +\S+ \S+: ")  # a text log's record


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


FORGED = "12:00:00 ERROR forged record"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_bug_a_client_reaches_is_logged_in_bounded_records_it_cannot_forge(fmt: str, proc_log_dir) -> None:
    """A bug is a traceback per request: its exception may quote the client (a line break, an escape), its path
    has no length limit, and a client can hit it at will. The records stay records, short, and a burst."""
    proc = ServerProcess("tests.support.error_app", ["--log-format", fmt], log_dir=proc_log_dir,
                         name=f"error_app_{fmt}")
    proc.start()
    try:
        with httpx.Client(base_url=proc.url, timeout=10) as client:
            for _ in range(3 * RateLimit.DEFAULT_BURST):
                answer = client.post("/bug/" + "p" * 5000, content=f"x\r\n{FORGED}\x1b[2J\n{FORGED}".encode())
                assert answer.status_code == 500
    finally:
        proc.stop()
    lines = [line for line in proc.log_path.read_text().splitlines() if line and not line.startswith("=== start")]
    if fmt == "json":
        records = [json.loads(line) for line in lines]
        bugs = [r for r in records if r["msg"].startswith("unhandled error")]
        assert all(len(r["msg"]) < 300 and FORGED in r["exc"] for r in bugs)
    else:
        # the forged text is there, as a traceback's line: never a record's, and with no escape sequence to run
        assert not [line for line in lines if not (RECORD.match(line) or line.startswith(TRACEBACK_INDENT))]
        assert f"{TRACEBACK_INDENT}{FORGED}\\x1b[2J" in lines and not [line for line in lines if "\x1b" in line]
        bugs = [line for line in lines if RECORD.match(line) and "unhandled error" in line]
        assert all(len(line) < 300 for line in bugs)
    assert len(bugs) == RateLimit.DEFAULT_BURST
