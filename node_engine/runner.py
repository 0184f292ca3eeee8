"""The model runner: owns every device tensor and runs one scheduler step.

Steady-state memory is allocated in exactly one method per tag, each inside
its memory region:

- ``_allocate_weights``: the model's parameters, the vision tower's included (``weights``);
- ``_allocate_workspace``: the request-to-slot table and the CUDA graph static
  buffers (``workspace``); a vision-language model's reservation for its
  worst-case vision step too (``vision/reservation.py``);
- ``_allocate_kv_cache``: the KV pool (``kv_cache``), pinned, a CPU default, or
  sized from measured peaks (``kv_sizing.py``) into ``KVPlan``;
- ``DecodeGraphs``: captured decode graphs and their private pool (``cuda_graph``).

What stays outside every region: the rotary cos/sin tables (built once, needed
to recompute nothing after a resume), small per-step tensors, and on CUDA the
context itself. ``docs/memory.md`` lists them with sizes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from node_engine.config import DEFAULT_CPU_MAX_TOTAL_TOKENS, ConfigError, EngineConfig
from node_engine.kv_cache import PADDING_SLOT
from node_engine.kv_sizing import DeviceBudget, HostBudget, KVPoolSizer, KVSizingError, MemoryBudget, SizingReport
from node_engine.memory.peak import CudaPeakMeter, HostPeakMeter
from node_engine.memory.headroom import step_headroom_bytes
from node_engine.memory.saver import MemorySaver
from node_engine.memory.tags import MemoryTag
from node_engine.model.arch import ModelArch, ModelConfigError
from node_engine.model.builtin import builtin_arch, builtin_weights, is_builtin
from node_engine.model.layers import AttentionBatch, RotaryTable
from node_engine.model.llama import CausalLM
from node_engine.model.checkpoint_io import CheckpointReader, TensorEntry
from node_engine.model.loader import (apply_staged, check_update, checkpoint_files, load_tensors, load_weights,
                                     stage_update, touched_parameters)
from node_engine.model.packing import WeightPacking
from node_engine.prefill_batch import prefill_batch
from node_engine.logits import apply_penalties
from node_engine.logprobs import PromptLogprobs, output_logprobs, prompt_logprobs
from node_engine.sampling import sample
from node_engine.scheduler import Step, StepKind, StepResult
from node_engine.tokenizer import Tokenizer
from node_engine.vision.encoder import Chunk
from node_engine.vision.inputs import MultimodalPrompt
from node_engine.vision.model import build_model
from node_engine.vision.runtime import VisionRuntime, processor_config_for

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
    rope_positions: torch.Tensor  # [B] the position it rotates by (M-RoPE: position + the prompt's delta)
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
        arch = builtin_arch(config.model_path, config.model_override_dict())
        return arch, Tokenizer.builtin_bytes(vision=arch.vision is not None)
    if config.model_override:
        raise ConfigError("--model-override applies to built-in models only")
    folder = Path(config.model_path)
    arch = ModelArch.from_folder(folder)
    checkpoint_files(folder)
    tokenizer = Tokenizer.from_folder(folder, extra_eos_ids=arch.eos_token_ids)
    if tokenizer.vocab_size > arch.vocab_size:
        raise ModelConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model only {arch.vocab_size}")
    return arch, tokenizer


VISION_FLAGS = ("max_image_tokens", "visual_batch_max_tokens", "vision_reserve_mb")


def check_vision_flags(config: EngineConfig, arch: ModelArch) -> None:
    if arch.vision is None:
        given = [name for name in VISION_FLAGS if getattr(config, name) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} is for vision-language models; {config.model_path} "
                              "has no vision tower")
    elif config.enable_torch_compile:
        raise ConfigError("--enable-torch-compile is not available for vision-language models yet (M-RoPE "
                          "positions differ from token positions in decode)")


class ModelRunner:
    def __init__(self, config: EngineConfig, saver: MemorySaver, arch: ModelArch, *,
                 drill: FaultDrill | None = None,
                 kv_allocate: Callable[[str, int], torch.Tensor] | None = None) -> None:
        """``kv_allocate``: the KV sizer's allocation function (tests inject failures through it)."""
        check_vision_flags(config, arch)
        self.config = config
        self.saver = saver
        self.arch = arch
        self.drill = drill
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.resolved_dtype]
        self.reader = CheckpointReader(drill=drill)
        self.keep_unpacked = False  # an update session is open: weights stay plain until it ends
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
        # Memory outside every tag, by what holds it (docs/memory.md says how each is measured).
        self.outside_tags: dict[str, int] = {"rotary_tables": self.rotary.nbytes}
        self.vision: VisionRuntime | None = None
        if arch.vision is not None:
            self.vision = VisionRuntime(config, arch, self.model.visual, self.rotary,
                                        processor_config_for(config, arch))
            self.vision.reserve(config, saver, self.device)
        self.bytes_per_slot = 2 * arch.num_layers * arch.kv_size * self.dtype.itemsize
        self.kv_sizing: SizingReport | None = None
        self.context_len = context_len
        pool = self._size_kv_pool(kv_allocate) if self._sizes_from_peaks else None
        self.kv_plan = KVPlan(num_slots=pool.shape[1] if pool is not None else self._fixed_num_slots() + 1,
                              bytes_per_slot=self.bytes_per_slot, context_len=context_len)
        self._allocate_kv_cache(pool)
        self.step_headroom_bytes = self._step_headroom_bytes()
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
            model = build_model(self.arch, device=self.device, dtype=self.dtype)
        self.saver.register(MemoryTag.WEIGHTS, model.parameters())
        if is_builtin(self.config.model_path):
            self.source_dtypes = load_tensors(model, builtin_weights(self.arch, self.config.seed))
        else:
            self.source_dtypes = load_weights(model, Path(self.config.model_path), self.reader)
        return model

    def _allocate_workspace(self, context_len: int) -> None:
        with self.saver.region(MemoryTag.WORKSPACE):
            self.req_to_token = torch.zeros(self.config.max_running_requests, context_len, dtype=torch.int32,
                                            device=self.device)
        self.saver.register(MemoryTag.WORKSPACE, [self.req_to_token])

    @property
    def _sizes_from_peaks(self) -> bool:
        """Pinned (``--max-total-tokens``) or a CPU engine without a budget: a fixed size, no profiling."""
        config = self.config
        return config.max_total_tokens is None and (self.device.type == "cuda" or config.memory_budget_mb is not None)

    def _fixed_num_slots(self) -> int:
        return self.config.max_total_tokens if self.config.max_total_tokens is not None else DEFAULT_CPU_MAX_TOTAL_TOKENS

    def _size_kv_pool(self, allocate: Callable[[str, int], torch.Tensor] | None) -> torch.Tensor:
        """The KV pool sized by ``kv_sizing.py`` (probe, target, validation, shrink and retry)."""
        config = self.config
        if self.device.type == "cuda":
            meter = CudaPeakMeter()
            budget: MemoryBudget = DeviceBudget(config.mem_fraction)
        else:
            meter = HostPeakMeter()
            budget = HostBudget(config.memory_budget_mb * 2**20, meter)
        min_slots = min(config.max_batch_tokens, self.context_len) + 1
        sizer = KVPoolSizer(self, budget, meter, device=self.device, min_slots=min_slots, probe_slots=min_slots,
                            allocate=allocate)
        self.kv_sizing = sizer.report
        allocated_before = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        try:
            pool = sizer.run()
        except KVSizingError:
            raise KVSizingError(self._sizing_error(sizer.report, budget)) from None
        pool.zero_()  # the stresses wrote garbage into it
        if self.device.type == "cuda":  # what the first forwards left allocated for good: cuBLAS's workspaces
            torch.cuda.synchronize()
            self.outside_tags["cublas_workspace_main_stream"] = max(
                0, torch.cuda.memory_allocated() - allocated_before - pool.nbytes)
        return pool

    def _sizing_error(self, report: SizingReport, budget: MemoryBudget) -> str:
        config, mib = self.config, 2**20
        weights = self.saver.tag_bytes(MemoryTag.WEIGHTS)
        workspace = self.saver.tag_bytes(MemoryTag.WORKSPACE)
        reservation = self.vision.reservation.num_bytes if self.vision and self.vision.reservation else 0
        left = report.free_bytes - report.activation_peak_bytes - report.canary_bytes
        vision = ""
        if self.vision is not None:
            vision = (f" of which the vision reservation {reservation / mib:.1f} MiB for --max-image-tokens "
                      f"{self.vision.max_image_tokens} and --visual-batch-max-tokens {self.vision.visual_budget}")
        attempts = "; ".join(f"{a.num_slots} slots: {a.outcome}" for a in report.attempts)
        knobs = "--max-batch-tokens, --max-running-requests, --context-length"
        knobs += ", --max-image-tokens or --visual-batch-max-tokens" if self.vision is not None else " or the model"
        return (f"no KV pool fits {budget.describe()}: the engine holds {report.held_bytes / mib:.1f} MiB before "
                f"the pool (weights {weights / mib:.1f} MiB, workspace {workspace / mib:.1f} MiB{vision}, the "
                f"process itself); the activation peak measured at "
                f"--max-batch-tokens {config.max_batch_tokens} and --max-running-requests "
                f"{config.max_running_requests} ({self.context_len}-token context) is "
                f"{report.activation_peak_bytes / mib:.1f} MiB and the canary {report.canary_bytes / mib:.0f} MiB; "
                f"{report.free_bytes / mib:.1f} MiB were free, leaving {max(0, left) / mib:.1f} MiB for the pool "
                f"({max(0, left) // report.bytes_per_slot} slots of {report.bytes_per_slot} bytes; at least "
                f"{min(config.max_batch_tokens, self.context_len) + 1} needed). Attempts: {attempts or 'none'}. "
                f"Give the engine more memory, lower {knobs}, or pin --max-total-tokens (no sizing).")

    def _step_headroom_bytes(self) -> int:
        """What one step may take outside every tag: the KV sizer's measured activation peak (its prefill and
        decode stresses) when it ran, else computed from the shapes (``memory/headroom.py``)."""
        if self.kv_sizing is not None and self.kv_sizing.activation_peak_bytes:
            return self.kv_sizing.activation_peak_bytes
        config, plan = self.config, self.kv_plan
        return step_headroom_bytes(self.arch, max_batch_tokens=config.max_batch_tokens,
                                   max_running_requests=config.max_running_requests, context_len=plan.context_len,
                                   num_slots=plan.num_slots, itemsize=self.dtype.itemsize)

    # -- what the KV sizer needs (kv_sizing.SizingTarget) ------------------------
    def allocate_pool(self, num_slots: int) -> torch.Tensor:
        arch = self.arch
        with self.saver.region(MemoryTag.KV_CACHE):
            # Per layer and slot, the keys then the values: a token's KV is one contiguous row.
            return torch.zeros(arch.num_layers, num_slots, 2 * arch.num_kv_heads, arch.head_dim,
                               dtype=self.dtype, device=self.device)

    def bind_pool(self, pool: torch.Tensor | None) -> None:
        if pool is None:  # unbind: layers must not keep a pool alive
            self.model.bind_kv_cache([torch.empty(0, device=self.device)] * self.arch.num_layers)
        else:
            self.model.bind_kv_cache(list(pool))

    @torch.inference_mode()
    def stress(self, num_slots: int) -> None:
        """The heaviest prefill and decode steps the engine can run (their values do not matter).

        Prefill: one chunk of ``--max-batch-tokens`` at the end of the context. Decode: the maximum batch,
        every sequence as long as the context.
        """
        dev, ctx, usable = self.device, self.context_len, num_slots - 1
        n = min(self.config.max_batch_tokens, ctx)
        key_pos = torch.arange(ctx, device=dev)
        query_pos = key_pos[ctx - n:]
        keys = (key_pos % usable + 1).view(1, ctx)
        batch = AttentionBatch(slot_mapping=(torch.arange(n, device=dev) % usable) + 1, kv_indices=keys,
                               mask=(key_pos[None, :] <= query_pos[:, None]).view(1, 1, n, ctx), num_seqs=1,
                               max_query_len=n)
        hidden = self.model(torch.zeros(n, dtype=torch.int64, device=dev), query_pos, batch)
        self.model.compute_logits(hidden[-min(n, self.config.max_running_requests):])
        del hidden, batch
        num_seqs = self.config.max_running_requests
        hidden = self._decode_forward(
            torch.zeros(num_seqs, dtype=torch.int64, device=dev),
            torch.full((num_seqs,), ctx - 1, dtype=torch.int64, device=dev),
            (torch.arange(num_seqs, device=dev) % usable) + 1, keys.to(torch.int32).expand(num_seqs, ctx),
            torch.ones(num_seqs, 1, 1, ctx, dtype=torch.bool, device=dev))
        self.model.compute_logits(hidden)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def _allocate_kv_cache(self, pool: torch.Tensor | None = None) -> None:
        """Keep the sized pool, or allocate one of the planned size."""
        self.kv_cache = pool if pool is not None else self.allocate_pool(self.kv_plan.num_slots)
        self.saver.register(MemoryTag.KV_CACHE, [self.kv_cache])
        self.bind_pool(self.kv_cache)

    # -- one step --------------------------------------------------------------
    @torch.inference_mode()
    def run(self, step: Step, eos_token_ids: Sequence[int] = ()) -> StepResult:
        """Compute the step's tokens: one sampled token per entry that samples, and the logprobs asked for.

        ``eos_token_ids`` are the tokens ``min_new_tokens`` holds back (with each request's stop tokens).
        """
        prompt_logprobs: dict[int, PromptLogprobs] = {}
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
            all_hidden, last_index = self._forward_prefill(step)
            prompt_logprobs = self._prompt_logprobs(step, all_hidden)
            if not sampling:
                return StepResult([], None, prompt_logprobs)
            hidden = all_hidden if len(last_index) == all_hidden.shape[0] else \
                all_hidden.index_select(0, torch.tensor(last_index, dtype=torch.int64, device=self.device))
        logits = self.model.compute_logits(hidden)
        requests = [e.request for e in sampling]
        if any(r.params.has_penalties for r in requests):
            apply_penalties(logits, [(r.params, r.output_ids) for r in requests], eos_token_ids)
        params = [r.params for r in requests]
        tokens = sample(logits, params, [r.generator for r in requests])
        logprobs = None
        if any(r.logprobs is not None for r in requests):
            logprobs = output_logprobs(logits, params, [r.logprobs for r in requests], tokens,
                                       original=self.config.return_original_logprob)
        return StepResult(tokens, logprobs, prompt_logprobs)

    def _prompt_logprobs(self, step: Step, hidden: torch.Tensor) -> dict[int, PromptLogprobs]:
        """Prompt logprobs of the positions this prefill computed that a request still needs."""
        result: dict[int, PromptLogprobs] = {}
        offset = 0
        for index, e in enumerate(step.entries):
            request = e.request
            first = request.prompt_logprob_next
            if first is not None and request.logprobs is not None:
                first = max(first, e.start)
                end = min(e.end, len(request.prompt_ids) - 1)  # the last prompt position predicts no prompt token
                if first < end:
                    rows = hidden[offset + first - e.start:offset + end - e.start]
                    result[index] = prompt_logprobs(rows, request.prompt_ids[first + 1:end + 1], first,
                                                    request.logprobs, self.model.compute_logits)
            offset += e.end - e.start
        return result

    def prepare_decode(self, step: Step) -> DecodeInputs:
        """The per-sequence tensors of a decode step, built in one pass; records the new slots."""
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        rope: list[int] = []  # the same as positions unless a prompt had images (M-RoPE's delta)
        for e in step.entries:
            request = e.request
            num_prompt = len(request.prompt_ids)
            tokens.append(request.prompt_ids[e.start] if e.start < num_prompt
                          else request.output_ids[e.start - num_prompt])
            positions.append(e.start)
            rows.append(request.row)
            # A decoded token is text after the prompt's last image (a prompt never ends with an image token).
            rope.append(e.start if request.mm is None else e.start + request.mm.rope_delta)
        input_ids, position_t, rows_t, rope_t = torch.tensor([tokens, positions, rows, rope],
                                                             device=self.device).unbind(0)
        # A copy even on CPU: made here, under inference mode, like the other inputs. A compiled decode
        # graph is specialized on that (the scheduler's tensor is an ordinary one).
        slot_mapping = step.slot_mapping.to(self.device, copy=True)
        self.req_to_token[rows_t, position_t] = slot_mapping.to(torch.int32)
        max_position = max(positions)
        return DecodeInputs(input_ids=input_ids, positions=position_t, rope_positions=rope_t, rows=rows_t,
                            slot_mapping=slot_mapping, max_len=max_position + 1,
                            is_ragged=min(positions) != max_position)

    def _forward_decode(self, step: Step) -> torch.Tensor:
        """Hidden states [B, hidden] of one token per sequence."""
        inputs = self.prepare_decode(step)
        num_seqs, max_len = len(step.entries), inputs.max_len
        kv_indices = self.req_to_token[:, :max_len].index_select(0, inputs.rows)
        mask = None  # sequences of one length: no padding in kv_indices, nothing to hide
        if inputs.is_ragged:
            key_pos = torch.arange(max_len, device=self.device)
            mask = (key_pos.unsqueeze(0) <= inputs.positions.unsqueeze(1)).view(num_seqs, 1, 1, max_len)
        return self.decode_forward(inputs.input_ids, inputs.rope_positions, inputs.slot_mapping, kv_indices, mask)

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_indices: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The model over one decode step's tensors (what ``--enable-torch-compile`` compiles)."""
        batch = AttentionBatch(slot_mapping=slot_mapping, kv_indices=kv_indices, mask=mask,
                               num_seqs=kv_indices.shape[0], max_query_len=1)
        return self.model(input_ids, positions, batch)

    def _forward_prefill(self, step: Step) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of every token the step computes, and the rows of its sampling positions (the last
        token of each entry that samples)."""
        entries = step.entries
        dev = self.device
        if step.images:
            self._vision().encoder.encode(step.images)
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
        batch = prefill_batch(step.entries, slot_mapping, self.req_to_token)
        if any(e.request.mm is not None for e in entries):
            hidden = self._forward_multimodal([(e.request.mm, e.start, e.end) for e in entries], input_ids,
                                              position_t, batch)
        else:
            hidden = self.model(input_ids, position_t, batch)
        return hidden, last_index

    def _vision(self) -> VisionRuntime:
        if self.vision is None:
            raise RuntimeError("images reached a model without a vision tower")
        return self.vision

    def _forward_multimodal(self, chunks: list[Chunk], input_ids: torch.Tensor, positions: torch.Tensor,
                            batch: AttentionBatch) -> torch.Tensor:
        """A prefill with images: their rows in the embeddings, M-RoPE for every token; then what the chunks
        consumed is dropped."""
        encoder = self._vision().encoder
        embeds = encoder.embed(chunks, input_ids, self.model.model.embed_tokens.weight)
        hidden = self.model(input_ids, positions, batch, embeds=embeds, rope=encoder.rope(chunks))
        encoder.release_consumed(chunks)
        return hidden

    @torch.inference_mode()
    def score(self, token_ids: list[int], mm: MultimodalPrompt | None = None) -> torch.Tensor:
        """Logits [T, V] of every position of one prompt, with its images if ``mm`` (tests and debugging only).

        Uses KV slots 1..T of the pool: only for a runner that serves nothing (no
        requests, no cached prefixes), as the tests build it.
        """
        n = len(token_ids)
        slots = torch.arange(1, n + 1, device=self.device)
        batch = AttentionBatch(slot_mapping=slots, kv_indices=slots.view(1, n), mask=None, num_seqs=1,
                               max_query_len=n, is_causal_self_only=True)
        input_ids, positions = torch.tensor(token_ids, device=self.device), torch.arange(n, device=self.device)
        if mm is None:
            hidden = self.model(input_ids, positions, batch)
        else:
            self._vision().encoder.encode(mm.needing_encode(0, n))
            hidden = self._forward_multimodal([(mm, 0, n)], input_ids, positions, batch)
        return self.model.compute_logits(hidden)

    def reset_kv_cache(self) -> None:
        """After the KV pool was resumed without its contents: zeros, unless the saver resumed it as zeros.

        Attention reads slots it then masks (``kv_indices`` padded with the padding
        slot, rows of the request-to-slot table past a sequence's length), and a
        masked weight times a NaN is still NaN: a CUDA resume maps fresh pages whose
        contents are undefined. One memset of the pool (docs/memory.md has its cost).
        """
        if not self.saver.resumes_zeroed:
            self.kv_cache.zero_()

    def memory_outside_tags(self) -> dict[str, int]:
        """What the engine holds outside every tag, by part; on CUDA also what torch's allocator reserves
        outside every tag now (cached blocks until a release empties the cache)."""
        parts = dict(self.outside_tags)
        if self.device.type == "cuda":
            in_tags = sum(self.saver.tag_bytes(tag) for tag in MemoryTag)
            parts["allocator_outside_tags"] = max(0, torch.cuda.memory_reserved() - in_tags)
        return parts

    def reset_workspace(self) -> None:
        """After the workspace was resumed without its contents: make every index valid again."""
        self.req_to_token.zero_()
        if self.graphs is not None:
            self.graphs.reset_buffers()

    # -- weights ---------------------------------------------------------------
    def check_weights_update(self, folder: Path) -> dict[str, TensorEntry]:
        """Headers only; any thread (reads the parameters' shapes, never their storage)."""
        return check_update(self.model, folder, self.source_dtypes, self.reader)

    def stage_weights_update(self, entries: dict[str, TensorEntry],
                             cancel: threading.Event | None = None) -> dict[str, torch.Tensor]:
        """Every tensor of a checked reload, read into host memory; any thread."""
        return stage_update(self.model, entries, self.reader, cancel)

    def apply_weights(self, tensors: dict[str, torch.Tensor], *, is_complete: bool) -> None:
        """Copy checked tensors into the parameters; engine thread only.

        ``is_complete``: every weight is written, so packed projections need not
        be written back first. A bucket unpacks only the projections it writes.
        While an update session is open (``keep_unpacked``) nothing is packed
        again until it ends.
        """
        if is_complete:
            self.packing.unpack(keep_contents=False)
        else:
            self.packing.unpack(only=touched_parameters(self.model, list(tensors)))
        try:
            apply_staged(self.model, tensors)
        finally:
            if not self.keep_unpacked:
                self.packing.try_pack()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def open_weight_session(self) -> None:
        """SGLang's ``begin_weight_update``: plain weights until the session ends, so buckets unpack nothing."""
        self.keep_unpacked = True
        self.packing.unpack()

    def close_weight_session(self) -> None:
        self.keep_unpacked = False
        self.packing.try_pack()

    @property
    def padding_slot(self) -> int:
        return PADDING_SLOT
