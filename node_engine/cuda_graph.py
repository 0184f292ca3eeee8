"""Decode through captured CUDA graphs, one per padded batch size.

Graphs read fixed buffers (token ids, positions, slots, each sequence's slot
list padded to the context length, and lengths) allocated in the
``workspace`` region; the graphs' private memory pool is captured through the
memory saver so it belongs to the ``cuda_graph`` tag and pauses with it.
Padding rows write to and read from the padding slot only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from node_engine.memory.tags import MemoryTag
from node_engine.model.layers import AttentionBatch
from node_engine.scheduler import Step

if TYPE_CHECKING:
    from node_engine.runner import ModelRunner

log = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", max_bs: int) -> None:
        self.runner = runner
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev, ctx = runner.device, runner.kv_plan.context_len
        with runner.saver.region(MemoryTag.WORKSPACE):
            self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
            self.slot_mapping = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
            self.kv_indices = torch.zeros(self.max_bs, ctx, dtype=torch.int32, device=dev)
            self.lengths = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
            self.key_pos = torch.arange(ctx, device=dev)
        runner.saver.register(MemoryTag.WORKSPACE, [self.input_ids, self.positions, self.slot_mapping,
                                                    self.kv_indices, self.lengths, self.key_pos])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _forward(self, bs: int) -> torch.Tensor:
        mask = (self.key_pos[None, :] < self.lengths[:bs, None]).view(bs, 1, 1, -1)
        batch = AttentionBatch(slot_mapping=self.slot_mapping[:bs], kv_indices=self.kv_indices[:bs], mask=mask,
                               num_seqs=bs, max_query_len=1)
        return self.runner.model(self.input_ids[:bs], self.positions[:bs], batch)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        saver = self.runner.saver
        free_before, _ = torch.cuda.mem_get_info()
        stream = torch.cuda.Stream()
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its pool
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            capture = getattr(saver, "cuda_graph", None)
            context = capture(graph, pool, stream) if capture else torch.cuda.graph(graph, pool=pool, stream=stream)
            with context:
                out = self._forward(bs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        saver.add_bytes(MemoryTag.CUDA_GRAPH, max(0, free_before - free_after))
        log.info("captured %d decode graphs (batch sizes %s), %.1f MiB", len(self.graphs), self.batch_sizes,
                 max(0, free_before - free_after) / 2**20)

    def reset_buffers(self) -> None:
        """After the workspace was resumed without its contents."""
        for buf in (self.input_ids, self.positions, self.slot_mapping, self.kv_indices):
            buf.zero_()
        self.lengths.fill_(1)
        torch.arange(self.key_pos.shape[0], out=self.key_pos)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_bs

    def run(self, step: Step) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step of ``len(step.entries)`` sequences."""
        num_seqs = len(step.entries)
        bs = next(b for b in self.batch_sizes if b >= num_seqs)
        runner = self.runner
        inputs = runner.prepare_decode(step)
        self.input_ids[:num_seqs].copy_(inputs.input_ids)
        self.positions[:num_seqs].copy_(inputs.rope_positions)  # what the model rotates by
        self.slot_mapping[:num_seqs].copy_(inputs.slot_mapping)
        self.kv_indices[:num_seqs].copy_(runner.req_to_token.index_select(0, inputs.rows))
        self.lengths[:num_seqs].copy_(inputs.positions + 1)     # the keys each sequence sees
        if bs > num_seqs:
            self.input_ids[num_seqs:bs].zero_()
            self.positions[num_seqs:bs].zero_()
            self.slot_mapping[num_seqs:bs].fill_(runner.padding_slot)
            self.kv_indices[num_seqs:bs].fill_(runner.padding_slot)
            self.lengths[num_seqs:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:num_seqs]
