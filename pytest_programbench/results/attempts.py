"""``--pb-attempts K``: per task the mean, best, spread, pass@k, resolved@k and near-resolved@k over its attempts,
and the headline's interval with attempts resampled within each task.

The interval is a two-level (hierarchical) percentile bootstrap, in numpy: each resample draws the tasks with
replacement, then each drawn task's attempts with replacement from its own, and takes the mean of the task means.
scipy's ``bootstrap`` resamples one level only; with one attempt per task this module is not used and the headline's
interval is scipy's over tasks (``statistics.mean_interval``), which says so. pass@k is the unbiased estimator of
``statistics.pass_at_k`` (n attempts that ended, c of them correct).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_programbench.results.coverage import mean_coverage
from pytest_programbench.results.statistics import CONFIDENCE, RESAMPLES, SEED, Interval, pass_at_k

RESOLVED, NEAR_RESOLVED = 1.0, 0.95  # programbench.submission's thresholds
METHOD = "percentile, two-level: tasks resampled, then attempts within each drawn task (numpy)"
OVER = "tasks (each task's mean over its attempts; attempts resampled within each task)"
CHUNK = 500  # resamples drawn at once: bounds the memory to CHUNK x tasks x attempts floats


@dataclass(frozen=True)
class Attempt:
    """One attempt's result: its score (None: it did not score: an infrastructure error, or not run) and whether
    its item passed (the verdict: ``--pb-min-score``)."""

    score: float | None
    passed: bool
    ended: bool = True  # False: not run (yet); it counts in no denominator


def at_k(attempts: Sequence[Attempt], correct: Any) -> dict[str, float]:
    """``{"1": ..., "k": ...}``: the unbiased estimate for every k up to the attempts that ended."""
    ended = [a for a in attempts if a.ended]
    n = len(ended)
    c = sum(1 for a in ended if correct(a))
    return {str(k): round(pass_at_k(n, c, k), 6) for k in range(1, n + 1)}


def task_statistics(attempts: Sequence[Attempt]) -> dict[str, Any]:
    """A task's numbers over its attempts (errors count 0 in ``mean_over_attempts``, as in the selection's mean)."""
    ended = [a for a in attempts if a.ended]
    scores = [a.score for a in ended if a.score is not None]
    mean = sum(scores) / len(scores) if scores else None
    return {
        "n_attempts": len(attempts),
        "ended": len(ended),
        "scored": len(scores),
        "mean": None if mean is None else round(mean, 6),
        "mean_over_attempts": round(sum(scores) / len(ended), 6) if ended else None,
        "best": max(scores) if scores else None,
        "worst": min(scores) if scores else None,
        "std": round(_std(scores), 6) if len(scores) > 1 else None,
        "pass_at_k": at_k(attempts, lambda a: a.passed),
        "resolved_at_k": at_k(attempts, lambda a: a.score is not None and a.score >= RESOLVED),
        "near_resolved_at_k": at_k(attempts, lambda a: a.score is not None and a.score >= NEAR_RESOLVED),
    }


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@functools.lru_cache(maxsize=32)  # the summary is rewritten after every item: the same samples, the same interval
def _two_level(samples: tuple[tuple[float, ...], ...], seed: int, resamples: int) -> tuple[float, float]:
    import numpy as np  # noqa: PLC0415 - lazy: numpy, a heavy wing; not needed while every attempt scores the same

    lengths = np.asarray([len(s) for s in samples])
    width = int(lengths.max())
    values = np.zeros((len(samples), width))
    for i, sample in enumerate(samples):
        values[i, :len(sample)] = sample
    rng = np.random.default_rng(seed)
    means = []
    done = 0
    while done < resamples:
        b = min(CHUNK, resamples - done)
        tasks = rng.integers(0, len(samples), size=(b, len(samples)))  # tasks drawn with replacement
        n = lengths[tasks]  # (b, T): each drawn task's own number of attempts
        # attempts drawn with replacement within each drawn task: index < that task's count
        picks = np.floor(rng.random((b, len(samples), width)) * n[..., None]).astype(int)
        drawn = values[tasks[..., None], picks]
        mask = np.arange(width)[None, None, :] < n[..., None]
        task_means = (drawn * mask).sum(axis=2) / n
        means.append(task_means.mean(axis=1))
        done += b
    pooled = np.concatenate(means)
    alpha = (1 - CONFIDENCE) / 2
    low, high = np.quantile(pooled, [alpha, 1 - alpha])
    return float(low), float(high)


def two_level_interval(samples: Mapping[str, Sequence[float]], *, seed: int = SEED,
                       resamples: int = RESAMPLES) -> Interval | None:
    """95% CI of the mean over tasks of each task's mean over its attempts; ``None`` below two tasks."""
    per_task = tuple(tuple(float(v) for v in samples[t]) for t in sorted(samples) if len(samples[t]))
    if len(per_task) < 2:
        return None
    means = [sum(v) / len(v) for v in per_task]
    estimate = sum(means) / len(means)
    if len({v for sample in per_task for v in sample}) == 1:  # every attempt the same: every resample too
        low = high = estimate
    else:
        low, high = _two_level(per_task, seed, resamples)
    return Interval(estimate, low, high, CONFIDENCE, METHOD, resamples, seed, len(per_task), OVER)


def headline(per_task: Mapping[str, Sequence[Attempt]], *, attempts: int, seed: int = SEED,
             resamples: int = RESAMPLES) -> dict[str, Any]:
    """The run's attempt numbers: both means with their two-level intervals, the spread across attempts, and the
    mean over tasks of each task's pass@k, resolved@k and near-resolved@k."""
    over_scored = {t: [a.score for a in rows if a.ended and a.score is not None] for t, rows in per_task.items()}
    over_scored = {t: [s for s in v if s is not None] for t, v in over_scored.items() if v}
    # Over the selection: every attempt that did not score counts 0, a task with none ended counts 0.
    over_selection = {t: [a.score or 0.0 for a in rows if a.ended] or [0.0] for t, rows in per_task.items()}
    scored = two_level_interval(over_scored, seed=seed, resamples=resamples)
    selection = two_level_interval(over_selection, seed=seed, resamples=resamples)
    attempt_means = _attempt_means(per_task, attempts)
    stats = {t: task_statistics(rows) for t, rows in per_task.items()}
    return {
        "attempts": attempts,
        "mean_over_scored_ci": scored.as_dict() if scored else None,
        "mean_over_selection_ci": selection.as_dict() if selection else None,
        "attempt_means": attempt_means,
        "std_across_attempts": round(_std(attempt_means), 6) if len(attempt_means) > 1 else None,
        "pass_at_k": _mean_at_k(stats, "pass_at_k"),
        "resolved_at_k": _mean_at_k(stats, "resolved_at_k"),
        "near_resolved_at_k": _mean_at_k(stats, "near_resolved_at_k"),
    }


def _attempt_means(per_task: Mapping[str, Sequence[Attempt]], attempts: int) -> list[float]:
    """The spread across attempts: attempt j's mean over the selection (errors 0), for each complete attempt."""
    attempt_means = []
    for j in range(attempts):
        column = [rows[j].score or 0.0 for rows in per_task.values() if len(rows) > j and rows[j].ended]
        if column and len(column) == len(per_task):  # only complete attempts: a partial one is not comparable
            attempt_means.append(round(sum(column) / len(column), 6))
    return attempt_means


def _mean_at_k(stats: Mapping[str, Mapping[str, Any]], name: str) -> dict[str, float]:
    """The mean over tasks of each task's ``name`` (pass@k...), for each k every task has."""
    ks = sorted({k for s in stats.values() for k in s[name]}, key=int)
    return {k: round(sum(s[name].get(k, 0.0) for s in stats.values()) / len(stats), 6)
            for k in ks if all(k in s[name] for s in stats.values())} if stats else {}


def mean_numbers(values: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each numeric key's mean over the mappings that have it as a number (bools and other values left out)."""
    sums: dict[str, list[float]] = {}
    for mapping in values:
        for key, value in mapping.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                sums.setdefault(key, []).append(float(value))
    return {key: round(sum(v) / len(v), 3) for key, v in sums.items()}


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def mean_meta(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A task's pb-meta.json numbers as their means over its attempts (each over the attempts that have it), in the
    same shape, so that a task's row reads as one attempt's does: phase timings, the evaluation's timings, the
    relay's tokens and waits, the agent's clock. What is not a number (the image, the blobs, the engine) is the last
    attempt's; integrity flags are every attempt's, once each."""
    metas = [m for m in metas if m]
    if not metas:
        return {}
    evaluations = [_mapping(m.get("evaluation")) for m in metas]
    flags: dict[str, Any] = {}
    for evaluation in evaluations:
        for flag in evaluation.get("integrity_flags") or []:
            flags.setdefault(repr(flag), flag)
    relays = [_mapping(m.get("relay")) for m in metas if isinstance(m.get("relay"), Mapping)]
    last = metas[-1]
    return {
        **{key: last[key] for key in ("image", "blobs", "engine", "engines_tried") if key in last},
        "timings": mean_numbers([_mapping(m.get("timings")) for m in metas]),
        "evaluation": {"timings": mean_numbers([_mapping(e.get("timings")) for e in evaluations]),
                       "integrity_flags": list(flags.values())},
        "relay": mean_numbers(relays) if relays else None,
        "agent": {key: value for key, value in mean_numbers([_mapping(m.get("agent")) for m in metas]).items()
                  if key in ("seconds", "clock_extended_s")},
        "coverage": mean_coverage([_mapping(m.get("coverage")) or None for m in metas]),
        "attempts_averaged": len(metas),
    }
