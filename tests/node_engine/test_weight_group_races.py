"""Races of ``init_weights_update_group`` with ``destroy_weights_update_group`` on :class:`WeightGroups`, in
process: the join is stubbed so the interleaving is exact."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from handoff.protocol.weights import DestroyWeightsUpdateGroupBody, InitWeightsUpdateGroupBody
from node_engine.errors import Conflict
from node_engine.weight_sync import distributed


class FakeGroup:
    def __init__(self) -> None:
        self.destroyed = 0
        self.name = "g"
        self.rank = 1
        self.world_size = 2
        self.backend = "gloo"

    def destroy(self) -> None:
        self.destroyed += 1


def test_a_destroy_that_answers_abandoned_leaves_no_group_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """The join's thread finished, and its result waits on the loop; a destroy that runs first answers "the join
    was abandoned", so the join must not then register the group (it did: joined, though the LB rolled back)."""
    engine = SimpleNamespace(config=SimpleNamespace(weight_sync_timeout=5.0),
                             runner=SimpleNamespace(device=SimpleNamespace(type="cpu")))
    groups = distributed.WeightGroups(engine)  # type: ignore[arg-type]
    made = FakeGroup()
    answers: list[asyncio.Task] = []

    async def main() -> object:
        loop = asyncio.get_running_loop()

        def join(body: InitWeightsUpdateGroupBody, timeout_s: float, cancel: threading.Event) -> FakeGroup:
            # the rollback's destroy arrives in the same loop turn as the join's result, just ahead of it
            loop.call_soon_threadsafe(lambda: answers.append(asyncio.ensure_future(groups.destroy(
                DestroyWeightsUpdateGroupBody(group_name="g", abandon_join_only=True)))))
            return made

        monkeypatch.setattr(distributed, "join_group", join)
        body = InitWeightsUpdateGroupBody(master_address="127.0.0.1", master_port=29500, rank_offset=1,
                                          world_size=2, group_name="g", backend="gloo")
        try:
            return await groups.init(body)
        except Conflict as exc:
            for _ in range(100):  # the join's result may reach the loop after the abandon (then it is discarded)
                if made.destroyed:
                    break
                await asyncio.sleep(0.02)
            return exc

    outcome = asyncio.run(main())
    assert answers[0].done() and "abandoned" in answers[0].result()["message"]
    assert isinstance(outcome, Conflict), outcome
    assert groups.groups == {} and made.destroyed == 1


def test_a_join_that_completes_after_its_caller_gave_up_destroys_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """``join_group`` looks at ``cancel`` once, after the rendezvous; a timeout between that look and the result's
    arrival on the loop dropped the group joined, never destroyed (its name then taken in torch's registry)."""
    engine = SimpleNamespace(config=SimpleNamespace(weight_sync_timeout=0.2),
                             runner=SimpleNamespace(device=SimpleNamespace(type="cpu")))
    groups = distributed.WeightGroups(engine)  # type: ignore[arg-type]
    made = FakeGroup()
    late = threading.Event()

    def join(body: InitWeightsUpdateGroupBody, timeout_s: float, cancel: threading.Event) -> FakeGroup:
        late.wait(5)  # past its deadline, and past its own look at ``cancel``
        return made

    async def main() -> None:
        monkeypatch.setattr(distributed, "join_group", join)
        body = InitWeightsUpdateGroupBody(master_address="127.0.0.1", master_port=29500, rank_offset=1,
                                          world_size=2, group_name="g", backend="gloo")
        with pytest.raises(distributed.WeightSyncTimeout):
            await groups.init(body)
        late.set()
        for _ in range(100):
            if made.destroyed:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert groups.groups == {} and made.destroyed == 1
