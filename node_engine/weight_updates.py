"""The engine's weight changes: from disk, from a local process's tensors, from a trainer's broadcasts;
SGLang's update session; the served version.

Every path has the same two phases:

1. **Get and check** the new tensors without touching the model: read a
   checkpoint, unpickle a tensor payload, receive broadcasts. This runs on a
   thread of its own (:class:`~handoff.bounded_thread.BoundedThreads`) with a
   deadline (``--reload-timeout``, ``--weight-sync-timeout``), so the engine keeps
   serving meanwhile and a stalled read or peer costs its deadline and no more.
   Updates run one at a time (:mod:`node_engine.weight_sync.staging`, as SGLang
   serializes them): each holds the staging slot from this read through its
   commit, and one that waits for it waits within the same deadline.
   Names, shapes and dtypes are checked here; any problem is a 400 and nothing
   changed.
2. **Commit** on the engine thread, between two steps (:meth:`WeightUpdates.commit`):
   the weights tag is resumed first if it was released (507 if it does not fit),
   the tensors are copied in place (``copy_`` converts as it copies, so nothing
   fails half way for a reason of the request's making), the version is set and
   the prefix cache flushed (``flush_cache``).

Weights resumed without a backup are invalid until every weight was written
again, by one complete update or by buckets that together cover them.
Likewise each answer's ``weights_updated_fully`` says whether updates have written every weight since the process
started (:mod:`node_engine.weight_coverage`): until then a restarted engine serves part of its start checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from handoff.checkpoint.files import shown
from handoff.protocol.control import UpdateWeightsFromDiskBody
from handoff.protocol.weights import (WEIGHTS_UPDATED_FULLY, BeginWeightUpdateBody, UpdateWeightsFromTensorBody,
                                     UpdateWeightVersionBody)
from handoff.bounded_thread import BoundedThreads, Overdue, TooManyStuck
from node_engine.errors import CheckpointTimeout, InvalidRequest, WeightsCorrupted, WeightSyncTimeout
from node_engine.memory.host_heap import trim_host_heap
from node_engine.memory.tags import MemoryTag
from node_engine.model.arch import ModelConfigError
from node_engine.model.loader import by_checkpoint_key, check_named_tensors
from node_engine.weight_coverage import WeightCoverage
from node_engine.weight_sync.staging import StagingSlots, deadline_after, time_left
from node_engine.weight_sync.tensor_payload import decode_payload
from node_engine.weight_sync.unpickler import UnsafePayload
from node_engine.weights_checker import WeightsChecker

if TYPE_CHECKING:
    from node_engine.engine import Engine

log = logging.getLogger(__name__)

T = TypeVar("T")


class WeightUpdates:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        # the checkpoint loaded last, as SGLang's tokenizer manager keeps it (reported as model_path)
        self.model_path = engine.config.model_path
        self.threads = BoundedThreads()
        self.staging = StagingSlots()  # one update's tensors at a time, read through commit
        self.token_step = 0
        self.session_selector: str | None = None  # an update session is open (SGLang's begin_weight_update)
        self.written = WeightCoverage()  # reported as weights_updated_fully: the start checkpoint is all replaced
        self.checker = WeightsChecker(engine)  # SGLang's /weights_checker (its snapshot outlives updates)

    # -- disk ------------------------------------------------------------------------
    async def check_disk(self, model_path: str) -> dict[str, Any]:
        """The dry run: files, keys, shapes, dtypes from the headers; changes nothing, needs no idle engine (and
        no staging slot: it holds no tensors)."""
        runner = self.engine.runner
        deadline = deadline_after(self.engine.config.reload_timeout)
        await self._read(lambda cancel: runner.weight_writer.check(Path(model_path)), model_path, deadline)
        return {"success": True, "dry_run": True, "message": f"{shown(model_path)} can be loaded"}

    async def update_from_disk(self, body: UpdateWeightsFromDiskBody) -> dict[str, Any]:
        """Read the whole checkpoint (bounded), then copy it in on the engine thread; one update at a time
        (:mod:`node_engine.weight_sync.staging`), the wait for the slot within ``--reload-timeout``."""
        runner = self.engine.runner
        path = body.model_path
        started = time.perf_counter()
        deadline = deadline_after(self.engine.config.reload_timeout)
        version = body.weight_version  # None keeps the version served (SGLang's _update_weight_version_if_provided)
        async with self.staging.staged(deadline, lambda why: self._read_timed_out(path, why)) as staged:
            read_started = time.perf_counter()
            # Only an engine holding all of its memory stages on the device: what a release gave back is the
            # cluster's (a colocated trainer's), and released weights must find room to resume at the commit.
            on_device = self.engine.memory.is_all_resident

            def stage(cancel: threading.Event) -> dict[str, torch.Tensor]:
                runner.weight_writer.stage(runner.weight_writer.check(Path(path)), staged, cancel,
                                           on_device=on_device)
                return staged

            def commit() -> dict[str, Any]:
                try:
                    return self.commit(staged, is_complete=True, version=version, flush_cache=body.flush_cache,
                                       torch_empty_cache=body.torch_empty_cache)
                finally:
                    staged.clear()  # on the engine thread, after the copy: a failed commit's traceback holds the dict

            try:
                try:
                    await self._read(stage, path, deadline)
                except BaseException:
                    staged.clear()  # what a read stuck past its deadline staged (but the run it is stuck on)
                    raise
                read_s = time.perf_counter() - read_started
                answer = await self.engine.call(commit)
            finally:
                if runner.device.type == "cuda":  # what a staging on the device held goes back
                    await asyncio.to_thread(torch.cuda.empty_cache)
        self.token_step = body.token_step
        self.model_path = path
        duration = time.perf_counter() - started
        self.engine.metrics.weight_update_seconds.labels("disk").observe(duration)
        log.info("weights reloaded from %s in %.2fs (read %.2fs), weight_version=%s", shown(path), duration,
                 read_s, self.engine.weight_version)
        return {"success": True, "message": f"weights loaded from {shown(path)}", "num_paused_requests": 0,
                **answer, "read_s": round(read_s, 6), "duration_s": round(duration, 6)}

    async def _read(self, work: Callable[[threading.Event], T], model_path: str, deadline: float) -> T:
        try:
            return await self.threads.run(work, time_left(deadline))
        except ModelConfigError as exc:
            raise InvalidRequest(f"cannot load {shown(model_path)}: {exc}") from exc
        except Overdue:
            raise self._read_timed_out(model_path, "the read did not finish") from None
        except TooManyStuck as exc:
            raise CheckpointTimeout(f"cannot read {shown(model_path)} now: {exc} (hung storage?); nothing "
                                    "was loaded") from None

    def _read_timed_out(self, model_path: str, why: str) -> CheckpointTimeout:
        return CheckpointTimeout(f"reading {shown(model_path)} took longer than --reload-timeout "
                                 f"({self.engine.config.reload_timeout:g} s): {why}; nothing was loaded, the old "
                                 "weights keep serving")

    # -- tensors of a process on this host ---------------------------------------------
    async def update_from_tensor(self, body: UpdateWeightsFromTensorBody) -> dict[str, Any]:
        """Unpickle (restricted) and check the payload off the engine thread, then copy it in; the payload's
        tensors live in one staging slot from the decode through the commit."""
        started = time.perf_counter()
        model = self.engine.runner.model
        deadline = deadline_after(self.engine.config.weight_sync_timeout)
        async with self.staging.staged(deadline, self._sync_timed_out("the tensor payload")) as tensors:
            # emptied with the slot: the sender's shared memory is let go (a refused commit's error outlives it)
            tensors.update(await self.read_tensor_payload(body, deadline))
            answer = await self.engine.call(lambda: self.commit(
                tensors, is_complete=set(tensors) == set(model.hf_weight_map()), version=body.weight_version,
                flush_cache=body.flush_cache, torch_empty_cache=body.torch_empty_cache))
        duration = time.perf_counter() - started
        self.engine.metrics.weight_update_seconds.labels("tensor").observe(duration)
        return {"success": True, "message": "Success", **answer, "duration_s": round(duration, 6)}

    async def check_tensor_payload(self, body: UpdateWeightsFromTensorBody) -> dict[str, Any]:
        """The dry run (``dry_run``): read and check the payload, load nothing; needs no idle engine, but a
        staging slot (it maps the payload's segments as a load would)."""
        deadline = deadline_after(self.engine.config.weight_sync_timeout)
        async with self.staging.staged(deadline, self._sync_timed_out("the tensor payload")) as tensors:
            tensors.update(await self.read_tensor_payload(body, deadline))
            return {"success": True, "dry_run": True,
                    "message": f"the payload's {len(tensors)} tensor(s) can be loaded"}

    async def read_tensor_payload(self, body: UpdateWeightsFromTensorBody, deadline: float) -> dict[str, torch.Tensor]:
        """The payload's checked tensors by checkpoint key; call it holding a staging slot. It is read before any
        refusal of the body's own (a draft selector): torch counts one reader per serialization, and a payload
        nobody reads holds the sender's shared memory until the sender exits."""
        model = self.engine.runner.model

        def decode(cancel: threading.Event) -> dict[str, torch.Tensor]:
            pairs = decode_payload(body.serialized_named_tensors, body.load_format,
                                   release_sender_reference=body.release_sender_reference, cancel=cancel)
            if body.selector == "draft":
                raise InvalidRequest("this engine has no draft model (selector 'draft')")
            if not pairs:
                raise UnsafePayload("the payload holds no tensors")
            return check_named_tensors(model, by_checkpoint_key(model, pairs))

        return await self.run_checked(decode, "the tensor payload", deadline)

    async def run_checked(self, work: Callable[[threading.Event], T], what: str, deadline: float) -> T:
        """``work`` on a bounded thread (until ``deadline``, within ``--weight-sync-timeout``); a payload or check
        problem is a 400."""
        try:
            return await self.threads.run(work, time_left(deadline))
        except (UnsafePayload, ModelConfigError) as exc:
            _let_go_of_tensors(exc)
            raise InvalidRequest(f"{what} was refused, nothing was loaded: {exc}") from exc
        except InvalidRequest as exc:
            _let_go_of_tensors(exc)
            raise
        except (Overdue, TooManyStuck) as exc:
            raise WeightSyncTimeout(f"{what}: {exc}; nothing was loaded") from None

    def _sync_timed_out(self, what: str) -> Callable[[str], WeightSyncTimeout]:
        timeout = self.engine.config.weight_sync_timeout
        return lambda why: WeightSyncTimeout(f"{what}: not begun within --weight-sync-timeout ({timeout:g} s): "
                                             f"{why}; nothing was loaded")

    # -- commit (engine thread) ------------------------------------------------------
    def commit(self, tensors: dict[str, torch.Tensor], *, is_complete: bool, version: str | None,
               flush_cache: bool, torch_empty_cache: bool) -> dict[str, Any]:
        """Copy checked tensors into the model; resumes the weights tag first if it is released.

        ``commit_s`` in the answer: how long the engine stopped serving for it (this call, on the engine thread).
        """
        engine = self.engine
        started = time.perf_counter()
        if engine.memory.weights_valid and engine.memory.is_all_resident:
            # else nothing queued has run on these weights (the engine does not step): they may change under it
            engine.control.require_idle("a weight update", paused_ok=True)
        resumed = []
        if MemoryTag.WEIGHTS in engine.memory.released_tags():
            resumed = engine.control.resume([MemoryTag.WEIGHTS], backup_optional=True)["resumed"]
        try:
            engine.runner.weight_writer.apply(tensors, is_complete=is_complete)
        except Exception as exc:
            engine.memory.mark_weights_invalid()
            raise WeightsCorrupted(f"a weight update failed part way ({exc}); generation is refused until an "
                                   "update succeeds") from exc
        if is_complete:
            engine.memory.mark_weights_valid()
            self.written.note_all()
        else:
            engine.memory.note_weights_written(tensors, engine.runner.model.hf_weight_map())
            self.written.note(tensors, engine.runner.model.hf_weight_map())
        if version is not None:
            engine.set_weight_version(version)
        dropped = engine.control.flush() if flush_cache else 0
        if torch_empty_cache:
            if engine.runner.device.type == "cuda":
                torch.cuda.empty_cache()
            else:
                trim_host_heap()
        return {"weight_version": engine.weight_version, "weights_valid": engine.memory.weights_valid,
                "resumed": resumed, "num_cached_tokens_dropped": dropped, WEIGHTS_UPDATED_FULLY: self.written.is_full,
                "commit_s": round(time.perf_counter() - started, 6)}

    # -- session and version ---------------------------------------------------------
    def begin_session(self, body: BeginWeightUpdateBody) -> dict[str, Any]:
        """Engine thread. SGLang's semantics: one session at a time; weights stay plain (unpacked) until the end."""
        if self.session_selector is not None:
            raise InvalidRequest("a weight-update session is already open; call end_weight_update() first")
        if body.selector == "draft":
            raise InvalidRequest("this engine has no draft model (selector 'draft')")
        self.engine.runner.weight_writer.open_session()
        self.session_selector = body.selector
        return {"success": True, "message": "Success"}

    def end_session(self) -> dict[str, Any]:
        if self.session_selector is None:
            raise InvalidRequest("no weight-update session is open; call begin_weight_update() first")
        self.engine.runner.weight_writer.close_session()
        self.session_selector = None
        return {"success": True, "message": "Success"}

    def update_version(self, body: UpdateWeightVersionBody) -> dict[str, Any]:
        """Engine thread: running requests (aborted first by the caller when asked) finish under the new name."""
        self.engine.set_weight_version(body.new_version)
        return {"success": True, "message": f"Weight version updated to {body.new_version}",
                "new_version": body.new_version}


def _let_go_of_tensors(exc: BaseException) -> None:
    """Clear the locals of the finished frames an error of a payload's read passed through (and of its causes):
    they hold the tensors decoded so far, which map the sender's shared memory, and the error outlives the answer
    (a reference cycle, until a garbage collection that may not come for long)."""
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)  # frames still running are left as they are
        chained = chained.__cause__ or chained.__context__
