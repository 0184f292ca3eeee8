"""node_engine/weight_coverage.py: which weights updates wrote since a moment (a restart of the process for
``weights_updated_fully``, weights made invalid for their validity)."""

from __future__ import annotations

from node_engine.weight_coverage import WeightCoverage

KEYS = ("embed.weight", "layer.0.weight", "lm_head.weight")


def test_buckets_cover_the_model_only_together() -> None:
    written = WeightCoverage()
    assert not written.is_full  # the start checkpoint serves
    written.note(["embed.weight"], KEYS)
    written.note(["embed.weight", "layer.0.weight"], KEYS)  # a key written again counts once
    assert not written.is_full
    written.note(["lm_head.weight"], KEYS)
    assert written.is_full
    written.note(["embed.weight"], KEYS)  # a later partial push leaves it full
    assert written.is_full


def test_a_whole_checkpoint_covers_the_model_at_once() -> None:
    written = WeightCoverage()
    written.note(["embed.weight"], KEYS)
    written.note_all()
    assert written.is_full


def test_a_restart_counts_from_nothing() -> None:
    written = WeightCoverage()
    written.note_all()
    written.restart()  # weights resumed as garbage: valid again only once every key is written since
    assert not written.is_full
    written.note(["embed.weight", "layer.0.weight"], KEYS)
    assert not written.is_full
    written.note(["lm_head.weight"], KEYS)
    assert written.is_full
