"""What routers, SDKs and probes ask an SGLang server, answered by the LB for the whole cluster.

- ``GET /v1/models``, ``/v1/models/{id}``: a node's answer, relayed once it is read as JSON (within bounds)
  of the shape the path answers, a model list or a card (the OpenAI SDK's ``models.list()``,
  ``models.retrieve()``); ``/model_info`` is
  ``lb/weight_versions.py``'s (asked here with :meth:`Probes.ask_object`, plus the cluster's weight version);
- ``GET /get_server_info``, ``/server_info``: a node's answer without its
  secrets (a plain SGLang node's has its ``api_key``, which may be the
  LB's own token to it), plus ``handoff_cluster``, the cluster's view
  (``GET /memory_occupation``'s);
- ``GET /health_generate`` (API key): 200 once one serving node's own
  ``/health_generate`` generated a token, else 503 ``no_available_node``; a node is given
  :data:`GENERATE_PROBE_TIMEOUT_S` for that (a busy engine queues the token behind its work).

A node's role does not matter: any healthy node answers, serving nodes first
(a released node still knows its model). Nodes are asked in turn, each within
``--health-timeout`` (a generation's time for ``/health_generate``) and with its answer bounded; the next
node is asked once one failed or took ``--health-timeout`` (that one is still waited for beside it); a node
that fails, or answers what is not the path's answer (not JSON, too deep, another shape), is skipped and named
if none answers (502 ``upstream_error``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, NamedTuple
from urllib.parse import quote

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from handoff.protocol import errors as E
from handoff.service.auth import BearerToken
from handoff.service.errors import ServiceError, Unavailable
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.redact import redact_secrets
from handoff.service.upstream import UpstreamError
from lb.cluster import Cluster
from lb.node import Node, NodeHealth
from lb.views import cluster_occupation

MAX_PROBE_ANSWER_BYTES = 1024 * 1024
# a node's /health_generate generates a token: a sidecar's queues behind the engine's work for up to 30 s
# (HEALTH_GENERATE_TIMEOUT_S), SGLang's own waits up to HEALTH_CHECK_TIMEOUT (20 s) and always at least 1 s
GENERATE_PROBE_TIMEOUT_S = 30.0
RELAYED = ("/v1/models",)
WITH_CLUSTER_VIEW = ("/get_server_info", "/server_info")
# why a node's parsed answer (with its status) is not what the path answers, None when it is
Shape = Callable[[int, Any], str | None]


class Answer(NamedTuple):
    """The node that answered a probe, its status and body, and the body as read (with a shape; None without)."""

    node: Node
    status: int
    body: bytes
    parsed: Any = None


class Probes:
    """Asks the cluster's nodes what a single SGLang server would answer."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def candidates(self, *, serving_only: bool = False) -> list[Node]:
        nodes = [n for n in self.cluster.membership.nodes() if n.health is NodeHealth.HEALTHY]
        serving = [n for n in nodes if n.is_routable]
        return serving if serving_only else serving + [n for n in nodes if not n.is_routable]

    async def ask(self, path: str, *, serving_only: bool = False, is_lookup: bool = False,
                  refusal_of: Callable[[bytes], str | None] | None = None,
                  shape: Shape | None = None, timeout_s: float | None = None) -> Answer:
        """The first node's 2xx answer to ``GET path`` (``is_lookup``: a 404 too, the path names something
        unknown; otherwise a 404 means that node lacks the endpoint, a plain server of another kind) that
        ``refusal_of`` (if given) finds no reason to pass over; when every node was passed over for such a
        reason, 503 ``no_available_node``. With ``shape``, an answer that is not JSON within bounds, or that
        ``shape`` finds amiss, is that node's failure (the answer read is kept in ``parsed``). Each node is given ``timeout_s`` (``--health-timeout``
        if None); the next node is asked as soon as one failed, or beside it once it took ``--health-timeout``."""
        nodes = self.candidates(serving_only=serving_only)
        if not nodes:
            raise Unavailable("no node can answer now", type=E.NO_AVAILABLE_NODE.name,
                              retry_after=self.cluster.config.health_interval_s)
        next_after_s = self.cluster.config.health_timeout_s
        timeout_s = next_after_s if timeout_s is None else timeout_s
        failures: list[dict[str, Any]] = []
        asking: dict[asyncio.Future[tuple[int, bytes, Any] | str], Node] = {}
        try:
            while nodes or asking:
                if nodes:
                    node = nodes.pop(0)
                    asking[asyncio.ensure_future(self._get(node, path, timeout_s, is_lookup, shape))] = node
                done, _ = await asyncio.wait(asking, timeout=next_after_s if nodes else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                for call in done:
                    node, outcome = asking.pop(call), call.result()
                    if isinstance(outcome, str):
                        failures.append({"node": node.url, "error": outcome})
                        continue
                    status, body, parsed = outcome
                    if 200 <= status < 300 or (is_lookup and status == 404):
                        refusal = None if refusal_of is None else refusal_of(body)
                        if refusal is None:
                            return Answer(node, status, body, parsed)
                        failures.append({"node": node.url, "refused": refusal})
                        continue
                    failures.append({"node": node.url, "status": status})
        finally:
            for call in asking:  # closes its connection: a node generating for this probe stops
                call.cancel()
        if all("refused" in failure for failure in failures):
            raise Unavailable(f"no node can answer now: {'; '.join(f['node'] + ' ' + f['refused'] for f in failures)}",
                              type=E.NO_AVAILABLE_NODE.name, retry_after=1)
        raise ServiceError(f"GET {path} failed on every node ({len(failures)})", kind=E.UPSTREAM_ERROR,
                           extra={"failures": failures})

    async def _get(self, node: Node, path: str, timeout_s: float, is_lookup: bool,
                   shape: Shape | None) -> tuple[int, bytes, Any] | str:
        """``node``'s status, answer to ``GET path`` (bounded in size and time) and, with ``shape``, that answer
        read; or why it gave none (or, with ``shape``, gave an answer that is not the path's)."""
        try:
            response = await self.cluster.client.request("GET", node.url + path, headers=self.cluster.node_headers,
                                                         timeout=timeout_s)
            status, body = response.status, await response.read_whole(MAX_PROBE_ANSWER_BYTES)
        except UpstreamError as exc:
            return str(exc)
        if shape is None or not (200 <= status < 300 or (is_lookup and status == 404)):
            return status, body, None
        try:  # parsed off the loop: up to MAX_PROBE_ANSWER_BYTES of a peer's JSON
            parsed = await asyncio.to_thread(loads_bounded, body)
        except PeerJSONError as exc:
            return f"answered {status} with not JSON we can read ({exc})"
        problem = shape(status, parsed)
        return (status, body, parsed) if problem is None else f"answered {status} with {problem}"

    async def relayed(self, path: str, shape: Shape, *, is_lookup: bool = False) -> Response:
        answer = await self.ask(path, is_lookup=is_lookup, shape=shape)
        return Response(answer.body, status_code=answer.status, media_type="application/json")

    async def ask_object(self, path: str) -> tuple[Node, dict[str, Any]]:
        """The first node's 2xx answer to ``GET path`` that is a JSON object, as read (asked as :meth:`ask` asks: any
        healthy node, serving nodes first; a node answering anything else is passed over and named)."""
        answer = await self.ask(path, shape=_object_shape)
        return answer.node, answer.parsed

    async def server_info(self, path: str) -> JSONResponse:
        node, info = await self.ask_object(path)
        info = await asyncio.to_thread(redact_secrets, info)  # off the loop: up to MAX_PROBE_ANSWER_BYTES of JSON
        nodes = self.cluster.membership.nodes()
        return JSONResponse({**info, "handoff_cluster": {"answered_by": node.url, **cluster_occupation(nodes)}})

    async def health_generate(self) -> JSONResponse:
        """A token generated by one serving node (its ``/health_generate``), whatever its role; a node that
        answers that it stopped serving meanwhile is passed over for the next."""
        node, _, body, _ = await self.ask("/health_generate", serving_only=True, refusal_of=_stopped_serving,
                                       timeout_s=max(GENERATE_PROBE_TIMEOUT_S, self.cluster.config.health_timeout_s))
        answer = _answer_object(body)
        return JSONResponse({"healthy": True, "node": node.url, "weight_version": answer.get("weight_version")})


def install_probes(app: FastAPI, cluster: Cluster, api_key: BearerToken, admin: BearerToken) -> None:
    """Register the probe routes on the LB's app."""
    probes = Probes(cluster)

    def relay(path: str):
        async def relayed(_: Request) -> Response:
            return await probes.relayed(path, _model_list_shape)
        return relayed

    def with_cluster(path: str):
        async def info(_: Request) -> JSONResponse:
            return await probes.server_info(path)
        return info

    for path in RELAYED:
        app.add_api_route(path, relay(path), methods=["GET"], name=f"probe_{path.strip('/')}")
    for path in WITH_CLUSTER_VIEW:
        app.add_api_route(path, with_cluster(path), methods=["GET"], name=f"probe_{path.strip('/')}")

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> Response:
        return await probes.relayed("/v1/models/" + quote(model, safe=""), _model_card_shape, is_lookup=True)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> JSONResponse:
        api_key.check(request, also=admin)
        return await probes.health_generate()


def _answer_object(body: bytes) -> dict[str, Any]:
    try:
        answer = loads_bounded(body) if body.strip() else {}
    except PeerJSONError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _stopped_serving(body: bytes) -> str | None:
    return "stopped serving" if _answer_object(body).get("serving") is False else None


def _object_shape(_: int, answer: Any) -> str | None:
    return None if isinstance(answer, dict) else "JSON that is not an object"


def _model_list_shape(status: int, answer: Any) -> str | None:
    """An OpenAI model list: an object whose ``data`` is a list of cards, each an object with a string ``id``."""
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list) or not all(_model_card_shape(status, card) is None for card in cards):
        return "no model list (an object whose data is a list of cards with an id)"
    return None


def _model_card_shape(status: int, answer: Any) -> str | None:
    """A model card (an object with a string ``id``), or for a 404, the node's error object."""
    if status == 404:
        return _object_shape(status, answer)
    return None if isinstance(answer, dict) and isinstance(answer.get("id"), str) else "no model card with an id"
