"""node_sidecar/intent.py: what the cluster asked of a node, as a fresh engine must get it again (CPU only)."""

from __future__ import annotations

import json

import pytest

from handoff.protocol.control import MAX_NAME_CHARS
from handoff.protocol.errors import NotServingReason
from handoff.protocol.tags import TAG_NAMES as TAGS
from node_sidecar.intent import (MAX_ENGINE_CHARS, MAX_GROUPS, ClusterIntent, IntentShapeError, StaleWeights,
                                 TagRecord)


def test_a_fresh_engine_owes_the_releases_and_the_weights_the_cluster_gave_the_one_before() -> None:
    intent = ClusterIntent()
    assert not intent.meet_engine("a", served_version="default", had_version=None)  # the first engine seen
    intent.record_release(["kv_cache", "weights"])
    intent.record_weights_loaded()
    assert intent.meet_engine("b", served_version="default", had_version="step-1")
    assert intent.unrestored == ["weights", "kv_cache"]  # in the tags' order
    assert intent.blocking_reason() is NotServingReason.NODE_RELEASED
    intent.restored(["weights", "kv_cache"])
    assert intent.blocking_reason() is NotServingReason.WEIGHTS_STALE
    assert "'step-1'" in intent.stale.message() and "'default'" in intent.stale.message()
    assert not intent.meet_engine("b", served_version="default", had_version="step-1")  # the same one again
    assert not intent.meet_engine(None, served_version="default", had_version="step-1")  # one naming no process
    intent.record_weights_loaded()
    assert intent.blocking_reason() is None


def test_the_tags_the_engine_met_holds_released_are_kept_for_a_fresh_one() -> None:
    """A sidecar that lost its record of a release (restarted without the file, or its write failed) learns it
    from the engine process it meets; before, the next fresh engine came up resident and was served."""
    intent = ClusterIntent()
    assert not intent.meet_engine("a", served_version=None, had_version=None, released=["kv_cache", "workspace"])
    assert intent.released == {"kv_cache", "workspace"}
    assert not intent.meet_engine("a", served_version=None, had_version=None, released=["weights", "kv_cache"])
    assert intent.released == {"kv_cache", "workspace", "weights"}  # the same process: only ever added
    assert intent.meet_engine("b", served_version=None, had_version=None, released=[])
    assert intent.unrestored == ["weights", "kv_cache", "workspace"]


def test_a_release_the_same_engine_holds_resident_again_is_forgotten() -> None:
    """An engine that reports its own tags and holds a released tag resident again (a resume it ran after the
    sidecar gave up on it): the release is undone and no fresh engine is released again for it; a tag a fresh
    engine still owes is kept until it is released again."""
    intent = ClusterIntent()
    intent.meet_engine("a", served_version=None, had_version=None)
    intent.record_release(["kv_cache", "workspace", "weights"])
    assert not intent.meet_engine("a", served_version=None, had_version=None, released=["weights"],
                                  resident=["kv_cache", "workspace", "cuda_graph"])
    assert intent.released == {"weights"}
    assert intent.meet_engine("b", served_version=None, had_version=None, resident=list(TAGS))
    assert intent.unrestored == ["weights"]
    assert not intent.meet_engine("b", served_version=None, had_version=None, resident=list(TAGS))
    assert intent.unrestored == ["weights"] and intent.released == {"weights"}  # owed, not undone


def test_a_fresh_engine_stays_stale_until_its_updates_wrote_every_weight() -> None:
    """Buckets (verl pushes several per step): the first lifted ``weights_stale``, and the node served a mix of
    the start checkpoint and the new weights until the last one landed (found by review)."""
    intent = ClusterIntent()
    intent.meet_engine("a", served_version="default", had_version=None)
    intent.record_weights_loaded("step-1", updated_fully=False)  # before a restart it changes nothing
    assert intent.meet_engine("b", served_version="default", had_version="step-1")
    intent.record_weights_loaded("step-2", updated_fully=False)
    assert intent.blocking_reason() is NotServingReason.WEIGHTS_STALE and intent.weights_updated
    assert intent.stale == StaleWeights("default", "step-1")
    intent.record_weights_loaded("step-2", updated_fully=True)
    assert intent.blocking_reason() is None


def test_a_release_again_is_made_as_the_cluster_made_it() -> None:
    """A vLLM node's sleep level follows ``stage_to_cpu``: a fresh engine released at another level would come back
    without weights (found by review)."""
    intent = ClusterIntent()
    intent.record_release(["weights"], stage_to_cpu=True)
    intent.record_release(["weights"], stage_to_cpu=None)  # a repeated release changes nothing
    assert intent.stage_to_cpu is True
    intent.record_resume(["weights"])
    intent.record_release(["weights", "kv_cache"], stage_to_cpu=False)
    assert intent.stage_to_cpu is False
    intent.meet_engine("a", served_version=None, had_version=None)
    intent.meet_engine("b", served_version=None, had_version=None)
    intent.restored(["weights", "kv_cache"])
    assert intent.stage_to_cpu is False and intent.released == {"weights", "kv_cache"}


def full_intent() -> ClusterIntent:
    """An intent with every field set: two engine processes seen, releases, an update, groups joined and lost."""
    intent = ClusterIntent()
    intent.meet_engine("a", served_version="default", had_version=None)
    intent.record_release(["kv_cache", "weights"], stage_to_cpu=True)
    intent.record_joined("g1")
    intent.record_weights_loaded("step-1")
    intent.meet_engine("b", served_version="default", had_version=None)
    intent.record_joined("g2")
    return intent


def test_the_intent_reads_back_as_it_was_written() -> None:
    intent = full_intent()
    data = json.loads(json.dumps(intent.to_json()))
    again = ClusterIntent.from_json(data)
    assert again == intent and again.to_json() == data
    assert again.unrestored == ["weights", "kv_cache"] and again.lost_groups == {"g1"}
    assert again.joined_groups == {"g2"} and again.stale == StaleWeights("default", "step-1")
    assert ClusterIntent.from_json(ClusterIntent().to_json()) == ClusterIntent()


def test_a_restarted_sidecar_names_the_version_the_node_had() -> None:
    """A sidecar restarted with its engine has read no version yet: the stored one is named."""
    intent = ClusterIntent()
    intent.meet_engine("a", served_version="default", had_version=None)
    intent.record_weights_loaded("step-7")
    again = ClusterIntent.from_json(intent.to_json())
    assert again.meet_engine("b", served_version="default", had_version=None)
    assert again.stale == StaleWeights("default", "step-7")


def test_every_change_is_heard_once_it_is_made() -> None:
    heard: list[dict] = []
    intent = ClusterIntent(on_change=lambda i: heard.append(i.to_json()))
    intent.record_release(["kv_cache"])
    intent.record_resume(["kv_cache"])
    intent.record_weights_loaded("v")
    intent.record_joined("g")
    intent.record_left("g")
    intent.meet_engine("a", served_version=None, had_version=None)
    assert [h["released"] for h in heard[:2]] == [["kv_cache"], []]
    assert heard[2]["weights_updated"] and heard[3]["joined_groups"] == ["g"] and heard[4]["joined_groups"] == []
    assert heard[5]["engine"] == "a" and len(heard) == 6


def test_a_restore_is_heard_once_and_whole() -> None:
    """A release again that found a tag released already (not in ``todo``) was heard twice, first with that tag
    still owed: a sidecar killed between the two writes read back an intent half restored."""
    heard: list[dict] = []
    intent = ClusterIntent()
    intent.record_release(["weights", "kv_cache"])
    intent.meet_engine("a", served_version=None, had_version=None)
    intent.meet_engine("b", served_version=None, had_version=None)
    intent.on_change = lambda i: heard.append(i.to_json())
    intent.restored(["kv_cache"])
    assert [h["unrestored"] for h in heard] == [[]]


def test_a_weight_update_that_woke_the_weights_leaves_them_resident() -> None:
    """An update over released weights wakes them (handoff's engine, vLLM): the cluster holds them resident, and a
    fresh engine must not release them again (it did, and the node was ``node_released`` on top of stale)."""
    heard: list[dict] = []
    intent = ClusterIntent(on_change=lambda i: heard.append(i.to_json()))
    intent.record_release(["weights", "kv_cache"], stage_to_cpu=True)
    intent.record_weights_loaded("step-1", resumed=["weights"])
    assert intent.released == {"kv_cache"} and heard[-1]["released"] == ["kv_cache"] and len(heard) == 2
    intent.meet_engine("a", served_version=None, had_version=None)
    intent.meet_engine("b", served_version="default", had_version="step-1")
    assert intent.unrestored == ["kv_cache"]


REACHABLE = [
    pytest.param(lambda i: None, id="fresh"),
    pytest.param(lambda i: i.record_release(["weights"], stage_to_cpu=False), id="stage-to-cpu-false"),
    pytest.param(lambda i: i.record_release(["kv_cache"], stage_to_cpu=True), id="stage-to-cpu-true"),
    pytest.param(lambda i: (i.meet_engine("a", served_version=None, had_version=None), i.record_weights_loaded(),
                            i.meet_engine("b", served_version=None, had_version=None)), id="stale-no-versions"),
    pytest.param(lambda i: (i.meet_engine("a", served_version=None, had_version=None), i.record_release(["weights"]),
                            i.record_joined("g"), i.meet_engine("b", served_version=None, had_version=None)),
                 id="unrestored-and-lost"),
    pytest.param(lambda i: (i.record_joined("g"), i.record_left("g"), i.record_resume(["weights"])), id="left"),
    pytest.param(lambda i: (i.record_paused(True), i.record_engine_memory(TagRecord("e", ("kv_cache",),
                                                                                    continue_held=True))),
                 id="paused-and-a-continue-held"),
]


@pytest.mark.parametrize("reach", REACHABLE)
def test_every_reachable_intent_reads_back(reach) -> None:
    intent = ClusterIntent()
    reach(intent)
    data = json.loads(json.dumps(intent.to_json()))
    assert ClusterIntent.from_json(data) == intent


def shaped(**changes: object) -> dict:
    data = full_intent().to_json()
    data.update(changes)
    return data


BAD_SHAPES = [
    pytest.param([], id="a-list"),
    pytest.param({k: v for k, v in shaped().items() if k != "engine"}, id="a-key-missing"),
    pytest.param(shaped(extra=1), id="a-key-extra"),
    pytest.param(shaped(format=2), id="another-format"),
    pytest.param(shaped(format=True), id="format-true"),
    pytest.param(shaped(format=1.0), id="format-a-float"),
    pytest.param(shaped(weight_version=""), id="version-empty"),
    pytest.param(shaped(engine=""), id="engine-empty"),
    pytest.param(shaped(joined_groups=["g1"]), id="a-group-joined-and-lost"),
    pytest.param(shaped(released=["kv_cache", "memory"]), id="a-tag-unknown"),
    pytest.param(shaped(released=["kv_cache", "kv_cache"]), id="a-tag-twice"),
    pytest.param(shaped(released="kv_cache"), id="tags-a-string"),
    pytest.param(shaped(unrestored=["cuda_graph"]), id="unrestored-not-released"),
    pytest.param(shaped(engine=7), id="engine-a-number"),
    pytest.param(shaped(engine="x" * (MAX_ENGINE_CHARS + 1)), id="engine-too-long"),
    pytest.param(shaped(weight_version="v" * (MAX_NAME_CHARS + 1)), id="version-too-long"),
    pytest.param(shaped(weights_updated=None), id="weights-updated-null"),
    pytest.param(shaped(weights_updated=1), id="weights-updated-a-number"),
    pytest.param(shaped(stage_to_cpu="yes"), id="stage-to-cpu-a-string"),
    pytest.param(shaped(stale={"served": "a"}), id="stale-a-key-missing"),
    pytest.param(shaped(stale={"served": "a", "had": 3}), id="stale-had-a-number"),
    pytest.param(shaped(stale="stale"), id="stale-a-string"),
    pytest.param(shaped(joined_groups=[f"g{i}" for i in range(MAX_GROUPS + 1)]), id="too-many-groups"),
    pytest.param(shaped(lost_groups=["g" * (MAX_NAME_CHARS + 1)]), id="group-name-too-long"),
    pytest.param(shaped(lost_groups=[""]), id="group-name-empty"),
    pytest.param(shaped(lost_groups=["g", "g"]), id="group-twice"),
    pytest.param(shaped(joined_groups=[1]), id="group-a-number"),
]


@pytest.mark.parametrize("data", BAD_SHAPES)
def test_stored_intent_of_another_shape_is_refused(data: object) -> None:
    with pytest.raises(IntentShapeError):
        ClusterIntent.from_json(data)


def test_an_update_the_engine_met_reports_is_kept_for_a_fresh_one() -> None:
    """A sidecar that lost its record of an update (its write failed, it was killed mid-update) learns it from
    handoff's engine (``weights_updated``); before, the next fresh engine's start checkpoint was served."""
    intent = ClusterIntent()
    assert not intent.meet_engine("a", served_version="step-1", had_version=None, updated=True)
    assert intent.weights_updated and intent.weight_version == "step-1"
    assert not intent.meet_engine("a", served_version="step-1", had_version="step-1", updated=False)
    assert intent.weights_updated  # only ever learnt, never forgotten
    assert intent.meet_engine("b", served_version="default", had_version=None)
    assert intent.stale == StaleWeights("default", "step-1")
    assert intent.blocking_reason() is NotServingReason.WEIGHTS_STALE
