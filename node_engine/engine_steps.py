"""The engine thread's work on requests: admit one (or answer it at once: memory released, weights invalid, nothing
to generate), abort, and run one step: scheduled, run on the device, counted, its outputs handed to the outbox.

A step that raises fails that step's requests (``engine_failed``, their KV freed and never cached) and the engine
goes on, unless the error leaves the device unusable (:func:`node_engine.failures.leaves_device_unusable`): then
:class:`~node_engine.failures.DeviceFailed` stops the engine thread.
"""

from __future__ import annotations

import logging
import time

from handoff.protocol import errors as E
from handoff.service.logs import rate_limit
from node_engine.errors import MemoryReleased, WeightsNotLoaded
from node_engine.failures import DeviceFailed, leaves_device_unusable
from node_engine.metrics import EngineMetrics
from node_engine.outbox import Outbox
from node_engine.request import FinishReason, Request, RequestState, error_output
from node_engine.request_gate import RequestGate
from node_engine.runner import ModelRunner
from node_engine.scheduler import Scheduler
from node_engine.step import Step, StepKind

# A batch that hits a bug fails every step it is in, and a client can send it again: a burst of tracebacks, then
# a count. The logger keeps the name it had in engine.py (docs/reliability.md names it).
step_failure_log = logging.getLogger("node_engine.engine.step_failures")
rate_limit(step_failure_log)


class EngineSteps:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, gate: RequestGate, metrics: EngineMetrics,
                 outbox: Outbox) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.gate = gate
        self.metrics = metrics
        self.outbox = outbox
        self._step_seconds = {kind: metrics.step_seconds.labels(kind.value) for kind in StepKind}
        self._time_to_first_token = metrics.time_to_first_token_seconds
        self._request_seconds = metrics.request_seconds
        self._running_since: float | None = None  # monotonic start of the model run under way, if one is

    def running_for(self) -> float:
        """Seconds the model run under way has taken so far (0 when none runs): read from any thread, for
        ``/health`` to tell a hung step (a collective that never returns, a stuck device) from a busy engine."""
        since = self._running_since
        return 0.0 if since is None else time.monotonic() - since

    def admit(self, request: Request) -> None:
        """Queue a request taken from the inbox, or answer it at once."""
        try:
            self.gate.check_can_generate()
        except (MemoryReleased, WeightsNotLoaded) as exc:
            self.metrics.rejected_requests.labels(exc.type).inc()
            self.outbox.deliver([(request, error_output(request, exc.kind, exc.message))])
            request.transition(RequestState.FINISHED)
            return
        if request.params.max_new_tokens == 0 and not request.prefill_only:
            request.transition(RequestState.FINISHED)
            request.set_finished(FinishReason.LENGTH, None, was_running=False)
            self.outbox.deliver([(request, request.take_output())])
            return
        self.scheduler.add(request)

    def abort(self, rid: str | None) -> None:
        """Finish one request (every one with ``None``) with ``abort`` and the tokens it had."""
        targets = list(self.scheduler.running) + list(self.scheduler.waiting) if rid is None else \
            [r for r in [self.scheduler.find(rid)] if r is not None]
        outputs = []
        for request in targets:
            self.scheduler.finish(request, FinishReason.ABORT)
            self.metrics.requests.labels(FinishReason.ABORT.value).inc()
            outputs.append((request, request.take_output()))
        self.outbox.deliver(outputs)

    def step(self) -> None:
        """Run the next step the scheduler plans, if any."""
        step = self.scheduler.schedule()
        if step is None:
            return
        started = time.perf_counter()
        self._running_since = time.monotonic()
        try:
            result = self.runner.run(step, self.scheduler.config.eos_token_ids)
        except Exception as exc:
            if leaves_device_unusable(exc):
                raise DeviceFailed(f"a {step.kind.value} step failed with an error that leaves the device "
                                   f"unusable: {type(exc).__name__}: {exc}") from exc
            self._fail(step, exc)
            return
        finally:
            self._running_since = None
        # a prefill-only request (n samples' shared prompt, a scoring request) samples a token it does not keep
        num_generated = sum(1 for e in step.entries if e.samples and not e.request.prefill_only)
        changed = self.scheduler.postprocess(step, result)
        self._step_seconds[step.kind].observe(time.perf_counter() - started)
        if step.kind is StepKind.PREFILL:
            self.metrics.prompt_tokens.inc(step.num_tokens)
        self.metrics.generated_tokens.inc(num_generated)
        outputs = []
        now = time.monotonic()
        for request in changed:
            if request.first_token_time is None and request.output_ids:
                request.first_token_time = now
                self._time_to_first_token.observe(now - request.arrival_time)
            if request.finish_reason is not None:
                self.metrics.requests.labels(request.finish_reason.value).inc()
                if request.finish_reason is not FinishReason.ABORT:
                    self._request_seconds.observe(now - request.arrival_time)
            elif not request.is_stream_output_due:
                continue
            outputs.append((request, request.take_output()))
        self.outbox.deliver(outputs)

    def _fail(self, step: Step, exc: Exception) -> None:
        """The requests of a step that raised fail; their KV (maybe half written) is freed, never cached."""
        requests = list(dict.fromkeys(e.request for e in step.entries))
        step_failure_log.error("a %s step of %d request(s) failed; they are answered engine_failed and the engine "
                               "goes on", step.kind.value, len(requests), exc_info=exc)
        message = (f"the model step failed ({type(exc).__name__}: {exc}); this request's work is lost, "
                   "the engine goes on serving")
        outputs = []
        for request in requests:
            self.scheduler.fail(request)
            self.metrics.requests.labels("error").inc()
            outputs.append((request, error_output(request, E.ENGINE_FAILED, message)))
        self.outbox.deliver(outputs)
