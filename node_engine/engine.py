"""The engine: a thread that owns the scheduler and the runner.

Everything that touches device tensors runs on this one thread. The HTTP side
talks to it through an inbox: ``submit`` a request, ``abort`` one, or ``call``
a control command (release, resume, reload, flush), which runs between two
steps with exclusive access. Outputs go back to the event loop once per step.

The engine defends itself: it refuses a release or a reload while requests
are queued or running, refuses generation while memory is released or the
weights are not valid, and never runs a step on released memory.

A step that raises fails that step's requests (``engine_failed``, their KV
freed and never cached) and the engine goes on (``engine_steps.py``: admit,
abort, step; ``outbox.py``: outputs to the event loop). An error it cannot survive
(:func:`node_engine.failures.leaves_device_unusable`, or a bug in its own
bookkeeping) closes the inbox: every request and control call still waiting
is answered, and ``on_fatal`` runs (the server process exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from typing import Any, Callable

import torch

from handoff.protocol import errors as E
from handoff.protocol.generate_sequences import LogprobOptions
from node_engine.config import EngineConfig
from node_engine.control import EngineControl
from node_engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from node_engine.engine_steps import EngineSteps
from node_engine.errors import EngineStopped
from node_engine.failures import FaultDrill
from node_engine.inbox import Abort, Add, Call, Closed, Inbox, Item
from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.memory.manager import MemoryManager
from node_engine.memory.setup import make_memory_info, make_saver
from node_engine.metrics import EngineMetrics
from node_engine.model.source import load_model_source
from node_engine.outbox import Outbox
from node_engine.prefix_cache import PrefixCache
from node_engine.request import Request, RequestHandle, RequestState, error_output
from node_engine.request_gate import RequestGate
from node_engine.runner import ModelRunner
from node_engine.sampling import SamplingParams
from node_engine.scheduler import Scheduler, SchedulerConfig
from node_engine.vision.inputs import MultimodalPrompt
from node_engine.vision.runtime import VisionRuntime
from node_engine.weight_sync.distributed import WeightGroups
from node_engine.weight_updates import WeightUpdates

log = logging.getLogger(__name__)


def _scores(logprobs: LogprobOptions | None, num_prompt: int) -> bool:
    """Whether a request with ``max_new_tokens`` 0 still answers logprobs, so must be prefilled: the prompt's
    (``logprob_start_len`` inside it), or the row after the prompt that ``top_logprobs_num`` or
    ``token_ids_logprob`` asks for (SGLang's ``compute_logprobs_only``)."""
    if logprobs is None:
        return False
    return 0 <= logprobs.start_len < num_prompt or logprobs.top_logprobs_num > 0 or logprobs.token_ids is not None


class Engine:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None = None, *,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """``on_fatal`` runs on the engine thread after an error it cannot survive, once every waiting request
        and call was answered (the server passes :func:`node_engine.failures.exit_process`)."""
        self.config = config
        self.metrics = metrics or EngineMetrics()
        self.on_fatal = on_fatal
        self.drill = FaultDrill(config.fault_drill_file) if config.fault_drill_file is not None else None
        self.arch, self.tokenizer = load_model_source(config)
        self.saver = make_saver(config)
        started = time.perf_counter()
        self.runner = ModelRunner(config, self.saver, self.arch, drill=self.drill)
        log.info("model %s loaded in %.2fs (%d parameters, %s on %s)", config.model_path,
                 time.perf_counter() - started, self.arch.num_params(), config.resolved_dtype, config.device)
        self.memory = MemoryManager(self.saver, make_memory_info(config), config.weights_backup,
                                    weights_listener=self.runner.packing,
                                    step_headroom_bytes=self.runner.step_headroom_bytes)
        plan = self.runner.kv_plan
        slots = SlotAllocator(plan.num_slots)
        self.scheduler = Scheduler(
            SchedulerConfig(max_running_requests=config.max_running_requests, max_batch_tokens=config.max_batch_tokens,
                            context_len=plan.context_len, schedule_conservativeness=config.schedule_conservativeness,
                            eos_token_ids=tuple(self.tokenizer.eos_token_ids) or self.arch.eos_token_ids,
                            max_visual_tokens=self.runner.vision.visual_budget if self.runner.vision else 0),
            slots, RowAllocator(config.max_running_requests),
            PrefixCache(slots) if config.enable_prefix_cache else None)
        self.gate = RequestGate(self.scheduler, self.memory, vocab_size=self.arch.vocab_size,
                                context_len=plan.context_len)
        self.outbox = Outbox(self.gate, config.weight_version)
        self.steps = EngineSteps(self.scheduler, self.runner, self.gate, self.metrics, self.outbox)
        self.instance = uuid.uuid4().hex  # this process (GET /memory_occupation's engine_instance)
        self._inbox = Inbox()
        self._calls_lock = threading.Lock()  # posted from the event loop, finished on the engine thread
        self._num_calls_pending = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.control = EngineControl(self)
        self.weights = WeightUpdates(self)
        self.weight_groups = WeightGroups(self)
        self.metrics.kv_slots.set(self.scheduler.slots.capacity)
        self.metrics.read_queues_from(self.scheduler)
        compiled = self.runner.compiled_decode
        if compiled is not None:
            self.metrics.decode_graphs_compiled.set_function(lambda: compiled.num_graphs)
        self._update_memory_metrics()

    # -- lifecycle ---------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.outbox.attach(loop)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def vision(self) -> VisionRuntime | None:
        """The image processor and encoder of a vision-language model (None for a text model)."""
        return self.runner.vision

    @property
    def weight_version(self) -> str:
        """The version outputs are stamped with now (``set_weight_version`` changes it)."""
        return self.outbox.weight_version

    @property
    def has_prefix_cache(self) -> bool:
        return self.scheduler.cache is not None

    @property
    def is_alive(self) -> bool:
        """The engine thread runs and takes work (false from the moment a fatal error closed the inbox)."""
        return self._thread is not None and self._thread.is_alive() and self._inbox.closed is None

    # -- event-loop side -----------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None, *,
               stream: bool = False, mm: MultimodalPrompt | None = None, logprobs: LogprobOptions | None = None,
               use_prefix_cache: bool = True, prefill: bool = False) -> RequestHandle:
        """Queue a checked request; its outputs arrive on the returned handle.

        A streaming request gets an output every ``stream_interval`` tokens; any other gets one when it finishes
        (its deltas accumulate meanwhile), which spares the event loop a wake-up per request per step. ``mm``: the
        prompt's images (placeholders already expanded). ``use_prefix_cache`` false: it neither reuses cached KV
        nor leaves its own (cache isolation). With ``max_new_tokens`` 0 the prompt is still prefilled (and cached)
        if ``prefill`` or if logprobs it answers are asked for: the prompt's, or the top / ``token_ids_logprob`` row
        of the distribution after the prompt (SGLang's scoring request).
        """
        rid = rid or f"req-{uuid.uuid4().hex[:16]}"
        self.gate.claim(rid)
        handle = RequestHandle(rid)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        generator = None if params.is_greedy else torch.Generator(device=self.runner.device).manual_seed(seed)
        request = Request(rid=rid, prompt_ids=list(prompt_ids), params=params,
                          detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop,
                                                             is_lazy=not stream and not params.stop,
                                                             skip_special_tokens=params.skip_special_tokens,
                                                             no_stop_trim=params.no_stop_trim,
                                                             context=prompt_ids[-CONTEXT_TOKENS:]),
                          on_output=handle.put, generator=generator, is_streaming=stream, mm=mm,
                          logprobs=logprobs, use_prefix_cache=use_prefix_cache,
                          prefill_only=params.max_new_tokens == 0 and (prefill or _scores(logprobs, len(prompt_ids))))
        self._post(Add(request))
        return handle

    def abort(self, rid: str | None) -> None:
        """Abort one request (or all with ``None``); it finishes with ``abort`` and the tokens it had.

        Posted after the request's own submission, so the engine thread finds it even if it has not taken it
        from its inbox yet; requests planned under ``rid`` (not submitted yet) are marked aborted.
        """
        self.gate.abort_planned(rid)
        self._post(Abort(rid))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two steps; its exception is raised here."""
        if self._stopping or self._thread is None or not self._thread.is_alive():
            raise EngineStopped("the engine is stopping")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._calls_lock:
            self._num_calls_pending += 1
        self._post(Call(fn, future, loop))
        return await future

    @property
    def num_calls_pending(self) -> int:
        """Calls posted and not run yet (or running): a caller that gave up on one (a sidecar's timeout) can
        tell that what it asked for may still happen, and wait before it reads the state."""
        return self._num_calls_pending

    def _call_finished(self) -> None:
        with self._calls_lock:
            self._num_calls_pending -= 1

    def _post(self, item: Item) -> None:
        """Queue ``item`` for the engine thread, or answer it at once if the inbox is closed."""
        closed = self._inbox.post(item)
        if closed is not None:
            self._refuse(item, closed)

    # -- engine thread -------------------------------------------------------------
    def _run(self) -> None:
        # OpenMP thread counts are per thread: a new thread starts at the machine's default, not at
        # what the process set, and MKL and oneDNN would fork that many threads for every product.
        torch.set_num_threads(torch.get_num_threads())
        try:
            while not self._stopping:
                self._drain_inbox(block=not self._can_step)
                if self._stopping:
                    break
                if self._can_step:
                    self.steps.step()
        except BaseException as exc:  # a device failure, or a bug in the engine's own bookkeeping
            log.critical("the engine thread failed", exc_info=exc)
            self._close(Closed(f"the engine failed ({type(exc).__name__}: {exc}) and is exiting; "
                                "nothing more runs here", has_failed=True))
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        self._close(Closed("the engine is stopping", has_failed=False))

    @property
    def _can_step(self) -> bool:
        """Work to do, generation not paused, and memory a step may run on (requests a pause kept wait)."""
        return (self.scheduler.has_work and not self.control.is_paused and self.memory.weights_valid
                and self.memory.is_all_resident)

    def _drain_inbox(self, *, block: bool) -> None:
        for item in self._inbox.take(block=block):
            try:
                self._handle(item)
            except BaseException:  # the engine closes: a request it did not queue is answered with the inbox's rest
                if isinstance(item, Add) and item.request not in self.scheduler.waiting:
                    self._inbox.hand_back(item)
                raise

    def _handle(self, item: Item) -> None:
        if isinstance(item, Add):
            self.steps.admit(item.request)
        elif isinstance(item, Abort):
            self.steps.abort(item.rid)
        else:
            try:
                result = item.fn()
            except BaseException as exc:  # handed to the caller, who raises it
                self._call_finished()  # before the caller can hear of it: its next read must not count the call
                item.fail(exc)
            else:
                self._call_finished()
                item.resolve(result)
            self._update_memory_metrics()

    def set_weight_version(self, version: str) -> None:
        """Engine thread: serve under ``version`` from now on; requests that made tokens already (running, or
        paused or retracted by ``pause_generation``) remember how many the old version made (``Outbox``)."""
        self.outbox.set_weight_version(version, [*self.scheduler.running, *self.scheduler.waiting])

    def _close(self, closed: Closed) -> None:
        """Take nothing more, and answer everything: requests the engine holds, then whatever is queued.

        A request that already ran fails (``engine_failed``, when the engine failed); one that never ran, like
        a queued call, is refused as not served (``engine_stopped``), so it may go to another node.
        """
        queued = self._inbox.close(closed)
        outputs = []
        # No bookkeeping (freeing KV): nothing runs here any more, and it could be what failed.
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            has_run = request.state is RequestState.RUNNING or bool(request.output_ids)
            kind = E.ENGINE_FAILED if closed.has_failed and has_run else E.ENGINE_STOPPED
            outputs.append((request, error_output(request, kind, closed.message)))
        self.outbox.deliver(outputs)
        for item in queued:
            self._refuse(item, closed)

    def _refuse(self, item: Item, closed: Closed) -> None:
        """Answer a queued item of a closed engine (any thread)."""
        if isinstance(item, Add):
            self.outbox.deliver([(item.request, error_output(item.request, E.ENGINE_STOPPED, closed.message))])
        elif isinstance(item, Call):
            self._call_finished()
            item.fail(EngineStopped(closed.message))

    def _update_memory_metrics(self) -> None:
        for tag, info in self.memory.occupation().items():
            for state in ("resident", "released"):
                self.metrics.memory_bytes.labels(tag, state).set(info["bytes"] if info["state"] == state else 0)
