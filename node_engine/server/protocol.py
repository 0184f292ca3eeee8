"""From a ``/generate`` body's ``sampling_params`` to the engine's :class:`SamplingParams`.

``/generate``'s body is SGLang's, the same for every process: :mod:`handoff.protocol.generate_request`; the
OpenAI bodies are :mod:`node_engine.server.openai_bodies`.
"""

from __future__ import annotations

from typing import Any

from handoff.protocol.generate_request import GenerateBody, SamplingParamsBody
from node_engine.sampling import MAX_SEED, MIN_SEED, SamplingParams, generator_seed

MAX_BATCH = 256
__all__ = ["GenerateBody", "SamplingParamsBody", "to_sampling_params"]


def to_sampling_params(body: SamplingParamsBody, default_max_new_tokens: int, *, vocab_size: int,
                       sample_index: int = 0) -> SamplingParams:
    """The engine's parameters for sample ``sample_index`` of ``body`` (sample j draws with seed + j).

    Raises ``ValueError`` naming the field for out-of-range values.
    """
    def value(name: str, default: Any) -> Any:
        given = getattr(body, name)
        return default if given is None else given

    if body.seed is not None and body.sampling_seed is not None and body.seed != body.sampling_seed:
        raise ValueError("give sampling_seed or its older name seed, not both")
    seed = body.sampling_seed if body.sampling_seed is not None else body.seed
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:  # checked before it is folded to 64 bits
        raise ValueError(f"sampling_seed must be an integer in [-2**63, 2**64), got {seed}")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    # one entry per token, the last one given (SGLang assigns each key in turn): "7", "07" and "007" are one
    # token, so a body's worth of spellings never becomes a body's worth of entries applied at every step
    bias: dict[int, float] = {}
    for key, amount in (body.logit_bias or {}).items():
        token = int(key) if key.isdigit() else None
        if token is None or not token < vocab_size:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}")
        bias[token] = amount
    return SamplingParams(
        max_new_tokens=value("max_new_tokens", default_max_new_tokens), temperature=value("temperature", 1.0),
        top_p=value("top_p", 1.0), top_k=value("top_k", -1), min_p=value("min_p", 0.0), stop=stop,
        stop_token_ids=tuple(sorted(set(body.stop_token_ids or ()))), ignore_eos=value("ignore_eos", False),
        seed=None if seed is None else generator_seed(seed, sample_index),
        frequency_penalty=value("frequency_penalty", 0.0), presence_penalty=value("presence_penalty", 0.0),
        repetition_penalty=value("repetition_penalty", 1.0), min_new_tokens=value("min_new_tokens", 0),
        logit_bias=tuple(bias.items()), skip_special_tokens=value("skip_special_tokens", True),
        spaces_between_special_tokens=value("spaces_between_special_tokens", True),
        no_stop_trim=value("no_stop_trim", False),
        # SGLang: 0 (or null) is the server's interval, 1 here; below it, every step (output_streamer.py:455-468)
        stream_interval=max(1, value("stream_interval", 1)))
