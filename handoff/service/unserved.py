"""SGLang endpoints no handoff node serves, answered as a refusal that says why (LB and sidecar alike).

An RL framework in a mode handoff does not support (LoRA adapters: verl's ``load_lora_adapter_from_tensors``,
AReaL's ``load_lora_adapter``) gets 400 ``unsupported`` naming the endpoint and what to do instead, after the
admin check the endpoint has in SGLang; never a bare 404 that reads like a wrong URL. The table is
:data:`handoff.protocol.engines.UNSERVED_SGLANG_ENDPOINTS`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from handoff.protocol.engines import UNSERVED_SGLANG_ENDPOINTS
from handoff.service.auth import BearerToken
from handoff.service.errors import Unsupported

__all__ = ["unserved_router"]


def unserved_router(admin: BearerToken) -> APIRouter:
    """One POST route per unserved SGLang endpoint, kept out of the schema (nothing there is served)."""
    router = APIRouter()
    for path, reason in UNSERVED_SGLANG_ENDPOINTS.items():
        router.add_api_route(path, _refusal(admin, path, reason), methods=["POST"], include_in_schema=False,
                             name=f"unserved_{path.strip('/')}")
    return router


def _refusal(admin: BearerToken, path: str, reason: str):
    async def refuse(request: Request) -> Response:
        admin.check(request)
        raise Unsupported(f"{path} is not available: {reason}", extra={"endpoint": path})
    return refuse
