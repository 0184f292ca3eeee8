"""Decode through captured CUDA graphs, one per padded batch size and context bucket.

A graph replays fixed shapes, so each is captured for a batch size (padded up
to the next of :func:`graph_batch_sizes`) and a number of keys (the longest
sequence's length, padded up to the next of :func:`context_buckets`): a batch
of short sequences attends over a few hundred keys, not the whole context.

The graphs read fixed buffers (token ids, positions, slots, each sequence's
slot list, lengths) allocated in the ``workspace`` region
(:class:`DecodeGraphInputs`, device-agnostic and tested on CPU); their private
memory pool is captured through the memory saver, so it belongs to the
``cuda_graph`` tag and pauses with it. Padding rows write to and read from the
padding slot only. What capturing costs outside every tag (cuBLAS's workspace
for the capture stream, the instantiated graphs) is recorded in the runner's
``outside_tags``.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch

from node_engine.memory.tags import MemoryTag
from node_engine.model.layers import AttentionBatch
from node_engine.step import Step

if TYPE_CHECKING:
    from node_engine.runner import ModelRunner

log = logging.getLogger(__name__)

SMALLEST_CONTEXT_BUCKET = 256


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def context_buckets(context_len: int, smallest: int = SMALLEST_CONTEXT_BUCKET) -> list[int]:
    """Key counts graphs are captured for: powers of two from ``smallest``, then the context length.

    A decode step attends over at most twice the keys its longest sequence has (or ``smallest``).
    """
    buckets = []
    size = smallest
    while size < context_len:
        buckets.append(size)
        size *= 2
    return buckets + [context_len]


def padded(sizes: list[int], num: int) -> int:
    """The smallest of ``sizes`` (sorted) that holds ``num``."""
    return sizes[bisect.bisect_left(sizes, num)]


class DecodeGraphInputs:
    """The fixed buffers a graph decode step reads, and the forward a graph captures."""

    def __init__(self, runner: "ModelRunner", max_bs: int, buckets: list[int]) -> None:
        self.runner = runner
        self.max_bs = max_bs
        self.buckets = buckets
        dev, ctx = runner.device, runner.kv_plan.context_len
        with runner.saver.region(MemoryTag.WORKSPACE):
            self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
            self.slot_mapping = torch.zeros(max_bs, dtype=torch.int64, device=dev)
            self.kv_indices = torch.zeros(max_bs, ctx, dtype=torch.int32, device=dev)
            self.lengths = torch.ones(max_bs, dtype=torch.int64, device=dev)
            self.key_pos = torch.arange(ctx, device=dev)
        runner.saver.register(MemoryTag.WORKSPACE, [self.input_ids, self.positions, self.slot_mapping,
                                                    self.kv_indices, self.lengths, self.key_pos])

    def forward(self, bs: int, num_keys: int) -> torch.Tensor:
        """Hidden states [bs, hidden] of the first ``bs`` rows over their first ``num_keys`` keys."""
        kv_indices = self.kv_indices[:bs, :num_keys]
        mask = (self.key_pos[None, :num_keys] < self.lengths[:bs, None]).view(bs, 1, 1, num_keys)
        batch = AttentionBatch(slot_mapping=self.slot_mapping[:bs], kv_indices=kv_indices, mask=mask,
                               num_seqs=bs, max_query_len=1)
        return self.runner.model(self.input_ids[:bs], self.positions[:bs], batch)

    def fill(self, step: Step, batch_sizes: list[int]) -> tuple[int, int]:
        """Write a decode step into the buffers; returns the (batch size, key count) of the graph to replay."""
        num_seqs = len(step.entries)
        runner = self.runner
        inputs = runner.prepare_decode(step)
        bs = padded(batch_sizes, num_seqs)
        num_keys = padded(self.buckets, inputs.max_len)
        self.input_ids[:num_seqs].copy_(inputs.input_ids)
        self.positions[:num_seqs].copy_(inputs.rope_positions)  # what the model rotates by
        self.slot_mapping[:num_seqs].copy_(inputs.slot_mapping)
        self.kv_indices[:num_seqs, :num_keys].copy_(runner.req_to_token[:, :num_keys].index_select(0, inputs.rows))
        self.lengths[:num_seqs].copy_(inputs.positions + 1)     # the keys each sequence sees
        if bs > num_seqs:
            self.input_ids[num_seqs:bs].zero_()
            self.positions[num_seqs:bs].zero_()
            self.slot_mapping[num_seqs:bs].fill_(runner.padding_slot)
            self.kv_indices[num_seqs:bs, :num_keys].fill_(runner.padding_slot)
            self.lengths[num_seqs:bs].fill_(1)
        return bs, num_keys

    def reset(self) -> None:
        """After the workspace was resumed without its contents."""
        for buf in (self.input_ids, self.positions, self.slot_mapping, self.kv_indices):
            buf.zero_()
        self.lengths.fill_(1)
        torch.arange(self.key_pos.shape[0], out=self.key_pos)


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", max_bs: int) -> None:
        self.runner = runner
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.buckets = context_buckets(runner.kv_plan.context_len)
        self.inputs = DecodeGraphInputs(runner, self.max_bs, self.buckets)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._capture_all()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        runner, saver = self.runner, self.runner.saver
        # Largest first, so that smaller graphs reuse the blocks of its pool.
        shapes = sorted(((bs, keys) for bs in self.batch_sizes for keys in self.buckets),
                        key=lambda shape: (shape[0] * shape[1], shape), reverse=True)
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        allocated_before = torch.cuda.memory_allocated()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # cuBLAS creates its workspace for this stream here, outside any tag
            for shape in shapes:
                for _ in range(2):
                    self.inputs.forward(*shape)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        runner.outside_tags["cublas_workspace_capture_stream"] = max(0, torch.cuda.memory_allocated()
                                                                     - allocated_before)
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info()
        pool_before = saver.tag_bytes(MemoryTag.CUDA_GRAPH)
        pool = None
        for shape in shapes:
            graph = torch.cuda.CUDAGraph()
            with saver.cuda_graph(graph, pool, stream):
                out = self.inputs.forward(*shape)
            if pool is None:
                pool = graph.pool()
            self.graphs[shape] = graph
            self.outputs[shape] = out
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        pool_bytes = saver.tag_bytes(MemoryTag.CUDA_GRAPH) - pool_before
        runner.outside_tags["graph_instantiation"] = max(0, free_before - free_after - pool_bytes)
        log.info("captured %d decode graphs (batch sizes %s x key counts %s): pool %.1f MiB, instantiation "
                 "%.1f MiB", len(self.graphs), self.batch_sizes, self.buckets, pool_bytes / 2**20,
                 runner.outside_tags["graph_instantiation"] / 2**20)

    def reset_buffers(self) -> None:
        """After the workspace was resumed without its contents."""
        self.inputs.reset()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_bs

    def run(self, step: Step) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step of ``len(step.entries)`` sequences."""
        shape = self.inputs.fill(step, self.batch_sizes)
        self.graphs[shape].replay()
        return self.outputs[shape][:len(step.entries)]
