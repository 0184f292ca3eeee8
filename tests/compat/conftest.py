"""One cluster (LB + 2 nodes) for every framework's sequence, and a reference engine loaded from a checkpoint
of the weights the sequences push. Each test leaves the cluster serving the original weights, version
``default``, nothing released, nothing paused, no weight group."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.weight_sync import serialize_named_tensors
from tests.support.procs import ServerProcess, wait_until
from tests.support.weights import greedy, save_tiny, tiny_weights

__all__ = ["assert_cluster_serves", "greedy"]


@pytest.fixture(scope="package")
def weights() -> dict[str, dict[str, torch.Tensor]]:
    return {"old": tiny_weights(0), "new": tiny_weights(21)}


@pytest.fixture(scope="package")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, weights) -> dict[str, Path]:
    return {name: save_tiny(tmp_path_factory.mktemp(f"ckpt-{name}"), weights[name]) for name in ("old", "new")}


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=2, lb_args=("--health-interval", "0.2", "--health-timeout", "1"),
                       sidecar_args=("--engine-poll-interval", "0.2"), engine_args=("--weight-sync-timeout", "30"))
    with LocalCluster(spec, tmp_path_factory.mktemp("compat")) as c:
        yield c


@pytest.fixture(scope="package")
def reference(tmp_path_factory: pytest.TempPathFactory, checkpoints) -> Iterator[str]:
    """An engine loaded from the checkpoint of the new weights: what every node must answer after a push."""
    proc = ServerProcess("node_engine", ["--model-path", str(checkpoints["new"])],
                         log_dir=tmp_path_factory.mktemp("reference"))
    proc.start()
    yield proc.url
    proc.stop()


@pytest.fixture
def lb(cluster: LocalCluster, weights) -> Iterator[str]:
    yield cluster.url
    with httpx.Client(base_url=cluster.url, timeout=120) as c:
        c.post("/continue_generation", json={})
        c.post("/resume_memory_occupation", json={})
        r = c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors(weights["old"].items())],
            "weight_version": "default"})
        assert r.status_code == 200, r.text
        wait_until(lambda: all(n["routable"] for n in c.get("/nodes").json()["nodes"]), timeout=30,
                   what="every node serving")


def assert_cluster_serves(cluster: LocalCluster, reference: str, version: str | None) -> None:
    """Every node serves what the reference engine does; the LB reports one version (if one is expected)."""
    expected = greedy(reference)
    for node in cluster.nodes:
        assert greedy(node.url) == expected
    assert greedy(cluster.url) == expected
    versions = httpx.get(cluster.url + "/get_weight_version", timeout=30).json()
    assert versions["consistent"] is True
    if version is not None:
        assert versions["weight_version"] == version
    assert all(n["routable"] for n in httpx.get(cluster.url + "/nodes", timeout=30).json()["nodes"])


@pytest.fixture(scope="package")
def lb_url(cluster: LocalCluster) -> str:
    return cluster.url


@pytest.fixture
def http(cluster: LocalCluster) -> Iterator[httpx.Client]:
    """A client of the LB for the generation tests (they leave weights, memory and pauses as they found them)."""
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        yield client
