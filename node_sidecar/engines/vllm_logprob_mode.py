"""Whether a vLLM node's logprobs mean what SGLang's mean, for one request.

SGLang 0.5.23 answers an output token's logprob from ``log_softmax`` of the
logits after penalties, ``logit_bias`` and ``min_new_tokens``, over the
temperature (1 when greedy), before top-k, top-p and min-p filtering
(``layers/sampler.py``; handoff's engine does the same, ``node_engine/logprobs.py``).
vLLM answers from one distribution per server, its ``--logprobs-mode``
(``model_config.logprobs_mode`` in ``/server_info``):

- ``raw_logprobs`` (its default): the raw logits, before any penalty or
  temperature. SGLang's when the temperature is 1 (or greedy) and nothing
  changes the logits.
- ``processed_logprobs``: after every processor, temperature and top-k /
  top-p / min-p included. SGLang's unless a sampled request filters.
- ``raw_logits``, ``processed_logits``: logits, not logprobs.

An RL loop takes these logprobs for the policy's (importance ratios), so a
request whose answer would hold another distribution's is refused
(400 ``unsupported``, saying which ``--logprobs-mode`` serves it), never
answered with numbers of another meaning. Prompt logprobs are the raw
logits' in every mode, as SGLang's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RAW_LOGPROBS", "PROCESSED_LOGPROBS", "is_number", "logprob_mismatch"]

RAW_LOGPROBS = "raw_logprobs"
PROCESSED_LOGPROBS = "processed_logprobs"


def logprob_mismatch(completion: dict[str, Any], mode: str | None) -> str | None:
    """Why vLLM's logprobs for ``completion`` (the body sent to it) would not be SGLang's under ``mode``
    (None: not reported, vLLM's default); None when they would be."""
    mode = mode or RAW_LOGPROBS
    greedy = _number(completion.get("temperature"), 1.0) == 0
    if mode == RAW_LOGPROBS:
        changed = _changes_logits(completion)
        if not greedy and _number(completion.get("temperature"), 1.0) != 1.0:
            changed.insert(0, "a temperature other than 1")
        if changed:
            return (f"vLLM serves raw logprobs here (--logprobs-mode {RAW_LOGPROBS}), before {' and '.join(changed)} "
                    f"change the distribution SGLang's logprobs are of; ask without them, or run vLLM with "
                    f"--logprobs-mode {PROCESSED_LOGPROBS}")
        return None
    if mode == PROCESSED_LOGPROBS:
        filters = [] if greedy else _filters(completion)
        if filters:
            return (f"vLLM serves logprobs after {' and '.join(filters)} here (--logprobs-mode "
                    f"{PROCESSED_LOGPROBS}), where SGLang's are before them; ask without them, or run vLLM with "
                    f"--logprobs-mode {RAW_LOGPROBS} at temperature 1")
        return None
    return (f"vLLM serves logits, not logprobs, here (--logprobs-mode {mode}); run it with --logprobs-mode "
            f"{RAW_LOGPROBS} or {PROCESSED_LOGPROBS}")


def _changes_logits(completion: dict[str, Any]) -> list[str]:
    changed = []
    if (_number(completion.get("frequency_penalty"), 0.0) != 0 or _number(completion.get("presence_penalty"), 0.0) != 0
            or _number(completion.get("repetition_penalty"), 1.0) != 1):
        changed.append("penalties")
    if completion.get("logit_bias"):
        changed.append("logit_bias")
    if _number(completion.get("min_tokens"), 0) > 0:
        changed.append("min_new_tokens")
    return changed


def _filters(completion: dict[str, Any]) -> list[str]:
    filters = []
    if _number(completion.get("top_k"), 0) > 0:
        filters.append("top_k")
    if _number(completion.get("top_p"), 1.0) < 1:
        filters.append("top_p")
    if _number(completion.get("min_p"), 0.0) > 0:
        filters.append("min_p")
    return filters


def is_number(value: Any) -> bool:
    """A JSON number (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: Any, default: float) -> float:
    """A field's number; anything else is taken as the default (vLLM refuses a value of the wrong type itself)."""
    return value if is_number(value) else default
