"""Whole-cluster runs: LB + sidecars + engines as real processes on loopback."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from handoff.client import FanoutFailed, HandoffClient, HandoffError, ServiceUnavailable
from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.demo import run_demo
from tests.support.procs import wait_until
from tests.support.streams import GenerationClient

ALL = ["weights", "kv_cache", "cuda_graph", "workspace"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(num_mixed=2, weights_backup="disk")
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster):
    with HandoffClient(cluster.url, timeout=60) as c:
        yield c
        # leave every node resident, serving and on the same weights
        for node in cluster.nodes:
            if not node.engine.is_running():
                node.engine.start()
        wait_until(lambda: all(n["health"] == "healthy" for n in c.nodes()), timeout=30, what="nodes healthy")
        c.continue_generation()
        c.resume()


def test_demo_cycle(tmp_path: Path) -> None:
    """The README's main job end to end; every step asserts what it shows."""
    lines: list[str] = []
    assert run_demo(2, log_dir=tmp_path / "logs", say=lines.append) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "greedy outputs identical" in text and "greedy outputs changed" in text
    assert "502 named node0" in text and "all steps passed" in text


def test_demo_cycle_with_the_vl_model(tmp_path: Path) -> None:
    """``make demo MODEL=builtin:tiny-vl``: the same steps on VL nodes, and the image step before the last."""
    lines: list[str] = []
    assert run_demo(2, model="builtin:tiny-vl", log_dir=tmp_path / "logs", say=lines.append) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "== 7. images through the LB, release/resume of the VL nodes" in text
    assert "vision reservation per node released with workspace and restored; outputs identical" in text
    assert "== 8. a node fails a release" in text and "all steps passed" in text


class LoadClient(threading.Thread):
    """Sends generation requests (alternating stream / non-stream) until stopped; counts how each ended."""

    def __init__(self, url: str, index: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.index, self.stop = url, index, stop
        self.outcomes: list[str] = []

    def run(self) -> None:
        n = 0
        while not self.stop.is_set() and n < 500:
            n += 1
            body = {"text": f"client {self.index} request {n}", "stream": n % 2 == 0,
                    "sampling_params": {"max_new_tokens": 40, "temperature": 0.7, "ignore_eos": True}}
            probe = GenerationClient(self.url + "/generate", body, timeout=30)
            probe.run()  # in this thread
            self.outcomes.append(classify(probe.result))


def classify(result) -> str:
    if result.error is not None:
        return f"lost: {result.error}"
    if result.status == 503:
        return "refused" if result.retry_after else "lost: 503 without Retry-After"
    if result.status != 200:
        return f"lost: status {result.status} {result.body}"
    if result.events:
        if not result.saw_done:
            return "lost: stream without [DONE]"
        if any("error" in e for e in result.events):
            return "lost: error event"
    reason = result.finish_reason
    if reason == "length" and result.num_tokens == 40:
        return "completed"
    if reason == "abort" and result.num_tokens < 40:
        return "aborted"
    return f"lost: finish {reason} with {result.num_tokens} tokens"


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_release_under_steady_load_loses_nothing(cluster: LocalCluster, client: HandoffClient, mode: str) -> None:
    stop = threading.Event()
    load = [LoadClient(cluster.url, i, stop) for i in range(6)]
    for t in load:
        t.start()

    def count(outcome: str) -> int:
        return sum(t.outcomes.count(outcome) for t in load)

    try:
        wait_until(lambda: sum(len(t.outcomes) for t in load) >= 12, timeout=30, what="load running")
        for _ in range(3):
            result = client.release(mode=mode, stage_to_cpu=True)
            assert result.total == 2
            refused = count("refused")
            wait_until(lambda: count("refused") > refused, timeout=30, what="a request refused while released")
            client.resume()
            wait_until(lambda: any(n["in_flight"] for n in client.nodes()), timeout=30, what="the load served again")
    finally:
        stop.set()
        for t in load:
            t.join(60)
    outcomes = [o for t in load for o in t.outcomes]
    lost = [o for o in outcomes if o.startswith("lost")]
    assert not lost, lost[:5]
    assert outcomes.count("completed") > 10
    assert outcomes.count("refused") > 0  # some arrived while the nodes were released
    if mode == "abort":
        assert all(o in ("completed", "aborted", "refused") for o in outcomes)
    else:
        assert "aborted" not in outcomes


def test_node_killed_during_a_release(cluster: LocalCluster, client: HandoffClient) -> None:
    victim, other = cluster.nodes
    streams = [GenerationClient(n.url + "/generate", {"text": "long", "stream": True, "sampling_params": {
        "max_new_tokens": 3000, "ignore_eos": True}}) for n in (victim, other)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started_streaming.wait(10)
    release = {}

    def run_release() -> None:
        try:
            client.release(mode="wait", drain_timeout=30, timeout=60)
        except FanoutFailed as exc:
            release["error"] = exc

    t = threading.Thread(target=run_release)
    t.start()
    wait_until(lambda: httpx.get(victim.url + "/memory_occupation").json()["admission"] == "closed", timeout=10,
               what="the release to start draining")
    victim.engine.kill()
    httpx.post(other.url + "/abort_request", json={"abort_all": True})  # let the other node's drain end
    t.join(60)
    exc = release["error"]
    assert exc.failed_nodes == [victim.url]
    assert [s.node for s in exc.succeeded] == [other.url]
    assert streams[0].finish(10).events[-1]["error"]["type"] == "engine_unavailable"
    victim.engine.start()
    wait_until(lambda: httpx.get(victim.url + "/ready").status_code == 200, timeout=30, what="victim back")
    retry = client.release(mode="wait")
    bodies = retry.bodies()
    assert bodies[victim.url]["released"] == ALL
    assert bodies[other.url]["released"] == [] and bodies[other.url]["already_released"] == ALL


def test_client_errors_are_typed(cluster: LocalCluster, client: HandoffClient) -> None:
    client.release(tags=["kv_cache"])
    with pytest.raises(ServiceUnavailable) as info:
        client.generate("x")
    assert info.value.type == "no_available_node" and info.value.retry_after is not None
    with pytest.raises(HandoffError) as bad:
        client.release(tags=["vram"])
    assert bad.value.status == 502 or bad.value.status == 400
    client.resume()
    events = list(client.stream_generate("streamed", sampling_params={"max_new_tokens": 5, "ignore_eos": True}))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_every_generation_form_is_returned_in_the_shape_the_client_checks(client: HandoffClient) -> None:
    """The client refuses a 2xx not of the call's shape (``invalid_response``): the LB's real answers, through
    sidecars and engines, are of it for every form of ``/generate`` (an object for one prompt, a list for a
    batch or ``n`` > 1), and ``memory_occupation`` is an object."""
    params = {"max_new_tokens": 2}
    assert isinstance(client.generate("one", sampling_params=params), dict)
    assert isinstance(client.generate(input_ids=[5, 6], sampling_params=params), dict)
    assert len(client.generate(["a", "b", "c"], sampling_params=params)) == 3
    assert len(client.generate(input_ids=[[5], [6]], sampling_params=params)) == 2
    assert len(client.generate("one", sampling_params={**params, "n": 2})) == 2
    assert len(client.generate(["a", "b"], sampling_params={**params, "n": 2})) == 4
    events = list(client.stream_generate(["a", "b"], sampling_params=params))
    assert {event["index"] for event in events} == {0, 1}
    assert isinstance(client.memory_occupation(), dict)


def test_tag_lists_follow_sglang(cluster: LocalCluster, client: HandoffClient) -> None:
    """``tags: []`` is no tag on every node (nothing released, nothing resumed); ``null`` is every tag."""
    nothing = client.release(tags=[])
    assert [body["released"] for body in nothing.bodies().values()] == [[], []]
    assert all(node["serving"] for node in client.nodes())
    resumed = client.resume()  # nothing released: every tag is reported as already resident
    assert [body["already_resident"] for body in resumed.bodies().values()] == [ALL, ALL]
    client.release(tags=["kv_cache"])
    assert [body["resumed"] for body in client.resume(tags=[]).bodies().values()] == [[], []]
    assert not any(node["serving"] for node in client.nodes())
    assert [body["resumed"] for body in client.resume().bodies().values()] == [["kv_cache", "workspace"]] * 2


def test_a_drain_ends_in_time_to_answer_the_lb(cluster: LocalCluster, client: HandoffClient) -> None:
    """A release under a short ?timeout with a stream running: each node's drain ends before the LB stops
    waiting, so the node answers 409 drain_timeout (nothing released, still serving) instead of being
    reported as timed out while it drains."""
    stream = GenerationClient(cluster.nodes[0].url + "/generate", {"text": "long", "stream": True, "sampling_params": {
        "max_new_tokens": 3000, "ignore_eos": True}})
    stream.start()
    assert stream.started_streaming.wait(10)
    try:
        with pytest.raises(FanoutFailed) as info:
            client.release(mode="wait", timeout=3)
        [failure] = info.value.failures
        assert failure["node"] == cluster.nodes[0].url and failure["status"] == 409, failure
        assert "drain_timeout" in failure["detail"]
        assert [s.node for s in info.value.succeeded] == [cluster.nodes[1].url]
    finally:
        httpx.post(cluster.nodes[0].url + "/abort_request", json={"abort_all": True})
    assert stream.finish(10).finish_reason == "abort"
