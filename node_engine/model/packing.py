"""CPU weight packing: large float32 projections kept in oneDNN's blocked layout.

oneDNN multiplies by weights in its own blocked layout. Handed a plain
row-major weight, it reorders the whole matrix on every call, which for a
decode batch costs about as much as the product itself: packing once made the
~100M model's decode step 1.7x faster at batch 8 (``docs/benchmarks.md``).

Rules:

- Weights are held once. Packing a projection parks its plain parameter
  (the storage is resized to 0 bytes), so a packed model takes the memory of
  an unpacked one.
- The plain parameters stay the canonical weights for everything that is not
  a forward pass: the memory saver's release (and its backup), reloads, and
  reload checks. Before those, :meth:`WeightPacking.unpack` writes the plain
  weights back (or :meth:`WeightPacking.discard` drops the packed copies when
  the contents are not wanted); after them, :meth:`WeightPacking.pack` builds
  the packed copies again.
- One tensor at a time, so packing or unpacking needs at most one extra
  projection's worth of memory.

- A weight update that writes a packed projection whole packs the new weight
  straight from the update's tensors (:meth:`repack_from`): the old packed copy
  is dropped first, so the new one takes its memory, and the plain parameter
  stays parked (no copy into it, no pages faulted in and trimmed again).

- While SGLang's update session is open (:meth:`hold_plain`), a resume leaves
  the weights plain: the session's buckets only copy, and its end packs them.

CPU bookkeeping for the memory manager goes through :meth:`before_release` and
:meth:`after_resume`. On CUDA there is nothing to pack and every method is a
no-op.
"""

from __future__ import annotations

import logging
from typing import Collection

import torch

from node_engine.memory.host_heap import trim_host_heap
from node_engine.model.projection import Projection

log = logging.getLogger(__name__)

# The decode batch oneDNN picks its blocked layout for. Any batch runs on it;
# 8, 16 and 32 measured within noise of each other for the ~100M model at batches 1 to 32.
PACK_BATCH_HINT = 16


def _reorder(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def can_pack() -> bool:
    """Whether this torch build has oneDNN's weight reorder (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class WeightPacking:
    """The packed state of a model's oneDNN projections (see the module docstring).

    The state is kept per projection (``packed`` set or not), so a pack or unpack
    that fails part way (out of memory) leaves every projection either packed with
    its plain storage parked, or plain and resident: both run correctly.
    """

    def __init__(self, projections: list[Projection], batch_hint: int = PACK_BATCH_HINT) -> None:
        for projection in projections:
            if not projection.is_onednn:
                raise ValueError("only projections that run through oneDNN can be packed")
        self.projections = projections if can_pack() else []
        self.batch_hint = batch_hint
        self._is_held_plain = False  # an update session is open: a resume leaves the weights plain

    @property
    def num_projections(self) -> int:
        return len(self.projections)

    @property
    def is_packed(self) -> bool:
        return bool(self.projections) and all(p.packed is not None for p in self.projections)

    def pack(self) -> None:
        """Build the packed copies and park the plain parameters; packed projections are left as they are, and so
        are released ones (no packed copy, no memory: the resume packs them)."""
        num_packed = 0
        for projection in self.projections:
            if projection.packed is not None or projection.weight.untyped_storage().nbytes() == 0:
                continue
            weight = projection.weight
            projection.packed = _reorder(weight, self.batch_hint)
            weight.untyped_storage().resize_(0)
            num_packed += 1
        if num_packed:
            trim_host_heap()  # the parked weights' pages, else the process keeps them

    def repack_from(self, parts: dict[Projection, list[torch.Tensor]]) -> set[Projection]:
        """New packed copies of packed projections, built from their whole new weights; returns those done.

        ``parts``: each projection's new weight, in row order (``q, k, v`` for a
        fused ``qkv``), any float dtype. A projection that is not packed now is left
        alone; one whose packing fails (out of memory) gets its plain storage back
        (with undefined contents) and no packed copy. Either way, the projections
        not returned must be written the plain way.
        """
        done = set()
        for projection, weight_parts in parts.items():
            if projection.packed is None:
                continue
            projection.packed = None  # first: the new copy can take the old one's memory
            try:
                weight = weight_parts[0] if len(weight_parts) == 1 else torch.cat(
                    [part.to(torch.float32) for part in weight_parts])
                projection.packed = _reorder(weight.to(torch.float32).contiguous(), self.batch_hint)
                done.add(projection)
            except (RuntimeError, MemoryError) as exc:
                log.warning("a projection is written plain and packed again after (%s)", exc)
            finally:
                if projection.packed is None:  # any failure: the plain weight gets memory to be written into
                    plain = projection.weight
                    plain.untyped_storage().resize_(plain.numel() * plain.element_size())
        if done:
            trim_host_heap()  # what the new copies did not take of the old ones' memory
        return done

    def try_pack(self) -> bool:
        """:meth:`pack`, but a failure (out of memory) only leaves projections plain, and is logged.

        Plain projections compute the same outputs, only slower; this is what runs
        where a failure must not stop anything else (a resume, the end of a reload).
        """
        try:
            self.pack()
        except (RuntimeError, MemoryError) as exc:
            num_plain = sum(p.packed is None for p in self.projections)
            log.warning("%d of %d projections stay unpacked (slower decode on CPU): %s", num_plain,
                        len(self.projections), exc)
            return False
        return True

    def unpack(self, *, keep_contents: bool = True, only: Collection[torch.Tensor] | None = None) -> None:
        """Give the plain parameters their memory back, then drop the packed copies.

        With ``keep_contents`` the plain parameters get the weights back from the
        packed copies; without, their contents are undefined (for a reload, which
        overwrites every weight). ``only``: the parameters to unpack (by identity;
        a weight update that writes some of them), None for all.
        """
        wanted = None if only is None else {id(param) for param in only}
        for projection in self.projections:
            weight, packed = projection.weight, projection.packed
            if packed is None or (wanted is not None and id(weight) not in wanted):
                continue
            weight.untyped_storage().resize_(weight.numel() * weight.element_size())
            if keep_contents:
                weight.copy_(packed.to_dense())
            projection.packed = None

    def discard(self) -> None:
        """Drop the packed copies without writing the plain weights back (their contents are lost).

        Only right before the weights are released without a backup: a discarded
        projection has no memory until the saver resumes its storage.
        """
        for projection in self.projections:
            projection.packed = None

    # -- memory manager hooks ----------------------------------------------------
    def before_release(self, *, keep_contents: bool) -> None:
        """The weights are about to be released: give the saver plain parameters to back up, or nothing."""
        if keep_contents:
            self.unpack()
        else:
            self.discard()

    def after_resume(self, *, is_valid: bool) -> None:
        """The weights are resident again; pack them if they hold real weights (else a reload will) and no update
        session keeps them plain (its end packs them)."""
        if is_valid and not self._is_held_plain:
            self.try_pack()

    @property
    def is_held_plain(self) -> bool:
        return self._is_held_plain

    def hold_plain(self, is_held: bool) -> None:
        """While held (SGLang's update session is open), a resume leaves the weights plain; :meth:`pack` and
        :meth:`repack_from` are not affected (the session's owner decides when to call them)."""
        self._is_held_plain = is_held
