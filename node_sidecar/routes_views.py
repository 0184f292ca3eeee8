"""The sidecar's views and probes: ``/memory_occupation``, ``/health``, ``/ready``, ``/health_generate``,
``/metrics`` and the engine's info endpoints passed through (``/get_server_info`` without the engine's secrets)."""

from __future__ import annotations

import asyncio
import logging
import math
import re
from typing import Any
from urllib.parse import quote

import psutil
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import JSONResponse, PlainTextResponse, Response

from handoff.protocol import errors as E
from handoff.service.auth import BearerToken
from handoff.service.errors import ServiceError
from handoff.service.logs import rate_limit
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.redact import redact_secrets
from handoff.service.shared_run import SharedRun
from handoff.service.upstream import UpstreamError
from node_sidecar.engines.base import HEALTH_GENERATE_TIMEOUT_S
from node_sidecar.errors import EngineUnavailable
from node_sidecar.metrics import SidecarMetrics
from node_sidecar.node import Node
from node_sidecar.node_views import state_view, update_memory_metrics
from node_sidecar.proxy import forward
from node_sidecar.state import TAGS, TagState

log = logging.getLogger(__name__)
rate_limit(log)  # /metrics needs no token: a line per scrape of an engine whose metrics are broken, at most


def views_router(metrics: SidecarMetrics, admin: BearerToken, api_key: BearerToken) -> APIRouter:
    router = APIRouter()

    def node_of(request: Request) -> Node:
        return request.app.state.node

    @router.get("/health_generate")
    async def health_generate(request: Request) -> JSONResponse:
        """One-token generation while serving; while not serving, the reason, without touching the engine."""
        api_key.check(request, also=admin)  # the admin token authorizes everything
        node = node_of(request)
        lease = node.admission.try_enter()
        if lease is None:
            released = [t for t in TAGS if node.state.tags[t] is not TagState.RESIDENT]
            status = 503 if not node.state.is_engine_reachable else 200
            return JSONResponse({"serving": False, "reason": node.state.not_serving_reason().value,
                                 "released": released}, status_code=status)
        try:
            weight_version = await node.engine_adapter.health_generate(
                min(HEALTH_GENERATE_TIMEOUT_S, node.config.generate_timeout))
        finally:
            lease.release()
        return JSONResponse({"serving": True, "success": True, "weight_version": weight_version})

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward(node_of(request), request, "/v1/models")

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def get_server_info(request: Request) -> Response:
        """The engine's, without its secrets (SGLang's server arguments carry ``api_key`` and ``admin_api_key``,
        its ``launch_command`` the flags): :func:`handoff.service.redact.redact_secrets`."""
        node = node_of(request)
        info = None if node.adapter is None else await node.adapter.info("/get_server_info")
        if info is not None:
            return JSONResponse(redact_secrets(info))
        answer = await forward(node, request, "/get_server_info", max_bytes=SERVER_INFO_MAX_BYTES)
        if not 200 <= answer.status_code < 300:
            return answer  # the engine's error, as it was
        return JSONResponse(await asyncio.to_thread(_relayable_info, bytes(answer.body)))

    @router.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        return await forward(node_of(request), request, "/v1/models/" + quote(model, safe=""))

    @router.get("/memory_occupation")
    async def memory_occupation(request: Request) -> JSONResponse:
        node = node_of(request)
        engine_view: dict = {}
        if node.state.is_engine_reachable and node.adapter is not None:
            try:
                engine_view = await node.adapter.memory_view()
            except EngineUnavailable:
                engine_view = {}
        view = state_view(node)
        engine_bytes = engine_view.get("tags")
        if node.state.is_synced and isinstance(engine_bytes, dict):
            for tag, row in view["tags"].items():
                if isinstance(engine_bytes.get(tag), int):
                    row["bytes"] = engine_bytes[tag]
        view.update(device=engine_view.get("device"), process_rss_bytes=engine_view.get("process_rss_bytes"),
                    sidecar_rss_bytes=psutil.Process().memory_info().rss)
        return JSONResponse(view)

    @router.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @router.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        node = node_of(request)
        if node.admission.is_open:
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False, "reason": node.state.not_serving_reason().value}, status_code=503)

    engine_exposition = _SharedExposition()  # /metrics needs no token: concurrent scrapes share one engine scrape

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics_view(request: Request) -> Response:
        node = node_of(request)
        metrics.inflight_requests.set(node.admission.num_in_flight)
        metrics.held_requests.set(node.admission.num_held)
        update_memory_metrics(node)
        text = generate_latest(metrics.registry)
        if node.state.is_engine_reachable:
            text += await engine_exposition(node)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return router


ENGINE_METRICS_MAX_BYTES = 8 * 1024 * 1024
SERVER_INFO_MAX_BYTES = 8 * 1024 * 1024  # SGLang's is tens of KiB: an answer past this is no server info


def _relayable_info(raw: bytes) -> Any:
    """The engine's 2xx ``/get_server_info`` answer without its secrets (parsed and redacted off the loop); an
    answer that is not JSON cannot be redacted, so it is not relayed: 502."""
    try:
        return redact_secrets(loads_bounded(raw))
    except PeerJSONError as exc:
        raise ServiceError(f"the engine answered /get_server_info with JSON we cannot read: {exc}",
                           kind=E.UPSTREAM_ERROR) from exc


async def _engine_exposition(node: Node) -> bytes:
    """The engine's own metrics, appended to the node's only when they parse as Prometheus text: an engine
    answering an error page, or more than the cap, must not make the node's own metrics unreadable (a scrape
    that fails to parse loses every series, the node's among them). What was left out is in ``last_error``."""
    try:
        text = await node.engine.scrape("/metrics", timeout=5, max_bytes=ENGINE_METRICS_MAX_BYTES)
        if not text:
            return b""  # the engine serves no metrics
        await asyncio.to_thread(_check_exposition, text)  # 8 MiB parses in about a second: off the loop
    except (UpstreamError, ValueError) as exc:  # the node's own metrics still answer; the probe judges the engine
        message = f"engine /metrics left out: {exc}"
        node.note_error(message)
        log.warning("%s", message)  # its series vanish from the node's scrape: say why
        return b""
    return text if text.endswith(b"\n") else text + b"\n"


class _SharedExposition:
    """:func:`_engine_exposition` of the app's node, one run for every scrape asked while it runs."""

    def __init__(self) -> None:
        self._node: Node | None = None
        self._run: SharedRun[bytes] | None = None

    async def __call__(self, node: Node) -> bytes:
        if self._run is None or node is not self._node:
            self._node, self._run = node, SharedRun(lambda: _engine_exposition(node))
        return await self._run()


def _check_exposition(text: bytes) -> None:
    """ValueError unless ``text`` is a Prometheus text exposition (what a scraper would parse): prometheus_client's
    parser, then the lines it takes that Prometheus' own parser refuses (:func:`_check_as_prometheus_reads`)."""
    try:
        decoded = text.decode("utf-8")
        for _ in text_string_to_metric_families(decoded):
            pass
        _check_as_prometheus_reads(decoded)
    except (UnicodeDecodeError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"not a Prometheus text exposition ({type(exc).__name__}: {str(exc)[:200]})") from None


# Prometheus' text parser (textparse): a sample's value is the text up to a blank (space or tab, never "\r"), read
# by Go's ParseFloat without "_" or hex (a sign on NaN, another script's digits, 1e400 refused); a timestamp is
# ASCII digits within int64; nothing follows it; a type is one of five. Python's float() and prometheus_client's
# parser take all of these, and one such line fails the whole scrape, the node's own series with it.
_BLANKS = re.compile(r"[ \t]+")
_GO_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf|infinity))|(?i:nan)")
_TIMESTAMP = re.compile(r"[0-9]{1,19}")
_TYPE_LINE = re.compile(r"#[ \t]+TYPE[ \t]")
_TYPE = re.compile(r"""#[ \t]+TYPE[ \t]+(?:"(?:[^"\\]|\\.)*"|[^ \t"]+)[ \t]"""
                   r"(?:counter|gauge|histogram|summary|untyped)")


def _check_as_prometheus_reads(text: str) -> None:
    """ValueError naming the first line of ``text`` (which prometheus_client's parser took) that Prometheus' own
    parser refuses."""
    for number, raw in enumerate(text.split("\n"), 1):
        line = raw.lstrip(" \t")
        if line.startswith("#"):
            if _TYPE_LINE.match(line) and not _TYPE.fullmatch(line):
                raise ValueError(f"line {number}: a type Prometheus does not read: {line[:100]!r}")
            continue
        if not line.strip(" \t"):
            continue
        labels_end = line.rfind("}") if "{" in line else -1
        fields = _BLANKS.split(line[labels_end + 1:].strip(" \t"))
        if labels_end < 0:
            fields = fields[1:]  # the metric's name
        if not 1 <= len(fields) <= 2 or not _GO_FLOAT.fullmatch(fields[0]) or (
                math.isinf(float(fields[0])) and "n" not in fields[0].lower()) or (
                len(fields) == 2 and not (_TIMESTAMP.fullmatch(fields[1]) and int(fields[1]) < 2 ** 63)):
            raise ValueError(f"line {number}: a value or timestamp Prometheus does not read: {line[:100]!r}")
