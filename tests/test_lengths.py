"""Which episodes training sees: lengths counted as generated, trained and dropped, and the KS distance
between generated and trained — against hand-computed values."""

from __future__ import annotations

from collections import Counter

import pytest

from kuberl.rollout.lengths import EpisodeLengths, described, ks_distance, quantile
from kuberl.rollout.types import Trajectory


def episodes(*lengths: int) -> list[Trajectory]:
    return [Trajectory(prompt_ids=[1], output_ids=[2] * n, behav_logprobs=[-0.1] * n, versions=[0] * n)
            for n in lengths]


def test_quantiles_and_description_by_hand():
    counts = Counter({2: 5, 4: 4, 10: 1})  # ten episodes
    assert (quantile(counts, 0.5), quantile(counts, 0.9), quantile(counts, 1.0)) == (2.0, 4.0, 10.0)
    assert described(counts) == {"n": 10, "mean": 3.6, "p50": 2.0, "p90": 4.0}
    assert described(Counter()) == {"n": 0, "mean": None, "p50": None, "p90": None}


def test_the_ks_distance_is_the_largest_gap_between_the_two_cumulative_distributions():
    same = Counter({3: 2, 5: 2})
    assert ks_distance(same, Counter({3: 10, 5: 10})) == 0.0
    # generated 1,2,3,4 (one each); trained only the short half: F_t(2) = 1, F_g(2) = 0.5
    assert ks_distance(Counter({1: 1, 2: 1, 3: 1, 4: 1}), Counter({1: 1, 2: 1})) == pytest.approx(0.5)
    assert ks_distance(Counter({1: 1}), Counter()) is None


def test_a_rollout_that_drops_its_long_episodes_trains_on_shorter_ones_and_says_so():
    lengths = EpisodeLengths()
    lengths.add(lengths.generated, episodes(2, 2, 3, 3, 40, 60))
    lengths.add(lengths.trained, episodes(2, 2, 3, 3))
    lengths.add(lengths.dropped, episodes(40, 60))
    report = lengths.report()
    assert report["generated"]["n"] == 6 and report["dropped"] == {"n": 2, "mean": 50.0, "p50": 40.0, "p90": 60.0}
    assert report["ks_generated_trained"] == pytest.approx(1 / 3, abs=1e-4)  # F_g(3) = 4/6 against F_t(3) = 1
