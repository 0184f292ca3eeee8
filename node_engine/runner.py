"""The model runner: owns every device tensor and runs one scheduler step.

Steady-state memory is allocated in exactly one method per tag, each inside
its memory region:

- ``_allocate_weights``: the model's parameters (``weights``);
- ``_allocate_workspace``: the request-to-slot table and the CUDA graph static
  buffers (``workspace``);
- ``_allocate_kv_cache``: the KV pool (``kv_cache``), sized into ``KVPlan``;
- ``DecodeGraphs``: captured decode graphs and their private pool (``cuda_graph``).

What stays outside every region: the rotary cos/sin tables (built once, needed
to recompute nothing after a resume), small per-step tensors, and on CUDA the
context itself. ``docs/memory.md`` lists them with sizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from node_engine.config import DEFAULT_CPU_MAX_TOTAL_TOKENS, ConfigError, EngineConfig
from node_engine.kv_cache import PADDING_SLOT
from node_engine.memory.saver import MemorySaver
from node_engine.memory.tags import MemoryTag
from node_engine.model.arch import ModelArch, ModelConfigError
from node_engine.model.builtin import builtin_arch, builtin_weights, is_builtin
from node_engine.model.layers import AttentionBatch, RotaryTable
from node_engine.model.llama import CausalLM
from node_engine.model.loader import apply_update, check_update, checkpoint_files, load_tensors, load_weights
from node_engine.model.packing import WeightPacking
from node_engine.prefill_batch import prefill_batch
from node_engine.sampling import sample
from node_engine.scheduler import Step, StepKind
from node_engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from node_engine.compiled_decode import CompiledDecode, DecodeForward
    from node_engine.failures import FaultDrill

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DecodeInputs:
    """Per-sequence tensors of one decode step (on the device), and what the attention batch needs to know."""

    input_ids: torch.Tensor     # [B] the token each sequence computes
    positions: torch.Tensor     # [B] its position
    rows: torch.Tensor          # [B] the sequence's row of the request-to-slot table
    slot_mapping: torch.Tensor  # [B] the slot its KV goes to
    max_len: int                # keys of the longest sequence
    is_ragged: bool             # sequences differ in length (the attention needs a mask)


@dataclass(frozen=True)
class KVPlan:
    """The KV pool as sized at start (a run-time result, not configuration)."""

    num_slots: int
    bytes_per_slot: int
    context_len: int

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot


def load_model_source(config: EngineConfig) -> tuple[ModelArch, Tokenizer]:
    """Architecture and tokenizer of the configured model; fails early, naming what is wrong."""
    if is_builtin(config.model_path):
        return builtin_arch(config.model_path, config.model_override_dict()), Tokenizer.builtin_bytes()
    if config.model_override:
        raise ConfigError("--model-override applies to built-in models only")
    folder = Path(config.model_path)
    arch = ModelArch.from_folder(folder)
    checkpoint_files(folder)
    tokenizer = Tokenizer.from_folder(folder, extra_eos_ids=arch.eos_token_ids)
    if tokenizer.vocab_size > arch.vocab_size:
        raise ModelConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model only {arch.vocab_size}")
    return arch, tokenizer


class ModelRunner:
    def __init__(self, config: EngineConfig, saver: MemorySaver, arch: ModelArch, *,
                 drill: FaultDrill | None = None) -> None:
        self.config = config
        self.saver = saver
        self.arch = arch
        self.drill = drill
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.resolved_dtype]
        context_len = config.context_length or arch.max_position_embeddings
        if context_len > arch.max_position_embeddings:
            raise ConfigError(f"--context-length {context_len} exceeds the model's max_position_embeddings "
                              f"({arch.max_position_embeddings})")
        self.rotary = RotaryTable(arch.head_dim, context_len, arch.rope_theta, arch.rope_scaling,
                                  device=self.device, dtype=self.dtype)
        self.model = self._allocate_weights()
        self.model.bind_rotary(self.rotary)
        self.packing = WeightPacking(self.model.packable_projections())
        self.packing.pack()
        self._allocate_workspace(context_len)
        self.kv_plan = self._plan_kv(context_len)
        self._allocate_kv_cache()
        self.compiled_decode: CompiledDecode | None = None
        self.decode_forward: DecodeForward = self._decode_forward
        if config.enable_torch_compile:
            from node_engine import compiled_decode  # imports Dynamo and Inductor: only when asked for

            self.compiled_decode = compiled_decode.CompiledDecode(self, self._decode_forward)
            self.decode_forward = self.compiled_decode
        self.graphs = None
        if self.device.type == "cuda" and not config.disable_cuda_graph:
            from node_engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_bs=min(config.cuda_graph_max_bs, config.max_running_requests))

    # -- allocation sites ------------------------------------------------------
    def _allocate_weights(self) -> CausalLM:
        with self.saver.region(MemoryTag.WEIGHTS):
            model = CausalLM(self.arch, device=self.device, dtype=self.dtype)
        self.saver.register(MemoryTag.WEIGHTS, model.parameters())
        if is_builtin(self.config.model_path):
            self.source_dtypes = load_tensors(model, builtin_weights(self.arch, self.config.seed))
        else:
            self.source_dtypes = load_weights(model, Path(self.config.model_path))
        return model

    def _allocate_workspace(self, context_len: int) -> None:
        with self.saver.region(MemoryTag.WORKSPACE):
            self.req_to_token = torch.zeros(self.config.max_running_requests, context_len, dtype=torch.int32,
                                            device=self.device)
        self.saver.register(MemoryTag.WORKSPACE, [self.req_to_token])

    def _plan_kv(self, context_len: int) -> KVPlan:
        arch = self.arch
        bytes_per_slot = 2 * arch.num_layers * arch.kv_size * self.dtype.itemsize
        if self.config.max_total_tokens is not None:
            num_slots = self.config.max_total_tokens
        elif self.device.type == "cpu":
            num_slots = DEFAULT_CPU_MAX_TOTAL_TOKENS
        else:
            num_slots = self._slots_from_free_memory(bytes_per_slot)
        return KVPlan(num_slots=num_slots + 1, bytes_per_slot=bytes_per_slot, context_len=context_len)

    def _slots_from_free_memory(self, bytes_per_slot: int) -> int:
        """CUDA: size the pool from free memory after a warm-up forward of a full prefill chunk."""
        num_warm = self.config.max_batch_tokens
        kv = torch.zeros(self.arch.num_layers, num_warm + 1, 2 * self.arch.num_kv_heads, self.arch.head_dim,
                         dtype=self.dtype, device=self.device)
        self.model.bind_kv_cache(list(kv))
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ids = torch.zeros(num_warm, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_warm, device=self.device) % self.rotary.num_positions
        slots = torch.arange(1, num_warm + 1, device=self.device)
        batch = AttentionBatch(slot_mapping=slots, kv_indices=slots.view(1, -1), mask=None, num_seqs=1,
                               max_query_len=num_warm, is_causal_self_only=True)
        with torch.inference_mode():
            self.model.compute_logits(self.model(ids, positions, batch))
        torch.cuda.synchronize()
        activation_bytes = torch.cuda.max_memory_allocated() - before
        self.model.bind_kv_cache([torch.empty(0, device=self.device)] * self.arch.num_layers)  # else layers keep it
        del kv, ids, positions, slots, batch
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        budget = free * self.config.mem_fraction - 2 * activation_bytes
        num_slots = int(budget // bytes_per_slot)
        if num_slots < 16:
            raise ConfigError(f"not enough free GPU memory for a KV pool: {free} bytes free after the weights")
        log.info("KV pool sized from free memory: %d slots (%.2f GiB), activations %.2f GiB", num_slots,
                 num_slots * bytes_per_slot / 2**30, activation_bytes / 2**30)
        return num_slots

    def _allocate_kv_cache(self) -> None:
        arch, plan = self.arch, self.kv_plan
        with self.saver.region(MemoryTag.KV_CACHE):
            # Per layer and slot, the keys then the values: a token's KV is one contiguous row.
            self.kv_cache = torch.zeros(arch.num_layers, plan.num_slots, 2 * arch.num_kv_heads, arch.head_dim,
                                        dtype=self.dtype, device=self.device)
        self.saver.register(MemoryTag.KV_CACHE, [self.kv_cache])
        self.model.bind_kv_cache(list(self.kv_cache))

    # -- one step --------------------------------------------------------------
    @torch.inference_mode()
    def run(self, step: Step) -> list[int]:
        """Compute the step's tokens; returns one sampled token per entry that samples."""
        if self.drill is not None:
            self.drill.fire(step.kind.value)
        if step.kind is StepKind.DECODE:
            sampling = step.entries  # every decode entry ends at its last token
            if self.graphs is not None and self.graphs.can_run(len(sampling)):
                hidden = self.graphs.run(step)
            else:
                hidden = self._forward_decode(step)
        else:
            sampling = [e for e in step.entries if e.samples]
            hidden = self._forward_prefill(step)
            if not sampling:
                return []
        logits = self.model.compute_logits(hidden)
        return sample(logits, [e.request.params for e in sampling], [e.request.generator for e in sampling])

    def prepare_decode(self, step: Step) -> DecodeInputs:
        """The per-sequence tensors of a decode step, built in one pass; records the new slots."""
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for e in step.entries:
            request = e.request
            num_prompt = len(request.prompt_ids)
            tokens.append(request.prompt_ids[e.start] if e.start < num_prompt
                          else request.output_ids[e.start - num_prompt])
            positions.append(e.start)
            rows.append(request.row)
        input_ids, position_t, rows_t = torch.tensor([tokens, positions, rows], device=self.device).unbind(0)
        # A copy even on CPU: made here, under inference mode, like the other inputs. A compiled decode
        # graph is specialized on that (the scheduler's tensor is an ordinary one).
        slot_mapping = step.slot_mapping.to(self.device, copy=True)
        self.req_to_token[rows_t, position_t] = slot_mapping.to(torch.int32)
        max_position = max(positions)
        return DecodeInputs(input_ids=input_ids, positions=position_t, rows=rows_t, slot_mapping=slot_mapping,
                            max_len=max_position + 1, is_ragged=min(positions) != max_position)

    def _forward_decode(self, step: Step) -> torch.Tensor:
        """Hidden states [B, hidden] of one token per sequence."""
        inputs = self.prepare_decode(step)
        num_seqs, max_len = len(step.entries), inputs.max_len
        kv_indices = self.req_to_token[:, :max_len].index_select(0, inputs.rows)
        mask = None  # sequences of one length: no padding in kv_indices, nothing to hide
        if inputs.is_ragged:
            key_pos = torch.arange(max_len, device=self.device)
            mask = (key_pos.unsqueeze(0) <= inputs.positions.unsqueeze(1)).view(num_seqs, 1, 1, max_len)
        return self.decode_forward(inputs.input_ids, inputs.positions, inputs.slot_mapping, kv_indices, mask)

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_indices: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The model over one decode step's tensors (what ``--enable-torch-compile`` compiles)."""
        batch = AttentionBatch(slot_mapping=slot_mapping, kv_indices=kv_indices, mask=mask,
                               num_seqs=kv_indices.shape[0], max_query_len=1)
        return self.model(input_ids, positions, batch)

    def _forward_prefill(self, step: Step) -> torch.Tensor:
        """Hidden states of the step's sampling positions (the last token of each entry that samples)."""
        entries = step.entries
        dev = self.device
        slot_mapping = step.slot_mapping.to(dev)
        tokens: list[int] = []
        positions: list[int] = []
        last_index: list[int] = []
        for e in entries:
            num = e.end - e.start
            if e.prefix is not None:  # a reused cached prefix: its slots open the request's row
                self.req_to_token[e.request.row, :e.start] = e.prefix.to(device=dev, dtype=torch.int32)
            self.req_to_token[e.request.row, e.start:e.end] = slot_mapping[len(tokens):len(tokens) + num]
            tokens.extend(e.request.token_slice(e.start, e.end))
            positions.extend(range(e.start, e.end))
            if e.samples:
                last_index.append(len(tokens) - 1)
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        position_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        hidden = self.model(input_ids, position_t, prefill_batch(step.entries, slot_mapping, self.req_to_token))
        if len(last_index) == len(tokens):
            return hidden
        return hidden.index_select(0, torch.tensor(last_index, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of every position of one prompt (tests and debugging only).

        Uses KV slots 1..T of the pool: only for a runner that serves nothing (no
        requests, no cached prefixes), as the tests build it.
        """
        n = len(token_ids)
        slots = torch.arange(1, n + 1, device=self.device)
        batch = AttentionBatch(slot_mapping=slots, kv_indices=slots.view(1, n), mask=None, num_seqs=1,
                               max_query_len=n, is_causal_self_only=True)
        hidden = self.model(torch.tensor(token_ids, device=self.device), torch.arange(n, device=self.device), batch)
        return self.model.compute_logits(hidden)

    def reset_workspace(self) -> None:
        """After the workspace was resumed without its contents: make every index valid again."""
        self.req_to_token.zero_()
        if self.graphs is not None:
            self.graphs.reset_buffers()

    # -- weights ---------------------------------------------------------------
    def check_weights_update(self, folder: Path):
        return check_update(self.model, folder, self.source_dtypes)

    def apply_weights_update(self, entries) -> None:
        # Every weight is overwritten (and a failure part way marks them invalid): nothing to write back.
        self.packing.unpack(keep_contents=False)
        try:
            apply_update(self.model, entries)
        finally:
            self.packing.try_pack()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @property
    def padding_slot(self) -> int:
        return PADDING_SLOT
