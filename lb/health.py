"""Health checks: poll each node's ``/memory_occupation`` (``/health`` for plain servers).

A handoff sidecar answers ``/memory_occupation`` with its per-tag state and
whether it serves; a node that answers 404 there (a plain SGLang server) is
checked with ``GET /health`` from then on, and its weight version read from its
``GET /model_info`` (where SGLang tells it: it has no ``/get_weight_version``),
so the version views and pinned requests know what a plain server serves. A
node that answers is healthy,
released or not: released only means not routable. ``unhealthy_threshold``
failures in a row make a healthy node unhealthy, ``healthy_threshold``
successes bring it back; a node never checked becomes either at its first check.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable, Mapping

from handoff.protocol.control import peer_weight_version
from handoff.protocol.weights import MAX_TP_SIZE
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.upstream import ResponseTooLarge, UpstreamClient, UpstreamError
from lb.config import LBConfig
from lb.membership import Membership
from lb.node import Node, NodeHealth
from lb.node_answer import state_problem

log = logging.getLogger(__name__)

MAX_PROBE_BODY_BYTES = 64 * 1024
MAX_SERVER_INFO_BYTES = 1024 * 1024  # SGLang's server info lists every server argument and each DP rank's state


class HealthMonitor:
    def __init__(self, client: UpstreamClient, membership: Membership, config: LBConfig,
                 node_headers: Mapping[str, str]) -> None:
        self._client = client
        self._membership = membership
        self._config = config
        self._headers = dict(node_headers)

    async def run(self) -> None:
        """Check every member every ``health_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self._config.health_interval_s)
            try:
                await self.check_many(self._membership.nodes())
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health check round failed")

    async def check_many(self, nodes: Iterable[Node]) -> None:
        await asyncio.gather(*(self.check(node) for node in nodes))

    async def check(self, node: Node) -> None:
        """One check of ``node``; the outcome is applied to it. Never raises for the node's fault. A state read
        while a control call changed the node is dropped when that call's answer (newer) was applied meanwhile:
        a check started before a resume must not take the node back to released after it."""
        num_applied = node.num_states_applied
        try:
            outcome = await self._probe(node)
        except UpstreamError as exc:
            self._record_failure(node, str(exc))
            return
        if isinstance(outcome, str):
            self._record_failure(node, outcome)
        elif node.num_states_applied == num_applied:
            self._record_success(node, outcome)

    async def _probe(self, node: Node) -> dict[str, Any] | str:
        """The node's state as a dict, or a string saying why the check failed."""
        timeout = self._config.health_timeout_s
        if node.is_sidecar is not False:
            response = await self._client.request("GET", node.url + "/memory_occupation",
                                                  headers=self._headers, timeout=timeout)
            if response.status in (404, 405):
                node.mark_plain()
                await response.read(MAX_PROBE_BODY_BYTES)
            elif response.status != 200:
                await response.read(MAX_PROBE_BODY_BYTES)
                return f"GET /memory_occupation answered {response.status}"
            else:
                try:
                    return _parse_occupation(await response.read_whole(MAX_PROBE_BODY_BYTES))
                except ResponseTooLarge:  # never judged on a cut body ("Unterminated string" says nothing)
                    return f"GET /memory_occupation answered more than {MAX_PROBE_BODY_BYTES} bytes"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        response = await self._client.request("GET", node.url + "/health", headers=self._headers,
                                              timeout=timeout)
        await response.read(MAX_PROBE_BODY_BYTES)
        if response.status != 200:
            return f"GET /health answered {response.status}"
        return {"serving": True, "weight_version": await self._plain_weight_version(node, deadline - loop.time())}

    async def _plain_weight_version(self, node: Node, timeout_s: float) -> str | None:
        """The version a plain server reports in ``GET /model_info`` (SGLang's; within what is left of the
        check's time), None if it tells none, the last one known if it did not answer: its failing to tell
        never fails the health check."""
        known = node.occupation.get("weight_version")
        if timeout_s <= 0:
            return known
        try:
            response = await self._client.request("GET", node.url + "/model_info", headers=self._headers,
                                                  timeout=timeout_s)
            async with response:
                if response.status != 200:
                    return None
                info = loads_bounded(await response.read_whole(MAX_PROBE_BODY_BYTES))
        except UpstreamError:
            return known
        except PeerJSONError:
            return None
        return peer_weight_version(info.get("weight_version")) if isinstance(info, dict) else None

    async def plain_tp_size(self, node: Node) -> int | None:
        """The ``tp_size`` a plain server tells in its server info (SGLang's ``/server_info``, or
        ``/get_server_info`` where there is no such path), within a check's time; None when it tells none."""
        for path in ("/server_info", "/get_server_info"):
            try:
                response = await self._client.request("GET", node.url + path, headers=self._headers,
                                                      timeout=self._config.health_timeout_s)
                async with response:
                    if response.status in (404, 405):
                        continue
                    if response.status != 200:
                        return None
                    info = loads_bounded(await response.read_whole(MAX_SERVER_INFO_BYTES))
            except (UpstreamError, PeerJSONError):
                return None
            tp_size = info.get("tp_size") if isinstance(info, dict) else None
            return tp_size if type(tp_size) is int and 1 <= tp_size <= MAX_TP_SIZE else None
        return None

    def apply_state(self, node: Node, state: dict[str, Any]) -> None:
        """A node's answer carried its state (a sidecar's control answers do): it counts as a good check, and
        wins over a check that was under way when it came."""
        node.count_state_applied()
        self._record_success(node, state)

    def _record_failure(self, node: Node, error: str) -> None:
        if node.is_removed:
            return
        failures = node.count_failure(error)
        if node.health is not NodeHealth.UNHEALTHY and (
                node.health is NodeHealth.UNKNOWN or failures >= self._config.unhealthy_threshold):
            log.warning("node %s failed %d health check(s): %s", node.url, failures, error)
            node.set_health(NodeHealth.UNHEALTHY)

    def _record_success(self, node: Node, state: dict[str, Any]) -> None:
        if node.is_removed:
            return
        successes = node.count_success(state)
        node.set_serving(_is_serving(state), state.get("admission") if isinstance(state.get("admission"), str)
                         else None)
        if node.health is NodeHealth.UNKNOWN or (
                node.health is NodeHealth.UNHEALTHY and successes >= self._config.healthy_threshold):
            node.set_health(NodeHealth.HEALTHY)

    def mark_unreachable(self, node: Node, error: str) -> None:
        """A refused connection seen on the request path: stop routing there until a check succeeds (one that
        began after it: what a check under way read is older, and dropped)."""
        if node.is_removed:
            return
        node.count_state_applied()
        node.count_refusal(error)
        if node.health is not NodeHealth.UNHEALTHY:
            log.warning("node %s refused a connection, unhealthy until its next good check: %s", node.url, error)
            node.set_health(NodeHealth.UNHEALTHY)

    def mark_not_serving(self, node: Node, error: str, reason: str) -> None:
        """The node said it does not serve (a 503 of type ``reason``, ``node_released``...): believe it until the
        next check, and show it so (``GET /nodes``, the 503 naming every node): its admission closed, unless it
        holds requests (a full queue refuses too), and ``reason`` as its ``not_serving_reason``. Newer than what
        a check under way read: that check's state is dropped, as after :meth:`apply_state`."""
        if not node.is_removed:
            node.count_state_applied()
            node.record_error(error)
            node.occupation = {**node.occupation, "not_serving_reason": reason}  # the next check replaces it
            node.set_serving(False, node.admission if node.admission == "holding" else "closed")


def _parse_occupation(body: bytes) -> dict[str, Any] | str:
    try:
        state = loads_bounded(body)
    except PeerJSONError as exc:
        return f"GET /memory_occupation answered 200 with a body that cannot be read: {exc}"
    if not isinstance(state, dict):
        return "GET /memory_occupation answered 200 with JSON that is not an object"
    problem = state_problem(state)  # an error body, {}, "serving": "false": no state to route by
    return f"GET /memory_occupation answered 200 with JSON that is no node's state: {problem}" if problem else state


def _is_serving(state: Mapping[str, Any]) -> bool:
    """A sidecar says ``serving``; an engine answered directly is judged by its tags and weights."""
    serving = state.get("serving")
    if isinstance(serving, bool):
        return serving
    tags = state.get("tags")
    if isinstance(tags, Mapping):
        for tag in tags.values():
            if isinstance(tag, Mapping) and tag.get("state", "resident") != "resident":
                return False
    return state.get("weights_valid", True) is not False
