"""The weight groups formed through this LB (:class:`WeightGroups`): which nodes a group's update and destroy go to.

A group is kept from its init's 200 until one of its nodes leaves it (a group short of a rank broadcasts no more);
the nodes a destroy failed on are kept apart, for the next destroy of that name and no update. Nodes are kept as
they joined (URL and role then) and called as the member at their address now. The record lives in this LB's
memory: a group formed through another replica, or before a restart, is not in it.
"""

from __future__ import annotations

from typing import Any, Callable

from lb.config import Role
from lb.membership import Membership
from lb.node import Node

__all__ = ["WeightGroups"]


class WeightGroups:
    """The weight groups of this LB, shared by every call: the names with an init under way, and for each name
    the groups formed (one per init, from its 200 until one of its nodes leaves it: a group without one of its
    ranks broadcasts no more) and the nodes left holding one after a destroy that failed on them. A node is kept as
    it joined (its URL and role then)."""

    def __init__(self) -> None:
        self.initializing: set[str] = set()
        self._groups: dict[str, list[list[Node]]] = {}
        self._leaving: dict[str, list[Node]] = {}  # a destroy failed on them: they get the next one, no update

    @property
    def is_empty(self) -> bool:
        """No group formed through this LB is alive (a group call's body need not be read for its name)."""
        return not self._groups and not self._leaving

    def formed(self, name: str, nodes: list[Node], membership: Membership) -> None:
        """``nodes`` joined a group called ``name``. Groups of that name formed before over other nodes (an init of
        another ``?role=``) stay: an engine refuses a second group of a name it holds, so the name's nodes are all
        of theirs. One that shares a node with this one (under its URL or another spelling) lost that rank."""
        joined = {id(node) for node in nodes}

        def rejoined(node: Node) -> bool:
            return id(_now(node, membership)) in joined

        kept, broken = _split(self._groups.get(name, []), rejoined)
        self._groups[name] = kept + [list(nodes)]
        self._set_leaving(name, [node for node in self._leaving.get(name, []) + broken if not rejoined(node)])

    def nodes_of(self, name: str, membership: Membership, role: Role | None, *,
                 leaving: bool = False) -> list[tuple[Node, Node]] | None:
        """The nodes of the groups called ``name`` (``leaving``: and the nodes to destroy it on again) that
        joined as ``role`` nodes (any role: None), each as (the node as it joined, the member at its address now:
        it left and joined again, under any spelling known without a lookup and any role; no longer a member, as
        it was). None: no such node (not formed through this LB, or not for ``role``)."""
        nodes = [node for group in self._groups.get(name, ()) for node in group]
        nodes += self._leaving.get(name, []) if leaving else []
        return [(node, _now(node, membership)) for node in nodes if role is None or node.role is role] or None

    def destroyed(self, name: str, called: list[tuple[Node, Node]], payload: dict[str, Any]) -> None:
        """After a destroy sent to ``called`` (:meth:`nodes_of`; ``payload``: its answer): the nodes that left
        (answered 2xx) are out; a group one of them left is no more, and its nodes the destroy failed on are left
        holding it (the next destroy goes to them, no update does)."""
        failed = {failure["node"] for failure in payload.get("failures", ())}
        left = {id(joined) for joined, now in called if now.url not in failed}
        kept, broken = _split(self._groups.pop(name, []), lambda node: id(node) in left)
        if kept:
            self._groups[name] = kept
        self._set_leaving(name, [node for node in self._leaving.get(name, []) + broken if id(node) not in left])

    def left_holding(self, name: str, nodes: list[Node]) -> None:
        """``nodes`` joined a group called ``name`` and a destroy failed on them (an init's rollback): the next
        destroy of that name goes to them."""
        known = self._leaving.get(name, [])
        self._set_leaving(name, known + [node for node in nodes if node not in known])

    def _set_leaving(self, name: str, nodes: list[Node]) -> None:
        if nodes:
            self._leaving[name] = nodes
        else:
            self._leaving.pop(name, None)


def _split(groups: list[list[Node]], lost: Callable[[Node], bool]) -> tuple[list[list[Node]], list[Node]]:
    """(the groups none of whose nodes is ``lost``, the nodes of the others)."""
    kept: list[list[Node]] = []
    broken: list[Node] = []
    for group in groups:
        if any(map(lost, group)):
            broken += group
        else:
            kept.append(group)
    return kept, broken


def _now(node: Node, membership: Membership) -> Node:
    """The member at ``node``'s address now (under any spelling known without a lookup), else ``node``."""
    return membership.same_address(node.url, learned=False) or node
