"""Weight sync as SGLang 0.5.23 does it, for both ends: the engine joins with it, and a trainer without an RL
framework pushes weights with it (``import torch`` happens on first use; the rest of ``handoff`` stays torch-free).

- :func:`join_weight_group`: SGLang's ``init_custom_process_group``. Rendezvous
  at ``tcp://master_address:master_port`` (rank 0, the trainer, hosts the TCP
  store), the store wrapped in ``PrefixStore(group_name, ...)``, the group made
  by ``_new_process_group_helper`` under ``group_name`` with every rank mapped to
  itself. verl, slime and AReaL build their end the same way, so either side
  can be theirs.
- :func:`broadcast_named_tensors`: the trainer's side of
  ``update_weights_from_distributed``: one broadcast from rank 0 per tensor, in
  the order of the body's ``names`` (or one flattened buffer).
- :func:`serialize_named_tensors`: SGLang's ``MultiprocessingSerializer`` output
  for ``update_weights_from_tensor``, base64: ``ForkingPickler`` over
  ``(name, tensor)`` pairs. CPU tensors travel as shared memory by name (the
  ``file_system`` sharing strategy, set here), so the receiver must be on this host.
"""

from __future__ import annotations

import base64
import io
import ipaddress
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

STORE_PROBE_INTERVAL_S = 0.2  # how soon a cancelled join that waits for the trainer's store stops


def tcp_init_method(address: str, port: int) -> str:
    """``tcp://host:port``, an IPv6 address in brackets (SGLang's ``NetworkAddress.to_tcp``)."""
    host = address.strip("[]")
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"tcp://{host}:{port}"


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether a join or a collective failed because no peer came or sent in time. torch.distributed says so
    only in words: gloo "Timed out waiting 3938ms for recv operation to complete" (a ``DistBackendError``), the
    store "Timed out" or "Socket Timeout" (``RuntimeError`` subclasses), a socket ``OSError``. An engine gives
    the group and its store its own weight-sync timeout, so which clock goes off first is a race; either way
    the caller must get the timeout (504), not a failure."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, OSError)) and ("timed out" in text or "timeout" in text)


class JoinCancelled(Exception):
    """The join was cancelled before it reached the trainer's store; nothing was joined."""


def wait_for_store(host: str, port: int, deadline: float, cancel: threading.Event) -> None:
    """Until the trainer's store accepts connections: plain TCP connects every ``STORE_PROBE_INTERVAL_S``
    (torch's own client retries cannot be cancelled, and log a stack trace for each try). Raises
    :class:`JoinCancelled` once ``cancel`` is set, :class:`TimeoutError` past ``deadline`` (``time.monotonic``)."""
    host = host.strip("[]")
    while not cancel.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the trainer's store at {host}:{port} did not accept a connection in time")
        try:
            with socket.create_connection((host, port), timeout=min(remaining, STORE_PROBE_INTERVAL_S)):
                pass
        except OSError:
            cancel.wait(min(max(0.0, deadline - time.monotonic()), STORE_PROBE_INTERVAL_S))
            continue
        if not cancel.is_set():
            return
    raise JoinCancelled()


def join_weight_group(*, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float, cancel: threading.Event | None = None) -> "dist.ProcessGroup":
    """Join (rank 0: host) the group; blocks until every rank joined or ``timeout_s`` passed.

    With ``cancel`` (a rank other than 0), the join waits for the trainer's store
    itself (:func:`wait_for_store`) and stops with :class:`JoinCancelled` once
    ``cancel`` is set: a join given up never pairs later with a trainer that came
    back on the same port. Once the store answered, the join runs to its end.
    """
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    deadline = time.monotonic() + timeout_s
    if cancel is not None and rank != 0:
        wait_for_store(master_address, master_port, deadline, cancel)
    timeout = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    store, rank, world_size = next(rendezvous(tcp_init_method(master_address, master_port), rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout,
                                         device_id=None)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_named_tensors(group: "dist.ProcessGroup", tensors: Sequence["torch.Tensor"], *,
                            flattened: bool = False) -> None:
    """Rank 0's broadcasts for one ``update_weights_from_distributed`` body listing these tensors in order."""
    import torch
    import torch.distributed as dist

    if flattened:
        flat = torch.cat([t.contiguous().flatten().view(torch.uint8) for t in tensors])
        dist.broadcast(flat, src=0, group=group)
        return
    handles = [dist.broadcast(t.contiguous(), src=0, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def serialize_named_tensors(named: Iterable[tuple[str, "torch.Tensor"]]) -> str:
    """One ``serialized_named_tensors`` entry; keep the tensors alive until the engine answered."""
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    mp.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([(name, tensor.detach()) for name, tensor in named])
    return base64.b64encode(buffer.getvalue()).decode()
