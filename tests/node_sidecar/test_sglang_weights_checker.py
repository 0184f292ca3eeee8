"""SGLang's /weights_checker relayed by the sidecar to SGLang (the stand-in, ``tests/support/sglang_fake.py``):
SGLang serves whatever a ``reset_tensors`` leaves in its weights, so the sidecar must stop serving whenever one
may have run, answered or not."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.node_sidecar.test_sglang_adapter import Node, fault_next
from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def node(proc_log_dir: Path) -> Iterator[Node]:
    made = Node(proc_log_dir, "--enable-memory-saver", sidecar_flags=("--control-timeout", "1.5"))
    yield made
    made.stop()


def _refused(node: Node) -> None:
    r = node.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503 and r.json()["error"]["type"] == "weights_not_loaded", r.text
    assert "generate" not in node.fake_state()["calls"]


def test_a_reset_stops_serving_and_a_checksum_is_sglangs_answer(node: Node) -> None:
    r = httpx.get(node.sidecar.url + "/weights_checker", timeout=30)
    assert r.status_code == 200 and r.json()["per_engine_checksum"] == "0" * 64, r.text
    assert node.post("/weights_checker", {"action": "reset_tensors"}).json() == {"success": True,
                                                                                 "message": "Success."}
    view = node.occupation()
    assert view["weights_valid"] is False and view["serving"] is False
    _refused(node)
    node.assert_fake_alive()


@pytest.mark.parametrize("fault", [{"delay_s": 3}, {"status": 500, "raw": "Internal Server Error"},
                                   {"status": 400, "raw": '{"success": false, "message": "CUDA out of memory"}',
                                    "content_type": "application/json"}])
def test_a_reset_that_may_have_run_stops_serving(node: Node, fault: dict) -> None:
    """A ``reset_tensors`` SGLang got but answered after the sidecar's control timeout, answered with a 5xx (a
    proxy, a crash in the handler), or failed part way (SGLang's 400: some weights already random) left the
    sidecar serving SGLang's random weights (found by review): only a 200 marked them garbage."""
    fault_next(node, "/weights_checker", **fault)
    r = node.post("/weights_checker", {"action": "reset_tensors"})
    assert r.status_code != 200, r.text
    wait_until(lambda: "weights_checker reset_tensors" in node.fake_state()["calls"] or "delay_s" not in fault,
               timeout=10, what="the reset reached SGLang")
    view = node.occupation()
    assert view["weights_valid"] is False and view["serving"] is False, view
    _refused(node)
    node.assert_fake_alive()


def test_an_lbs_checksum_of_sglang_nodes_with_eight_tp_ranks(proc_log_dir: Path) -> None:
    """SGLang answers a checksum with one rank per TP rank, each naming every tensor: a 7B model on 8 ranks is
    ~160 KB. The LB read each node's answer to 64 KiB and failed every node as "answer longer than 65536 bytes"
    (found by review): NeMo-RL's ``check_weights`` through the LB could never succeed on such nodes."""
    node = Node(proc_log_dir, "--tp-size", "8")
    lb = ServerProcess("lb", ["--node", node.sidecar.url, "--health-interval", "0.2", "--health-timeout", "1"],
                       log_dir=proc_log_dir, name="lb").start()
    try:
        wait_until(lambda: httpx.get(lb.url + "/nodes", timeout=5).json()["nodes"][0]["routable"], timeout=20,
                   what="the node routable")
        direct = httpx.get(node.sidecar.url + "/weights_checker", timeout=30)
        assert direct.status_code == 200 and len(direct.content) > 100_000
        r = httpx.get(lb.url + "/weights_checker", timeout=30)
        assert r.status_code == 200, r.text[:2000]
        assert r.json()["results"][0]["body"] == direct.json()
    finally:
        lb.stop()
        node.stop()
