"""Weight sync across the cluster: a trainer's group over every node, tensor pushes to chosen nodes, versions.

``init_weights_update_group`` takes SGLang's body once, with ``rank_offset``
the first engine rank and ``world_size`` the whole group (the trainer's ranks,
``0 .. rank_offset - 1``, plus every engine rank). Node ``i`` (in membership
order) gets ``rank_offset`` plus the ranks of the nodes before it; a node's
ranks are its tensor-parallel size (``tp_size`` in its state, 1 for this
engine; a plain server's from its server info), as each node tells it when
checked at the init's start (a node removed meanwhile is in no group). A
``world_size`` that does not add up is a 400 naming the right one.
The nodes join concurrently; if any fails, the rollback begins at once: a node
that joined is told ``destroy_weights_update_group``, a node still waiting in its
join is told to abandon it (``abandon_join_only``: a group of that name it holds
already, another init's, stays), and a node that refused (409: a group by that
name exists or is being joined there) is left alone. No node is left in a
half-formed group, and the answer is a 502 naming the failed nodes, with what
the rollback did (a node that joined and could not be made to leave gets the
next destroy of that name). One init per group name at a time goes through the
LB (409 otherwise), so a retry cannot abandon the join of the call it retries.

A group formed through this LB is remembered (:class:`WeightGroups`) until it
is destroyed: ``update_weights_from_distributed`` and
``destroy_weights_update_group`` naming it go to the nodes that joined it,
whatever the membership did since (a node that left still holds its rank, and
its group until it is told to destroy it; a node that joined since holds none;
a node that left and joined again, under another spelling or role, is called as
the member it is now). With ``?role=``, the nodes that joined as nodes of that
role. A destroy that some nodes of a group answered ends it: the nodes it failed
on get the next destroy and no update. A group this LB did not form (through
another replica, or before a restart), or formed for other roles only, is sent
to every member (of the role).

``update_weights_from_tensor`` goes to the nodes the caller names
(``?node=URL``, repeatable; default all): its payload is shared memory or CUDA
IPC handles, valid only on the sender's host. torch counts one reader per
serialization, so when one payload goes to several nodes, all but one read it
with ``release_sender_reference: false``; the one that releases it is a healthy
node where there is one (a node known down never reads, and a reference nobody
releases keeps the payload in the sender's shared memory until it exits).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from handoff.protocol.weights import (DEFAULT_GROUP_NAME, DESTROY_GROUP_PATH, INIT_GROUP_PATH, MAX_TP_SIZE,
                                      DestroyWeightsUpdateGroupBody, InitWeightsUpdateGroupBody)
from handoff.service.bodies import parse_value
from handoff.service.errors import Conflict, InvalidRequest, parse_json_bytes
from handoff.service.peer_json import PeerJSONError, loads_bounded
from lb.addresses import canonical_url
from lb.config import Role
from lb.errors import NoNodes, NodeNotFound, WeightGroupLost
from lb.fanout import FanOut, NodeResult
from lb.health import HealthMonitor
from lb.membership import Membership
from lb.node import Node, NodeHealth
from lb.weight_groups import WeightGroups

JSON = "application/json"
ABANDON_AGAIN_S = 1.0  # while rolled-back nodes are still joining, their abandon is sent again this often


def node_ranks(node: Node) -> int:
    """How many ranks a node takes in a group: its tensor-parallel size if it reports one, else 1."""
    tp_size = node.occupation.get("tp_size")
    return tp_size if type(tp_size) is int and 1 <= tp_size <= MAX_TP_SIZE else 1


class WeightSync:
    def __init__(self, fanout: FanOut, membership: Membership, health: HealthMonitor,
                 groups: WeightGroups | None = None) -> None:
        """``groups``: this LB's weight groups, shared by every call."""
        self._fanout = fanout
        self._membership = membership
        self._health = health
        self._groups = WeightGroups() if groups is None else groups
        self._initializing = self._groups.initializing

    # -- the group --------------------------------------------------------------------
    async def init_group(self, raw: bytes, role: Role | None, timeout_s: float) -> tuple[int, dict[str, Any]]:
        body = parse_value(parse_json_bytes(raw) if raw.strip() else None, InitWeightsUpdateGroupBody)
        nodes, ranks = await self._nodes_and_ranks(role)
        offsets, next_rank = [], body.rank_offset
        for num_ranks in ranks:
            offsets.append(next_rank)
            next_rank += num_ranks
        if body.world_size != next_rank:
            raise InvalidRequest(
                f"world_size must be {next_rank}: rank_offset {body.rank_offset} (the trainer's ranks) plus "
                f"{next_rank - body.rank_offset} engine rank(s) on {len(nodes)} node(s); got {body.world_size}",
                extra={"world_size": next_rank, "rank_offsets": {n.url: o for n, o in zip(nodes, offsets)}})
        if body.group_name in self._initializing:
            raise Conflict(f"an init_weights_update_group of group {body.group_name!r} is already under way "
                           "through this LB; wait for its answer")
        self._initializing.add(body.group_name)
        started = time.perf_counter()
        try:
            results, rolled_back = await self._join_all(body, nodes, offsets, timeout_s)
        finally:
            self._initializing.discard(body.group_name)
        status, payload = self._fanout.answer("POST", INIT_GROUP_PATH, results, time.perf_counter() - started)
        by_url = dict(zip((n.url for n in nodes), offsets))
        for entry in payload.get("results", []) + payload.get("failures", []) + payload.get("succeeded", []):
            entry["rank_offset"] = by_url[entry["node"]]
        payload["world_size"] = body.world_size
        if status == 200:
            self._groups.formed(body.group_name, nodes, self._membership)
        if rolled_back:
            payload["message"] += "; the nodes this call joined (or was joining) left the group again"
            payload["rolled_back"] = [r.as_json() for r in rolled_back]
        return status, payload

    async def _nodes_and_ranks(self, role: Role | None) -> tuple[list[Node], list[int]]:
        """The members (of ``role``) as they are now, and each one's ranks: its ``tp_size`` as it reports it now
        (each is checked first: an engine restarted at another TP size since its last check, or a node not checked
        yet, would get ranks another node gets too; a plain server's is read from its server info). A node removed
        meanwhile is in no group."""
        nodes = self._nodes(role, INIT_GROUP_PATH)
        await self._health.check_many(nodes)
        plain = [node for node in nodes if node.is_sidecar is False]
        plain_ranks = dict(zip(plain, await asyncio.gather(*map(self._health.plain_tp_size, plain))))
        nodes = [node for node in nodes if not node.is_removed]
        if not nodes:
            raise NoNodes(f"no {role.value + ' ' if role else ''}nodes to send {INIT_GROUP_PATH} to")
        return nodes, [plain_ranks.get(node) or node_ranks(node) for node in nodes]

    async def _join_all(self, body: InitWeightsUpdateGroupBody, nodes: list[Node], offsets: list[int],
                        timeout_s: float) -> tuple[list[NodeResult], list[NodeResult]]:
        """Every node's join, concurrently; once one fails, the others are rolled back: a node that joined
        leaves the group, a node still joining (or that stopped answering) abandons its join (asked again every
        ``ABANDON_AGAIN_S`` while it has not answered: the first ask may have come before the join began), and
        leaves if it joined before the abandon reached it. A node that answered a refusal (409: a group by that
        name exists there, say) is left as it was."""
        calls = {asyncio.ensure_future(self._fanout.call_node(
            node, "POST", INIT_GROUP_PATH, _json({**body.engine_body(), "rank_offset": offset}), JSON, timeout_s)):
            node for node, offset in zip(nodes, offsets)}
        rolled_back: list[NodeResult] = []
        abandoned: set[asyncio.Future[NodeResult]] = set()  # still joining when the rollback began
        is_rolling_back = False
        pending = set(calls)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=ABANDON_AGAIN_S if is_rolling_back else None,
                                               return_when=asyncio.FIRST_COMPLETED)
            if is_rolling_back and not done:  # an abandon that reached a node before its join began did nothing
                await self._roll_back(body.group_name, [], [calls[t] for t in pending], timeout_s)
            elif not is_rolling_back and any(not task.result().is_ok for task in done):
                is_rolling_back, abandoned = True, set(pending)
                joined = [calls[t] for t in calls if t.done() and t.result().is_ok]
                # still joining, or gone quiet (a timeout, a dropped connection): its join may still be under way
                joining = [calls[t] for t in calls if not t.done() or t.result().status is None]
                rolled_back += await self._roll_back(body.group_name, joined, joining, timeout_s)
        late = [calls[t] for t in abandoned if t.result().is_ok]  # joined before the abandon arrived
        if late:
            rolled_back += await self._roll_back(body.group_name, late, [], timeout_s)
        return [task.result() for task in calls], rolled_back

    async def _roll_back(self, group_name: str, joined: list[Node], joining: list[Node],
                         timeout_s: float) -> list[NodeResult]:
        """``destroy_weights_update_group`` on the nodes that joined; on those still joining, only the
        abandon of that join (``abandon_join_only``). A node that joined and did not leave gets the group's next
        destroy."""
        leave = _json(DestroyWeightsUpdateGroupBody(group_name=group_name).engine_body())
        abandon = _json(DestroyWeightsUpdateGroupBody(group_name=group_name, abandon_join_only=True).engine_body())
        timeout = min(timeout_s, 30.0)
        results = list(await asyncio.gather(
            *(self._fanout.call_node(node, "POST", DESTROY_GROUP_PATH, leave, JSON, timeout) for node in joined),
            *(self._fanout.call_node(node, "POST", DESTROY_GROUP_PATH, abandon, JSON, timeout) for node in joining)))
        self._groups.left_holding(group_name, [result.node for result in results[:len(joined)] if not result.is_ok])
        return results

    async def to_group(self, path: str, raw: bytes, content_type: str | None, role: Role | None,
                       timeout_s: float) -> tuple[int, dict[str, Any]]:
        """``update_weights_from_distributed`` or ``destroy_weights_update_group``: to the nodes of the group the
        body names that joined it as ``role`` nodes, if it was formed through this LB, members or not; else (no
        such node) to every member of ``role``."""
        lost = [] if path == DESTROY_GROUP_PATH else [n for n in self._membership.nodes(role) if _lost_groups(n)]
        body = None if self._groups.is_empty and not lost else _json_object(raw)
        name = body.get("group_name", DEFAULT_GROUP_NAME) if body is not None else None
        destroy = path == DESTROY_GROUP_PATH and body is not None and body.get("abandon_join_only") is not True
        nodes = (self._groups.nodes_of(name, self._membership, role, leaving=destroy) if isinstance(name, str)
                 else None)
        called = None if nodes is None else list({now.url: now for _, now in nodes}.values())  # one per address
        if path != DESTROY_GROUP_PATH:
            _refuse_lost(name, lost if called is None else called)
        if body is None or called is None:
            return await self._fanout.run("POST", path, raw, content_type, role, timeout_s)
        status, payload = await self._fanout.run("POST", path, raw, content_type, role, timeout_s, called)
        if destroy:
            self._groups.destroyed(name, nodes, payload)
        return status, payload

    # -- tensors to the sender's host -------------------------------------------------
    async def to_nodes(self, path: str, raw: bytes, content_type: str | None, urls: list[str],
                       timeout_s: float) -> tuple[int, dict[str, Any]]:
        """``path`` to the members named in ``urls`` (every member when empty)."""
        if urls:
            named = {url: self._member(url) for url in urls}
            unknown = [url[:200] for url, node in named.items() if node is None]
            if unknown:
                raise NodeNotFound(f"not members: {', '.join(unknown[:8])}", extra={"nodes": unknown[:8]})
            nodes = list({id(node): node for node in named.values() if node is not None}.values())
        else:
            nodes = self._nodes(None, path)
        # the reader that releases the sender's reference must be one that reads: a node known down never does
        releaser = next((i for i, node in enumerate(nodes) if node.health is NodeHealth.HEALTHY), 0)
        bodies = _one_reader_releases(raw, len(nodes), releaser)
        started = time.perf_counter()
        results = await asyncio.gather(*(self._fanout.call_node(node, "POST", path, body, content_type, timeout_s)
                                         for node, body in zip(nodes, bodies) if node is not None))
        return self._fanout.answer("POST", path, list(results), time.perf_counter() - started)

    def _member(self, url: str) -> Node | None:
        """The member ``url`` names, under any spelling known without a lookup; 400 for a URL that is not one."""
        try:
            canonical = canonical_url(url)
        except ValueError as exc:
            raise InvalidRequest(f"?node=: {exc}") from None
        return self._membership.same_address(canonical, learned=False)

    def _nodes(self, role: Role | None, path: str) -> list[Node]:
        nodes = list(self._membership.nodes(role))
        if not nodes:
            raise NoNodes(f"no {role.value + ' ' if role else ''}nodes to send {path} to")
        return nodes


def _one_reader_releases(raw: bytes, num_nodes: int, releaser: int) -> list[bytes]:
    """The body for each node: torch counts one reader per serialized CPU tensor, so when one payload goes to
    several engines only the node at index ``releaser`` releases the sender's reference
    (``release_sender_reference``); a payload no node releases stays in the sender's shared memory until it exits."""
    if num_nodes < 2:
        return [raw] * num_nodes
    try:
        body = parse_json_bytes(raw)
    except InvalidRequest:
        return [raw] * num_nodes  # the nodes refuse it, each with its own 400
    if not isinstance(body, dict):
        return [raw] * num_nodes
    if not isinstance(body.get("release_sender_reference", True), bool):  # rewritten below for all but one node
        raise InvalidRequest("release_sender_reference: Input should be a valid boolean; nothing was sent")
    borrowing = _json({**body, "release_sender_reference": False})
    releasing = _json({**body, "release_sender_reference": body.get("release_sender_reference", True)})
    return [releasing if index == releaser else borrowing for index in range(num_nodes)]


def _lost_groups(node: Node) -> list[str]:
    """The weight groups the node's sidecar says its engine left by restarting (a peer's JSON: strings only)."""
    names = node.occupation.get("weight_groups_lost")
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []


def _refuse_lost(name: object, nodes: list[Node]) -> None:
    """An update over group ``name``, which one of ``nodes`` lost with a restart of its engine, is refused before
    anything is sent: the other nodes would wait for broadcasts the trainer's broken group cannot send."""
    lost = [node.url for node in nodes if isinstance(name, str) and name in _lost_groups(node)]
    if lost:
        raise WeightGroupLost(
            f"the engine of {', '.join(lost[:8])} restarted after it joined weight group {name!r} and is in no group "
            "now: nothing was sent; destroy the group (destroy_weights_update_group) and call "
            "init_weights_update_group again with the same world_size", extra={"nodes": lost[:8], "group_name": name})


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """A weight call's body as a JSON object (an empty body is SGLang's defaults); None when it is not one (the
    nodes refuse it)."""
    if not raw.strip():
        return {}
    try:
        body = loads_bounded(raw)
    except PeerJSONError:
        return None
    return body if isinstance(body, dict) else None


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()
