"""The model's eager forward passes over the runner's tensors: a decode step's tensors, a prefill step (its images
encoded and placed, M-RoPE for every token), and the forwards that serve no request (the KV sizer's heaviest steps,
a prompt's logits for tests and debugging). It allocates nothing that outlives a call; the runner
(``runner.py``) owns every tensor it reads and picks the decode path (CUDA graph, compiled, eager).
"""

from __future__ import annotations

import torch

from node_engine.model.layers import AttentionBatch
from node_engine.model.llama import CausalLM
from node_engine.prefill_batch import prefill_batch
from node_engine.step import Step
from node_engine.step_inputs import prefill_inputs
from node_engine.vision.encoder import Chunk
from node_engine.vision.inputs import MultimodalPrompt
from node_engine.vision.runtime import VisionRuntime


class ModelForward:
    def __init__(self, model: CausalLM, req_to_token: torch.Tensor, vision: VisionRuntime | None,
                 device: torch.device) -> None:
        """``req_to_token``: the request-to-slot table (its storage may be released and resumed, never replaced)."""
        self.model = model
        self.req_to_token = req_to_token
        self.vision = vision
        self.device = device

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               kv_indices: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The model over one decode step's tensors (what ``--enable-torch-compile`` compiles)."""
        batch = AttentionBatch(slot_mapping=slot_mapping, kv_indices=kv_indices, mask=mask,
                               num_seqs=kv_indices.shape[0], max_query_len=1)
        return self.model(input_ids, positions, batch)

    def prefill(self, step: Step) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of every token the step computes, and the rows of its sampling positions (the last
        token of each entry that samples)."""
        if step.images:
            self._vision().encoder.encode(step.images)
        inputs = prefill_inputs(step, self.req_to_token)
        batch = prefill_batch(step.entries, inputs.slot_mapping, self.req_to_token)
        if any(e.request.mm is not None for e in step.entries):
            hidden = self._multimodal([(e.request.mm, e.start, e.end) for e in step.entries],
                                      inputs.input_ids, inputs.positions, batch)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, batch)
        return hidden, inputs.sampling_rows

    def _vision(self) -> VisionRuntime:
        if self.vision is None:
            raise RuntimeError("images reached a model without a vision tower")
        return self.vision

    def _multimodal(self, chunks: list[Chunk], input_ids: torch.Tensor, positions: torch.Tensor,
                    batch: AttentionBatch) -> torch.Tensor:
        """A prefill with images: their rows in the embeddings, M-RoPE for every token; then what the chunks
        consumed is dropped."""
        encoder = self._vision().encoder
        embeds = encoder.embed(chunks, input_ids, self.model.model.embed_tokens.weight)
        hidden = self.model(input_ids, positions, batch, embeds=embeds, rope=encoder.rope(chunks))
        encoder.release_consumed(chunks)
        return hidden

    @torch.inference_mode()
    def stress(self, num_slots: int, *, context_len: int, max_batch_tokens: int, max_running_requests: int) -> None:
        """The heaviest prefill and decode steps the engine can run (their values do not matter).

        Prefill: one chunk of ``--max-batch-tokens`` at the end of the context. Decode: the maximum batch,
        every sequence as long as the context.
        """
        dev, ctx, usable = self.device, context_len, num_slots - 1
        n = min(max_batch_tokens, ctx)
        key_pos = torch.arange(ctx, device=dev)
        query_pos = key_pos[ctx - n:]
        keys = (key_pos % usable + 1).view(1, ctx)
        batch = AttentionBatch(slot_mapping=(torch.arange(n, device=dev) % usable) + 1, kv_indices=keys,
                               mask=(key_pos[None, :] <= query_pos[:, None]).view(1, 1, n, ctx), num_seqs=1,
                               max_query_len=n)
        hidden = self.model(torch.zeros(n, dtype=torch.int64, device=dev), query_pos, batch)
        self.model.compute_logits(hidden[-min(n, max_running_requests):])
        del hidden, batch
        num_seqs = max_running_requests
        hidden = self.decode(
            torch.zeros(num_seqs, dtype=torch.int64, device=dev),
            torch.full((num_seqs,), ctx - 1, dtype=torch.int64, device=dev),
            (torch.arange(num_seqs, device=dev) % usable) + 1, keys.to(torch.int32).expand(num_seqs, ctx),
            torch.ones(num_seqs, 1, 1, ctx, dtype=torch.bool, device=dev))
        self.model.compute_logits(hidden)
        if dev.type == "cuda":
            torch.cuda.synchronize()

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
            hidden = self._multimodal([(mm, 0, n)], input_ids, positions, batch)
        return self.model.compute_logits(hidden)
