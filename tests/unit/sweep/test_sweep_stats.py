"""The seed statistics of a sweep (lmsys/sweep/stats.py): Student's t against known values. A real
sweep's groups: tests/integration/launch/test_sweep_stats.py."""

from __future__ import annotations

import pytest

from lmsys.sweep.stats import betainc, t_quantile, t_sf_two_sided


def test_student_t_against_known_values():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062047, rel=1e-7)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764451, rel=1e-7)
    assert t_quantile(0.975, 1000) == pytest.approx(1.9623390, rel=1e-6)
    assert t_sf_two_sided(2.0, 10) == pytest.approx(0.0733880, rel=1e-5)
    assert betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248, rel=1e-12)  # 1 - sum of binomial terms
    scipy_stats = pytest.importorskip("scipy.stats")  # a cross-check where scipy happens to be
    for df in (1, 2, 3, 7, 30):
        assert t_quantile(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-9)
        assert t_sf_two_sided(1.7, df) == pytest.approx(2 * scipy_stats.t.sf(1.7, df), rel=1e-9)
