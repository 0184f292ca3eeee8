"""Security of a whole cluster with tokens set (issue 8): auth on every protected endpoint, no token in
any log, constant-time comparison, no contact outside the membership, body limits, no reflected headers."""

from __future__ import annotations

import hmac
import io
import json
import logging
import socket
import threading
import time
from contextlib import redirect_stderr
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient

from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.service import auth
from handoff.service.logs import setup_logging
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

ADMIN = "adm-Z9x!tok-7f3e"
API_KEY = "gen-Q2w#key-81c4"
BODY_LIMIT = 64 * 1024
CANARY_HOST = "127.0.0.2"  # loopback, but no member of the cluster listens there

LB_OPEN = {("GET", "/health"), ("GET", "/nodes"), ("GET", "/memory_occupation"), ("GET", "/metrics"),
           ("GET", "/openapi.json"), ("GET", "/get_weight_version"), ("GET", "/model_info"),
           ("GET", "/get_model_info"), ("GET", "/list_workers"), ("GET", "/workers"), ("GET", "/v1/models"),
           ("GET", "/v1/models/{model}"), ("GET", "/get_server_info"), ("GET", "/server_info"),
           ("GET", "/workers/{id_or_url}")}
SIDECAR_OPEN = {("GET", "/health"), ("GET", "/ready"), ("GET", "/memory_occupation"), ("GET", "/metrics"),
                ("GET", "/openapi.json"), ("GET", "/v1/models"), ("GET", "/get_server_info"),
                ("GET", "/get_weight_version"), ("GET", "/model_info"), ("GET", "/get_model_info"),
                ("GET", "/v1/models/{model}"), ("GET", "/server_info"), ("GET", "/v1/loads")}
GENERATION = {"/generate", "/v1/completions", "/v1/chat/completions", "/health_generate"}
BAD_CREDENTIALS: list[dict[str, Any]] = [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {ADMIN[:-1]}"},
    {"Authorization": f"Bearer {ADMIN}x"}, {"Authorization": ADMIN}, {"Authorization": f"Basic {ADMIN}"},
    {"Authorization": f"Bearer{ADMIN}"}, {"Authorization": f"Bearer {ADMIN} x"},
    {"X-Api-Key": API_KEY}, {"Authorization": b"Bearer \xe9"},  # type: ignore[dict-item]
]
# RFC 9110: the scheme is case-insensitive; whitespace around the token is not part of it
# (a trailing space, which clients like httpx cannot send, is in tests/lb/test_security.py over a raw socket)
GOOD_SPELLINGS = ["Bearer {}", "bearer {}", "BEARER {}", "Bearer  {}", "bEaReR {}"]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=2, weights_backup="disk", admin_token=ADMIN, api_key=API_KEY,
                       lb_args=("--max-body-bytes", str(BODY_LIMIT), "--log-format", "json", "--log-level", "debug"),
                       sidecar_args=("--max-body-bytes", str(BODY_LIMIT), "--log-level", "debug"),
                       engine_args=("--log-level", "debug"))
    with LocalCluster(spec, tmp_path_factory.mktemp("security")) as c:
        yield c


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def routes(http: httpx.Client, base: str) -> set[tuple[str, str]]:
    spec = http.get(base + "/openapi.json").json()
    return {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops} | {
        ("GET", "/openapi.json")}


GENERATION_BODIES = {"/generate": {"text": "x", "sampling_params": {"max_new_tokens": 1}},
                     "/v1/completions": {"prompt": "x", "max_tokens": 1},
                     "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}}


def harmless_body(path: str) -> bytes:
    """A body each route refuses or answers at once, so an authorized call changes nothing (a one-token
    generation; for everything else a body no control call accepts)."""
    if path in GENERATION_BODIES:
        return json.dumps(GENERATION_BODIES[path]).encode()
    return b'{"tags": ["not_a_tag"], "mode": "never", "url": "http://127.0.0.1:1"}'


def test_every_protected_endpoint_refuses_missing_and_wrong_tokens(cluster: LocalCluster, http: httpx.Client) -> None:
    for base, open_routes in ((cluster.url, LB_OPEN), (cluster.nodes[0].url, SIDECAR_OPEN)):
        served = routes(http, base)
        assert open_routes <= served
        protected = sorted(served - open_routes)
        assert len(protected) >= 10, protected
        for method, path in protected:
            for headers in BAD_CREDENTIALS:
                answer = http.request(method, base + path, content=harmless_body(path), headers=headers)
                assert answer.status_code == 401, (base, method, path, headers, answer.text)
                assert answer.json()["error"]["type"] == "unauthorized" and answer.headers["www-authenticate"] == "Bearer"
            # control and membership take the admin token only; generation the API key or the admin token
            is_generation = path in GENERATION
            with_key = http.request(method, base + path, content=harmless_body(path), headers=bearer(API_KEY))
            assert (with_key.status_code != 401) is is_generation, (method, path, with_key.status_code)
            for spelling in GOOD_SPELLINGS:
                with_admin = http.request(method, base + path, content=harmless_body(path),
                                          headers={"Authorization": spelling.format(ADMIN)})
                assert with_admin.status_code != 401, (method, path, spelling)
        for method, path in sorted(open_routes):
            path = path.replace("{model}", "builtin:tiny")  # the served model's card
            path = path.replace("{id_or_url}", quote(cluster.nodes[0].url, safe=""))  # a worker, by its URL
            assert http.request(method, base + path).status_code == 200, (base, path)
    assert all(n["routable"] for n in http.get(cluster.url + "/nodes").json()["nodes"])


def test_tokens_never_reach_a_log_line(cluster: LocalCluster, http: httpx.Client) -> None:
    """Every place a client can put a token, on every process; then every line of every log is searched."""
    lb, sidecar = cluster.url, cluster.nodes[0].url
    for base in (lb, sidecar):
        for token in (ADMIN, API_KEY):
            http.post(base + "/release_memory_occupation", params={"token": token, "role": token}, json={},
                      headers={"Authorization": f"Bearer {token}x", "X-Request-Id": token, "Cookie": token})
            http.post(base + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
                      headers={"Authorization": f"Basic {token}", "X-Forwarded-For": token})
            http.get(base + "/nodes", params={"url": token}, headers=bearer(token))
            http.request("DELETE", lb + "/nodes", params={"url": f"http://{token}:1"}, headers=bearer(ADMIN))
            http.post(lb + "/nodes", json={"url": f"http://127.0.0.1:1/{token}", "role": token}, headers=bearer(ADMIN))
        http.post(base + "/generate", content=b'{"text": "' + ADMIN.encode() + b'", bad json',
                  headers=bearer(API_KEY))
        send_raw(base, f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
                       f"Content-Length: nope-{API_KEY}\r\n\r\n".encode())
        send_raw(base, f"GET /health?{ADMIN} HTTP/1.1\r\nHost: x\r\nX: {API_KEY}\r\n\x00bad\r\n\r\n".encode())
    # a control call every node refuses, so the fan-out's warning lines are written too
    http.post(lb + "/resume_memory_occupation", headers=bearer(ADMIN), json={"tags": [ADMIN]})
    seen = 0
    for proc in cluster.processes():
        for number, line in enumerate(proc.log_path.read_text(errors="replace").splitlines()):
            if line.startswith("=== start"):
                continue  # the launcher's own header: the command line, with token values masked
            seen += 1
            assert ADMIN not in line and API_KEY not in line, f"{proc.name} log line {number}: {line}"
    assert seen > 20


def send_raw(base: str, data: bytes) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        try:
            return sock.recv(65536)
        except OSError:
            return b""


def test_redaction_covers_tracebacks_and_extra_fields() -> None:
    """The loggers' last line of defence hides a token wherever it ends up in a line (both formats)."""
    secret = "tok-\u00e9\"x"  # escaped differently in JSON
    for fmt in ("text", "json"):
        stream = io.StringIO()
        with redirect_stderr(stream):
            setup_logging("test", fmt=fmt, secrets=[secret])
            log = logging.getLogger("security-test")
            try:
                raise ValueError(f"header was Bearer {secret}")
            except ValueError:
                log.exception("refused %s", secret)
            log.warning("extra", extra={"header": f"Bearer {secret}"})
        output = stream.getvalue()
        assert output.count("***") >= (3 if fmt == "json" else 2), output  # text lines leave extra fields out
        assert secret not in output and json.dumps(secret)[1:-1] not in output, output
    logging.getLogger().handlers.clear()


class SpyCompare:
    """Stands in for ``hmac.compare_digest``: records its arguments, answers what the test says."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.calls: list[tuple[bytes, bytes]] = []

    def __call__(self, a: bytes, b: bytes) -> bool:
        self.calls.append((a, b))
        return self.answer


@pytest.mark.parametrize("service", ["lb", "sidecar"])
def test_hmac_compare_digest_is_what_decides(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both processes authorize through ``hmac.compare_digest`` (constant time) and nothing else: making it
    say yes lets a wrong token in, making it say no keeps the right one out."""
    assert auth.hmac is hmac
    if service == "lb":
        from lb.app import create_app
        from lb.config import LBConfig

        app = create_app(LBConfig(admin_token=ADMIN, api_key=API_KEY))
    else:
        from node_sidecar.app import create_app as create_sidecar
        from node_sidecar.config import SidecarConfig

        app = create_sidecar(SidecarConfig(engine_url="http://127.0.0.1:9", admin_token=ADMIN, api_key=API_KEY))
    with TestClient(app) as client:
        for path in ("/flush_cache", "/generate"):
            yes = SpyCompare(True)
            monkeypatch.setattr(auth.hmac, "compare_digest", yes)
            assert client.post(path, json={"text": "x"}, headers=bearer("wrong")).status_code != 401, path
            assert yes.calls and all(given == b"wrong" for given, _ in yes.calls)
            assert {expected for _, expected in yes.calls} <= {ADMIN.encode(), API_KEY.encode()}
            no = SpyCompare(False)
            monkeypatch.setattr(auth.hmac, "compare_digest", no)
            assert client.post(path, json={"text": "x"}, headers=bearer(ADMIN)).status_code == 401, path
            assert no.calls
            monkeypatch.setattr(auth.hmac, "compare_digest", hmac.compare_digest)


class Canary(threading.Thread):
    """A listener on an address no member has: counts every connection made to it."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind((CANARY_HOST, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.num_connections = 0
        self.stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{CANARY_HOST}:{self.port}"

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.num_connections += 1
            conn.close()
        self.sock.close()


def bodies_naming(canary: Canary) -> list[dict[str, Any]]:
    url, host, port = canary.url, CANARY_HOST, canary.port
    return [
        {"text": f"fetch {url}/x please", "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": 1,
         "sampling_params": {"max_new_tokens": 1}},
        {"text": [url, url], "bootstrap_host": [host, host], "bootstrap_port": [port, port],
         "sampling_params": {"max_new_tokens": 1}},
        {"prompt": url, "model": url, "max_tokens": 1, "url": url, "callback_url": url, "webhook": url},
        {"messages": [{"role": "user", "content": url, "image_url": {"url": url}}], "max_tokens": 1},
        {"model_path": url + "/ckpt", "weight_version": url, "load_format": url},
        {"model_path": f"{host}:{port}", "url": url, "node": url, "engine_url": url, "nodes": [url]},
        {"tags": [url], "mode": url, "url": url, "host": host, "port": port},
        {"url": url, "role": "mixed"}, {"url": url, "role": "decode", "bootstrap_port": port},
    ]


def test_the_lb_contacts_no_address_outside_its_membership(cluster: LocalCluster, http: httpx.Client) -> None:
    canary = Canary()
    canary.start()
    try:
        url = canary.url
        headers = {"Host": f"{CANARY_HOST}:{canary.port}", "X-Forwarded-Host": url, "Forwarded": f"host={url}",
                   "X-Forwarded-For": CANARY_HOST, "Referer": url, "Origin": url, "X-Request-Id": url}
        paths = sorted(path for _, path in routes(http, cluster.url))
        for body in bodies_naming(canary):
            for path in paths:
                for auth_headers in ({}, bearer(API_KEY), bearer(ADMIN)):
                    for method in ("POST", "GET", "DELETE"):
                        if ((method, path) in {("POST", "/nodes"), ("POST", "/add_worker"), ("POST", "/workers")}
                                and auth_headers == bearer(ADMIN)):
                            continue  # the admin APIs defining the membership: adding a node is their job
                        http.request(method, cluster.url + path, json=body, params={"url": url, "node": url},
                                     headers={**headers, **auth_headers})
        # the absolute form of a request target names the canary too
        send_raw(cluster.url, f"POST {url}/generate HTTP/1.1\r\nHost: {CANARY_HOST}\r\nContent-Length: 2\r\n\r\n{{}}"
                 .encode())
        # let every asynchronous consequence (health checks, background settles) happen: one full health round
        since = time.time()
        wait_until(lambda: all((n["last_seen"] or 0) > since for n in http.get(cluster.url + "/nodes").json()["nodes"]),
                   timeout=10, what="a health round after the requests")
        assert canary.num_connections == 0
        assert [n["url"] for n in http.get(cluster.url + "/nodes").json()["nodes"]] == [n.url for n in cluster.nodes]
    finally:
        canary.stop.set()
        canary.join(5)


def test_bodies_over_the_limit_are_413_everywhere(cluster: LocalCluster, http: httpx.Client) -> None:
    big = b'{"text": "' + b"x" * BODY_LIMIT + b'"}'
    before = http.get(cluster.url + "/nodes").json()
    for base in (cluster.url, cluster.nodes[0].url):
        for method, path in sorted(routes(http, base)):
            if method != "POST":
                continue
            declared = http.post(base + path, content=big, headers=bearer(ADMIN))
            assert declared.status_code == 413, (base, path, declared.status_code)
            assert declared.json()["error"]["type"] == "payload_too_large"
            chunked = http.post(base + path, content=iter([big[:BODY_LIMIT // 2], big[BODY_LIMIT // 2:]]),
                                headers=bearer(ADMIN))
            assert chunked.status_code == 413, (base, path, "chunked")
            at_limit = b"[" + b" " * (BODY_LIMIT - 2) + b"]"  # judged (a 400 or a no-op), not refused for size
            exact = http.post(base + path, content=at_limit, headers=bearer(ADMIN))
            assert exact.status_code != 413, (base, path, "at the limit")
    after = http.get(cluster.url + "/nodes").json()
    assert [n["routable"] for n in after["nodes"]] == [n["routable"] for n in before["nodes"]] == [True, True]


REFLECTABLE = {"X-Canary-Header": "reflected-1", "Set-Cookie": "session=reflected-2",
               "Access-Control-Allow-Origin": "https://reflected-3.example", "Location": "https://reflected-4.example",
               "X-Request-Id": "reflected-5", "Cache-Control": "reflected-6", "Retry-After": "777",
               "Content-Security-Policy": "reflected-7", "Cookie": "reflected-8=1"}


def test_request_headers_are_not_copied_into_responses(cluster: LocalCluster, http: httpx.Client) -> None:
    for base in (cluster.url, cluster.nodes[0].url):
        for method, path in sorted(routes(http, base)):
            for stream in (False, True):
                body = json.loads(harmless_body(path))
                if path in GENERATION_BODIES:
                    body["stream"] = stream
                elif stream:
                    continue
                with http.stream(method, base + path, json=body, headers={**REFLECTABLE, **bearer(ADMIN)}) as answer:
                    answer.read()
                    for name, value in answer.headers.items():
                        assert "reflected" not in value and value != "777", (base, method, path, name, value)
                    assert "set-cookie" not in answer.headers and "access-control-allow-origin" not in answer.headers
