"""The engine's weight update groups: join, receive and load, destroy (SGLang's ``init_weights_update_group``,
``update_weights_from_distributed``, ``destroy_weights_update_group``).

Rules:

- Updates and leaves run one at a time (an asyncio lock): a broadcast is never
  received by two calls at once. A join waits for every rank outside the lock;
  ``destroy_weights_update_group`` abandons a join under way (the LB's rollback
  when another node failed to join).
- An update is checked against the model before anything is received: known
  names, the model's shapes, floating dtypes. A body that fails the check is a
  400 and the old weights serve; its broadcasts are still received (into
  scratch memory, when they fit in twice the model's size) so the trainer is not
  left blocked and the group stays in step. When they do not fit, or a receive
  fails or times out, the group is marked broken (409 ``weight_sync_broken``
  until it is destroyed and joined again): a group that missed a broadcast
  would pair the next tensors with the wrong names.
- Received tensors are loaded with :meth:`WeightUpdates.commit` on the engine
  thread; joining and receiving run on bounded threads and never block it.
- An update holds the engine's staging slot (:mod:`.staging`) from before its
  receive to the end of its commit, so received tensors of updates waiting for
  the engine thread never pile up; one that does not get the slot within
  ``--weight-sync-timeout`` is a 504 and marks the group broken (the trainer's
  broadcasts for it went unreceived).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from pydantic import ValidationError

from handoff.protocol.weights import (DEFAULT_GROUP_NAME, WEIGHT_DTYPES, AnnouncedBroadcasts,
                                      DestroyWeightsUpdateGroupBody, InitWeightsUpdateGroupBody,
                                      UpdateWeightsFromDistributedBody)
from handoff.weight_sync import JoinCancelled, is_collective_timeout
from handoff.bounded_thread import Aborted, BoundedThreads, Overdue, TooManyStuck
from handoff.checkpoint.files import shown
from node_engine.errors import Conflict, InvalidRequest, WeightSyncBroken, WeightSyncTimeout
from node_engine.model.arch import ModelConfigError
from node_engine.model.loader import by_checkpoint_key, check_named_tensors, is_dropped_key
from node_engine.weight_sync.group import WeightGroup, join_group, receive, unaligned
from node_engine.weight_sync.staging import deadline_after, time_left

if TYPE_CHECKING:
    from node_engine.engine import Engine

log = logging.getLogger(__name__)

SCRATCH_FACTOR = 2  # a refused update's broadcasts are still received when they fit in this many model sizes


class WeightGroups:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.groups: dict[str, WeightGroup] = {}
        self.joining: dict[str, asyncio.Event] = {}  # joins under way; setting the event abandons one
        # Joins wait for the trainer, so they have threads of their own: joins that overran cannot hold up a
        # reload or a push (and a join given up stops within STORE_PROBE_INTERVAL_S while the store is absent).
        self._join_threads = BoundedThreads()
        self._lock = asyncio.Lock()

    @property
    def _timeout(self) -> float:
        return self.engine.config.weight_sync_timeout

    async def init(self, body: InitWeightsUpdateGroupBody) -> dict[str, Any]:
        """Join; waits for every rank (up to ``--weight-sync-timeout``) unless a destroy abandons the join."""
        if body.backend == "nccl" and self.engine.runner.device.type != "cuda":
            raise InvalidRequest("backend nccl needs a CUDA engine; this engine runs on CPU, use gloo")
        name = body.group_name
        if name in self.groups or name in self.joining:
            raise Conflict(f"group {name!r} exists or is being joined; destroy it first")
        abandon = self.joining[name] = asyncio.Event()
        started = time.perf_counter()
        try:
            group = await self._join_threads.run(
                lambda cancel: join_group(body, self._timeout, cancel), self._timeout, abort=abandon,
                discard=lambda late: late.destroy())
        except (Overdue, TooManyStuck, TimeoutError) as exc:
            raise _join_timed_out(body, exc) from None
        except Aborted:
            raise Conflict(f"the join of group {name!r} was abandoned by destroy_weights_update_group") from None
        except (RuntimeError, ValueError, OSError, JoinCancelled) as exc:
            if is_collective_timeout(exc):  # the store's own clock (the same length) went off first
                raise _join_timed_out(body, exc) from exc
            raise InvalidRequest(f"failed to join group {name!r}: {exc}") from exc
        finally:
            self.joining.pop(name, None)
        if abandon.is_set():  # a destroy answered "abandoned" while the join's result waited on the loop
            group.destroy()
            raise Conflict(f"the join of group {name!r} was abandoned by destroy_weights_update_group")
        self.groups[name] = group
        log.info("joined weight group %s as rank %d of %d (%s) in %.2fs", name, group.rank, group.world_size,
                 group.backend, time.perf_counter() - started)
        return {"success": True, "message": "Succeeded to initialize custom process group.", "rank": group.rank,
                "world_size": group.world_size}

    def view(self) -> dict[str, list[str]]:
        """The groups joined and the joins under way, by name (``/get_server_info``'s ``weight_groups``)."""
        return {"joined": sorted(self.groups), "joining": sorted(self.joining)}

    async def destroy(self, body: DestroyWeightsUpdateGroupBody) -> dict[str, Any]:
        """Leave a group; a join still under way is abandoned (its thread destroys what it makes, if it ever
        completes)."""
        abandon = self.joining.get(body.group_name)
        if abandon is not None:
            abandon.set()
            return {"success": True, "message": f"The join of group {body.group_name!r} was abandoned."}
        if body.abandon_join_only:
            return {"success": True, "message": f"No join of group {body.group_name!r} was under way; nothing "
                                                "was destroyed."}
        async with self._lock:
            group = self.groups.pop(body.group_name, None)
            if group is None:
                raise InvalidRequest(f"group {body.group_name!r} does not exist")
            group.destroy()
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    async def refused(self, value: object, refusal: InvalidRequest) -> InvalidRequest:
        """The error for a body refused as it was read (a field wrong, unknown or missing): its trainer broadcasts
        whatever the answer, so the tensors it announces are still received and discarded when they can be sized
        (:class:`AnnouncedBroadcasts`); when they cannot, its group is marked out of step."""
        announces = isinstance(value, dict) and "names" in value  # else no broadcast was announced
        name = value.get("group_name", DEFAULT_GROUP_NAME) if isinstance(value, dict) else None
        group = self.groups.get(name) if announces and isinstance(name, str) else None
        if group is None or group.broken is not None:
            return refusal  # no group to keep in step (or one already out of step): the refusal as it is
        try:
            announced = AnnouncedBroadcasts.model_validate(value)
        except ValidationError:
            group.broken = f"an update whose broadcasts could not be sized was refused ({refusal})"
            return InvalidRequest(f"{refusal}; the broadcasts it announces cannot be sized to be received, so group "
                                  f"{shown(group.name)} is now out of step: destroy it and join again")
        try:
            await self.update(announced, refused=str(refusal))
        except InvalidRequest as exc:  # what this refusal is, its broadcasts received and discarded
            return exc
        return refusal  # not reached: a refused update never loads

    async def update(self, body: UpdateWeightsFromDistributedBody | AnnouncedBroadcasts, *,
                     refused: str | None = None) -> dict[str, Any]:
        """Receive, check and commit, the received tensors held in the engine's staging slot throughout (one
        weight update at a time: :mod:`node_engine.weight_sync.staging`); all within ``--weight-sync-timeout``.
        ``refused``: why the body was refused as it was read; its broadcasts are received and discarded."""
        started = time.perf_counter()
        deadline = deadline_after(self._timeout)
        self._usable(body.group_name)  # an unknown or broken group is refused at once, not after a wait
        async with self.engine.weights.staging.staged(deadline, lambda why: self._not_begun(body, why)) as staged:
            async with self._lock:
                group = self._usable(body.group_name)
                # the trainer broadcasts whatever the answer: refused, the broadcasts are still taken (group in step)
                problem = refused if refused is not None else self._check(body)
                dropped = [(dtype, shape) for name, dtype, shape in zip(body.names, body.dtypes, body.shapes,
                                                                        strict=True)
                           if is_dropped_key(self.engine.runner.model, name)]
                if problem is None and not self._fits_scratch(dropped):
                    # received and dropped (rotary buffers, a tied lm_head), so the check bounds nothing of theirs
                    problem = "the tensors this model takes and drops are too large"
                if problem is not None and not self._fits_scratch(zip(body.dtypes, body.shapes, strict=True)):
                    group.broken = f"an update it could not receive was refused ({problem})"
                    raise InvalidRequest(f"{problem}; its broadcasts are too large to receive and discard, so group "
                                         f"{body.group_name!r} is now out of step: destroy it and join again")
                tensors = await self._receive(group, body, deadline, keep=problem is None)
                received_s = time.perf_counter() - started
                if problem is not None:
                    tensors.clear()
                    raise InvalidRequest(f"{problem}; the broadcasts were received and discarded, nothing was "
                                         "loaded")
            if not isinstance(body, UpdateWeightsFromDistributedBody):  # only a refused body is read alone
                raise InvalidRequest("nothing was loaded")
            model = self.engine.runner.model
            try:
                staged.update(check_named_tensors(model, by_checkpoint_key(model, tensors)))
            except ModelConfigError as exc:
                raise InvalidRequest(f"the received tensors were refused, nothing was loaded: {exc}") from exc
            finally:
                tensors.clear()  # what stays is in ``staged``, emptied with the slot
            answer = await self.engine.call(lambda: self.engine.weights.commit(
                staged, is_complete=set(staged) == set(model.hf_weight_map()), version=body.weight_version,
                flush_cache=body.flush_cache, torch_empty_cache=body.torch_empty_cache))
        duration = time.perf_counter() - started
        self.engine.metrics.weight_update_seconds.labels("distributed").observe(duration)
        return {"success": True, "message": "Succeeded to update parameter online.", **answer,
                "receive_s": round(received_s, 6), "duration_s": round(duration, 6)}

    def _not_begun(self, body: UpdateWeightsFromDistributedBody | AnnouncedBroadcasts, why: str) -> WeightSyncTimeout:
        """The slot did not come in time: the trainer's broadcasts for this update go unreceived, so the group
        is out of step, as after a receive that timed out."""
        group = self.groups.get(body.group_name)
        if group is None:
            return WeightSyncTimeout(f"the update was not begun within --weight-sync-timeout ({self._timeout:g} "
                                     f"s): {why}; nothing was loaded")
        return self._timed_out(group, body, f"not begun in time: {why}")

    def _usable(self, name: str) -> WeightGroup:
        group = self.groups.get(name)
        if group is None:
            raise InvalidRequest(f"group {name!r} does not exist; call init_weights_update_group first")
        if group.broken is not None:
            raise WeightSyncBroken(f"group {name!r} is out of step: {group.broken}; destroy it and join again")
        return group

    def _check(self, body: UpdateWeightsFromDistributedBody | AnnouncedBroadcasts) -> str | None:
        """What is wrong with the announced tensors, checked on metadata alone (meta tensors, no memory)."""
        if isinstance(body, UpdateWeightsFromDistributedBody) and body.selector == "draft":
            return "this engine has no draft model (selector 'draft')"
        others = [f"{shown(name)} ({dtype})" for name, dtype in zip(body.names, body.dtypes, strict=True)
                  if dtype not in WEIGHT_DTYPES]
        if others:  # announced in a torch dtype no weight has: sized and received, then refused
            return (f"{len(others)} tensor(s) in a dtype weights never have: {', '.join(others[:4])}; weights are "
                    f"one of {list(WEIGHT_DTYPES)}")
        model = self.engine.runner.model
        announced = [(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
                     for name, dtype, shape in zip(body.names, body.dtypes, body.shapes, strict=True)]
        try:
            check_named_tensors(model, by_checkpoint_key(model, announced))
        except ModelConfigError as exc:
            return str(exc)
        if body.load_format == "flattened_bucket":
            return unaligned(body.names, body.dtypes, body.shapes)
        return None

    def _fits_scratch(self, announced_tensors: Iterable[tuple[str, list[int]]]) -> bool:
        """Whether tensors of these dtypes and shapes fit in ``SCRATCH_FACTOR`` times the model's size."""
        model_bytes = sum(p.numel() * p.element_size() for p in self.engine.runner.model.parameters())
        announced = sum(getattr(torch, dtype).itemsize * torch.Size(shape).numel()
                        for dtype, shape in announced_tensors)
        return announced <= SCRATCH_FACTOR * model_bytes

    async def _receive(self, group: WeightGroup, body: UpdateWeightsFromDistributedBody | AnnouncedBroadcasts,
                       deadline: float, *, keep: bool) -> list[tuple[str, torch.Tensor]]:
        device = self.engine.runner.device

        def work(cancel: threading.Event) -> list[tuple[str, torch.Tensor]]:
            return receive(group, body.names, body.dtypes, body.shapes,
                           flattened=body.load_format == "flattened_bucket", device=device, keep=keep)

        try:
            return await self.engine.weights.threads.run(work, time_left(deadline))
        except (Overdue, TooManyStuck) as exc:
            raise self._timed_out(group, body, exc) from None
        except (RuntimeError, ValueError) as exc:
            if is_collective_timeout(exc):  # the group's own clock (the same length) went off first
                raise self._timed_out(group, body, exc) from exc
            group.broken = f"a broadcast failed ({exc})"
            raise WeightSyncBroken(f"receiving on group {group.name!r} failed: {exc}; nothing was loaded") from exc

    @staticmethod
    def _timed_out(group: WeightGroup, body: UpdateWeightsFromDistributedBody | AnnouncedBroadcasts,
                   exc: BaseException | str) -> WeightSyncTimeout:
        group.broken = f"a broadcast did not arrive within --weight-sync-timeout ({exc})"
        return WeightSyncTimeout(f"receiving {len(body.names)} tensor(s) on group {group.name!r}: {exc}; nothing "
                                 "was loaded and the group is out of step (destroy it and join again)")


def _join_timed_out(body: InitWeightsUpdateGroupBody, exc: BaseException) -> WeightSyncTimeout:
    return WeightSyncTimeout(f"joining group {body.group_name!r} at {body.master_address}:{body.master_port} as rank "
                             f"{body.rank_offset} of {body.world_size}: {exc} (did the trainer, rank 0, and every "
                             "other rank join?)")

