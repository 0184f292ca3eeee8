"""node_sidecar/intent.py: what the cluster asked of a node, as a fresh engine must get it again (CPU only)."""

from __future__ import annotations

from handoff.protocol.errors import NotServingReason
from node_sidecar.intent import ClusterIntent


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
