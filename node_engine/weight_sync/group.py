"""The engine's end of a weight update group (SGLang's ``init_weights_update_group``): joined with
:func:`handoff.weight_sync.join_weight_group`, SGLang's own recipe, so a trainer written for SGLang joins it
unchanged. One rank per engine (no tensor parallelism): the engine's rank is ``rank_offset``.

Backend ``gloo`` on CPU (and into CPU buffers on a CUDA engine), ``nccl`` on
CUDA. Joining and receiving block; they run on
:mod:`handoff.bounded_thread` threads with ``--weight-sync-timeout`` as both
the thread's deadline and the group's own timeout, so a trainer that never joins
or never sends costs that long and no more. A join that completes after its
caller gave up destroys the group it made.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from handoff.protocol.weights import InitWeightsUpdateGroupBody
from handoff.weight_sync import JoinCancelled, join_weight_group



@dataclass
class WeightGroup:
    """One joined group. ``broken`` says why it can no longer be used (a broadcast was missed), or None."""

    name: str
    group: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    broken: str | None = None

    def destroy(self) -> None:
        dist.destroy_process_group(self.group)


def join_group(body: InitWeightsUpdateGroupBody, timeout_s: float, cancel: threading.Event) -> WeightGroup:
    """Rendezvous with the trainer and build the group (blocking). :class:`JoinCancelled` when ``cancel`` is
    set: before the trainer's store answered, nothing was joined; after, the group made is destroyed."""
    group = join_weight_group(master_address=body.master_address, master_port=body.master_port,
                              rank=body.rank_offset, world_size=body.world_size, group_name=body.group_name,
                              backend=body.backend, timeout_s=timeout_s, cancel=cancel)
    joined = WeightGroup(body.group_name, group, body.rank_offset, body.world_size, body.backend)
    if cancel.is_set():
        joined.destroy()
        raise JoinCancelled()
    return joined


def unaligned(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> str | None:
    """Why a flattened bucket of these tensors cannot be viewed as them (a tensor starting at a byte offset its
    dtype does not divide, as SGLang's ``FlattenedTensorBucket.empty`` refuses), or None."""
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        itemsize = getattr(torch, dtype).itemsize
        if offset % itemsize:
            return f"{name}: byte offset {offset} of the flattened bucket is not aligned to {dtype}"
        offset += itemsize * torch.Size(shape).numel()
    return None


def receive(group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
            flattened: bool, device: torch.device, keep: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The trainer's broadcasts from rank 0, one per tensor in order (or one flattened buffer), into fresh tensors.

    gloo receives into CPU memory; nccl into ``device``. Blocking; the group's
    timeout bounds each broadcast. ``keep`` false: received and dropped (a
    refused update's, taken so that the group stays in step), nothing returned.
    """
    where = device if group.backend == "nccl" else torch.device("cpu")
    torch_dtypes = [getattr(torch, dtype) for dtype in dtypes]
    if flattened:
        problem = unaligned(names, dtypes, shapes) if keep else None
        if problem is not None:
            raise ValueError(problem)
        sizes = [dtype.itemsize * torch.Size(shape).numel() for dtype, shape in zip(torch_dtypes, shapes, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=where)
        dist.broadcast(flat, src=0, group=group.group)
        if not keep:
            return []
        starts = [0, *itertools.accumulate(sizes)][:-1]
        return [(name, flat[start:start + size].view(dtype).reshape(shape))
                for name, dtype, shape, start, size in zip(names, torch_dtypes, shapes, starts, sizes, strict=True)]
    received = [(name, torch.empty(shape, dtype=dtype, device=where))
                for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True)]
    handles = [dist.broadcast(tensor, src=0, group=group.group, async_op=True) for _, tensor in received]
    for handle in handles:
        handle.wait()
    return received if keep else []
