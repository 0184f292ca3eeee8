"""A fresh engine process met by the node (:mod:`node_sidecar.intent`): what the cluster had asked of the one
before it is done again before the node admits anything.

The tags the cluster had released are released again on the fresh engine (:func:`release_again`, under the control
lock, admission closed); a node whose weights had been updated says why it holds out the start checkpoint
(:func:`meet_fresh_engine`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from handoff.service.errors import ServiceError
from node_sidecar.state import TagState

if TYPE_CHECKING:
    from node_sidecar.node import Node

log = logging.getLogger(__name__)


def meet_fresh_engine(node: Node) -> None:
    """Log what the fresh engine owes the cluster; a stale node's reason becomes its ``last_error``."""
    intent = node.state.intent
    log.warning("the engine is a new process (%s); the cluster had released %s%s", intent.engine,
                intent.unrestored or "nothing", f"; {intent.stale.message()}" if intent.stale is not None else "")
    if intent.stale is not None:
        node.note_error(intent.stale.message())


async def release_again(node: Node) -> None:
    """Release on a fresh engine the tags the cluster had released (under the control lock, admission closed:
    nothing was admitted to the fresh engine). If it fails the node stays not serving and the monitor tries
    again; a resume or release through the sidecar settles it too."""
    state, intent, adapter = node.state, node.state.intent, node.engine_adapter
    resident = state.tags_in(TagState.RESIDENT)
    todo = adapter.release_set([t for t in intent.unrestored if t in resident], resident)
    for tag in todo:
        state.transition(tag, TagState.RELEASING)
    try:
        change = await adapter.release(todo, stage_to_cpu=intent.stage_to_cpu) if todo else None
    except BaseException as exc:
        for tag in todo:
            state.transition(tag, TagState.RESIDENT)
        if not isinstance(exc, ServiceError):
            raise
        error = (f"the restarted engine holds {intent.unrestored} resident, which the cluster had released; "
                 f"releasing them again failed ({exc.message}): not serving until that succeeds (retried) or "
                 "a resume or release through the sidecar")
        if error != node.last_error:
            log.error("%s", error)
        node.note_error(error)
        return
    for tag in todo:
        state.transition(tag, TagState.RELEASED)
    if change is not None and change.weights_valid is not None:
        state.weights_valid = change.weights_valid
    intent.restored(todo)
    log.warning("released %s again on the restarted engine, as the cluster had released them", todo)
