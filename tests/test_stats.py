"""The statistics behind every reported figure: finite means, standard errors, paired gains, pooled variances."""

import math

import pytest

from sao.stats import mean, paired_gain, pooled_variance, stderr


def test_mean_leaves_out_what_is_not_a_finite_number():
    assert mean([1.0, float("nan"), 3.0, float("inf"), None]) == 2.0
    assert mean([float("nan")]) is None and mean([]) is None


def test_stderr_is_the_sample_sd_over_root_n():
    assert stderr([1.0, 2.0, 3.0, 4.0]) == pytest.approx(math.sqrt(5 / 3) / 2)
    assert stderr([1.0]) is None


def test_paired_gain_of_known_scores():
    # Differences 1, 0, 0, 0, 1: mean 0.4, sample sd sqrt(0.3), s.e. sqrt(0.3 / 5).
    gain, stderr = paired_gain([0, 0, 1, 1, 0], [1, 0, 1, 1, 1])
    assert gain == pytest.approx(0.4) and stderr == pytest.approx((0.3 / 5) ** 0.5)
    # Pairing matters: the same base scores in another task order give differences 1, -1, 1, 0, 1.
    assert paired_gain([0, 1, 0, 1, 0], [1, 0, 1, 1, 1])[1] == pytest.approx((0.8 / 5) ** 0.5)
    assert paired_gain([0.5], [1.0]) == (0.5, None) and paired_gain([], []) == (None, None)
    with pytest.raises(ValueError, match="one base and one final score per item"):
        paired_gain([0, 1], [1])


def test_pooled_variance_takes_deviations_from_each_groups_own_mean():
    # Groups (1, 3) and (10, 10, 13): squared deviations 2 and 6 over (1 + 2) degrees of freedom.
    assert pooled_variance([[1.0, 3.0], [10.0, 10.0, 13.0]]) == pytest.approx(8 / 3)
    assert pooled_variance([[1.0, 3.0], [5.0], []]) == pytest.approx(2.0)  # one value adds no freedom
    assert pooled_variance([[1.0], [2.0]]) is None
