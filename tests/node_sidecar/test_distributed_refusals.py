"""``update_weights_from_distributed`` refused by the sidecar after it was announced (a drain that timed out), on
real processes with this test process as the trainer (rank 0 of a gloo group): the trainer broadcasts whatever
the answer, so the engine must still take those broadcasts, or the next update pairs them with its own names."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from handoff.protocol.control import DEADLINE_HEADER
from handoff.weight_sync import broadcast_named_tensors
from tests.node_sidecar.test_tensor_push_refusals import _a_long_generation, _sidecar
from tests.support.procs import ServerProcess
from tests.support.trainer import Trainer, distributed_body
from tests.support.weights import greedy, tiny_weights

pytestmark = pytest.mark.timeout(180)
SYNC_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def node(proc_log_dir: Path) -> Iterator[str]:
    """A sidecar in front of a real engine (broadcasts bounded at ``SYNC_TIMEOUT_S``): its URL."""
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--weight-sync-timeout",
                                           str(SYNC_TIMEOUT_S)], log_dir=proc_log_dir, name="engine")
    engine.start()
    sidecar = _sidecar(engine, proc_log_dir, "sidecar")
    yield sidecar.url
    sidecar.stop()
    engine.stop()


def _push(trainer: Trainer, named: list[tuple[str, torch.Tensor]], headers: dict[str, str],
          **fields: object) -> httpx.Response:
    """One update with ``headers``, broadcast as the trainer does whatever the answer (its broadcast error, if
    any, raised)."""
    assert trainer.group is not None
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, trainer.url + "/update_weights_from_distributed",
                             json=distributed_body(named, trainer.group_name, **fields), headers=headers, timeout=60)
        broadcast_named_tensors(trainer.group, [t for _, t in named])
        return answer.result()


def test_an_update_refused_by_a_drain_that_timed_out_still_takes_its_broadcasts(node: str) -> None:
    before = greedy(node)
    old, new = tiny_weights(0), tiny_weights(5)
    trainer = Trainer(node, group_name="drained")
    r = trainer.join(timeout_s=SYNC_TIMEOUT_S)
    assert r.status_code == 200, r.text
    try:
        with _a_long_generation(node):
            r = _push(trainer, list(new.items()), {DEADLINE_HEADER: "1"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "drain_timeout", r.text
        # the group is still in step: the next update loads what it broadcasts (the start weights), not the
        # refused update's tensors under its names
        r = _push(trainer, list(old.items()), {})
        assert r.status_code == 200, r.text
        assert greedy(node) == before
    finally:
        trainer.leave()


def test_an_update_the_sidecar_refuses_as_read_still_has_its_broadcasts_taken(node: str) -> None:
    """A mistyped field (``weight_version: 5``): 400 at the sidecar, and the engine still took the broadcasts, as
    it does for a body it refuses itself."""
    before = greedy(node)
    old, new = tiny_weights(0), tiny_weights(5)
    trainer = Trainer(node, group_name="mistyped")
    r = trainer.join(timeout_s=SYNC_TIMEOUT_S)
    assert r.status_code == 200, r.text
    try:
        r = _push(trainer, list(new.items()), {}, weight_version=5)
        assert r.status_code == 400 and "weight_version" in r.json()["error"]["message"], r.text
        r = _push(trainer, list(old.items()), {})
        assert r.status_code == 200, r.text
        assert greedy(node) == before
    finally:
        trainer.leave()
