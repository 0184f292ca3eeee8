"""SGLang's ``/weights_checker`` on the engine: snapshot, reset, compare and checksum the model's weights.

As SGLang 0.5.23's ``utils/weight_checker.py`` does it for a single-rank engine (slime's
``--check-weight-update-equal`` runs snapshot, reset_tensors, a weight update, then compare; NeMo-RL's
``check_weights`` asks for checksums):

- ``snapshot``: a host copy of every weight (parameters and buffers); a second one replaces the first. Refused
  (507 ``insufficient_memory``, nothing changed) when it would not fit the host's available memory, within the
  container's limit (:func:`~node_engine.memory.backup_room.check_host_room`).
- ``reset_tensors``: random values (``torch.rand``, as SGLang) into every weight not skipped. The weights are
  garbage until the next update, so the engine marks them invalid: generation answers 503
  ``weights_not_loaded`` until an update writes every weight again (SGLang serves the garbage). It needs an idle
  engine (409 ``requests_in_flight``; the sidecar drains first), and drops the prefix cache.
- ``compare``: exact comparison with the snapshot, in float32 a chunk of :data:`CHUNK_NUMEL` elements at a time
  (reset fills the same chunks; no whole-tensor float32 copy); mismatches are a 400 naming each tensor in SGLang's words
  (``check tensor equality failed:`` then ``name=... max_abs_err=...`` lines). A match drops the snapshot.
- ``checksum``: each tensor's hash (the first 8 bytes of the sha256 of its bytes, in hex: SGLang's host-side
  ``tensor_hash``), ``per_gpu_checksum`` (sha256 over the sorted names and hashes) and the parallelism info of
  the one rank; ``per_engine_checksum`` is the sha256 of that rank's ``per_gpu_checksum``.

``skip_tensor_list`` (substrings of names) leaves tensors out of reset, compare and checksum, as do SGLang's
non-persistent buffer names. ``selector`` ``draft`` selects no model here (no draft model): SGLang then does
nothing and answers success. Every action runs on the engine thread, between two steps; released weights are
refused (503 ``memory_released``). oneDNN-packed projections (:mod:`node_engine.model.packing`) are read from
their packed copies and written plain, then packed again.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any, Iterator

import torch

from handoff.protocol.weights import WEIGHTS_CHECKER_ACTIONS, WeightsCheckerBody
from node_engine.errors import InsufficientMemory, MemoryReleased
from node_engine.memory.backup_room import BackupUnavailable, check_host_room
from node_engine.memory.tags import MemoryTag

if TYPE_CHECKING:
    from node_engine.engine import Engine

log = logging.getLogger(__name__)

SUCCESS = "Success."  # SGLang's scheduler answers every successful check with it
HASH_CHUNK_BYTES = 64 * 1024 * 1024
# Elements per step of compare and reset (SGLang's ``weight_checker_comparator.CHUNK_NUMEL``): a float32 copy of a
# chunk, never of a whole tensor (an 8B model's embedding is 0.5 G elements, 2 GiB in float32).
CHUNK_NUMEL = 64 * 1024 * 1024
NON_PERSISTENT_BUFFER_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis",
                                  "expert_mask_gpu")


class CheckFailed(Exception):
    """An action SGLang answers with ``success: false`` (400): the message is SGLang's."""


class WeightsChecker:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._snapshot: dict[str, torch.Tensor] | None = None

    @property
    def has_snapshot(self) -> bool:
        return self._snapshot is not None

    def handle(self, body: WeightsCheckerBody) -> tuple[int, dict[str, Any]]:
        """Engine thread: (status, SGLang's answer). Project errors (released weights, no room, requests in
        flight) are raised as such."""
        try:
            payload = None if body.selector == "draft" else self._run(body)
        except CheckFailed as exc:
            log.warning("weights_checker %s failed: %s", body.action[:100], str(exc)[:1000])
            return 400, {"success": False, "message": str(exc)}
        answer: dict[str, Any] = {"success": True, "message": SUCCESS}
        if payload is not None:
            answer["ranks"] = [payload]
            answer["per_engine_checksum"] = hashlib.sha256(payload["per_gpu_checksum"].encode()).hexdigest()
        return 200, answer

    def _run(self, body: WeightsCheckerBody) -> dict[str, Any] | None:
        if body.action not in WEIGHTS_CHECKER_ACTIONS:
            raise CheckFailed(f"Unsupported action={body.action!r}")
        released = self.engine.memory.released_tags()
        if MemoryTag.WEIGHTS in released:
            raise MemoryReleased("the weights are released: resume them before /weights_checker", retry_after=None)
        skip = tuple(body.skip_tensor_list or ())
        if body.action == "snapshot":
            self._take_snapshot()
        elif body.action == "reset_tensors":
            self._reset(skip)
        elif body.action == "compare":
            self._compare(skip)
        else:
            return self._checksum(skip)
        return None

    # -- reading and writing the weights ------------------------------------------------
    def _state(self) -> Iterator[tuple[str, torch.Tensor]]:
        model = self.engine.runner.model
        yield from model.named_parameters()
        yield from model.named_buffers()

    def _read(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each weight's current value; a packed projection's from its packed copy (its plain storage is parked)."""
        packed = {id(p.weight): p.packed for p in self.engine.runner.packing.projections if p.packed is not None}
        for name, tensor in self._state():
            copy = packed.get(id(tensor))
            yield name, (copy.to_dense() if copy is not None else tensor.detach())

    # -- actions --------------------------------------------------------------------------
    def _take_snapshot(self) -> None:
        needed = sum(t.numel() * t.element_size() for _, t in self._state())
        held = sum(t.numel() * t.element_size() for t in (self._snapshot or {}).values())
        try:
            check_host_room(needed - held, "a weights_checker snapshot")
        except BackupUnavailable as exc:
            raise InsufficientMemory(f"{exc}; nothing was changed (the previous snapshot, if any, is kept)",
                                     extra={"needed_bytes": needed}) from exc
        self._snapshot = None  # replaced: its memory goes to the new copy
        snapshot = {}
        for name, tensor in self._read():
            snapshot[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").copy_(tensor)
        self._snapshot = snapshot
        log.info("weights_checker: snapshot of %d tensors (%d bytes)", len(snapshot), needed)

    def _reset(self, skip: tuple[str, ...]) -> None:
        engine = self.engine
        engine.control.require_idle("weights_checker reset_tensors", paused_ok=True)
        packing = engine.runner.packing
        packing.unpack()
        try:
            with torch.no_grad():
                for name, tensor in self._state():
                    if not _skipped(name, skip):
                        random_fill_(tensor)
        finally:
            engine.memory.mark_weights_invalid()  # garbage until an update writes every weight again
            engine.control.flush()
            if not packing.is_held_plain:
                packing.try_pack()
        log.warning("weights_checker: weights reset to random values; generation is refused until an update")

    def _compare(self, skip: tuple[str, ...]) -> None:
        if self._snapshot is None:
            raise CheckFailed("no snapshot to compare with: call /weights_checker with action 'snapshot' first")
        errors = []
        for name, actual in self._read():
            if _skipped(name, skip):
                continue
            expect = self._snapshot.get(name)
            if expect is None:
                errors.append(f"name={name} is not in the snapshot")
            elif expect.shape != actual.shape:
                errors.append(f"name={name} expect={_raw(expect)} actual={_raw(actual)} (shapes differ)")
            else:
                equal, max_abs_err, mean_abs_err, num_exceed = compare_weights(expect, actual)
                if not equal:
                    errors.append(f"name={name} max_abs_err={max_abs_err} mean_abs_err={mean_abs_err} "
                                  f"num_exceed={num_exceed} expect={_raw(expect)} actual={_raw(actual)} ")
        if errors:
            raise CheckFailed("check tensor equality failed:\n" + "\n".join(errors))
        self._snapshot = None

    def _checksum(self, skip: tuple[str, ...]) -> dict[str, Any]:
        checksums = {name: _hash_tensor(tensor) for name, tensor in self._read() if not _skipped(name, skip)}
        return {"checksums": checksums, "per_gpu_checksum": overall_checksum(checksums),
                "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                      "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]}


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(pattern in name for pattern in NON_PERSISTENT_BUFFER_PATTERNS + skip)


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's ``overall_checksum``: sha256 over each name and its hash, in name order."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


def _hash_tensor(tensor: torch.Tensor) -> str:
    """SGLang's host-side ``tensor_hash`` as ``_hash_tensor`` writes it: the sha256's first 8 bytes, 16 hex digits.

    Hashed a copied chunk at a time: ``numpy()`` on a view of the parameter itself would mark its storage not
    resizable for good, and the memory saver's next release (which resizes it to 0 bytes) would fail."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256()
    for start in range(0, flat.numel(), HASH_CHUNK_BYTES):
        digest.update(memoryview(flat[start:start + HASH_CHUNK_BYTES].cpu().clone().numpy()))
    return digest.digest()[:8].hex()


def _raw(tensor: torch.Tensor) -> str:
    return f"raw(shape={tuple(tensor.shape)} dtype={tensor.dtype})"


def compare_weights(expect: torch.Tensor, actual: torch.Tensor) -> tuple[bool, float, float, int]:
    """SGLang's ``compare_weights`` for a raw tensor: (equal, max_abs_err, mean_abs_err, num_exceed), compared
    :data:`CHUNK_NUMEL` elements at a time over the flattened tensors, in float32, on ``actual``'s device (the
    snapshot's chunk is moved there); the mean is the sum of each chunk's sum over the element count."""
    expect_flat, actual_flat = expect.reshape(-1), actual.detach().reshape(-1)
    equal, max_abs_err, sum_abs_err, num_exceed = True, torch.zeros((), dtype=torch.float32), 0.0, 0
    for start in range(0, actual_flat.numel(), CHUNK_NUMEL):
        actual_chunk = actual_flat[start:start + CHUNK_NUMEL]
        expect_chunk = expect_flat[start:start + CHUNK_NUMEL].to(actual_chunk.device)
        abs_diff = (actual_chunk.float() - expect_chunk.float()).abs()
        if bool(torch.all(abs_diff == 0)):
            continue
        equal = False
        max_abs_err = torch.maximum(max_abs_err, abs_diff.max().cpu())
        sum_abs_err += abs_diff.sum().item()
        num_exceed += int((~(abs_diff <= 0)).sum())  # NaN counts, as in SGLang
    return equal, max_abs_err.item(), sum_abs_err / max(actual_flat.numel(), 1), num_exceed


def random_fill_(tensor: torch.Tensor) -> None:
    """SGLang's ``_random_like`` written into ``tensor`` :data:`CHUNK_NUMEL` elements at a time: uniform [0, 1)
    (drawn in float32) for floats, random bits for booleans, the full range for integers."""
    target = tensor if tensor.is_contiguous() else torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    for chunk in target.view(-1).split(CHUNK_NUMEL):
        chunk.copy_(_random_like(chunk))
    if target is not tensor:
        tensor.copy_(target)


def _random_like(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype.is_floating_point:
        return torch.rand(tensor.shape, device=tensor.device, dtype=torch.float32).to(tensor.dtype)
    if tensor.dtype == torch.bool:
        return torch.rand(tensor.shape, device=tensor.device) > 0.5
    info = torch.iinfo(tensor.dtype)
    return torch.randint(int(info.min), int(info.max), tensor.shape, device=tensor.device, dtype=tensor.dtype)
