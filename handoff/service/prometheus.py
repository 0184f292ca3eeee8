"""The Prometheus registry of a process's metrics (the LB's, the sidecar's, the engine's): :func:`new_registry`,
:class:`CounterReadAtScrape` for a count a process keeps itself, and :func:`shared_exposition` for a registry whose
series grow with the peers (the LB's, with a node's)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from handoff.service.shared_run import SharedRun

# a control call's duration (a release, a resume, a weight update, a fan-out of them): from milliseconds (nothing
# to do) to an hour, the longest drain a release may wait (the sidecar's --max-drain-timeout, the LB's
# --max-control-timeout), so that a long call's quantiles stay readable instead of falling in +Inf
CONTROL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


def new_registry() -> CollectorRegistry:
    """A registry of the app's own, whose counters and histograms expose no ``*_created`` series.

    prometheus_client adds to every labelled counter and histogram a gauge of when it was first used
    (``handoff_lb_requests_created{route,code}``...): as many series again, which no dashboard reads. The switch
    is the library's, for the whole process; every process here exposes only its own metrics.
    """
    disable_created_metrics()
    return CollectorRegistry(auto_describe=True)


def shared_exposition(registry: CollectorRegistry) -> Callable[[], Awaitable[bytes]]:
    """``await render()``: ``registry``'s text exposition, rendered on a thread, one rendering shared by every scrape
    asked while it runs (:class:`SharedRun`). prometheus_client renders in Python, about 70 ms for the LB's series
    with 1024 members: on the event loop, clients scraping in a loop (``/metrics`` needs no token) held every other
    request behind whole renderings; on a thread the loop keeps its turns."""
    return SharedRun(lambda: asyncio.to_thread(generate_latest, registry))


class CounterReadAtScrape(Collector):
    """A counter whose value is read at scrape time from a count the process keeps (``Counter`` has no
    ``set_function``, and a ``Gauge`` of a count that only grows breaks Prometheus' typing: ``rate()`` over it is
    flagged, and an SRE cannot tell it from a level). Exposed as ``<name>_total`` of type counter; 0 until
    :meth:`read_from` names the count."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._read: Callable[[], float] = lambda: 0
        registry.register(self)

    def read_from(self, read: Callable[[], float]) -> None:
        """Read ``read()`` (a count that never goes down while the process lives) at each scrape."""
        self._read = read

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())
