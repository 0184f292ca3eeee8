"""One node as the sidecar sees it: state, admission, the engine, and the engine's liveness.

Admission is open exactly while the node serves (every tag resident, weights
valid, not paused, engine reachable) and no control call is draining it. The
engine is polled; when it stops answering, generation is refused with
``engine_unavailable`` and held requests are released with that 503; when it
answers again, the state is re-read from the engine, not assumed. When the
engine answering is a new process (:mod:`node_sidecar.intent`), the tags the
cluster had released are released again before the node admits anything, and a
node whose weights had been updated does not serve its start checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Iterator

from handoff.protocol.control import peer_weight_version
from handoff.protocol.errors import NotServingReason
from handoff.service.errors import Unavailable
from handoff.service.upstream import UpstreamClient, UpstreamError, UpstreamTimeout
from node_sidecar.admission import Admission, HoldLimits
from node_sidecar.inflight_bytes import InFlightBytes
from node_sidecar.config import SidecarConfig
from node_sidecar.engine_client import EngineClient
from node_sidecar.engines import EngineAdapter, EngineKind, create_adapter, detect_kind
from node_sidecar.engines.foreign import ForeignEngine
from node_sidecar.errors import EngineRefused, EngineUnavailable, NotServing
from node_sidecar.fresh_engine import meet_fresh_engine, release_again
from node_sidecar.intent import TagRecord
from node_sidecar.intent_file import load_intent
from node_sidecar.metrics import SidecarMetrics
from node_sidecar.state import TAGS, NodeState, TagState

log = logging.getLogger(__name__)

STATE_WRITE_WAIT_S = 10.0  # how long a control call (or the shutdown) waits for its change to reach --state-file


class Node:
    def __init__(self, config: SidecarConfig, client: UpstreamClient, metrics: SidecarMetrics) -> None:
        self.config = config
        self.metrics = metrics
        intent, self.state_writer = load_intent(config.state_file)
        self.state = NodeState(intent=intent, is_paused=intent.paused)  # a pause the sidecar made, kept
        self.admission = Admission(refuse=self._refusal, hold_limits=self._hold_limits)
        self.inflight_bytes = InFlightBytes(config.max_inflight_bytes)
        self.engine = EngineClient(config.engine_base, client, control_timeout=config.control_timeout,
                                   on_unreachable=self.mark_unreachable)
        self.adapter: EngineAdapter | None = (None if config.engine_kind is None else self._adapter_for(
            EngineKind(config.engine_kind)))  # None until the engine's kind was detected
        self.control_lock = asyncio.Lock()  # control calls run one at a time, in arrival order (FIFO lock)
        self._is_draining = False          # a control call holds admission closed (:meth:`draining`)
        self._is_updating_weights = False  # ... to update the weights (requests wait, as SGLang's do)
        self.last_error: str | None = None
        self._poke = asyncio.Event()
        self._health_misses = 0  # health probes in a row not answered in time
        self._monitor: asyncio.Task[None] | None = None

    # -- admission -------------------------------------------------------------
    def _hold_limits(self) -> HoldLimits | None:
        """SGLang queues generation while paused and behind a weight update, without a bound: here up to
        ``--pause-hold-max`` requests for ``--pause-hold-timeout`` each (through a release under the pause,
        as an RL step does; an update holds only on a node that will serve once it ends, its memory
        resident); otherwise only ``--hold-requests`` holds (within ``--hold-max``, ``--hold-timeout``).
        Held bodies take at most ``--hold-max-bytes``; nothing is held while the engine is unreachable."""
        config, state = self.config, self.state
        if not state.is_engine_reachable:
            return None  # nothing will admit them until the engine is back: they may go elsewhere now
        if state.is_paused or (self._is_updating_weights and state.is_all_resident):
            return HoldLimits(config.pause_hold_max, config.pause_hold_timeout, config.hold_max_bytes)
        if config.hold_requests:
            return HoldLimits(config.hold_max, config.hold_timeout, config.hold_max_bytes)
        return None

    def _refusal(self) -> NotServing:
        reason = self.state.not_serving_reason()
        self.metrics.rejected_requests.labels(reason.value).inc()
        intent = self.state.intent
        released = [t for t in TAGS if self.state.tags[t] is not TagState.RESIDENT or t in intent.unrestored]
        why = f": {intent.stale.message()}" if reason is NotServingReason.WEIGHTS_STALE and intent.stale else ""
        if reason is NotServingReason.NODE_RELEASED and self.state.unknown_reason:
            why = f": {self.state.unknown_reason}"
        return NotServing(f"the node is not serving ({reason.value}){why}", reason,
                          retry_after=self.config.retry_after_s, extra={"released": released})

    def refresh_admission(self) -> None:
        """Open admission iff the node serves and no drain holds it closed."""
        if self.state.is_serving and not self._is_draining:
            self.admission.open()
        else:
            self.admission.close()
            self.admission.reapply_limits()  # held requests follow why it is closed now (none: refused)
        self.metrics.serving.set(1 if self.admission.is_open else 0)

    @contextlib.contextmanager
    def draining(self, *, updating_weights: bool = False) -> Iterator[None]:
        """Admission stays closed for the block (new requests wait through a weight update, as SGLang's wait
        for its update lock, and are refused otherwise); afterwards it follows the node's state again."""
        self._is_draining, self._is_updating_weights = True, updating_weights
        self.refresh_admission()
        try:
            yield
        finally:
            self._is_draining = self._is_updating_weights = False
            self.refresh_admission()

    def require_engine(self) -> None:
        if not (self.state.is_engine_reachable and self.state.is_synced):
            raise EngineUnavailable("the engine is unreachable; its state will be re-read when it is back",
                                    retry_after=self.config.retry_after_s)

    # -- engine liveness -------------------------------------------------------
    def note_error(self, message: str) -> None:
        """A failure that leaves the engine up (a scrape of its metrics left out, say): the views' ``last_error``,
        after the reason tags are in doubt while they are (the way out must stay in sight)."""
        standing = self.state.unknown_reason if self.state.unknown_tags else None
        self.last_error = message if standing is None or message.startswith(standing) else f"{standing}; {message}"

    def mark_unreachable(self, exc: UpstreamError | str) -> None:
        if self.state.is_engine_reachable:
            log.warning("engine unreachable: %s", exc)
        self.last_error = str(exc)
        self._health_misses = 0
        self.state.is_engine_reachable = False
        self.state.is_synced = False
        self.metrics.engine_up.set(0)
        self.refresh_admission()
        self.admission.refuse_held()
        self._poke.set()

    @property
    def health_misses(self) -> int:
        """Health probes in a row the engine has not answered."""
        return self._health_misses

    def _adapter_for(self, kind: EngineKind) -> EngineAdapter:
        adapter = create_adapter(kind, self.engine, vllm_sleep_level=self.config.vllm_sleep_level,
                                 vllm_weight_sync_timeout=self.config.vllm_weight_sync_timeout)
        if isinstance(adapter, ForeignEngine) and adapter.keeps_memory:
            adapter.recall(self.state.intent.engine_memory, self._keep_engine_memory)
        return adapter

    async def _keep_engine_memory(self, memory: TagRecord, before_call: bool) -> None:
        """The adapter's record of its engine's tags, into ``--state-file``; ``before_call``: written before the
        call that may move them is sent (a sidecar that dies during it leaves them in doubt, never resident); raises
        :class:`Unavailable` if it is not in the file then (the call must not be sent)."""
        self.state.intent.record_engine_memory(memory)
        writer = self.state_writer
        if before_call and writer is not None and not await asyncio.to_thread(writer.kept, STATE_WRITE_WAIT_S):
            # sent unrecorded, the call would leave a record a restarted sidecar reads as the tags' state
            raise Unavailable(f"--state-file {writer.store.path} cannot be written (see the sidecar's log: a full "
                              f"or read-only disk, or one stalled past {STATE_WRITE_WAIT_S:g}s): the engine's tags "
                              "are recorded there before each call that moves them, so nothing was sent",
                              retry_after=self.config.retry_after_s)

    @property
    def engine_adapter(self) -> EngineAdapter:
        """The adapter, once the engine's kind is known (control calls run only after a sync, which sets it)."""
        if self.adapter is None:
            raise EngineUnavailable("the engine's kind is not known yet; it is read when the engine answers",
                                    retry_after=self.config.retry_after_s)
        return self.adapter

    async def sync(self) -> None:
        """Re-read the node's state from the engine (raises EngineUnavailable)."""
        try:
            if self.adapter is None:
                self.adapter = self._adapter_for(await detect_kind(self.engine))
                log.info("engine kind: %s", self.adapter.kind.value)
            view = await self.adapter.read_view()
        except (EngineRefused, EngineUnavailable) as exc:
            if self.last_error != exc.message:
                log.warning("the engine's state cannot be read: %s", exc.message)
            self.last_error = exc.message
            self.state.is_synced = False  # what a failed call changed is not known until the engine's view is read
            self.refresh_admission()
            raise EngineUnavailable(f"the engine's state cannot be read: {exc.message}",
                                    retry_after=self.config.retry_after_s) from exc
        if view.control_calls_pending:  # a call this sidecar gave up on may still change the state: wait for it
            self.state.is_synced = False
            self.refresh_admission()
            raise EngineUnavailable(f"the engine is still running {view.control_calls_pending} control call(s) "
                                    "(one that got no answer in time, say); its state is read once they are done",
                                    retry_after=self.config.retry_after_s)
        was_reachable, had_version = self.state.is_engine_reachable, self.state.weight_version
        is_fresh = self.state.intent.meet_engine(view.instance, served_version=peer_weight_version(
            view.weight_version), had_version=had_version,
            released=[t for t, s in view.tags.items() if s is TagState.RELEASED], updated=view.weights_updated,
            resident=[t for t, s in view.tags.items() if s is TagState.RESIDENT and view.reports_tags])
        self.state.sync(view)
        self.state.is_engine_reachable = True
        self.metrics.engine_up.set(1)
        if not was_reachable:
            log.info("engine reachable; state read from it: %s, weights_valid=%s, weight_version=%s",
                     {t: s.value for t, s in self.state.tags.items()}, self.state.weights_valid,
                     self.state.weight_version)
        if is_fresh:
            meet_fresh_engine(self)
        if view.unknown_reason is not None:
            if not (self.last_error or "").startswith(view.unknown_reason):
                log.error("%s", view.unknown_reason)
            self.note_error(view.unknown_reason)
        if self.state.intent.unrestored:
            await release_again(self)
        self.refresh_admission()

    async def resync_quietly(self) -> None:
        """After a control call failed: the engine's view wins, if it can be read."""
        try:
            await self.sync()
        except EngineUnavailable:
            pass  # mark_unreachable already recorded it; the monitor re-syncs when the engine is back

    def start(self) -> None:
        self._monitor = asyncio.create_task(self._watch(), name="engine-monitor")

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await self.intent_written()

    async def intent_written(self) -> None:
        """Wait, off the event loop, until the changes of the cluster's intent made so far are in ``--state-file``
        (or their write failed: logged), at most :data:`STATE_WRITE_WAIT_S` (a stalled disk: logged)."""
        writer = self.state_writer
        if writer is None or writer.is_idle or await asyncio.to_thread(writer.flush, STATE_WRITE_WAIT_S):
            return
        log.error("--state-file %s: a change is not written after %gs (a stalled disk?); the call answers, and a "
                  "restart of the sidecar meanwhile would read an older intent", writer.store.path, STATE_WRITE_WAIT_S)

    async def _watch(self) -> None:
        while True:
            try:
                if not self.state.is_synced:
                    async with self.control_lock:
                        if not self.state.is_synced:
                            await self.sync()
                elif self.state.intent.unrestored and self.state.is_engine_reachable:
                    async with self.control_lock:
                        if self.state.intent.unrestored and self.state.is_synced:
                            await release_again(self)
                            self.refresh_admission()
                else:
                    await self._probe_health()
            except EngineUnavailable:
                pass  # already marked; retry after the interval
            self._poke.clear()
            try:
                await asyncio.wait_for(self._poke.wait(), self.config.engine_poll_interval)
            except asyncio.TimeoutError:
                pass  # the normal tick

    async def _probe_health(self) -> None:
        """One health probe. A refused or dropped connection or an error status marks the engine down at once;
        a probe that is merely not answered in time only after ``engine_health_misses`` in a row, because an
        engine busy generating on a loaded host answers late but is alive (and serving)."""
        path = self.engine_adapter.health_path
        try:
            status, _ = await self.engine.peek(path, timeout=self.config.engine_health_timeout, max_bytes=4096)
        except UpstreamTimeout as exc:
            self._health_misses += 1
            self.metrics.engine_health_misses.inc()
            log.warning("engine %s not answered within %gs (%d in a row; counted down at %d)", path,
                        self.config.engine_health_timeout, self._health_misses, self.config.engine_health_misses)
            if self._health_misses >= self.config.engine_health_misses:
                self.mark_unreachable(exc)
            return
        except UpstreamError as exc:
            self.mark_unreachable(exc)
            return
        self._health_misses = 0
        if status != 200:
            self.mark_unreachable(f"engine {path} answered {status}")
