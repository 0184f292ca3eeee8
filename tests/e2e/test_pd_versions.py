"""A PD cluster (real LB, sidecars, engines) and pinned weight versions: both nodes of a pair must serve the
pinned version, and a client's pin never takes a node out of rotation for everyone else (found by review:
one request pinned to a version nobody served made every PD node unroutable until its next health check)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from handoff.cluster.local import ClusterSpec, LocalCluster
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(180)
BODY = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=0, num_prefill=1, num_decode=1, lb_args=("--health-interval", "30"))
    with LocalCluster(spec, tmp_path_factory.mktemp("pd_versions")) as c:
        yield c


def nodes(http: httpx.Client) -> list[dict]:
    return http.get("/nodes").json()["nodes"]


def test_a_pin_nobody_serves_is_refused_at_the_lb_and_changes_no_node(cluster: LocalCluster) -> None:
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        wait_until(lambda: all(n["routable"] for n in nodes(http)), timeout=60, what="both nodes routable")
        assert http.post("/generate", json=BODY).status_code == 200
        r = http.post("/generate", json=BODY, headers={"X-Weight-Version": "bogus"})
        assert r.status_code == 503 and "serves weight_version 'bogus'" in r.json()["error"]["message"], r.text
        assert all(n["routable"] for n in nodes(http))  # the health interval is 30 s: nothing was marked
        assert http.post("/generate", json=BODY).status_code == 200


def test_a_pair_serves_the_pinned_version_on_both_sides(cluster: LocalCluster) -> None:
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        wait_until(lambda: all(n["routable"] for n in nodes(http)), timeout=60, what="both nodes routable")
        prefill = next(n["url"] for n in nodes(http) if n["role"] == "prefill")
        assert http.post("/update_weight_version", params={"role": "prefill"},
                         json={"new_version": "v2"}).status_code == 200
        try:
            wait_until(lambda: {n["role"]: n["weight_version"] for n in nodes(http)} == {
                "prefill": "v2", "decode": "default"}, timeout=10, what="the LB's view of the versions")
            r = http.post("/generate", json=BODY, headers={"X-Weight-Version": "v2"})
            assert r.status_code == 503 and "no decode node serves weight_version 'v2'" in r.text, r.text
            assert all(n["routable"] for n in nodes(http)), nodes(http)
        finally:
            assert httpx.post(prefill + "/update_weight_version", json={"new_version": "default"},
                              timeout=30).status_code == 200
