"""The memory one step takes outside every tag: what a resume must leave free for the first step after it.

A step's activations, the keys and values it gathers for attention, its index
tensors and logits come and go with the step, outside every memory region. A
resume that maps the tags back into all but the last few MiB leaves the first
step to run out of memory. The bound here is computed from the shapes (every
tensor of one decoder layer alive at once: the allocator reuses a layer's
blocks for the next), for the largest prefill chunk and for a decode step of
the most requests over the longest keys the pool can hold. On CUDA the runner
also measures a prefill chunk's peak at start and keeps the larger figure.
"""

from __future__ import annotations

from node_engine.model.arch import ModelArch


def step_bytes(arch: ModelArch, *, num_tokens: int, num_seqs: int, total_keys: int, itemsize: int) -> int:
    """Upper bound of the tensors one forward step makes: ``num_tokens`` new tokens of ``num_seqs``
    sequences, attending over ``total_keys`` keys in all, in a dtype of ``itemsize`` bytes."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    qk = q + kv
    per_token = (2 * h                 # norm output and its temporaries
                 + (q + 2 * kv)         # fused qkv
                 + 4 * qk               # rotation: x*cos, roll, *sin, sum
                 + q + 2 * h            # attention output, o_proj, residual
                 + 2 * h                # second norm
                 + 2 * inter + 2 * inter + h + h)  # gate_up, silu and product, down, residual
    gathered = 2 * total_keys * kv      # keys and values gathered for attention
    tables = 2 * num_tokens * arch.head_dim + num_tokens * h  # cos/sin rows, hidden state
    layer = (num_tokens * per_token + gathered + tables) * itemsize
    indices = 8 * (4 * num_tokens) + 4 * total_keys + total_keys  # ids, positions, slots; kv_indices, mask
    logits = 4 * num_seqs * arch.vocab_size
    return layer + indices + logits


def step_headroom_bytes(arch: ModelArch, *, max_batch_tokens: int, max_running_requests: int, context_len: int,
                        num_slots: int, itemsize: int) -> int:
    """The larger of a full prefill chunk and a decode step of every running request over the longest keys."""
    prefill = step_bytes(arch, num_tokens=max_batch_tokens, num_seqs=1, total_keys=max_batch_tokens,
                         itemsize=itemsize)
    decode = step_bytes(arch, num_tokens=max_running_requests, num_seqs=max_running_requests,
                        total_keys=min(max_running_requests * context_len, num_slots), itemsize=itemsize)
    return max(prefill, decode)
