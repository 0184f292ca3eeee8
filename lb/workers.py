"""Worker registration as sglang-router and its gateway expose it, mapped onto the LB's membership (admin token).

- Legacy: ``POST /add_worker?url=``, ``POST /remove_worker?url=`` (plain-text
  answers, as the router gives), ``GET /list_workers`` (``{"urls": [...]}``).
- RESTful: ``POST /workers`` (``url``, ``worker_type`` ``regular`` | ``prefill`` |
  ``decode``, ``bootstrap_port``; the answer has the ``worker_id`` and ``location`` of
  sglang-router 0.3's), ``GET /workers`` (each with an ``id``), ``GET`` and
  ``DELETE /workers/{id}`` (the id ``GET /workers`` gave, or the URL, percent-encoded,
  as older routers took it).

A worker is a node: ``regular`` is the ``mixed`` role. ``GET /workers`` and
``GET /list_workers`` list a worker under the URL it was last registered as,
spelled as given (as sglang-router does: slime finds its worker at shutdown by
comparing ``url`` with what it registered); the LB itself uses the canonical
spelling (``GET /nodes``). Registering is
idempotent: adding a member again (under any spelling of its address) with the
same role and bootstrap port answers 200 (an RL loop that restarts its engines
registers them again); removing a URL that is not a member answers 200 saying
so (SGLang's router answers 200 there too). Adding a member under another role
or bootstrap port is 409.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal
from urllib.parse import unquote

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.responses import JSONResponse, PlainTextResponse, Response

from handoff.service.auth import BearerToken
from handoff.service.bodies import openapi_body, parse_body
from handoff.service.errors import InvalidRequest
from lb.addresses import canonical_url
from lb.cluster import Cluster
from lb.config import NodeSpec, Role
from lb.errors import NodeExists, NodeNotFound
from lb.node import Node
from lb.params import single_param

MAX_URL_CHARS = 2048
WORKER_TYPES: dict[str, Role] = {"regular": Role.MIXED, "prefill": Role.PREFILL, "decode": Role.DECODE}
ROLE_TYPES = {role: name for name, role in WORKER_TYPES.items()}


class WorkerBody(BaseModel):
    """``POST /workers`` (the gateway's ``WorkerConfigRequest``, the fields an RL loop sends)."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=1, max_length=MAX_URL_CHARS)
    worker_type: Literal["regular", "prefill", "decode"] = "regular"
    bootstrap_port: StrictInt | None = None
    # the rest of sglang-router 0.3's WorkerConfigRequest: taken (a client written for the router sends them) and
    # meaning nothing here (the LB checks health its own way and calls nodes with its own token); a field no
    # router knows is still a 400 (a typo)
    api_key: str | None = None
    model_id: str | None = None
    priority: StrictInt | None = None
    cost: float | None = None
    runtime: str | None = None
    tokenizer_path: str | None = None
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    chat_template: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    health_check_timeout_secs: StrictInt | None = None
    health_check_interval_secs: StrictInt | None = None
    health_success_threshold: StrictInt | None = None
    health_failure_threshold: StrictInt | None = None
    disable_health_check: bool = False
    max_connection_attempts: StrictInt | None = None
    dp_aware: bool = False


def worker_id(url: str) -> str:
    """A stable id per URL (the same on every LB): what ``DELETE /workers/{id}`` takes."""
    return "worker-" + hashlib.sha256(url.encode()).hexdigest()[:16]


def worker_view(node: Node) -> dict[str, Any]:
    view: dict[str, Any] = {"id": worker_id(node.url), "url": node.registered_url, "model_id": "unknown",
                            "worker_type": ROLE_TYPES[node.role], "is_healthy": node.health.value == "healthy",
                            "load": node.num_inflight, "connection_mode": "Http",
                            "weight_version": node.occupation.get("weight_version")}
    if node.bootstrap_port is not None:
        view["bootstrap_port"] = node.bootstrap_port
    return view


def _described(node: Node | NodeSpec) -> str:
    port = "" if node.bootstrap_port is None else f" with bootstrap port {node.bootstrap_port}"
    return f"a {node.role.value} node{port}"


def workers_router(cluster: Cluster, admin: BearerToken) -> APIRouter:
    router = APIRouter()

    def spec_of(url: str | None, role: Role = Role.MIXED, bootstrap_port: int | None = None) -> NodeSpec:
        if not url:
            raise InvalidRequest("give the worker as ?url=http://HOST:PORT")
        if len(url) > MAX_URL_CHARS:
            raise InvalidRequest(f"a worker URL is at most {MAX_URL_CHARS} characters, got {len(url)}")
        try:
            return NodeSpec(url, role, bootstrap_port)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc

    async def add(spec: NodeSpec, given: str) -> tuple[Node, bool]:
        """(the member, whether it was added now), listed from now on as ``given`` (the URL as the caller
        spelled it). A member under any spelling of the same address is that member; under another role or
        bootstrap port it is 409 (the registration would change what it is)."""
        existing = cluster.membership.same_address(spec.url, learned=False)
        if existing is None:
            try:
                node = await cluster.add_node(spec)
            except NodeExists as exc:  # a name that resolved to a member's address
                existing = cluster.membership.get(exc.extra["node"])
                if existing is None:
                    raise
            else:
                node.register_as(given)
                return node, True
        if existing.role is not spec.role or existing.bootstrap_port != spec.bootstrap_port:
            raise NodeExists(f"{spec.url} is already a member as {_described(existing)}; remove it first to "
                             f"register it as {_described(spec)}", extra={"node": existing.url})
        existing.register_as(given)
        return existing, False

    def member(url: str) -> Node | None:
        """The member ``url`` names (under any spelling known without a lookup, or the URL the worker API lists
        it under: a name's member registered again as the address the name had)."""
        return cluster.membership.same_address(url, learned=False) or next(
            (node for node in cluster.membership.nodes() if canonical_url(node.registered_url) == url), None)

    def remove(url: str) -> str | None:
        """The URL of the member ``url`` names, now removed."""
        node = member(url)
        if node is None:
            return None
        cluster.membership.remove(node.url, "removed through the worker API")
        return node.url

    def named(id_or_url: str) -> Node:
        """The member ``/workers/{id}`` names: by the id ``GET /workers`` gave, or by its URL percent-encoded."""
        node = next((node for node in cluster.membership.nodes() if worker_id(node.url) == id_or_url), None)
        if node is None and "://" in unquote(id_or_url):
            node = member(spec_of(unquote(id_or_url)).url)
        if node is None:
            raise NodeNotFound(f"no worker {id_or_url[:200]!r}", extra={"node": id_or_url[:200]})
        return node

    @router.post("/add_worker")
    async def add_worker(request: Request) -> Response:
        admin.check(request)
        url = single_param(request, "url")
        node, added = await add(spec_of(url), url or "")
        verb = "Successfully added worker" if added else "Worker already added"
        return PlainTextResponse(f"{verb}: {node.url}")

    @router.post("/remove_worker")
    async def remove_worker(request: Request) -> Response:
        admin.check(request)
        url = spec_of(single_param(request, "url")).url
        removed = remove(url)
        if removed is not None:
            return PlainTextResponse(f"Successfully removed worker: {removed}")
        return PlainTextResponse(f"Worker {url} was not registered")

    @router.get("/list_workers")
    async def list_workers() -> dict[str, Any]:
        return {"urls": [node.registered_url for node in cluster.membership.nodes()]}

    @router.post("/workers", openapi_extra=openapi_body(WorkerBody))
    async def create_worker(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, WorkerBody)
        node, added = await add(spec_of(body.url, WORKER_TYPES[body.worker_type], body.bootstrap_port), body.url)
        message = f"Worker {node.url} added successfully" if added else f"Worker {node.url} was already added"
        # worker_id, url and location as sglang-router 0.3 answers (it adds in the background, 202); here the
        # worker is a member when this answers, so 200 and the worker itself as well
        ident = worker_id(node.url)
        return JSONResponse({"success": True, "message": message, "worker": worker_view(node), "worker_id": ident,
                             "url": body.url, "location": f"/workers/{ident}"})

    @router.get("/workers")
    async def list_workers_rest() -> dict[str, Any]:
        nodes = cluster.membership.nodes()
        return {"workers": [worker_view(node) for node in nodes], "total": len(nodes),
                "stats": {f"{name}_count": sum(node.role is role for node in nodes)
                          for name, role in WORKER_TYPES.items()}}

    @router.get("/workers/{id_or_url:path}")
    async def get_worker(id_or_url: str) -> dict[str, Any]:
        return worker_view(named(id_or_url))

    @router.delete("/workers/{id_or_url:path}")
    async def delete_worker(request: Request, id_or_url: str) -> JSONResponse:
        admin.check(request)
        node = named(id_or_url)
        cluster.membership.remove(node.url, "removed through the worker API")
        return JSONResponse({"success": True, "message": f"Worker {node.url} removed successfully", "worker": None,
                             "worker_id": worker_id(node.url)})

    return router
