"""What the adapters of engines not built for handoff (vLLM, SGLang) share.

Such an engine does not say which of its regions are released after a
restart of the sidecar, does not measure what it frees, and cannot check a
checkpoint before loading it. So the adapter remembers the SPEC tags it
released (:attr:`ForeignEngine.released`, forgotten when the engine is a new
process), measures around each memory call (:mod:`~node_sidecar.engines.measure`),
and checks checkpoints itself (:mod:`~node_sidecar.engines.checkpoint`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable, TypeVar

from handoff.bounded_thread import BoundedThreads, Overdue, TooManyStuck
from handoff.checkpoint.files import shown
from handoff.service.errors import InvalidRequest
from node_sidecar.engines.base import EngineAdapter
from node_sidecar.engines.checkpoint import CHECK_TIMEOUT_S, CheckpointShape, check_compatible, read_checkpoint
from node_sidecar.engines.measure import PROCESS_RSS, EngineMemory, freed
from node_sidecar.errors import CheckpointTimeout

T = TypeVar("T")

log = logging.getLogger(__name__)


class ForeignEngine(EngineAdapter):
    screens_media = True  # it fetches URLs and reads files on its own (node_sidecar/media.py)

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

    def adopt_instance(self, instance: object) -> bool:
        """Note the engine process answering now; True (and everything remembered forgotten) if it is not the
        one this adapter knew: a restarted engine starts with every region resident and its weights loaded."""
        if instance == self.instance:
            return False
        self.instance = instance
        self.released = set()
        return True

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
