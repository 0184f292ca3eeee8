"""The Prometheus registry of a process's metrics (the LB's, the sidecar's, the engine's): :func:`new_registry`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, disable_created_metrics


def new_registry() -> CollectorRegistry:
    """A registry of the app's own, whose counters and histograms expose no ``*_created`` series.

    prometheus_client adds to every labelled counter and histogram a gauge of when it was first used
    (``handoff_lb_requests_created{route,code}``...): as many series again, which no dashboard reads. The switch
    is the library's, for the whole process; every process here exposes only its own metrics.
    """
    disable_created_metrics()
    return CollectorRegistry(auto_describe=True)
