from __future__ import annotations

import pytest

from node_sidecar.engines.base import EngineView
from node_sidecar.state import TAGS, IllegalTransition, NodeState, TagState


def occupation(**states: str) -> EngineView:
    return EngineView(tags={t: TagState(states.get(t, "resident")) for t in TAGS}, weights_valid=True,
                      weight_version="v1", weights_backup="disk", memory_saver="cpu", can_stage_weights=True,
                      tag_bytes={t: 10 for t in TAGS})


def test_legal_cycle_and_illegal_moves_name_the_state() -> None:
    state = NodeState()
    state.transition("kv_cache", TagState.RELEASING)
    state.transition("kv_cache", TagState.RELEASED)
    with pytest.raises(IllegalTransition, match="from released to releasing"):
        state.transition("kv_cache", TagState.RELEASING)
    state.transition("kv_cache", TagState.RESUMING)
    state.transition("kv_cache", TagState.RELEASED)  # a failed resume goes back
    state.transition("kv_cache", TagState.RESUMING)
    state.transition("kv_cache", TagState.RESIDENT)
    with pytest.raises(IllegalTransition, match="from resident to resumed|from resident to resuming"):
        state.transition("kv_cache", TagState.RESUMING)


def test_serving_needs_everything() -> None:
    state = NodeState()
    assert not state.is_serving and state.not_serving_reason() == "engine_unavailable"
    state.is_engine_reachable = True
    state.sync(occupation())
    assert state.is_serving
    state.sync(occupation(kv_cache="released"))
    assert not state.is_serving and state.not_serving_reason() == "node_released"
    state.sync(occupation())
    state.weights_valid = False
    assert state.not_serving_reason() == "weights_not_loaded"
    state.weights_valid = True
    state.is_paused = True
    assert state.not_serving_reason() == "generation_paused"
