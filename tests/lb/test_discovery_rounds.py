"""DNS discovery rounds over several targets, in process against a scripted resolver (found by review, stop 41)."""

from __future__ import annotations

import asyncio
import socket

import pytest

import lb.discovery
from lb.config import DnsTarget, Role
from lb.discovery import DnsDiscovery
from lb.membership import Membership
from lb.metrics import LBMetrics
from lb.node import NodeHealth

pytestmark = pytest.mark.timeout(20)
X = "http://10.0.0.1:8000"


def discovery_of(answers: dict[str, list[str]], *targets: str) -> tuple[DnsDiscovery, Membership]:
    membership = Membership(LBMetrics())

    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return list(answers[host])

    return DnsDiscovery([DnsTarget.parse(t) for t in targets], membership, 1.0, resolver), membership


async def test_a_node_one_target_drops_and_another_lists_stays_the_member_it_was() -> None:
    """Two targets of one role and port listing one pod (services whose selectors overlap): when the target that
    added it no longer lists it, the other's listing kept it out of the membership for a whole interval (targets
    in that order) or made it a new member, unchecked and unroutable until its first check (the other order)."""
    answers = {"a-svc": ["10.0.0.1"], "b-svc": []}
    for order in (("mixed=b-svc:8000", "mixed=a-svc:8000"), ("mixed=a-svc:8000", "mixed=b-svc:8000")):
        answers.update({"a-svc": ["10.0.0.1"], "b-svc": []})
        discovery, membership = discovery_of(answers, *order)
        await discovery.refresh()
        node = membership.get(X)
        assert node is not None and node.source == "dns mixed=a-svc:8000"
        node.set_health(NodeHealth.HEALTHY)
        node.set_serving(True, "open")
        answers.update({"a-svc": [], "b-svc": ["10.0.0.1"]})
        await discovery.refresh()
        assert membership.get(X) is node and node.is_routable, order
        assert node.source == "dns mixed=b-svc:8000"
        answers["b-svc"] = []
        await discovery.refresh()
        assert membership.get(X) is None


async def test_an_address_that_moves_to_another_roles_target_is_a_member_of_that_role_at_once() -> None:
    """A pod IP reused by a pod of another role (same port): with the new role's target looked up first, the
    address stayed out of the membership until the next round."""
    answers = {"p-svc": ["10.0.0.1"], "d-svc": []}
    discovery, membership = discovery_of(answers, "decode=d-svc:8000", "prefill=p-svc:8000")
    await discovery.refresh()
    assert membership.get(X).role is Role.PREFILL
    answers.update({"p-svc": [], "d-svc": ["10.0.0.1"]})
    await discovery.refresh()
    node = membership.get(X)
    assert node is not None and node.role is Role.DECODE


async def test_a_lookup_that_never_answers_neither_stalls_the_round_nor_the_other_targets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose lookup hung (a DNS server that does not answer) held the round, and every other target's
    changes, for as long as it hung: the first round at start, so the LB itself did not start."""
    monkeypatch.setattr(lb.discovery, "LOOKUP_TIMEOUT_S", 0.2)
    membership = Membership(LBMetrics())
    never = asyncio.Event()

    async def resolver(host: str, port: int) -> list[str]:
        if host == "hung-svc":
            await never.wait()
        return ["10.0.0.1"]

    targets = [DnsTarget.parse("prefill=hung-svc:8000"), DnsTarget.parse("decode=d-svc:8000")]
    discovery = DnsDiscovery(targets, membership, 1.0, resolver)
    await asyncio.wait_for(discovery.refresh(), 5)
    assert [node.url for node in membership.nodes(Role.DECODE)] == [X]
    assert membership.nodes(Role.PREFILL) == []
