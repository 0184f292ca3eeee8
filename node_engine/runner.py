"""The model runner: owns every device tensor and runs one scheduler step.

Steady-state memory is allocated in exactly one method per tag, each inside
its memory region:

- ``_allocate_weights``: the model's parameters, the vision tower's included (``weights``);
- ``_allocate_workspace``: the request-to-slot table and the CUDA graph static
  buffers (``workspace``); a vision-language model's reservation for its
  worst-case vision step too (``vision/reservation.py``);
- ``_allocate_kv_cache``: the KV pool (``kv_cache``), pinned, a CPU default, or
  sized from measured peaks (``kv_pool.py``, ``kv_sizing.py``) into ``KVPlan``;
- ``DecodeGraphs``: captured decode graphs and their private pool (``cuda_graph``).

The eager forwards over these tensors are ``ModelForward``'s (``model_forward.py``); the runner
picks a step's decode path (CUDA graph, compiled, eager) and samples its tokens.

What stays outside every region: the rotary cos/sin tables (built once, needed
to recompute nothing after a resume), small per-step tensors, and on CUDA the
context itself. ``docs/memory.md`` lists them with sizes.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from node_engine.config import ConfigError, EngineConfig
from node_engine.kv_cache import PADDING_SLOT
from node_engine.kv_pool import KVPlan, fixed_num_slots, size_from_peaks, sizes_from_peaks
from node_engine.kv_sizing import SizingReport
from node_engine.memory.headroom import step_headroom_bytes
from node_engine.memory.saver import MemorySaver
from node_engine.memory.tags import MemoryTag
from node_engine.model.arch import ModelArch
from node_engine.model.builtin import builtin_weights, is_builtin
from node_engine.model.rotary import RotaryTable
from node_engine.model.llama import CausalLM
from node_engine.model.checkpoint_io import CheckpointReader
from node_engine.model.loader import load_tensors, load_weights
from node_engine.model.packing import WeightPacking
from node_engine.model.source import check_vision_flags
from node_engine.model.weight_writer import WeightWriter
from node_engine.model_forward import ModelForward
from node_engine.logits import apply_penalties
from node_engine.logprobs import PromptLogprobs, output_logprobs, step_prompt_logprobs
from node_engine.sampling import sample
from node_engine.step import Step, StepKind, StepResult
from node_engine.step_inputs import DecodeInputs, decode_inputs
from node_engine.vision.inputs import MultimodalPrompt
from node_engine.vision.model import build_model
from node_engine.vision.runtime import VisionRuntime, processor_config_for

if TYPE_CHECKING:
    from node_engine.compiled_decode import CompiledDecode, DecodeForward
    from node_engine.failures import FaultDrill

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        context_len = config.context_length or arch.max_position_embeddings
        if context_len > arch.max_position_embeddings:
            raise ConfigError(f"--context-length {context_len} exceeds the model's max_position_embeddings "
                              f"({arch.max_position_embeddings})")
        flag = "--context-length" if config.context_length else f"--model-path {config.model_path}: " \
            "max_position_embeddings"
        with _flag_allocation(flag, context_len, "the rotary table of that many positions (a smaller "
                                                 "--context-length takes less)"):
            self.rotary = RotaryTable(arch.head_dim, context_len, arch.rope_theta, arch.rope_scaling,
                                      device=self.device, dtype=self.dtype)
        self.model = self._allocate_weights()
        self.model.bind_rotary(self.rotary)
        self.packing = WeightPacking(self.model.packable_projections())
        self.packing.pack()
        self.weight_writer = WeightWriter(self.model, self.packing, self.reader, self.source_dtypes)
        self._allocate_workspace(context_len)
        # Memory outside every tag, by what holds it (docs/memory.md says how each is measured).
        self.outside_tags: dict[str, int] = {"rotary_tables": self.rotary.nbytes}
        self.vision: VisionRuntime | None = None
        if arch.vision is not None:
            self.vision = VisionRuntime(config, arch, self.model.visual, self.rotary,
                                        processor_config_for(config, arch))
            self.vision.reserve(config, saver, self.device)
        self.forward = ModelForward(self.model, self.req_to_token, self.vision, self.device)
        self.bytes_per_slot = 2 * arch.num_layers * arch.kv_size * self.dtype.itemsize
        self.kv_sizing: SizingReport | None = None
        self.context_len = context_len
        pool = None
        if sizes_from_peaks(config):
            sized = size_from_peaks(self, kv_allocate)
            pool, self.kv_sizing = sized.pool, sized.report
            self.outside_tags.update(sized.outside_tags)
        self.kv_plan = KVPlan(num_slots=pool.shape[1] if pool is not None else fixed_num_slots(config) + 1,
                              bytes_per_slot=self.bytes_per_slot, context_len=context_len)
        self._allocate_kv_cache(pool)
        self.step_headroom_bytes = self._step_headroom_bytes()
        self.compiled_decode: CompiledDecode | None = None
        self.decode_forward: DecodeForward = self.forward.decode
        if config.enable_torch_compile:
            from node_engine import compiled_decode  # imports Dynamo and Inductor: only when asked for

            self.compiled_decode = compiled_decode.CompiledDecode(self, self.forward.decode)
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
        rows = self.config.max_running_requests
        with self.saver.region(MemoryTag.WORKSPACE), _flag_allocation("--max-running-requests", rows,
                                                                       f"its request table ({context_len} "
                                                                       "positions each)"):
            self.req_to_token = torch.zeros(rows, context_len, dtype=torch.int32, device=self.device)
        self.saver.register(MemoryTag.WORKSPACE, [self.req_to_token])

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

    def stress(self, num_slots: int) -> None:
        """The heaviest prefill and decode steps the engine can run (``ModelForward.stress``)."""
        self.forward.stress(num_slots, context_len=self.context_len, max_batch_tokens=self.config.max_batch_tokens,
                            max_running_requests=self.config.max_running_requests)

    def _allocate_kv_cache(self, pool: torch.Tensor | None = None) -> None:
        """Keep the sized pool, or allocate one of the planned size."""
        if pool is None:
            with _flag_allocation("--max-total-tokens", self.kv_plan.num_slots - 1, "its KV pool"):
                pool = self.allocate_pool(self.kv_plan.num_slots)
        self.kv_cache = pool
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
            all_hidden, last_index = self.forward.prefill(step)
            prompt_logprobs = step_prompt_logprobs(step.entries, all_hidden, self.model.compute_logits)
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
                                       original=self.config.return_original_logprob,
                                       untempered=[r.prefill_only for r in requests])
        return StepResult(tokens, logprobs, prompt_logprobs)

    def prepare_decode(self, step: Step) -> DecodeInputs:
        """The per-sequence tensors of a decode step; records the new slots."""
        return decode_inputs(step, self.req_to_token)

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

    def score(self, token_ids: list[int], mm: MultimodalPrompt | None = None) -> torch.Tensor:
        """Logits [T, V] of every position of one prompt (``ModelForward.score``: tests and debugging only)."""
        return self.forward.score(token_ids, mm)

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

    @property
    def padding_slot(self) -> int:
        return PADDING_SLOT


@contextlib.contextmanager
def _flag_allocation(flag: str, value: int, what: str) -> Iterator[None]:
    """A tensor sized by ``flag`` that cannot be had (too large for the memory, past int64) is one line naming the
    flag (:class:`ConfigError`, exit 2), not a traceback from torch's allocator."""
    try:
        yield
    except (RuntimeError, MemoryError, TypeError, OverflowError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{flag} {value}: {what} cannot be allocated ({reason})") from None
