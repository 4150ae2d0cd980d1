"""The run's numbers with their noise: a confidence interval of the mean score, the paired difference of two runs,
a permutation test, and the unbiased pass@k estimator. Computed by scipy (``scipy.stats.bootstrap``,
``scipy.stats.permutation_test``), seeded so that a run's numbers are reproducible and a test can recompute them.

Per-task samples are lists of scores, one per attempt: today a run has one attempt per task, and the interval is
then over tasks only (said in ``over``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

CONFIDENCE = 0.95
RESAMPLES = 9999
SEED = 20261123  # fixed: the same run gives the same interval; named in the output
METHOD = "percentile"  # BCa is undefined (NaN) on the degenerate samples small runs have (every task scored 1.0)

OVER_TASKS = "tasks (one attempt per task: the interval is over tasks only)"
OVER_TASK_MEANS = "tasks (each task's mean over its attempts; attempts not resampled)"


@dataclass(frozen=True)
class Interval:
    """A bootstrap confidence interval of a mean, with how it was computed."""

    estimate: float
    low: float
    high: float
    confidence: float
    method: str
    resamples: int
    seed: int
    n: int
    over: str

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@functools.lru_cache(maxsize=32)  # the summary is rewritten after every task: the same scores, the same interval
def _bootstrap_mean(columns: tuple[tuple[float, ...], ...], *, paired: bool, seed: int,
                    resamples: int) -> tuple[float, float]:
    # Every sample (every paired difference) the same: every resample's mean is that value. Answered before scipy
    # is imported (a second at a session's start, when every task still counts 0).
    if len(columns) == 1 and min(columns[0]) == max(columns[0]):
        return float(columns[0][0]), float(columns[0][0])
    if len(columns) == 2 and len({new - base for base, new in zip(*columns, strict=True)}) == 1:
        same = float(columns[1][0] - columns[0][0])
        return same, same
    import numpy as np  # noqa: PLC0415 - lazy: numpy, imported with scipy below
    from scipy.stats import bootstrap  # noqa: PLC0415 - lazy: scipy, a heavy wing (~0.7 s); not while every score is the same

    arrays = tuple(np.asarray(c, dtype=float) for c in columns)
    if len(arrays) == 1:
        result = bootstrap(arrays, np.mean, confidence_level=CONFIDENCE, n_resamples=resamples, method=METHOD,
                           rng=np.random.default_rng(seed))
    else:

        def difference(base: Any, new: Any, axis: int = -1) -> Any:
            return np.mean(new - base, axis=axis)

        result = bootstrap(arrays, difference, paired=paired, confidence_level=CONFIDENCE, n_resamples=resamples,
                           method=METHOD, rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def mean_interval(samples: Mapping[str, Sequence[float]], *, seed: int = SEED,
                  resamples: int = RESAMPLES) -> Interval | None:
    """95% CI of the mean score over tasks (bootstrap over tasks); ``None`` below two tasks."""
    per_task = [list(samples[t]) for t in sorted(samples) if len(samples[t])]  # by id: the seed's draws are stable
    if len(per_task) < 2:
        return None
    means = [sum(v) / len(v) for v in per_task]
    low, high = _bootstrap_mean((tuple(means),), paired=False, seed=seed, resamples=resamples)
    over = OVER_TASKS if all(len(v) == 1 for v in per_task) else OVER_TASK_MEANS
    return Interval(sum(means) / len(means), low, high, CONFIDENCE, METHOD, resamples, seed, len(means), over)


def paired_difference(base: Mapping[str, float], new: Mapping[str, float], *, seed: int = SEED,
                      resamples: int = RESAMPLES, over: str | None = None) -> Interval | None:
    """95% CI of mean(new - base) over the tasks both score (paired bootstrap); ``None`` below two such tasks.
    ``over`` says what a task's number is when it is not one attempt's score (a mean over attempts)."""
    common = sorted(set(base) & set(new))
    if len(common) < 2:
        return None
    a = [base[t] for t in common]
    b = [new[t] for t in common]
    low, high = _bootstrap_mean((tuple(a), tuple(b)), paired=True, seed=seed, resamples=resamples)
    estimate = sum(y - x for x, y in zip(a, b, strict=True)) / len(common)
    return Interval(estimate, low, high, CONFIDENCE, METHOD + " (paired)", resamples, seed, len(common),
                    over or "tasks both runs scored (one attempt per task)")


@dataclass(frozen=True)
class PermutationTest:
    p_value: float
    statistic: float
    resamples: int  # the number of sign patterns when exact
    exact: bool
    seed: int

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "p_value": round(self.p_value, 6), "statistic": round(self.statistic, 6),
                "method": "scipy.stats.permutation_test (paired: scores swapped within each task, two-sided, "
                          "statistic mean(new - base))"}


def paired_permutation_test(base: Mapping[str, float], new: Mapping[str, float], *, seed: int = SEED,
                            resamples: int = RESAMPLES) -> PermutationTest | None:
    """Two-sided p-value that the runs' means differ, swapping each task's two scores (exact below 2^n resamples)."""
    import numpy as np  # noqa: PLC0415 - lazy: numpy, imported with scipy below
    from scipy.stats import permutation_test  # noqa: PLC0415 - lazy: scipy, a heavy wing (~0.7 s); only comparisons test

    common = sorted(set(base) & set(new))
    if len(common) < 2:  # scipy's permutation_test needs two observations per sample
        return None
    a = np.asarray([base[t] for t in common], dtype=float)
    b = np.asarray([new[t] for t in common], dtype=float)

    def statistic(x: Any, y: Any, axis: int = -1) -> Any:
        return np.mean(y - x, axis=axis)

    result = permutation_test((a, b), statistic, permutation_type="samples", n_resamples=resamples,
                              vectorized=True, rng=np.random.default_rng(seed))
    exact = 2 ** len(common) <= resamples
    p_value = 1.0 if math.isnan(float(result.pvalue)) else float(result.pvalue)
    return PermutationTest(p_value, float(result.statistic), 2 ** len(common) if exact else resamples, exact, seed)


def interval_text(ci: Mapping[str, Any]) -> str:
    """An interval as ``Interval.as_dict`` writes it, in one line naming how it was computed."""
    return (f"{ci['estimate']:.3f}, {ci['confidence']:.0%} CI [{ci['low']:.3f}, {ci['high']:.3f}] (bootstrap "
            f"{ci['method']}, {ci['resamples']} resamples, seed {ci['seed']}, over {ci['n']} {ci['over']})")


def bounds_text(ci: Mapping[str, Any]) -> str:
    """An interval's bounds alone (``method_text`` says how it was computed, once for several)."""
    return f"{ci['confidence']:.0%} CI [{ci['low']:.3f}, {ci['high']:.3f}]"


def method_text(ci: Mapping[str, Any]) -> str:
    """How an interval was computed, as ``interval_text`` says it after the numbers."""
    return (f"{ci['confidence']:.0%} CI: bootstrap {ci['method']}, {ci['resamples']} resamples, seed "
            f"{ci['seed']}, over {ci['n']} {ci['over']}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimator of pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), for n samples of which c correct.
    resolved@k is the same with c the attempts that resolved the task (score 1.0)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def headline_statistics(scores_over_scored: Mapping[str, Sequence[float]], selected: Sequence[str], *,
                        seed: int = SEED, resamples: int = RESAMPLES) -> dict[str, Any]:
    """The headline's intervals: over the scored tasks, and over the selection with unscored tasks counted 0."""
    over_selection = {t: list(scores_over_scored.get(t) or [0.0]) for t in selected}
    scored = mean_interval(scores_over_scored, seed=seed, resamples=resamples)
    selection = mean_interval(over_selection, seed=seed, resamples=resamples)
    return {
        "mean_over_scored_ci": scored.as_dict() if scored else None,
        "mean_over_selection_ci": selection.as_dict() if selection else None,
    }
