"""Engine adapters: one module per kind of engine the sidecar can stand in front of.

- :mod:`~node_sidecar.engines.handoff`: handoff's own engine (every call passes through).
- :mod:`~node_sidecar.engines.vllm`: a vLLM server in dev mode (sleep levels, wake-up tags).
- :mod:`~node_sidecar.engines.sglang`: an SGLang server (its memory-occupation calls, guarded).

``--engine-kind`` names the kind; without it :func:`detect_kind` asks the
engine's info endpoints. Everything else (state, admission, drain, answers)
is the sidecar's, the same for every kind; see :mod:`~node_sidecar.engines.base`.
"""

from __future__ import annotations

from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_sidecar.engine_client import EngineClient
from handoff.protocol.engines import EngineKind
from node_sidecar.engines.base import EngineAdapter
from node_sidecar.errors import EngineUnavailable

DETECT_TIMEOUT_S = 5.0

__all__ = ["EngineAdapter", "EngineKind", "create_adapter", "detect_kind"]


def create_adapter(kind: EngineKind, engine: EngineClient, *, vllm_sleep_level: int = 1,
                   vllm_weight_sync_timeout: float = 300.0) -> EngineAdapter:
    if kind is EngineKind.HANDOFF:
        from node_sidecar.engines.handoff import HandoffEngine

        return HandoffEngine(engine)
    if kind is EngineKind.VLLM:
        from node_sidecar.engines.vllm import VllmEngine

        return VllmEngine(engine, default_sleep_level=vllm_sleep_level,
                          weight_sync_timeout=vllm_weight_sync_timeout)
    from node_sidecar.engines.sglang import SglangEngine

    return SglangEngine(engine)


async def detect_kind(engine: EngineClient) -> EngineKind:
    """Which engine answers at the engine URL, from endpoints only one kind has:
    ``GET /memory_occupation`` with per-tag rows (handoff), ``GET /model_info`` with ``is_generation``
    (SGLang), ``GET /version`` with a ``version`` (vLLM). Raises EngineUnavailable naming what was tried."""
    probes = ((EngineKind.HANDOFF, "/memory_occupation", "tags"), (EngineKind.SGLANG, "/model_info", "is_generation"),
              (EngineKind.VLLM, "/version", "version"))
    for kind, path, key in probes:
        response, raw = await engine.exchange("GET", path, timeout=DETECT_TIMEOUT_S)
        if response.status != 200:
            continue
        try:
            answer = loads_bounded(raw)
        except PeerJSONError:
            continue
        if isinstance(answer, dict) and key in answer:
            return kind
    raise EngineUnavailable("cannot tell which engine this is: it answers none of GET /memory_occupation (handoff), "
                            "GET /model_info (SGLang), GET /version (vLLM); start the sidecar with --engine-kind",
                            retry_after=1)
