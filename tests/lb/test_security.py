"""Auth (SPEC 6), body limits, the error envelope, JSON logs and flag errors of a real LB process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from lb.__main__ import main as lb_main
from tests.lb.fakes import FakeCluster
from tests.support.procs import REPO_ROOT, assert_refused_at_start

pytestmark = pytest.mark.timeout(30)

ADMIN = "admin-s3cret-token"
API_KEY = "api-k3y-value"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("via", ["flags", "env"])
def test_admin_token_and_api_key(fakes: FakeCluster, start_lb, via: str) -> None:
    node = fakes.start_one()
    if via == "flags":
        lb = start_lb("--node", node.url, "--admin-token", ADMIN, "--api-key", API_KEY, "--log-format", "json")
    else:
        lb = start_lb("--node", node.url, "--log-format", "json",
                      env={"HANDOFF_ADMIN_TOKEN": ADMIN, "HANDOFF_API_KEY": API_KEY})
    http = lb.http
    for headers in ({}, bearer("wrong"), bearer(API_KEY)):
        answer = http.post("/release_memory_occupation", headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["type"] == "unauthorized"
        assert answer.headers["www-authenticate"] == "Bearer"
        assert http.post("/nodes", json={"url": "http://127.0.0.1:9"}, headers=headers).status_code == 401
        assert http.delete("/nodes", params={"url": node.url}, headers=headers).status_code == 401
        assert http.get("/flush_cache", headers=headers).status_code == 401
    assert http.post("/release_memory_occupation", headers=bearer(ADMIN)).status_code == 200
    for headers in ({}, bearer("wrong")):
        assert http.post("/generate", json={"text": "x"}, headers=headers).status_code == 401
    assert http.post("/resume_memory_occupation", headers=bearer(ADMIN)).status_code == 200
    assert http.post("/generate", json={"text": "x"}, headers=bearer(API_KEY)).status_code == 200
    # the admin token authorizes everything, generation included (the LB uses it towards the nodes)
    assert http.post("/generate", json={"text": "x"}, headers=bearer(ADMIN)).status_code == 200
    for view in ("/health", "/nodes", "/memory_occupation", "/metrics"):
        assert http.get(view).status_code == 200, view
    # the LB's own token goes to the node on every call; the client's key never does
    seen = {r.path: r.headers.get("authorization") for r in node.requests}
    assert seen["/release_memory_occupation"] == seen["/memory_occupation"] == f"Bearer {ADMIN}"
    assert seen["/generate"] == f"Bearer {ADMIN}"
    # the harness writes the command line into the log first; everything else is the LB's own output
    output = [line for line in lb.log().splitlines() if line and not line.startswith("=== start")]
    assert not any(ADMIN in line or API_KEY in line for line in output)
    events = [json.loads(line) for line in output]
    assert events and all({"ts", "level", "service", "msg"} <= e.keys() for e in events)


def test_oversized_bodies_are_413(fakes: FakeCluster, start_lb) -> None:
    node = fakes.start_one()
    lb = start_lb("--node", node.url, "--max-body-bytes", "1000")
    for path in ("/generate", "/release_memory_occupation"):
        declared = lb.http.post(path, content=b"x" * 2000)
        assert declared.status_code == 413 and declared.json()["error"]["type"] == "payload_too_large"
        chunked = lb.http.post(path, content=iter([b"y" * 600, b"y" * 600]))
        assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "payload_too_large"
    assert not node.requests_to("/generate") and not node.requests_to("/release_memory_occupation")
    assert lb.http.post("/generate", content=b'{"text": "small"}').status_code == 200


def test_every_error_is_the_envelope(fakes: FakeCluster, start_lb) -> None:
    lb = start_lb()
    for method, path, status in (("GET", "/nope", 404), ("GET", "/generate", 405), ("PUT", "/flush_cache", 405),
                                 ("POST", "/nodes", 400), ("POST", "/generate", 503)):
        answer = lb.http.request(method, path, content=b"{}")
        assert answer.status_code == status, (method, path)
        assert set(answer.json()["error"]) >= {"type", "message"}, (method, path)
    assert lb.metric("handoff_lb_requests_total", route="other", code="404") == 1
    assert lb.metric("handoff_lb_requests_total", route="/generate", code="503") == 1


@pytest.mark.parametrize("args,field", [
    (["--control-timeout", "0"], "--control-timeout: a number of seconds above 0"),
    (["--control-timeout", "100", "--max-control-timeout", "10"], "--max-control-timeout (10) must be at least"),
    (["--node", "localhost:8000"], "http://"),
    (["--prefill", "http://127.0.0.1:8000@notaport"], "bootstrap port"),
    (["--discover-dns", "gpu=svc:8000"], "--discover-dns role"),
    (["--node", "http://127.0.0.1:1", "--node", "http://127.0.0.1:1/"], "listed twice"),
    (["--node", "http://localhost:1", "--decode", "http://[::ffff:127.0.0.1]:1"], "same address and port as"),
    (["--node", "http://[::1"], "unterminated IPv6"),
    (["--node", "http://h\u00e9:1"], "printable ASCII"),
    (["--unhealthy-threshold", "0"], "--unhealthy-threshold"),
    (["--discover-dns", "mixed=a..b:8000"], "--discover-dns host"),
    (["--admin-token", "   "], "--admin-token (or HANDOFF_ADMIN_TOKEN) is blank"),
    (["--api-key", "s\u00e9cret"], "visible ASCII"),
])
def test_bad_flags_exit_naming_the_field(args: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        lb_main([*args, "--port", "0"])  # fails in flag parsing, before anything is served
    assert info.value.code == 2 and field in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://user:s3cr3t@127.0.0.1:1", "http://s3cr3t@127.0.0.1:1",
                                 "http://u:s3cr3t@127.0.0.1:1/x", "http://127.0.0.1:1/?token=s3cr3t"])
def test_a_node_url_refused_is_not_written_out_with_its_secret(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        lb_main(["--node", url, "--port", "0"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "node URL must be http://HOST[:PORT] without" in err and "s3cr3t" not in err


def test_a_timeout_past_a_week_stops_the_lb_at_start() -> None:
    """``--generate-timeout 1e300`` was taken: "never" without a word (found by review)."""
    assert_refused_at_start(["lb", "--port", "0", "--generate-timeout", "1e300"], "--generate-timeout", timeout_s=20)


def test_the_module_entry_point_reports_bad_flags() -> None:
    done = subprocess.run([sys.executable, "-m", "lb", "--control-timeout", "-1"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 2 and "--control-timeout" in done.stderr, done.stderr


def raw_status(url: str, request: bytes) -> int:
    """Send ``request`` as it is (clients like httpx refuse odd header spellings) and return the status."""
    host, port = url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        head = b""
        while b"\r\n" not in head:
            piece = conn.recv(4096)
            if not piece:
                break
            head += piece
    return int(head.split(b" ", 2)[1])


def test_bearer_scheme_and_token_spacing(fakes: FakeCluster, start_lb) -> None:
    """The scheme is case-insensitive and whitespace around the token is not part of it (RFC 9110)."""
    node = fakes.start_one()
    lb = start_lb("--node", node.url, "--admin-token", ADMIN)
    for value in (f"bearer {ADMIN}", f"BEARER {ADMIN}", f"Bearer {ADMIN}  ", f"Bearer  {ADMIN}", f"bEaReR {ADMIN}\t"):
        request = f"POST /flush_cache HTTP/1.1\r\nHost: x\r\nAuthorization: {value}\r\nContent-Length: 0\r\n\r\n"
        assert raw_status(lb.url, request.encode()) == 200, repr(value)
    for value in (f"Bearer{ADMIN}", f"Bearer {ADMIN}x", f"Basic {ADMIN}", ADMIN, f"Bearer {ADMIN} {ADMIN}"):
        request = f"POST /flush_cache HTTP/1.1\r\nHost: x\r\nAuthorization: {value}\r\nContent-Length: 0\r\n\r\n"
        assert raw_status(lb.url, request.encode()) == 401, repr(value)


def test_a_request_head_must_arrive_in_time(fakes: FakeCluster, start_lb) -> None:
    """Connections that dribble their request heads (or send nothing) are answered 408 and closed at the LB's
    --header-timeout; the LB keeps answering everyone else."""
    lb = start_lb("--node", fakes.start_one().url, "--header-timeout", "1.5")
    host, port = lb.url[len("http://"):].rsplit(":", 1)
    conns = [socket.create_connection((host, int(port)), timeout=30) for _ in range(20)]
    for i, conn in enumerate(conns):
        if i % 2:
            conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    statuses = []
    for conn in conns:
        data = b""
        while piece := conn.recv(65536):
            data += piece
        conn.close()
        statuses.append(int(data.split(b" ", 2)[1]) if data else 0)
    assert statuses == [408] * 20
    assert lb.http.get("/health").status_code == 200
