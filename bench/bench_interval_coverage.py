"""Coverage of the headline's 95% interval under --pb-attempts: how often it holds the true mean.

    python bench/bench_interval_coverage.py [--seeds N] [--tasks T ...] [--attempts K ...] [--resamples B]

A simulated stochastic agent, through the same statistics code as a run (``results/attempts.two_level_interval``
for K > 1, ``results/statistics.mean_interval``, scipy's bootstrap over tasks, for K = 1): a population of tasks, each
with its own chance p of a full solve (p ~ Beta(1.2, 1.8)) and otherwise a partial score (uniform in [0, q], q ~
U(0.3, 0.95), per task). The true mean is the population's, E[p + (1 - p) q / 2], worked out in closed form. Each seed
draws T tasks and K attempts of each; the interval covers when it holds the true mean. Prints, per (T, K), the
coverage with its binomial standard error and the mean width; writes JSON to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytest_programbench.results.attempts import two_level_interval
from pytest_programbench.results.statistics import mean_interval

A, B = 1.2, 1.8  # Beta parameters of a task's full-solve chance
Q_LOW, Q_HIGH = 0.3, 0.95  # a task's partial scores are uniform in [0, q], q ~ U(Q_LOW, Q_HIGH)


def true_mean() -> float:
    """E[p + (1 - p) q / 2] with p ~ Beta(A, B), q ~ U(Q_LOW, Q_HIGH) independent."""
    p = A / (A + B)
    q = (Q_LOW + Q_HIGH) / 2
    return p + (1 - p) * q / 2


def simulate(rng: np.random.Generator, tasks: int, attempts: int) -> dict[str, list[float]]:
    p = rng.beta(A, B, size=tasks)
    q = rng.uniform(Q_LOW, Q_HIGH, size=tasks)
    solved = rng.random((tasks, attempts)) < p[:, None]
    partial = rng.uniform(0, 1, size=(tasks, attempts)) * q[:, None]
    scores = np.where(solved, 1.0, partial)
    return {f"t{i:03d}": [float(s) for s in scores[i]] for i in range(tasks)}


def coverage(tasks: int, attempts: int, seeds: int, resamples: int) -> dict[str, float]:
    target = true_mean()
    hits, widths = 0, []
    for seed in range(seeds):
        samples = simulate(np.random.default_rng(1000 + seed), tasks, attempts)
        if attempts == 1:
            ci = mean_interval(samples, seed=seed, resamples=resamples)
        else:
            ci = two_level_interval(samples, seed=seed, resamples=resamples)
        assert ci is not None
        hits += ci.low <= target <= ci.high
        widths.append(ci.high - ci.low)
    rate = hits / seeds
    return {"tasks": tasks, "attempts": attempts, "seeds": seeds, "resamples": resamples,
            "coverage": round(rate, 4), "stderr": round(math.sqrt(rate * (1 - rate) / seeds), 4),
            "mean_width": round(float(np.mean(widths)), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=400)
    parser.add_argument("--tasks", type=int, nargs="+", default=[10, 30, 100])
    parser.add_argument("--attempts", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    started = time.monotonic()
    rows = [coverage(t, k, args.seeds, args.resamples) for t in args.tasks for k in args.attempts]
    print(f"true mean {true_mean():.4f}; nominal 95%; {args.seeds} seeds, {args.resamples} resamples each")
    print(f"{'tasks':>6} {'K':>3} {'coverage':>9} {'± se':>7} {'width':>7}")
    for row in rows:
        print(f"{row['tasks']:>6} {row['attempts']:>3} {row['coverage']:>9.3f} {row['stderr']:>7.3f} "
              f"{row['mean_width']:>7.3f}")
    out = Path(__file__).parent / "results" / f"bench_interval_coverage-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"true_mean": true_mean(), "rows": rows,
                               "seconds": round(time.monotonic() - started, 1)}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
