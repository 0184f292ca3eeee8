"""A trainer as an RL framework runs one: rank 0 of a gloo weight group, joined the way SGLang's
``init_custom_process_group`` joins (:func:`handoff.weight_sync.join_weight_group`), pushing weights with
``update_weights_from_distributed`` (one broadcast per tensor, or one flattened buffer)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
import torch.distributed as dist

from handoff.weight_sync import broadcast_named_tensors, join_weight_group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def distributed_body(named: list[tuple[str, torch.Tensor]], group_name: str, **fields) -> dict:
    """SGLang's ``update_weights_from_distributed`` body for ``named`` (dtypes without ``torch.``, as slime sends)."""
    return {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name, **fields}


class Trainer:
    """Rank 0 of ``world_size``; the engines behind ``url`` (one node, or an LB over several) take ranks
    ``rank_offset`` onwards."""

    def __init__(self, url: str, *, world_size: int = 2, rank_offset: int = 1, group_name: str = "weight_update_group",
                 headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.world_size = world_size
        self.rank_offset = rank_offset
        self.group_name = group_name
        self.headers = headers or {}
        self.port = free_port()
        self.group: dist.ProcessGroup | None = None

    def init_body(self) -> dict:
        return {"master_address": "127.0.0.1", "master_port": self.port, "rank_offset": self.rank_offset,
                "world_size": self.world_size, "group_name": self.group_name, "backend": "gloo"}

    def join(self, *, timeout_s: float = 30, params: dict | None = None, body: dict | None = None) -> httpx.Response:
        """Send ``init_weights_update_group`` (``body``: a framework's own, else :meth:`init_body`) and join as
        rank 0 meanwhile; the call's answer."""
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, self.url + "/init_weights_update_group", json=body or self.init_body(),
                                 params=params, headers=self.headers, timeout=timeout_s + 30)
            self.group = join_weight_group(master_address="127.0.0.1", master_port=self.port, rank=0,
                                           world_size=self.world_size, group_name=self.group_name, backend="gloo",
                                           timeout_s=timeout_s)
            return answer.result()

    def push(self, named: list[tuple[str, torch.Tensor]], *, flattened: bool = False, body: dict | None = None,
             **fields) -> httpx.Response:
        """One ``update_weights_from_distributed`` (``body`` overrides what it announces) and its broadcasts."""
        if flattened:
            fields["load_format"] = "flattened_bucket"
        announced = body or distributed_body(named, self.group_name, **fields)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, self.url + "/update_weights_from_distributed", json=announced,
                                 headers=self.headers, timeout=120)
            broadcast_named_tensors(self.group, [t for _, t in named], flattened=flattened)
            return answer.result()

    def leave(self) -> httpx.Response:
        answer = httpx.post(self.url + "/destroy_weights_update_group", json={"group_name": self.group_name},
                            headers=self.headers, timeout=30)
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        return answer
