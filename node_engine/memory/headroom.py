"""The memory one step takes outside every tag: what a resume must leave free for the first step after it.

A step's activations, the keys and values it gathers for attention, its index
tensors, masks and logits come and go with the step, outside every memory
region. A resume that maps the tags back into all but the last few MiB leaves
the first step to run out of memory. The bound here is computed from the shapes
(every tensor of one decoder layer alive at once: the allocator reuses a
layer's blocks for the next), for the largest prefill chunk and for a decode
step of the most requests. Attention gathers each sequence's keys padded to the
longest of its step (``kv_indices`` is [sequences, longest]): a decode step of
``--max-running-requests`` sequences, one of them as long as the context, gathers
that many times the context, however few slots the others hold. When the KV
sizer ran, the runner keeps its measured peaks instead (the same heaviest steps).
"""

from __future__ import annotations

from node_engine.model.arch import ModelArch

PREFILL_PADDING_FACTOR = 2  # prefill_batch.RAGGED_FACTOR: padded queries are at most twice the real ones


def step_bytes(arch: ModelArch, *, num_tokens: int, num_seqs: int, total_keys: int, itemsize: int,
               mask_elems: int | None = None, score_elems: int = 0) -> int:
    """Upper bound of the tensors one forward step makes: ``num_tokens`` new tokens of ``num_seqs``
    sequences, gathering ``total_keys`` keys in all (padding included), a boolean mask of ``mask_elems``
    (``total_keys`` when None; SDPA adds a copy of it in the working dtype), and ``score_elems`` query-key
    pairs whose attention weights are materialized per head (decode), in a dtype of ``itemsize`` bytes."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    qk = q + kv
    per_token = (2 * h                 # norm output and its temporaries
                 + (q + 2 * kv)         # fused qkv
                 + 4 * qk               # rotation: x*cos, roll, *sin, sum
                 + q + 2 * h            # attention output, o_proj, residual
                 + 2 * h                # second norm
                 + 2 * inter + 2 * inter + h + h)  # gate_up, silu and product, down, residual
    gathered = 2 * total_keys * kv      # keys and values gathered for attention
    scores = 2 * score_elems * arch.num_heads  # attention weights and their softmax
    tables = 2 * num_tokens * arch.head_dim + num_tokens * h  # cos/sin rows, hidden state
    mask = total_keys if mask_elems is None else mask_elems
    layer = (num_tokens * per_token + gathered + scores + tables + mask) * itemsize
    indices = 8 * (4 * num_tokens) + 4 * total_keys + mask  # ids, positions, slots; kv_indices, boolean mask
    logits = 4 * num_seqs * arch.vocab_size
    return layer + indices + logits


def step_headroom_bytes(arch: ModelArch, *, max_batch_tokens: int, max_running_requests: int, context_len: int,
                        num_slots: int, itemsize: int) -> int:
    """The larger of a full prefill chunk and a decode step of every running request, each step's sequences
    padded to the longest context the pool can hold."""
    longest = min(context_len, num_slots)
    chunk = min(max_batch_tokens, context_len)
    prefill_seqs = min(max_running_requests, chunk)
    prefill = step_bytes(arch, num_tokens=chunk, num_seqs=prefill_seqs, total_keys=prefill_seqs * longest,
                         mask_elems=PREFILL_PADDING_FACTOR * chunk * longest, itemsize=itemsize)
    decode_keys = max_running_requests * longest
    decode = step_bytes(arch, num_tokens=max_running_requests, num_seqs=max_running_requests,
                        total_keys=decode_keys, score_elems=decode_keys, itemsize=itemsize)
    return max(prefill, decode)
