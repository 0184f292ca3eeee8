"""What of a vLLM server sleeps, at which level, and whether its weights survived: the release and resume of
:class:`~node_sidecar.engines.vllm.VllmEngine` (vLLM's dev endpoints, ``VLLM_SERVER_DEV_MODE=1``).

vLLM sleeps as a whole: ``POST /sleep?level=1`` offloads the weights to host
memory and discards the KV cache, ``level=2`` discards both;
``POST /wake_up?tags=weights`` / ``tags=kv_cache`` brings them back in the
order asked, and scheduling resumes once nothing sleeps. So:

- releasing ``weights`` releases ``kv_cache`` with it (both are reported);
- releasing ``kv_cache`` alone sleeps at level 1 and wakes the weights at once
  (vLLM's ``/release_kv_cache_memory`` fails on CPU and leaves
  ``/is_sleeping`` true, so it is not used); while the weights sleep (vLLM
  ignores a sleep while anything sleeps) the weights are woken and both sleep
  again at the weights' level;
- the level: 1 with ``stage_to_cpu: true``, 2 with ``false``, else
  ``--vllm-sleep-level`` (default 1). After level 2 the weights are gone: the
  node refuses generation (``weights_not_loaded``) until a reload;
- ``cuda_graph`` and ``workspace`` have no region of their own in vLLM: their
  state is the sidecar's and they free nothing.

On vLLM's own, ``/sleep`` aborts or waits for the requests it runs and a
request sent while it sleeps hangs until a wake-up; behind the sidecar
generation is drained (or aborted) first and refused with 503 while
released. On CPU, vLLM refuses ``--enable-sleep-mode`` but its sleep
endpoints still answer and keep the state: they free nothing there (measured:
the process RSS does not move).
"""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlencode

from handoff.protocol.tags import TAG_NAMES
from node_sidecar.engines.base import MemoryChange, TagMeaning, tags_named
from node_sidecar.engines.foreign import ForeignEngine

WEIGHTS, KV_CACHE = "weights", "kv_cache"
SLEEPING_TAGS = (WEIGHTS, KV_CACHE)


class VllmSleep(ForeignEngine):
    """The sleep levels and wake-up tags of a vLLM adapter, and the validity of the weights they leave."""

    tag_meanings = {
        WEIGHTS: TagMeaning(WEIGHTS, "the model's parameters: sleep level 1 keeps them in host memory, level 2 "
                                     "discards them (reload before serving); vLLM sleeps them with kv_cache"),
        KV_CACHE: TagMeaning(KV_CACHE, "the KV cache, discarded; alone, by sleeping at level 1 and waking the "
                                       "weights at once"),
        "cuda_graph": TagMeaning(None, "no region of its own in vLLM: tracked by the sidecar, frees nothing"),
        "workspace": TagMeaning(None, "no region of its own in vLLM: tracked by the sidecar, frees nothing"),
    }

    def __init__(self, engine: Any, *, default_sleep_level: int = 1) -> None:
        super().__init__(engine)
        self.default_sleep_level = default_sleep_level
        self.level = 0                 # the level of the sleep the weights went to (0: not asleep)
        self.weights_discarded = False  # woken after a level-2 sleep, not reloaded since
        self.weights_epoch = uuid.uuid4().hex  # renewed whenever the weights are lost: the worker counts the
        # weights updates wrote since it changed
        self.reloaded = False  # a reload from disk wrote every weight of this process since the epoch began

    def _adopt_sleeping(self, sleeping: bool) -> None:
        """Square what this adapter remembers with ``/is_sleeping``. Asleep with nothing remembered (the
        sidecar restarted): everything counts as released, at the worst level. Awake while it remembers a
        sleep: someone woke vLLM directly; its weights count as lost if they slept at level 2."""
        asleep = self.released & set(SLEEPING_TAGS)
        if sleeping and not asleep:
            self.released = set(TAG_NAMES)
            self.level = 2
        elif not sleeping and asleep:
            self.released -= set(SLEEPING_TAGS)
            if self.level == 2:
                self._lose_weights()
            self.level = 0

    def release_set(self, asked: list[str], resident: list[str]) -> list[str]:
        wanted = set(asked)
        if WEIGHTS in wanted and KV_CACHE in resident:
            wanted.add(KV_CACHE)  # vLLM cannot sleep the weights and keep the KV cache
        return [t for t in TAG_NAMES if t in wanted]

    async def release(self, tags: list[str], *, stage_to_cpu: bool | None) -> MemoryChange:
        level = 1 if stage_to_cpu else 2 if stage_to_cpu is False else self.default_sleep_level
        engine_tags = tags_named(self.tag_meanings, [t for t in tags if t not in self.released])
        change: dict[str, int] = {}
        measured_by = None
        if WEIGHTS in engine_tags:
            if KV_CACHE in self.released:  # asleep alone: woken, so that both go to sleep together
                await self._wake([KV_CACHE])
            _, change, measured_by = await self.measured(lambda: self._sleep(level), [WEIGHTS, KV_CACHE])
            self.level = level
        elif engine_tags and WEIGHTS in self.released:  # vLLM ignores a sleep while its weights sleep: both
            level = self.level or self.default_sleep_level  # woken, then both asleep at the weights' level

            async def both_again() -> None:
                await self._wake([WEIGHTS])
                await self._sleep(level)
            _, change, measured_by = await self.measured(both_again, [KV_CACHE])
            self.level = level
        elif engine_tags:  # kv_cache alone
            async def kv_only() -> None:
                await self._sleep(1)
                await self._wake([WEIGHTS])
            _, change, measured_by = await self.measured(kv_only, [KV_CACHE])
        self.released.update(tags)
        return MemoryChange(tags, change, measured_by)

    async def resume(self, tags: list[str]) -> MemoryChange:
        engine_tags = [t for t in tags_named(self.tag_meanings, tags) if t in self.released]
        change: dict[str, int] = {}
        measured_by = None
        if engine_tags:
            _, change, measured_by = await self.measured(lambda: self._wake(engine_tags), engine_tags,
                                                         restoring=True)
            if WEIGHTS in engine_tags and self.level == 2:
                self._lose_weights()
        self.released.difference_update(tags)
        if not self.released & set(SLEEPING_TAGS):
            self.level = 0
        return MemoryChange(tags, change, measured_by, weights_valid=not self.weights_discarded)

    async def _sleep(self, level: int) -> None:
        # mode=wait: anything vLLM still runs (the sidecar drained already) finishes rather than being cut
        await self.engine.call("POST", f"/sleep?level={level}&mode=wait")

    async def _wake(self, engine_tags: list[str]) -> None:
        # one call per tag: vLLM wakes nothing for a call naming a tag that is awake (a sidecar that met it asleep
        # counts both asleep, not knowing which sleeps)
        for tag in engine_tags:
            await self.engine.call("POST", "/wake_up?" + urlencode([("tags", tag)]))

    async def _wake_weights_for_update(self) -> list[str]:
        """An update loads into the weights: released ones are woken first; ``["weights"]`` if they were."""
        if WEIGHTS not in self.released:
            return []
        await self._wake([WEIGHTS])
        self.released.discard(WEIGHTS)
        return [WEIGHTS]

    def _forget_sleep(self) -> None:
        """A new vLLM process answers: nothing remembered of the old one's sleep or weights holds for it."""
        self.level, self.weights_discarded, self.reloaded = 0, False, False

    def _reloaded_weights(self, resumed: list[str]) -> None:
        """A reload from disk wrote every weight (woken first if ``resumed`` names them): they are valid again."""
        self.weights_discarded, self.reloaded = False, True
        if WEIGHTS in resumed:
            self.level = 0

    def _woke_weights_to_push(self) -> None:
        """Released weights were woken for a pushed update: after a level-2 sleep they count as lost (what updates
        wrote before counts no more) until updates wrote every weight."""
        if self.level == 2:
            self._lose_weights()
        self.level = 0

    def _pushed_every_weight(self) -> None:
        """Updates wrote every weight since the weights were lost: they are valid again."""
        self.weights_discarded = False

    def _lose_weights(self) -> None:
        """The weights are not usable (discarded, or loaded half way): what updates wrote before counts no more."""
        self.weights_discarded, self.reloaded = True, False
        self.weights_epoch = uuid.uuid4().hex
