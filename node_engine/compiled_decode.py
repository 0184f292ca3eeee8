"""CPU decode through ``torch.compile`` (``--enable-torch-compile``).

An eager decode step of a small model is mostly fixed cost: about 25 torch
calls per layer, each a few microseconds of dispatch for a few hundred bytes
of arithmetic. Inductor fuses everything between the matrix products and the
attention kernel (norms, rotary, KV store and gather, SiLU, residuals) into a
handful of C++ loops, and its C++ wrapper makes the calls of the whole graph.
The products and the attention stay the library kernels eager mode uses; a
oneDNN projection is one opaque op (``handoff::onednn_project``), so packed
weights keep working.

Rules:

- Compiled once, at start, before the engine serves. One graph serves every
  decode step: batch size and context length are symbolic, the attention mask
  is always built (inside the graph), and a lone sequence gets a padding row
  (a batch of 1 would be specialized into a second graph).
  ``handoff_engine_decode_graphs_compiled`` says if a step ever had to compile.
- Only the decode forward is compiled. Prefill, logits and sampling stay eager.
- The graph reads the weights and the KV pool as inputs on every call, so the
  memory saver's release and resume (storage freed and re-allocated in place)
  and weight reloads need nothing here.
- Warm-up and padding rows write only to the padding slot, as padded CUDA
  graph rows do.
- Compiling needs a C++ compiler and the Python headers (Inductor's CPU
  backend). Kernels are cached on disk (``TORCHINDUCTOR_CACHE_DIR``), so a
  restart with the same model compiles faster than the first start.
"""

from __future__ import annotations

import logging
import time
import types
from typing import TYPE_CHECKING, Callable

import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

from node_engine.config import ConfigError
from node_engine.kv_cache import PADDING_SLOT

if TYPE_CHECKING:
    from node_engine.runner import ModelRunner

log = logging.getLogger(__name__)

DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                         torch.Tensor]

_INDUCTOR_OPTIONS = {
    "cpp_wrapper": True,   # the graph's calls from C++, not Python: 10-15% off a tiny model's step
    "compile_threads": 1,  # compile in this process: a worker pool would outlive an engine killed by a signal
}

# Warm-up shapes. Both must be at least 2 (a size of 1 is specialized; a decode step has at least two
# sequences after padding, and attends to at least the prompt's first token and itself), and they must
# differ: torch gives dimensions of equal size one symbol, which would tie the batch size to the length.
_WARM_UP_SEQS = 2
_WARM_UP_LEN = 4


class CompiledDecode:
    """The runner's decode forward, compiled; called as the eager one.

    ``forward(input_ids, positions, slot_mapping, kv_indices, mask)`` returns
    hidden states [B, hidden]: the eager function's, up to float rounding (the
    fused loops add in another order). ``mask`` is ignored: the graph builds
    its own from ``positions``.
    """

    def __init__(self, runner: "ModelRunner", forward: DecodeForward) -> None:
        if runner.device.type != "cpu":
            raise RuntimeError(f"torch.compile decode is for CPU engines, this one runs on {runner.device}")
        self._forward = forward
        # Dynamo keeps compiled graphs on the function's code object, shared by every instance: a copy of the
        # code per engine keeps each engine's graph, its count and its recompile limit its own.
        masked_forward = _with_own_code(CompiledDecode._masked_forward)
        self._code = masked_forward.__code__
        self._compiled = torch.compile(types.MethodType(masked_forward, self), fullgraph=True,
                                       options=_INDUCTOR_OPTIONS)
        self.device = runner.device
        try:
            self.compile_s = self._warm_up()
        except torch._dynamo.exc.TorchDynamoException as exc:
            raise ConfigError(f"--enable-torch-compile: compiling the decode graph failed: {_explain(exc)}; "
                              "without the flag the engine runs eager") from exc
        log.info("decode compiled with torch.compile in %.1f s", self.compile_s)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_indices: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if input_ids.shape[0] > 1:
            return self._compiled(input_ids, positions, slot_mapping, kv_indices)
        # One sequence: a padding row makes it two, so the graph for many serves it (a batch dimension
        # of size 1 would be specialized into a graph of its own, compiled again).
        padding = torch.tensor([PADDING_SLOT], dtype=torch.int64, device=self.device)
        padded_kv_indices = torch.cat((kv_indices, torch.full_like(kv_indices, PADDING_SLOT)))
        hidden = self._compiled(torch.cat((input_ids, padding)), torch.cat((positions, padding)),
                                torch.cat((slot_mapping, padding)), padded_kv_indices)
        return hidden[:1]

    def _masked_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_indices: torch.Tensor) -> torch.Tensor:
        # The mask is always built (in the graph, where it costs one fused loop): one graph then serves
        # sequences of one length and of many.
        num_seqs, max_len = kv_indices.shape
        key_pos = torch.arange(max_len, device=kv_indices.device)
        mask = (key_pos[None, :] <= positions[:, None]).view(num_seqs, 1, 1, max_len)
        return self._forward(input_ids, positions, slot_mapping, kv_indices, mask)

    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far: 1 after start; more means a decode step stopped to compile."""
        return len(_debug_get_cache_entry_list(self._code))

    @torch.inference_mode()
    def _warm_up(self) -> float:
        started = time.perf_counter()
        self._compiled(*self._example(_WARM_UP_SEQS))
        return time.perf_counter() - started

    def _example(self, num_seqs: int) -> tuple[torch.Tensor, ...]:
        """Inputs of a decode step of ``num_seqs`` sequences, all on the padding slot, marked symbolic."""
        dev, length = self.device, _WARM_UP_LEN
        input_ids = torch.zeros(num_seqs, dtype=torch.int64, device=dev)
        # Position 1 whatever the length: the rotary table may hold only 2 positions (--context-length 2).
        positions = torch.ones(num_seqs, dtype=torch.int64, device=dev)
        slot_mapping = torch.full((num_seqs,), PADDING_SLOT, dtype=torch.int64, device=dev)
        kv_indices = torch.full((num_seqs, length), PADDING_SLOT, dtype=torch.int32, device=dev)
        for tensor in (input_ids, positions, slot_mapping, kv_indices):
            torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(kv_indices, 1)
        return input_ids, positions, slot_mapping, kv_indices


def _with_own_code(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` with a copy of its code object (same behaviour, a distinct Dynamo cache)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _explain(exc: BaseException) -> str:
    """The first line of a compile failure, and what to install when it is the C++ toolchain."""
    reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, (InvalidCxxCompiler, CppCompileError)):
            return f"{reason} (Inductor needs a C++ compiler and the Python headers)"
        cause = cause.__cause__ or cause.__context__
    return reason
