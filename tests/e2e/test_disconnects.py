"""A generation client that goes away, through real processes (LB, sidecars, builtin:tiny engines).

As SGLang 0.5.23 does for /generate, its streams and the OpenAI routes (``is_disconnected`` /
``abort_request`` in its tokenizer manager), the engine aborts what the client left, every sequence of it
(a batch, ``n`` samples; in PD, on the prefill and the decode node alike), and frees its KV; every hop gives
back its count of the request exactly once (the sidecar's in-flight count a drain waits on, the LB's load),
and nothing is logged as an error. A client that closes its write side after its request is gone too, as
uvicorn takes it: the request either never ran or is aborted. Each case leaves at a known point: after the
first streamed bytes, or once every engine it reaches runs it.
"""

from __future__ import annotations

import json
import socket
from typing import Any, Iterator

import httpx
import pytest

from handoff.cluster.local import ClusterSpec, LocalCluster
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(240)

LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
GENERATE = ("/generate", {"text": "walk away", "sampling_params": LONG})
COMPLETIONS = ("/v1/completions", {"model": "m", "prompt": "walk away", "max_tokens": 3000, "temperature": 0,
                                   "ignore_eos": True})
CHAT = ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "walk away"}],
                                 "max_tokens": 3000, "temperature": 0, "ignore_eos": True})


def with_fields(route: tuple[str, dict[str, Any]], **fields: Any) -> tuple[str, dict[str, Any]]:
    path, body = route
    if path == "/generate" and "n" in fields:
        return path, {**body, "sampling_params": {**body["sampling_params"], "n": fields.pop("n")}, **fields}
    return path, {**body, **fields}


# (name, (path, body), sequences it runs, how its client leaves)
CASES = [
    ("generate_stream", with_fields(GENERATE, stream=True), 1, "mid_stream"),
    ("generate", GENERATE, 1, "waiting"),
    ("completions_stream", with_fields(COMPLETIONS, stream=True), 1, "mid_stream"),
    ("completions", COMPLETIONS, 1, "waiting"),
    ("chat_stream", with_fields(CHAT, stream=True), 1, "mid_stream"),
    ("chat", CHAT, 1, "waiting"),
    ("generate_batch_stream", with_fields(GENERATE, text=["walk away", "and again"], stream=True), 2, "mid_stream"),
    ("generate_n", with_fields(GENERATE, n=2), 2, "waiting"),
    ("completions_n_stream", with_fields(COMPLETIONS, n=2, stream=True), 2, "mid_stream"),
    ("chat_n", with_fields(CHAT, n=2), 2, "waiting"),
    ("generate_half_closed", GENERATE, 1, "half_close"),
    ("chat_stream_half_closed", with_fields(CHAT, stream=True), 1, "half_close"),
]
PD_CASES = [
    ("generate_stream", with_fields(GENERATE, stream=True), 1, "mid_stream"),
    ("generate", GENERATE, 1, "waiting"),
    ("chat_n_stream", with_fields(CHAT, n=2, stream=True), 2, "mid_stream"),
    ("completions", COMPLETIONS, 1, "waiting"),
    # the LB reads the prefill node's answer whole before it answers: the client leaves while it waits
    ("generate_logprobs_stream", with_fields(GENERATE, stream=True, return_logprob=True), 1, "waiting"),
]


def engine_metrics(url: str) -> dict[str, float]:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)
            if name.startswith("handoff_engine_")}


def num_aborted(url: str) -> float:
    return engine_metrics(url).get('handoff_engine_requests_total{finish_reason="abort"}', 0.0)


def num_running(url: str) -> float:
    metrics = engine_metrics(url)
    return metrics["handoff_engine_running_requests"] + metrics["handoff_engine_queued_requests"]


def is_settled(url: str) -> bool:
    """Nothing runs or waits, and every KV slot in use is the prefix cache's."""
    metrics = engine_metrics(url)
    return (metrics["handoff_engine_running_requests"] == metrics["handoff_engine_queued_requests"] == 0
            and metrics["handoff_engine_kv_slots_used"] == metrics["handoff_engine_cached_tokens"])


def send(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def leave(url: str, path: str, body: dict[str, Any], how: str, engines: list[str], num_sequences: int) -> None:
    """Send the request and go away as ``how`` says."""
    sock = send(url, path, body)
    try:
        if how == "mid_stream":
            head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 200"), head[:300]
        elif how == "waiting":
            wait_until(lambda: all(num_running(e) >= num_sequences for e in engines), timeout=30,
                       what="the request running on every engine it reaches")
        else:
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):  # the server closes the connection: nobody is left to answer
                pass
    finally:
        sock.close()


def check_left(cluster: LocalCluster, url: str, path: str, body: dict[str, Any], how: str, engines: list[str],
               num_sequences: int) -> None:
    before = [num_aborted(e) for e in engines]
    leave(url, path, body, how, engines, num_sequences)
    wait_until(lambda: all(is_settled(e) for e in engines), timeout=30, what="every engine settled")
    aborted = [num_aborted(e) - b for e, b in zip(engines, before)]
    expected = {num_sequences} if how != "half_close" else {0, num_sequences}
    assert all(a in expected for a in aborted), f"aborted {aborted}, expected one of {expected} each"
    wait_until(lambda: all(in_flight(node.url) == 0 for node in cluster.nodes), timeout=10,
               what="the sidecars' in-flight counts back to 0")
    wait_until(lambda: all(n["in_flight"] == 0 for n in lb_nodes(cluster)), timeout=10,
               what="the LB's in-flight counts back to 0")


def in_flight(sidecar_url: str) -> int:
    return httpx.get(sidecar_url + "/memory_occupation", timeout=10).json()["in_flight"]


def lb_nodes(cluster: LocalCluster) -> list[dict[str, Any]]:
    return httpx.get(cluster.url + "/nodes", timeout=10).json()["nodes"]


def check_aftermath(cluster: LocalCluster) -> None:
    """No count left behind (a drain ends at once), no KV locked, nothing logged as an error or a 500."""
    released = httpx.post(cluster.url + "/release_memory_occupation", json={"mode": "wait", "tags": ["kv_cache"]},
                          timeout=30)
    assert released.status_code == 200, released.text
    assert [r["body"]["drained_requests"] for r in released.json()["results"]] == [0] * len(cluster.nodes)
    assert httpx.post(cluster.url + "/resume_memory_occupation", json={}, timeout=30).status_code == 200
    for node in cluster.nodes:
        assert httpx.post(node.engine.url + "/flush_cache", timeout=10).status_code == 200
        assert engine_metrics(node.engine.url)["handoff_engine_kv_slots_used"] == 0  # no prefix-cache lock held
    for url in [cluster.url, *(node.url for node in cluster.nodes)]:
        codes = [line for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                 if line.startswith(("handoff_lb_requests_total", "handoff_node_requests_total"))]
        assert codes and not [line for line in codes if 'code="5' in line], codes
    for proc in cluster.processes():
        log = proc.log_path.read_text(errors="replace")
        assert "Traceback" not in log and " ERROR " not in log, proc.log_tail()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(ClusterSpec(num_mixed=1), tmp_path_factory.mktemp("disconnects")) as cluster:
        wait_until(lambda: all(n["routable"] for n in lb_nodes(cluster)), timeout=60, what="the node routable")
        yield cluster


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=0, num_prefill=1, num_decode=1)
    with LocalCluster(spec, tmp_path_factory.mktemp("pd_disconnects")) as cluster:
        wait_until(lambda: all(n["routable"] for n in lb_nodes(cluster)), timeout=60, what="both nodes routable")
        yield cluster


def test_a_client_that_leaves_is_aborted_at_every_hop(mixed: LocalCluster) -> None:
    node = mixed.nodes[0]
    engines = [node.engine.url]
    for hop, url in (("lb", mixed.url), ("sidecar", node.url), ("engine", node.engine.url)):
        for name, (path, body), num_sequences, how in CASES:
            try:
                check_left(mixed, url, path, body, how, engines, num_sequences)
            except AssertionError as exc:
                raise AssertionError(f"{name}, leaving the {hop}: {exc}") from exc
    check_aftermath(mixed)


def test_a_request_under_an_id_in_flight_is_refused_and_the_first_runs_on(mixed: LocalCluster) -> None:
    """Two clients, one id: the second is refused (SGLang's duplicate id), and its leaving touches nothing."""
    body = {"rid": "shared-id", "text": "mine", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=mixed.url, timeout=60) as client:
        with client.stream("POST", "/generate", json=body) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: {")
            second = client.post("/generate", json={**body, "stream": False})
            assert second.status_code == 400 and "Duplicate request ID" in second.json()["error"]["message"]
            leave(mixed.url, "/generate", {**body, "stream": False}, "half_close", [], 1)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}


def test_a_pd_client_that_leaves_is_aborted_on_both_nodes(pd: LocalCluster) -> None:
    engines = [node.engine.url for node in pd.nodes]
    for name, (path, body), num_sequences, how in PD_CASES:
        try:
            check_left(pd, pd.url, path, body, how, engines, num_sequences)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
    check_aftermath(pd)
