"""Prometheus metrics of the engine (``handoff_engine_*``), one registry per app."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from handoff.service.prometheus import CONTROL_BUCKETS, CounterReadAtScrape, new_registry

if TYPE_CHECKING:
    from node_engine.scheduler import Scheduler

# a generation: milliseconds to the first token of a short prompt, up to the sidecar's --generate-timeout (an hour)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = new_registry()
        r = self.registry
        self.requests = Counter("handoff_engine_requests", "Generation requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected_requests = Counter("handoff_engine_rejected_requests",
                                         "Generation requests refused before running, by error type.",
                                         ["reason"], registry=r)
        self.prompt_tokens = Counter("handoff_engine_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generated_tokens = Counter("handoff_engine_generated_tokens", "Tokens generated.", registry=r)
        self.running_requests = Gauge("handoff_engine_running_requests", "Requests in the running batch.",
                                      registry=r)
        self.queued_requests = Gauge("handoff_engine_queued_requests", "Requests waiting to be scheduled.",
                                     registry=r)
        self.kv_slots_used = Gauge("handoff_engine_kv_slots_used", "KV token slots in use (requests and cache).",
                                   registry=r)
        self.cached_tokens = Gauge("handoff_engine_cached_tokens",
                                   "Tokens whose KV the prefix cache keeps for reuse.", registry=r)
        self.prefix_hit_tokens = CounterReadAtScrape(
            "handoff_engine_prefix_hit_tokens", "Prompt tokens taken from the prefix cache instead of computed.",
            registry=r)
        # not ..._total: that suffix is the counters' (Prometheus' naming rules); a gauge of it reads as a count
        self.kv_slots = Gauge("handoff_engine_kv_slots", "KV token slots in the pool.", registry=r)
        self.decode_graphs_compiled = Gauge(
            "handoff_engine_decode_graphs_compiled",
            "Decode graphs compiled by torch.compile (--enable-torch-compile): 1 after start, 0 without.", registry=r)
        self.memory_bytes = Gauge("handoff_engine_memory_bytes", "Bytes of each memory tag, by state.",
                                  ["tag", "state"], registry=r)
        self.step_seconds = Histogram("handoff_engine_step_seconds", "Duration of one scheduler step.",
                                      ["kind"], registry=r,
                                      buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self.release_seconds = Histogram("handoff_engine_release_seconds", "Duration of a memory release.",
                                         registry=r, buckets=CONTROL_BUCKETS)
        self.resume_seconds = Histogram("handoff_engine_resume_seconds", "Duration of a memory resume.",
                                        registry=r, buckets=CONTROL_BUCKETS)
        self.time_to_first_token_seconds = Histogram(
            "handoff_engine_time_to_first_token_seconds", "From a generation request's arrival to its first token "
            "(queueing and prefill).", registry=r, buckets=_LATENCY_BUCKETS)
        self.request_seconds = Histogram(
            "handoff_engine_request_seconds", "From a generation request's arrival to its end, for requests that "
            "finished (stop or length).", registry=r, buckets=_LATENCY_BUCKETS)
        self.weight_update_seconds = Histogram(
            "handoff_engine_weight_update_seconds", "Duration of a weight update, by source (disk, tensor, "
            "distributed).", ["source"], registry=r, buckets=CONTROL_BUCKETS)

    def read_queues_from(self, scheduler: "Scheduler") -> None:
        """Have the queue and KV gauges read ``scheduler`` when scraped, not be set on every step.

        The engine thread changes these values every step; reading them at scrape time
        (plain ints and list lengths) costs the step nothing.
        """
        self.running_requests.set_function(lambda: len(scheduler.running))
        self.queued_requests.set_function(lambda: len(scheduler.waiting))
        self.kv_slots_used.set_function(lambda: scheduler.slots.num_used)
        self.cached_tokens.set_function(lambda: 0 if scheduler.cache is None else scheduler.cache.num_cached_tokens)
        self.prefix_hit_tokens.read_from(lambda: scheduler.num_prefix_hit_tokens)

