"""Prometheus metrics of the load balancer (``handoff_lb_*``), one registry per app."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from handoff.service.prometheus import CONTROL_BUCKETS, new_registry


class LBMetrics:
    def __init__(self) -> None:
        self.registry = new_registry()
        r = self.registry
        self.requests = Counter("handoff_lb_requests", "Requests answered by the LB, by route and status code.",
                                ["route", "code"], registry=r)
        self.fanout_seconds = Histogram("handoff_lb_fanout_seconds", "Duration of a control fan-out, by path.",
                                        ["path"], registry=r, buckets=CONTROL_BUCKETS)
        self.fanout_node_failures = Counter("handoff_lb_fanout_node_failures",
                                            "Nodes that failed a control fan-out, by path and reason.",
                                            ["path", "reason"], registry=r)
        self.node_healthy = Gauge("handoff_lb_node_healthy", "1 while a node answers its health checks.",
                                  ["node", "role"], registry=r)
        self.node_serving = Gauge("handoff_lb_node_serving", "1 while a node can take generation.",
                                  ["node", "role"], registry=r)
        self.node_inflight = Gauge("handoff_lb_node_inflight", "Generation requests the LB has in flight per node.",
                                   ["node", "role"], registry=r)
        self.generate_retries = Counter("handoff_lb_generate_retries",
                                        "Generation requests retried on another node after a refused connection "
                                        "(or none made within --connect-timeout).", registry=r)
        self.generate_not_serving_retries = Counter(
            "handoff_lb_generate_not_serving_retries",
            "Generation requests retried on another node after a node answered a 503 saying it does not serve "
            "(node_released, engine_unavailable, ...: it ran nothing).", registry=r)
        self.generate_overloaded_retries = Counter(
            "handoff_lb_generate_overloaded_retries",
            "Generation requests retried on another node after a node answered 503 overloaded (it holds as many "
            "bodies or connections as it may: it ran nothing, and stays in rotation).", registry=r)
        self.streams_cut = Counter("handoff_lb_streams_cut",
                                   "Generation streams a node failed after they started: the client got a 200 "
                                   "and an error event, so handoff_lb_requests_total counts them as 200.", registry=r)
        self.nodes = Gauge("handoff_lb_nodes", "Nodes in the membership, by role.", ["role"], registry=r)
