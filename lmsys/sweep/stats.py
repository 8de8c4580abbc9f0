"""Seed statistics of a sweep: jobs that differ only in trainer.seed are one configuration.

For every configuration (group) and metric: n, mean, sample standard deviation and the half
width of a 95% confidence interval for the mean, `t(0.975, n-1) * std / sqrt(n)` (Student t).
Against a baseline group (e.g. `optim=adamw`): the per-seed differences of each other group
from the baseline run with the same seed and the same other settings (a paired design: the
seed fixes initialisation and data order, so most run-to-run noise cancels), their mean, ci95
and the two-sided paired t-test p-value.

No scipy: Student t's distribution function is the regularized incomplete beta function,
evaluated by its continued fraction (Numerical Recipes 6.4, Lentz's method); the quantile by
bisection on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

SEED_KEY = "trainer.seed"


# ----------------------------------------------------------------------------- Student t


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function I_x(a, b) (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast here; else use the symmetry
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_sf_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The p-quantile (p > 0.5) of Student's t with df degrees of freedom, by bisection."""
    target = 2.0 * (1.0 - p)  # the two-sided tail mass beyond the quantile
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_sf_two_sided(mid, df) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class Spread:
    n: int
    mean: float | None
    std: float | None  # sample standard deviation (n - 1); None for n < 2
    ci95: float | None  # half width of the 95% interval of the mean; None for n < 2

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread:
        xs = [float(v) for v in values if v is not None and math.isfinite(v)]
        n = len(xs)
        if n == 0:
            return cls(0, None, None, None)
        mean = sum(xs) / n
        if n < 2:
            return cls(n, mean, None, None)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        return cls(n, mean, std, t_quantile(0.975, n - 1) * std / math.sqrt(n))


@dataclass(frozen=True)
class Paired:
    """Per-seed differences (group - baseline) of one metric."""

    pairs: int
    mean: float | None
    ci95: float | None
    p_value: float | None  # two-sided paired t-test; None for fewer than 2 pairs

    @classmethod
    def of(cls, differences: Sequence[float]) -> Paired:
        spread = Spread.of(differences)
        if spread.n < 2 or spread.std is None or spread.mean is None:
            return cls(spread.n, spread.mean, None, None)
        if spread.std == 0.0:
            return cls(spread.n, spread.mean, 0.0, 1.0 if spread.mean == 0 else 0.0)
        t = spread.mean / (spread.std / math.sqrt(spread.n))
        return cls(spread.n, spread.mean, spread.ci95, t_sf_two_sided(t, spread.n - 1))


# ----------------------------------------------------------------------------- grouping jobs


@dataclass
class Group:
    """The jobs of one configuration: equal in every distinguishing key but trainer.seed."""

    values: dict[str, Any]  # key -> value, the keys that tell the groups apart
    jobs: list[Any] = field(default_factory=list)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={_short(v)}" for k, v in self.values.items()) or "all jobs"

    def seeds(self) -> dict[Any, Any]:
        return {job.config.get(SEED_KEY): job for job in self.jobs}


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def group_jobs(jobs: Sequence[Any], keys: Sequence[str]) -> list[Group]:
    """Jobs grouped by the values of `keys` other than trainer.seed, in first-seen order."""
    group_keys = [k for k in keys if k != SEED_KEY]
    groups: dict[str, Group] = {}
    for job in jobs:
        values = {k: job.config.get(k) for k in group_keys}
        key = repr(sorted((k, repr(v)) for k, v in values.items()))
        groups.setdefault(key, Group(values)).jobs.append(job)
    return list(groups.values())


def baseline_matcher(spec: str) -> tuple[str, str]:
    """`optim=adamw` or `optim.lr=1e-3` as (config key, value): a config group stands for its
    `.name` key. ValueError when it is not KEY=VALUE."""
    key, sep, value = spec.partition("=")
    if not sep or not key or not value:
        raise ValueError(f"a baseline is KEY=VALUE (e.g. optim=adamw), not {spec!r}")
    return (key if "." in key else f"{key}.name"), value


def _matches(value: Any, wanted: str) -> bool:
    if str(value) == wanted or _short(value) == wanted:
        return True
    try:
        return isinstance(value, (int, float)) and float(wanted) == float(value)
    except ValueError:
        return False


def check_baseline(spec: str, configs: Sequence[dict[str, Any]]) -> None:
    """Before any job runs: ValueError unless `spec` (KEY=VALUE) is a baseline some job's
    flattened config has, naming the values the jobs have instead."""
    key, wanted = baseline_matcher(spec)
    values = [config[key] for config in configs if key in config]
    if not values:
        raise ValueError(f"--baseline {spec}: no config key {key}")
    if not any(_matches(value, wanted) for value in values):
        have = ", ".join(dict.fromkeys(_short(v) for v in values))
        raise ValueError(f"no sweep job has {key}={wanted} (the baseline {spec}); the jobs have {key}={have}")


def paired_against(
    groups: Sequence[Group], spec: str, metric: Callable[[Any], float | None]
) -> dict[int, Paired]:
    """For each group (by index) other than the baseline ones: the paired differences of
    `metric` against the baseline group that agrees with it on every key but the baseline's,
    seed by seed. ValueError when no group matches the baseline."""
    key, wanted = baseline_matcher(spec)
    bases = [g for g in groups if any(_matches(j.config.get(key), wanted) for j in g.jobs[:1])]
    if not bases:
        raise ValueError(f"no sweep job has {key}={wanted} (the baseline {spec})")
    out: dict[int, Paired] = {}
    for index, group in enumerate(groups):
        if group in bases:
            continue
        others = {k: repr(v) for k, v in group.values.items() if k != key}
        base = next(
            (b for b in bases if {k: repr(v) for k, v in b.values.items() if k != key} == others), bases[0]
        )
        base_seeds = base.seeds()
        diffs = []
        for seed, job in group.seeds().items():
            mine, theirs = metric(job), metric(base_seeds[seed]) if seed in base_seeds else None
            if mine is not None and theirs is not None:
                diffs.append(mine - theirs)
        out[index] = Paired.of(diffs)
    return out
