"""What the audit of the hidden tests costs: ``pytest --pb-submissions`` with ``--pb-audit-hidden-tests on`` (the
default) against the same session with it ``off``, on the same submissions.

    python bench/bench_audit.py [--repeat N] [--variant good] [--branches N] [-n WORKERS]

Runs, on copies of the test bed's run directory ``testbed/.state/submissions/<variant>`` (all four fixture tasks; with
``--branches N`` the test bed's own three with N active branches each, as in ``bench_eval.py``), the plugin with the
audit off and on, alternately, ``--repeat`` times each (the best kept). The audit runs only for tasks that would pass
(the ``good`` variant: all of them), so this is its whole cost; a failing task pays nothing.

Prints the wall seconds of each, the ratio on ÷ off, and per task the evaluation phase (``pb-meta.json``'s
``timings.evaluation``) with and without the audit, the audit's own seconds (``evaluation.audit.seconds``) and the
official hidden tests' (``run_tests`` in eval.json), and what the audit found; then the audit's seconds over the
official hidden tests' seconds of the same evaluations (each pair measured back to back in one evaluation, so the
ratio holds on a loaded machine, where the wall times of two sessions minutes apart do not), over every "on" run;
writes JSON to ``bench/results/bench_audit-<UTC>.json`` with the load average before and after. The scores must be
equal in both (the audit never changes one). Needs the test bed: ``bash testbed/setup.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_eval import RESULTS, merged_tasks_dir, read_env, scores_from_eval_json, timed, widened


def per_task(output: Path) -> dict[str, Any]:
    tasks: dict[str, Any] = {}
    for meta_path in sorted(output.glob("*/pb-meta.json")):
        meta = json.loads(meta_path.read_text())
        evaluation = meta.get("evaluation") or {}
        audit = evaluation.get("audit") or {}
        eval_json = next(meta_path.parent.glob("*.eval.json"), None)
        tests = 0.0
        if eval_json is not None:
            tests = sum(float(e.get("wall_time") or 0.0) for e in json.loads(eval_json.read_text()).get("log") or []
                        if isinstance(e, dict) and e.get("step") == "run_tests")
        tasks[meta_path.parent.name] = {
            "evaluation": (meta.get("timings") or {}).get("evaluation"),
            "official_tests": round(tests, 3),
            "audit_seconds": audit.get("seconds"),
            "audit": f"{audit.get('state')}/{audit.get('result') or audit.get('why') or '-'}",
        }
    return tasks


def run(name: str, source: Path, work: Path, tasks_dir: Path, env: dict[str, str], workers: int,
        audit: bool) -> dict[str, Any]:
    run_copy = work / "input" / source.name
    shutil.copytree(source, run_copy)
    output = work / "output"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pb-submissions", str(run_copy),
           "--pb-tasks-dir", env["PB_TESTBED_TASKS_DIR"], "--pb-include-fixtures", "--pb-blob-dir",
           env["PB_TESTBED_BLOB_DIR"], "--pb-cpus", "2", "--pb-output", str(output),
           "--pb-audit-hidden-tests", "on" if audit else "off"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    cwd = work / "cwd"
    cwd.mkdir()
    seconds, rc = timed(cmd, env=dict(os.environ), cwd=cwd, log=work / "session.log")
    return {"name": name, "seconds": seconds, "returncode": rc, "scores": scores_from_eval_json(output, tasks_dir),
            "tasks": per_task(output)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each configuration (the best is kept)")
    parser.add_argument("--variant", default="good", help="test bed run directory (good, wrong, ...)")
    parser.add_argument("--branches", type=int, default=0,
                        help="give each of the test bed's own tasks this many branches (its own repeated)")
    parser.add_argument("-n", dest="workers", type=int, default=1, help="pytest-xdist workers")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    env = read_env()
    source = Path(env["PB_TESTBED_RUNS"]) / args.variant
    if not source.is_dir():
        sys.exit(f"no run directory {source}")
    work_root = Path(tempfile.mkdtemp(prefix="pb-bench-audit-"))
    if args.branches > 0:
        env, source = widened(work_root, env, source, args.branches)
    rows: dict[str, dict[str, Any]] = {}
    audited: list[dict[str, Any]] = []  # every "on" run's tasks
    load_before = os.getloadavg()
    try:
        tasks_dir = merged_tasks_dir(work_root, env)
        for attempt in range(args.repeat):
            for name, audit in (("audit off", False), ("audit on", True)):
                work = work_root / f"{attempt}-{name.replace(' ', '-')}"
                work.mkdir()
                row = run(name, source, work, tasks_dir, env, args.workers, audit)
                if audit:
                    audited.append(row["tasks"])
                print(f"[{attempt + 1}/{args.repeat}] {name}: {row['seconds']:.1f} s (exit {row['returncode']})",
                      file=sys.stderr)
                best = rows.get(name)
                row["all_seconds"] = [*(best or {}).get("all_seconds", []), round(row["seconds"], 2)]
                if best is None or row["seconds"] < best["seconds"]:
                    rows[name] = row
                else:
                    best["all_seconds"] = row["all_seconds"]
    finally:
        if not args.keep:
            shutil.rmtree(work_root, ignore_errors=True)

    off, on = rows["audit off"], rows["audit on"]
    print()
    print(f"{len(on['scores'])} submissions from {source}; best of {args.repeat}; -n {args.workers}")
    print(f"{'configuration':12s} {'wall s':>8s} {'runs':>20s}")
    for name, row in rows.items():
        print(f"{name:12s} {row['seconds']:8.1f} {row['all_seconds']!s:>20s}")
    ratio = on["seconds"] / off["seconds"]
    print(f"audit on ÷ audit off = {ratio:.2f}x")
    print()
    print(f"{'task':34s} {'eval off':>9s} {'eval on':>9s} {'audit':>7s} {'tests':>7s}  audit result")
    for task, seen in on["tasks"].items():
        plain = off["tasks"].get(task, {})
        print(f"{task:34s} {plain.get('evaluation') or 0:9.1f} {seen.get('evaluation') or 0:9.1f} "
              f"{seen.get('audit_seconds') or 0:7.1f} {seen['official_tests']:7.1f}  {seen['audit']}")
    audit_s = sum(float(t.get("audit_seconds") or 0.0) for tasks in audited for t in tasks.values())
    tests_s = sum(float(t.get("official_tests") or 0.0) for tasks in audited for t in tasks.values())
    per_run = [round(sum(float(t.get("audit_seconds") or 0.0) for t in tasks.values())
                     / max(1e-9, sum(float(t.get("official_tests") or 0.0) for t in tasks.values())), 2)
               for tasks in audited]
    audit_ratio = audit_s / tests_s if tests_s else float("nan")
    print(f"audit ÷ official hidden tests, same evaluations, {len(audited)} run(s): {audit_s:.1f} s ÷ {tests_s:.1f} s "
          f"= {audit_ratio:.2f}x (per run {per_run})")
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} on {os.cpu_count()} cores")
    if on["scores"] != off["scores"]:
        print(f"SCORES DIFFER: off {off['scores']} on {on['scores']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"bench_audit-{stamp}.json"
    out.write_text(json.dumps({"when": stamp, "variant": args.variant, "branches": args.branches,
                               "workers": args.workers, "repeat": args.repeat, "cores": os.cpu_count(),
                               "ratio_on_off": round(ratio, 3), "audit_over_tests": round(audit_ratio, 3),
                               "audit_over_tests_per_run": per_run, "audited_runs": audited,
                               "load_before": load_before, "load_after": load_after, "rows": rows},
                              indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
