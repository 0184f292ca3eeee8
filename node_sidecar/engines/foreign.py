"""What the adapters of engines not built for handoff (vLLM, SGLang) share.

Such an engine does not say which of its regions are released after a
restart of the sidecar, does not measure what it frees, and cannot check a
checkpoint before loading it. So the adapter remembers the SPEC tags it
released (:attr:`ForeignEngine.released`, forgotten when the engine is a new
process), measures around each memory call (:mod:`~node_sidecar.engines.measure`),
and checks checkpoints itself (:mod:`~node_sidecar.engines.checkpoint`).

An adapter whose engine says nothing of its tags (SGLang) also keeps what it
remembers in the node's ``--state-file`` (:attr:`ForeignEngine.keep`): before a
memory call is sent, its tags are recorded as in doubt on the engine process
(and the record written: if it cannot be, the call is refused, 503, nothing
sent), and once the call ended the tags it holds released (and a continue it
holds back, :attr:`ForeignEngine.pending_continue`); a reload likewise
records the weights as not known before it is sent (:meth:`ForeignEngine.reload_call`).
A restarted sidecar meeting the same process (:meth:`ForeignEngine.recall`)
takes the released tags back, and holds the ones in doubt out of every call
(:attr:`ForeignEngine.unknown`): SGLang may or may not have moved them, and a
wrong guess either way kills it. A new engine process is all resident.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar, TypeVar

from handoff.bounded_thread import BoundedThreads, Overdue, TooManyStuck
from handoff.checkpoint.files import shown
from handoff.protocol import errors as E
from handoff.protocol.tags import TAG_NAMES
from handoff.service.errors import InvalidRequest, ServiceError
from node_sidecar.engines.base import EngineAdapter
from node_sidecar.engines.checkpoint import CHECK_TIMEOUT_S, CheckpointShape, check_compatible, read_checkpoint
from node_sidecar.engines.measure import PROCESS_RSS, EngineMemory, freed
from node_sidecar.errors import CheckpointTimeout, EngineRefused
from node_sidecar.intent import TagRecord

T = TypeVar("T")
KeepMemory = Callable[[TagRecord, bool], Awaitable[None]]  # the record, and whether it must be written first

log = logging.getLogger(__name__)


class ForeignEngine(EngineAdapter):
    screens_media = True  # it fetches URLs and reads files on its own (node_sidecar/media.py)
    keeps_memory: ClassVar[bool] = False  # its tags are known only from its own calls: kept in --state-file

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.memory = EngineMemory(engine.base_url)
        self.device = "cpu"                  # the engine's device, read with its server info
        self.released: set[str] = set()     # SPEC tags this adapter released and has not resumed
        self.instance: object = None         # what tells one engine process from the next
        self.model_path: str | None = None   # the checkpoint the engine serves
        self.check_threads = BoundedThreads()  # checkpoint checks: a hung mount costs a bounded thread
        self.served_check_threads = BoundedThreads()  # the served checkpoint's, read to compare: apart, so that
        # reads stuck on the storage of the checkpoint served never refuse the check of the one that replaces it
        self.unknown: set[str] = set()       # tags of a call a sidecar before this one sent and did not see end
        self.keep: KeepMemory | None = None  # where the record of the tags goes (the node's state file)
        self._recalled: TagRecord | None = None
        self.adopted: TagRecord | None = None  # the record of the process adopted last, if it was its
        self.weights_garbage = False  # weights not a checkpoint's (resumed without a backup, a failed reload)
        self.pending_continue: bool | None = None  # a continue_generation held back (its torch_empty_cache)

    def recall(self, memory: TagRecord | None, keep: KeepMemory) -> None:
        """The record a sidecar before this one kept (taken once, by the first engine process met, if it is that
        record's), and where this adapter keeps its own from now on."""
        self._recalled, self.keep = memory, keep

    def adopt_instance(self, instance: object) -> bool:
        """Note the engine process answering now; True (and everything remembered forgotten) if it is not the
        one this adapter knew: a restarted engine starts with every region resident and its weights loaded."""
        if instance == self.instance:
            return False
        self.instance = instance
        self.released, self.unknown = set(), set()
        recalled, self._recalled, self.adopted = self._recalled, None, None
        if recalled is not None and recalled.engine == self.instance_key:
            self.released, self.unknown, self.adopted = set(recalled.released), set(recalled.in_doubt), recalled
            log.warning("the engine process %s holds %s released, as recorded%s", recalled.engine,
                        sorted(self.released) or "nothing", f"; {self.unknown_message()}" if self.unknown else "")
        return True

    @property
    def has_tags_out(self) -> bool:
        """A tag released, or in doubt: the engine's memory is not all known to be there."""
        return bool(self.released or self.unknown)

    def unknown_message(self) -> str:
        """Why the tags in doubt are held out of every call, and the way out."""
        tags = [t for t in TAG_NAMES if t in self.unknown]
        return (f"whether the engine holds {tags} released is not known: a sidecar stopped while its call to release "
                f"or resume them was under way (engine process {self.instance_key}); a generation on a released "
                "tag, a release of a released one and a resume of a resident one each kill the engine, so the "
                "node serves nothing and sends none of them. Restart the engine (a new process holds every tag "
                "resident; the node then does what the cluster last asked)")

    def refuse_unknown(self, tags: list[str]) -> None:
        """409, nothing sent, if a tag of ``tags`` is in doubt."""
        if self.unknown.intersection(tags):
            raise EngineRefused(E.CONFLICT.status, {"error": {"type": E.CONFLICT.name,
                                                              "message": self.unknown_message()}})

    @contextlib.asynccontextmanager
    async def memory_call(self, tags: list[str]) -> AsyncIterator[None]:
        """Around a release or resume of ``tags`` sent to the engine: recorded in doubt (and written) before, and
        the tags held released after the call ended with an answer or an error the adapter read (its memory is
        the best word on it then). Ended any other way (cancelled), the tags stay in doubt, here too."""
        async with self._recorded(lambda key: self._memory(key, tags), on_cut=lambda: self.unknown.update(tags)):
            yield

    @contextlib.asynccontextmanager
    async def reload_call(self) -> AsyncIterator[None]:
        """Around a reload sent to the engine: its weights recorded as not known (and written) before, since one
        that fails part way leaves them neither the old nor the new checkpoint's; the record follows
        :attr:`weights_garbage` as the caller leaves it after the call ended with an answer or an error the adapter
        read. Ended any other way (cancelled), the weights are taken as not known, here too."""
        async with self._recorded(lambda key: self._memory(key, [], garbage=True),
                                  on_cut=lambda: setattr(self, "weights_garbage", True)):
            yield

    @contextlib.asynccontextmanager
    async def _recorded(self, before: Callable[[str], TagRecord], *, on_cut: Callable[[], None]) -> AsyncIterator[None]:
        """``before(key)`` written before the call is sent, the adapter's own record after it ended with an answer
        or an error it read; ended any other way (cancelled), ``on_cut`` says what is no longer known."""
        key = self.instance_key
        if self.keep is None or key is None:
            yield
            return
        await self._keep_before(self.keep, key, before(key))
        try:
            yield
        except ServiceError:
            await self.keep(self._memory(key, []), False)
            raise
        except BaseException:
            on_cut()
            raise
        await self.keep(self._memory(key, []), False)

    async def _keep_before(self, keep: KeepMemory, key: str, record: TagRecord) -> None:
        """``record`` written before a call is sent; if it cannot be (the call is refused), the record as it was
        is kept again, so that a write that lands later never leaves a call not sent in doubt."""
        try:
            await keep(record, True)
        except ServiceError:
            await keep(self._memory(key, []), False)
            raise

    async def keep_record(self) -> None:
        """The record written again after a change that is not a memory call's (the weights' validity)."""
        key = self.instance_key
        if self.keep is not None and key is not None:
            await self.keep(self._memory(key, []), False)

    def _memory(self, key: str, in_doubt: list[str], *, garbage: bool = False) -> TagRecord:
        doubt = self.unknown.union(in_doubt)
        return TagRecord(key, tuple(t for t in TAG_NAMES if t in self.released and t not in doubt),
                         tuple(t for t in TAG_NAMES if t in doubt), self.weights_garbage or garbage,
                         self.pending_continue)

    @property
    def instance_key(self) -> str | None:
        """The engine process for :attr:`EngineView.instance` (None: the engine names none)."""
        return None if self.instance is None else json.dumps(self.instance, sort_keys=True, default=str)

    async def memory_view(self) -> dict[str, Any]:
        reading = await asyncio.to_thread(self.memory.read, self.device)
        if reading is None:
            return {}
        if reading.source == PROCESS_RSS:
            return {"process_rss_bytes": reading.used_bytes}
        return {"device": {"type": self.device, "used_bytes": reading.used_bytes}}

    async def measured(self, call: Callable[[], Awaitable[T]], tags: list[str], *,
                       restoring: bool = False) -> tuple[T, dict[str, int], str | None]:
        """Run ``call`` between two readings of the engine's memory: the bytes it freed (``restoring``: took
        back), keyed by the engine tags that moved together (``"weights+kv_cache"``), and how they were
        measured; ``({}, None)`` when they cannot be measured here."""
        before = await asyncio.to_thread(self.memory.read, self.device)
        result = await call()
        after = await asyncio.to_thread(self.memory.read, self.device)
        change = freed(before, after)
        if change is None or not tags:
            return result, {}, None
        num_bytes, source = change
        return result, {"+".join(tags): -num_bytes if restoring else num_bytes}, source

    async def check_checkpoint(self, model_path: str) -> None:
        """InvalidRequest unless ``model_path`` holds a readable checkpoint of the served model's shape (compared
        when the served checkpoint can be read too)."""
        new = await self._read_checkpoint(model_path, self.check_threads)
        if self.model_path is None:
            return
        try:
            current = await self._read_checkpoint(self.model_path, self.served_check_threads)
        except InvalidRequest:
            return  # the served checkpoint is not a folder here (a hub id, another volume): nothing to compare
        except CheckpointTimeout as exc:
            # its storage does not answer (a hung mount): nothing to compare either, and a reload is the way off it
            log.warning("the served checkpoint is not compared with %s: %s", shown(model_path), exc.message)
            return
        check_compatible(new, current)

    async def _read_checkpoint(self, path: str, threads: BoundedThreads) -> CheckpointShape:
        try:
            return await threads.run(lambda cancel: read_checkpoint(path), CHECK_TIMEOUT_S)
        except (Overdue, TooManyStuck) as exc:
            raise CheckpointTimeout(f"reading the checkpoint's headers at {shown(path)!r} did not finish ({exc}): "
                                    "hung storage? Nothing was loaded") from None
