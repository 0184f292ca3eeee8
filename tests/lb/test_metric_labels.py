"""The LB's ``/metrics`` against a node that answers random error types, messages and bodies: label values
come from the LB's own bounded sets, so a hostile node cannot grow the series."""

from __future__ import annotations

import random
import re
import string

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.lb.behaviours import drop, reply
from tests.lb.fakes import FakeCluster, FakeNode
from tests.lb.lbproc import LB, set_members

pytestmark = pytest.mark.timeout(60)

ODD = '"\\\n\u00e9{}='
CONTROL_PATHS = ("/release_memory_occupation", "/resume_memory_occupation", "/flush_cache", "/pause_generation")


def series(lb: LB) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    text = httpx.get(lb.url + "/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items())))
            for family in text_string_to_metric_families(text) for sample in family.samples}


def misbehave(node: FakeNode, rng: random.Random) -> None:
    """Every path of ``node`` answers an error type, message and success flag never seen before."""
    def junk() -> str:
        return "".join(rng.choice(string.printable) for _ in range(12)) + ODD

    error = {"error": {"type": junk(), "message": junk()}, "type": junk(), "success": False, "message": junk()}
    for path in CONTROL_PATHS:
        node.handlers[path] = rng.choice([reply(503, error), reply(200, error), reply(400, error), drop(),
                                          reply(200, junk().encode(), content_type=junk())])
    node.handlers["/generate"] = reply(rng.choice([400, 500, 503]), error)


def test_a_node_answering_random_error_types_adds_no_series(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """Label values are the LB's words (paths it serves, its failure reasons, status codes), never a node's."""
    (node,) = module_fakes.start(1)
    set_members(shared_lb, node.url)
    rng = random.Random(7)
    for _ in range(20):
        misbehave(node, rng)
        for path in CONTROL_PATHS:
            shared_lb.http.post(path, json={})
        shared_lb.http.post("/generate", json={"text": "x"})
    scraped = series(shared_lb)
    assert ("handoff_lb_fanout_node_failures_total", (("path", "/flush_cache"), ("reason", "http_status"))) in scraped
    values = {value for name, labels in scraped for key, value in labels if key not in ("node", "le")}
    assert all(re.fullmatch(r"[a-z0-9_/]+", value) for value in values), values
    reasons = {value for _, labels in scraped for key, value in labels if key == "reason"}
    assert len(reasons) <= 10, reasons
