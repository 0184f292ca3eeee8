"""Choosing a node for a generation request: the candidates, then the policy.

Candidates are the routable nodes of a role (healthy, serving, no release or
pause under way). When none is routable, nodes that hold requests
(``--hold-requests`` sidecars: the request waits there until the node serves
again) are candidates instead; when there are none either, the request gets
503 ``no_available_node``.
"""

from __future__ import annotations

import random
from typing import Collection, Mapping, Sequence

from lb.config import Policy, Role
from lb.errors import NoAvailableNode
from lb.membership import Membership
from lb.node import Node, NodeHealth

MAX_REASON_CHARS = 64


class Picker:
    """A policy: picks one node out of a non-empty list of candidates."""

    def pick(self, candidates: Sequence[Node]) -> Node:
        raise NotImplementedError


class LeastInflight(Picker):
    """The node with the fewest requests in flight from this LB; ties rotate."""

    def __init__(self) -> None:
        self._num_picks = 0

    def pick(self, candidates: Sequence[Node]) -> Node:
        self._num_picks += 1
        num_candidates = len(candidates)
        start = self._num_picks % num_candidates
        best = candidates[start]
        for offset in range(1, num_candidates):
            node = candidates[(start + offset) % num_candidates]
            if node.num_inflight < best.num_inflight:
                best = node
        return best


class RoundRobin(Picker):
    def __init__(self) -> None:
        self._num_picks = 0

    def pick(self, candidates: Sequence[Node]) -> Node:
        self._num_picks += 1
        return candidates[self._num_picks % len(candidates)]


class RandomPick(Picker):
    def pick(self, candidates: Sequence[Node]) -> Node:
        return random.choice(candidates)


class PowerOfTwo(Picker):
    """Two nodes at random, the one with fewer requests in flight."""

    def pick(self, candidates: Sequence[Node]) -> Node:
        if len(candidates) == 1:
            return candidates[0]
        first, second = random.sample(candidates, 2)
        return second if second.num_inflight < first.num_inflight else first


_PICKERS: dict[Policy, type[Picker]] = {
    Policy.LEAST_INFLIGHT: LeastInflight,
    Policy.ROUND_ROBIN: RoundRobin,
    Policy.RANDOM: RandomPick,
    Policy.POWER_OF_TWO: PowerOfTwo,
}


class Router:
    """One picker per role, so prefill and decode pools rotate independently."""

    def __init__(self, membership: Membership, policy: Policy, retry_after_s: float) -> None:
        self._membership = membership
        self._pickers = {role: _PICKERS[policy]() for role in Role}
        self.retry_after_s = retry_after_s

    def has_routable(self, role: Role) -> bool:
        return any(node.is_routable for node in self._membership.nodes(role))

    def pick(self, role: Role, exclude: Collection[Node] = (), *, avoid: Collection[Node] = (),
             weight_version: str | None = None) -> Node:
        """A node of ``role`` to send a request to, never one in ``exclude``, one in ``avoid`` only when no other
        can serve and, with ``weight_version``, only one that last reported serving that version; else 503.
        ``exclude`` may map each node to what it answered this request: the 503 names that."""
        nodes = self._membership.nodes(role)
        if weight_version is not None:
            nodes = [node for node in nodes if node.occupation.get("weight_version") == weight_version]
            if not nodes:
                raise NoAvailableNode(f"no {role.value} node serves weight_version {weight_version!r}",
                                      retry_after=self.retry_after_s)
        candidates = [node for node in nodes if node.is_routable and node not in exclude]
        if not candidates:
            candidates = [node for node in nodes if node.is_holding and node not in exclude]
        if not candidates:
            raise self.unavailable(role, nodes, exclude)
        preferred = [node for node in candidates if node not in avoid]
        return self._pickers[role].pick(preferred or candidates)

    def unavailable(self, role: Role, nodes: Sequence[Node], tried: Collection[Node]) -> NoAvailableNode:
        if not nodes:
            message = f"no {role.value} node in the membership"
        else:
            states = [f"{node.url}: {_why_not(node, tried)}" for node in nodes]
            message = f"no {role.value} node can serve now ({'; '.join(states[:8])})"
        return NoAvailableNode(message, retry_after=self.retry_after_s)


def _why_not(node: Node, tried: Collection[Node]) -> str:
    if node in tried:
        reason = tried[node] if isinstance(tried, Mapping) else None
        return f"tried: {reason or node.last_error or 'failed'}"
    if node.health is not NodeHealth.HEALTHY:
        return node.health.value
    if node.num_fences:
        return "release or pause in progress"
    reason = node.occupation.get("not_serving_reason")  # a sidecar's word (a peer's JSON: a short string only)
    said = f"{reason}, " if isinstance(reason, str) and 0 < len(reason) <= MAX_REASON_CHARS else ""
    return f"not serving ({said}admission {node.admission or 'unknown'})"
