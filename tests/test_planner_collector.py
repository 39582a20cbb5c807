"""Searches run without the collector's full collections, and give the thresholds back."""

import gc

import pytest

from autopar.planner.collector import NEVER, without_full_collections, young_collections_only


def test_the_oldest_generation_waits_inside_and_the_thresholds_come_back_even_on_an_error():
    before = gc.get_threshold()
    with young_collections_only():
        assert gc.get_threshold() == (before[0], before[1], NEVER)
    assert gc.get_threshold() == before

    @without_full_collections
    def failing():
        assert gc.get_threshold()[2] == NEVER
        raise ValueError("no plan")

    with pytest.raises(ValueError):
        failing()
    assert gc.get_threshold() == before


def test_inside_the_young_generations_still_collect_and_the_oldest_does_not():
    seen = []

    def note(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    try:
        with young_collections_only():
            kept = [[] for _ in range(200 * gc.get_threshold()[0] * gc.get_threshold()[1])]
    finally:
        gc.callbacks.remove(note)
    assert len(kept) and seen.count(0) > 0 and seen.count(1) > 0
    assert 2 not in seen  # without the hold, 200 x the young thresholds of survivors bring full ones
