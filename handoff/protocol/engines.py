"""The kinds of engine a node can run behind its sidecar (``--engine-kind``; ``engine_kind`` in node views)."""

from __future__ import annotations

import enum


class EngineKind(str, enum.Enum):
    HANDOFF = "handoff"   # python -m node_engine
    VLLM = "vllm"         # a vLLM OpenAI server in dev mode (VLLM_SERVER_DEV_MODE=1)
    SGLANG = "sglang"     # an SGLang server (0.5.23's HTTP API)


ENGINE_KIND_NAMES: tuple[str, ...] = tuple(kind.value for kind in EngineKind)

# what vLLM must load (--worker-extension-cls) for SGLang's weight-sync calls on a vLLM node; the sidecar reads it
# back from vLLM's /server_info, and handoff up passes it when it starts vLLM
VLLM_WORKER_EXTENSION = "node_sidecar.engines.vllm_worker_ext.HandoffWeightSync"

# SGLang 0.5.23 endpoints that RL frameworks call and no handoff node serves (verl's and AReaL's LoRA modes): each
# answers 400 ``unsupported`` with the reason, as SGLang started without --enable-lora refuses them with a 400
# (``managers/tokenizer_control_mixin.py:667``), rather than a bare 404
_NO_LORA = ("LoRA adapters are not served by handoff nodes: merge the adapter into the weights and push them "
            "(update_weights_from_tensor, update_weights_from_distributed or update_weights_from_disk)")
UNSERVED_SGLANG_ENDPOINTS: dict[str, str] = {
    "/load_lora_adapter": _NO_LORA,
    "/load_lora_adapter_from_tensors": _NO_LORA,
    "/unload_lora_adapter": _NO_LORA,
}
