"""Prometheus metrics of the sidecar (``handoff_node_*``), one registry per app.

The sidecar's ``/metrics`` also relays the engine's own text (``handoff_engine_*``),
because in Kubernetes the engine listens on localhost only.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from handoff.service.prometheus import CONTROL_BUCKETS, new_registry


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = new_registry()
        r = self.registry
        self.memory_bytes = Gauge("handoff_node_memory_bytes", "Bytes of each memory tag, by state.",
                                  ["tag", "state"], registry=r)
        self.serving = Gauge("handoff_node_serving", "1 while the node serves generation.", registry=r)
        self.engine_up = Gauge("handoff_node_engine_up", "1 while the engine answers.", registry=r)
        self.engine_health_misses = Counter("handoff_node_engine_health_misses",
                                            "Health probes the engine did not answer in time.", registry=r)
        self.release_seconds = Histogram("handoff_node_release_seconds", "Duration of a release, drain included.",
                                         registry=r, buckets=CONTROL_BUCKETS)
        self.resume_seconds = Histogram("handoff_node_resume_seconds", "Duration of a resume.",
                                        registry=r, buckets=CONTROL_BUCKETS)
        self.inflight_requests = Gauge("handoff_node_inflight_requests", "Generation requests in flight.",
                                       registry=r)
        self.held_requests = Gauge("handoff_node_held_requests", "Generation requests held while not serving.",
                                   registry=r)
        self.drained_requests = Counter("handoff_node_drained_requests", "Requests waited for by a drain.",
                                        registry=r)
        self.aborted_requests = Counter("handoff_node_aborted_requests", "Requests aborted by a drain.",
                                        registry=r)
        self.rejected_requests = Counter("handoff_node_rejected_requests",
                                         "Generation requests answered 503, by reason.", ["reason"], registry=r)
        self.control_calls = Counter("handoff_node_control_calls",
                                     "Control and weight calls answered, by path and the status code the caller got.",
                                     ["path", "code"], registry=r)
        self.requests = Counter("handoff_node_requests",
                                "Generation requests answered, by route and the status code the client got.",
                                ["route", "code"], registry=r)
