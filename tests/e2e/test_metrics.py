"""Every ``/metrics`` (LB, sidecar, engine) read by Prometheus's reference parser after hostile traffic: label
values from bounded sets only, no series left for a node that left, none for a dead engine's memory."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from handoff.cluster.local import ClusterSpec, LocalCluster
from lb.config import LBConfig
from node_sidecar.config import SidecarConfig
from tests.support.procs import ServerProcess, wait_until
from tests.support.weights import save_tiny, tiny_weights

pytestmark = pytest.mark.timeout(240)

Series = set[tuple[str, tuple[tuple[str, str], ...]]]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
# what Prometheus sends: OpenMetrics preferred, the text format accepted
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
# units Prometheus' naming rules replace by base units (_seconds, _bytes) or ratios
NON_BASE_UNITS = re.compile(r"_(ns|us|ms|nanoseconds|microseconds|milliseconds|minutes|hours|days|kb|mb|gb|kib|mib|"
                            r"gib|kilobytes|megabytes|gigabytes|bits|percent)(_|$)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(ClusterSpec(num_mixed=1), tmp_path_factory.mktemp("metrics")) as c:
        yield c


def scrape(url: str) -> Series:
    """Every sample of ``url``'s ``/metrics`` as Prometheus's reference parser reads it (raises if it cannot)."""
    answer = httpx.get(url + "/metrics", timeout=30)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items())))
            for family in text_string_to_metric_families(answer.content.decode("utf-8"))
            for sample in family.samples}


def families_as_prometheus_reads(url: str) -> list[Metric]:
    """``url``'s ``/metrics`` asked for as Prometheus asks, read by the parser of the format it answered in."""
    answer = httpx.get(url + "/metrics", headers={"accept": PROMETHEUS_ACCEPT}, timeout=30)
    assert answer.status_code == 200, url
    content_type = answer.headers["content-type"]
    if content_type.startswith("application/openmetrics-text"):
        return list(openmetrics_families(answer.text))
    assert content_type.startswith("text/plain;"), content_type
    return list(text_string_to_metric_families(answer.text))


def exposed_name(family: Metric) -> str:
    """The name a query uses: a counter's samples carry ``_total`` (the parser drops it from the family's)."""
    return family.name + "_total" if family.type == "counter" and not family.name.endswith("_total") else family.name


def documented_metrics() -> dict[str, str]:
    """``name -> type`` of docs/operations.md's metrics table."""
    section = DOCS.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, str] = {}
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if row.startswith("| `handoff_") and len(cells) >= 2:
            documented |= {name: cells[1] for name in re.findall(r"`(handoff_\w+)`", cells[0])}
    return documented


def hostile_round(http: httpx.Client, urls: list[str], mark: str) -> None:
    """Requests whose paths, models, versions, tags and bodies carry ``mark`` and characters a label must escape."""
    odd = f'{mark}"\\\n\u00e9'
    for url in urls:
        for method in ("GET", "POST", "DELETE", "PUT"):
            http.request(method, f"{url}/{mark}%22%0A%5C%FF")
            http.request(method, f"{url}/v1/models/{mark}%22")
        http.post(url + "/generate", json={"text": "x", "model": odd, "sampling_params": {"max_new_tokens": 1}})
        http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "model": odd})
        http.post(url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1, "model": "\\udc80"}')
        http.post(url + "/generate", content=b'\xff\xfe{"text": "' + mark.encode() + b'"}')
        http.post(url + "/update_weight_version", json={"new_version": odd})
        http.post(url + "/update_weights_from_disk", json={"model_path": f"/nowhere/{odd}"})
        http.post(url + "/release_memory_occupation", json={"tags": [odd]})
        http.post(url + "/abort_request", json={"rid": odd})


def test_every_endpoint_parses_and_hostile_traffic_adds_no_series(cluster: LocalCluster) -> None:
    """Label values come from bounded sets: a second round of requests with other paths, models, versions and
    tags adds no series to any endpoint (each counter's ``*_created`` twin included: there are none)."""
    node = cluster.nodes[0]
    urls = [cluster.url, node.url, node.engine.url]
    with httpx.Client(timeout=30) as http:
        hostile_round(http, urls, "first")
        for url in urls:
            scrape(url)  # the LB counts its own scrapes: that series is there from now on
        after_first = {url: scrape(url) for url in urls}
        hostile_round(http, urls, "second")
        for url in urls:
            assert scrape(url) == after_first[url], url
    for url, series in after_first.items():
        assert not [name for name, _ in series if name.endswith("_created")], url
        values = {value for _, labels in series for _, value in labels}
        assert not [v for v in values if "first" in v or '"' in v or "\n" in v], (url, values)


def check_conventions(family: Metric) -> None:
    """Prometheus' naming rules for one family: ``_total`` only on counters, base units, sane buckets."""
    name = exposed_name(family)
    assert name.startswith("handoff_"), name
    assert not NON_BASE_UNITS.search(name), f"{name}: not in a base unit"
    if family.type == "counter":
        assert name.endswith("_total") and all(s.name == name for s in family.samples), name
        assert all(s.value >= 0 for s in family.samples), name
        return
    assert not name.endswith("_total"), f"{name} is a {family.type}: _total is the counters' suffix"
    if family.type == "histogram":
        assert name.endswith("_seconds"), f"{name}: a histogram of durations in seconds"
        bounds: dict[tuple[tuple[str, str], ...], list[float]] = {}
        for sample in family.samples:
            if sample.name == name + "_bucket":
                series = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                bounds.setdefault(series, []).append(float(sample.labels["le"]))
        for les in bounds.values():  # a labelled histogram nothing observed yet has none
            assert les[-1] == math.inf and les == sorted(set(les)), (name, les)
            assert len(les) >= 10 and les[0] <= 0.01 and les[-2] >= 5, (name, les)


def test_names_types_and_docs_follow_prometheus_conventions(cluster: LocalCluster) -> None:
    """Every family of the three processes, asked for as Prometheus asks, parses and follows the naming rules
    (``handoff_engine_kv_slots_total`` was a gauge; ``handoff_engine_prefix_hit_tokens`` a gauge counting since
    start), and docs/operations.md's table names exactly the families exposed, with their types."""
    node = cluster.nodes[0]
    with httpx.Client(base_url=cluster.url, timeout=60) as http:  # a step of each kind, a fan-out
        http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).raise_for_status()
        http.post("/flush_cache").raise_for_status()
    exposed: dict[str, str] = {}
    for url in (cluster.url, node.url, node.engine.url):
        for family in families_as_prometheus_reads(url):
            check_conventions(family)
            exposed[exposed_name(family)] = family.type
    assert documented_metrics() == exposed


def largest_finite_bucket(family: Metric) -> float:
    return max(float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf")


def test_control_durations_have_buckets_as_long_as_a_call_may_take(cluster: LocalCluster, tmp_path: Path) -> None:
    """A release waits up to its ``drain_timeout`` (the sidecar's ``--max-drain-timeout``, an hour by default)
    and a fan-out up to the LB's ``--max-control-timeout``: the buckets stopped at 120 s (the LB's at 300 s, a
    weight update's at 300 s where the LB gives one 600), so every release that drained longer fell in ``+Inf``
    and its quantiles read as the last bucket."""
    checkpoint = save_tiny(tmp_path / "tiny", tiny_weights(0))  # the weights the engine started with
    with httpx.Client(base_url=cluster.url, timeout=60) as http:  # labelled histograms have buckets once used
        http.post("/flush_cache").raise_for_status()
        http.post("/update_weights_from_disk", json={"model_path": str(checkpoint)}).raise_for_status()
    longest = {"handoff_lb_fanout_seconds": LBConfig.max_control_timeout_s,
               "handoff_node_release_seconds": SidecarConfig.max_drain_timeout,
               "handoff_node_resume_seconds": SidecarConfig.max_drain_timeout,
               "handoff_engine_release_seconds": SidecarConfig.control_timeout,
               "handoff_engine_resume_seconds": SidecarConfig.control_timeout,
               "handoff_engine_weight_update_seconds": LBConfig.weight_sync_timeout_s}
    found = {family.name: largest_finite_bucket(family)
             for url in (cluster.url, cluster.nodes[0].url, cluster.nodes[0].engine.url)
             for family in families_as_prometheus_reads(url) if family.name in longest}
    assert found.keys() == longest.keys()
    assert {name: bound for name, bound in found.items() if bound < longest[name]} == {}


def latency_counts(engine_url: str) -> dict[str, tuple[float, float]]:
    """``name -> (count, sum)`` of the engine's two latency histograms."""
    found: dict[str, dict[str, float]] = {}
    for family in families_as_prometheus_reads(engine_url):
        for sample in family.samples:
            if sample.name.endswith(("_count", "_sum")) and family.name in (
                    "handoff_engine_time_to_first_token_seconds", "handoff_engine_request_seconds"):
                found.setdefault(family.name, {})[sample.name.rsplit("_", 1)[1]] = sample.value
    return {name: (values["count"], values["sum"]) for name, values in found.items()}


def test_the_engine_reports_time_to_first_token_and_request_latency(cluster: LocalCluster) -> None:
    """No process said how long a generation took (only each step's time): an SRE had no latency to set an SLO
    on. The engine observes each request's time to its first token and to its end, from its arrival."""
    engine_url = cluster.nodes[0].engine.url
    before = latency_counts(engine_url)
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
                  ).raise_for_status()
        http.post("/generate", json={"text": "y", "stream": True, "sampling_params": {"max_new_tokens": 4}}
                  ).raise_for_status()
    after = latency_counts(engine_url)
    first, whole = "handoff_engine_time_to_first_token_seconds", "handoff_engine_request_seconds"
    assert after[first][0] - before[first][0] == 2 and after[whole][0] - before[whole][0] == 2
    assert 0 < after[first][1] - before[first][1] <= after[whole][1] - before[whole][1]


def test_the_documented_alerts_query_only_documented_metrics() -> None:
    """docs/operations.md's alert rules name metrics of its table (which the test above keeps equal to what the
    processes expose): a renamed metric cannot leave a rule that never fires."""
    section = DOCS.read_text().split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    queried = {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"\bhandoff_\w+", section)}
    assert len(queried) >= 5 and queried <= documented_metrics().keys(), queried - documented_metrics().keys()


def test_a_removed_node_leaves_no_series(cluster: LocalCluster, proc_log_dir: Path) -> None:
    """Nodes added through ``POST /nodes`` and removed again leave no ``handoff_lb_node_*`` series behind."""
    before = scrape(cluster.url)
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        for port in range(1, 41):
            http.post("/nodes", json={"url": f"http://127.0.0.3:{port}"}).raise_for_status()
        added = {labels for name, labels in scrape(cluster.url) - before if name.startswith("handoff_lb_node_")}
        assert len(added) == 40
        for port in range(1, 41):
            http.delete("/nodes", params={"url": f"http://127.0.0.3:{port}"}).raise_for_status()
    def per_node(series: Series) -> Series:
        return {(name, labels) for name, labels in series if name.startswith("handoff_lb_node")}

    assert per_node(scrape(cluster.url)) == per_node(before) != set()


def memory_series(sidecar: ServerProcess) -> dict[tuple[str, str], float]:
    answer = httpx.get(sidecar.url + "/metrics", timeout=30).text
    return {(sample.labels["tag"], sample.labels["state"]): sample.value
            for family in text_string_to_metric_families(answer) if family.name == "handoff_node_memory_bytes"
            for sample in family.samples}


def test_a_dead_engines_memory_is_not_reported(proc_log_dir: Path) -> None:
    """``handoff_node_memory_bytes`` kept the last bytes read while the engine was dead (summed by the memory
    dashboard as if still held); it has no series while the engine's state is unknown, as ``/memory_occupation``
    says ``unknown``, and the restarted engine's once it is read again."""
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver"],
                           log_dir=proc_log_dir, name="metrics-engine").start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2"],
                            log_dir=proc_log_dir, name="metrics-sidecar").start()
    try:
        wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="serving")
        assert httpx.post(sidecar.url + "/release_memory_occupation", json={"tags": ["kv_cache"]},
                          timeout=30).status_code == 200
        series = memory_series(sidecar)
        assert series[("weights", "resident")] > 0 and series[("kv_cache", "released")] > 0
        engine.kill()
        wait_until(lambda: httpx.get(sidecar.url + "/memory_occupation").json()["engine_reachable"] is False,
                   timeout=10, what="the engine seen down")
        assert memory_series(sidecar) == {}
        engine.start()  # same port; the sidecar releases kv_cache again on the fresh engine
        wait_until(lambda: memory_series(sidecar).get(("kv_cache", "released"), 0) > 0, timeout=20,
                   what="the fresh engine's memory read")
        assert memory_series(sidecar)[("weights", "resident")] > 0
    finally:
        sidecar.stop()
        engine.stop()
