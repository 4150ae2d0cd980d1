#!/usr/bin/env python3
"""Prove the test bed: run every fixture's reference, known-good solution and bad variants
against its hidden branches in real containers, print per-test statuses, check expectations.

    testbed/setup.sh && python3 testbed/check.py [-t ID ...] [-s SUBJECT ...] [-q] [--official]

Subjects: `reference` (the image's own /workspace/executable), `good` (testbed/solutions),
and each variant under testbed/bad/<id>/. The steps mirror the official evaluator
(programbench 1.2.5): compile in a fresh container, commit, one fresh container per branch,
thread->signal patch of run.sh, PYTEST_ADDOPTS=--max-worker-restart=4, JUnit parsed and
completed with `not_run` by the official functions, one serial retry after an xdist worker
crash. `--official` additionally drives programbench's own Evaluator over the submissions
(with --network none added to its docker run). Exit status 1 when an expectation fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from programbench.eval.eval import _process_branch_xml, count_testcases, count_worker_crashes
from programbench.utils.load_data import (
    _load_single_instance,
    get_active_branches,
    get_ignored_tests,
)

TB = Path(__file__).resolve().parent
STATE = TB / ".state"
CALC = "testorg__calculator.abc1234"
LABEL = f"pytest-programbench.testbed=check-{os.getpid()}"  # never the plugin's own label key
CPUS = "2"  # xdist workers per branch (PYTEST_XDIST_AUTO_NUM_WORKERS), like --docker-cpus


def docker(*args: str, timeout: float = 120, stdin=None, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, stdin=stdin)
    if check and r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])}... failed: {r.stderr.strip()}")
    return r


def image_of(task_id: str) -> str:
    return f"programbench/{task_id.replace('__', '_1776_')}:task_cleanroom_v6"


class Container:
    """A sleeping container without network; removed on exit whatever happens."""

    def __init__(self, image: str, env: dict[str, str] | None = None):
        full_env = {"PYTEST_XDIST_AUTO_NUM_WORKERS": CPUS, **(env or {})}
        envs = [a for k, v in full_env.items() for a in ("-e", f"{k}={v}")]
        self.id = docker(
            "run",
            "-d",
            "--init",
            "--network",
            "none",
            "--label",
            LABEL,
            "-w",
            "/workspace",
            *envs,
            image,
            "sleep",
            "1800",
        ).stdout.strip()

    def sh(self, cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        try:
            return docker("exec", self.id, "bash", "-c", cmd, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(cmd, -1, "", f"host timeout after {timeout}s")

    def put_tar(self, tar_gz: Path) -> None:
        with tar_gz.open("rb") as f:
            docker("exec", "-i", self.id, "tar", "-C", "/workspace", "-xzf", "-", stdin=f)

    def read(self, path: str) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            r = docker("cp", f"{self.id}:{path}", tmp + "/f", check=False)
            return Path(tmp, "f").read_text() if r.returncode == 0 else ""

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        docker("rm", "-f", self.id, check=False)


@dataclass
class Outcome:
    subject: str
    compile_error: str = ""
    statuses: dict[str, dict[str, str]] = field(default_factory=dict)  # branch -> test -> status
    messages: dict[str, str] = field(default_factory=dict)  # branch/test -> short message
    crashes: dict[str, list[int]] = field(default_factory=dict)  # branch -> crashes per attempt
    seconds: float = 0.0
    thread_method: bool = False  # run.sh kept pytest-timeout's thread method (--thread)


def run_branch(image: str, blob: Path, branch: str, inst: dict, out: Outcome, keep_thread: bool) -> None:
    tests_by_branch = {b: i["tests"] for b, i in inst["branches"].items()}
    attempts: list[int] = []
    xml, best = "", -1
    for serial in (False, True):  # official: one retry, serial, after an xdist worker crash
        env = {"PYTEST_ADDOPTS": "--max-worker-restart=4"}
        if serial:
            env["PYTEST_XDIST_AUTO_NUM_WORKERS"] = "1"
        with Container(image, env) as c:
            c.put_tar(blob)
            if not keep_thread:  # --thread: show what the official rewrite prevents
                c.sh("sed -i 's/--timeout-method=thread/--timeout-method=signal/g' eval/run.sh")
            c.sh("rm -f eval/results.xml")
            c.sh("chmod +x eval/run.sh && ./eval/run.sh", timeout=600)
            attempt = c.read("/workspace/eval/results.xml")
        crashes = count_worker_crashes(attempt)
        attempts.append(crashes)
        if count_testcases(attempt) - crashes > best:  # official: keep the most non-crashed testcases
            xml, best = attempt, count_testcases(attempt) - crashes
        if crashes == 0:
            break
    out.crashes[branch] = attempts
    if not xml.strip():
        out.statuses[branch] = {t: "not_run" for t in tests_by_branch[branch]}
        return
    results, _ = _process_branch_xml(
        xml,
        branch,
        tests_by_branch,
        ignored_tests=get_ignored_tests(inst),
        branch_ignored=inst["branches"][branch]["ignored"],
    )
    out.statuses[branch] = {r.name: r.status for r in results}
    for r in results:
        msg = (r.extra.get("message") or "").splitlines()
        if r.status != "passed" and msg:
            out.messages[f"{branch}/{r.name}"] = msg[0][:90]


def evaluate(inst: dict, subject: str, submission: Path | None, keep_thread: bool = False) -> Outcome:
    """Runs all branches (ignored ones too) for the reference (submission None) or a submission."""
    t0 = time.monotonic()
    out = Outcome(subject, thread_method=keep_thread)
    blobs = STATE / "blobs" / inst["instance_id"] / "tests"
    image, committed = image_of(inst["instance_id"]), None
    try:
        if submission is not None:
            with Container(image) as c:
                c.sh("rm -rf /workspace/* /workspace/.[!.]*")
                c.put_tar(submission)
                c.sh("rm -f ./executable")
                r = c.sh("chmod +x ./compile.sh && ./compile.sh && test -f ./executable", timeout=300)
                if r.returncode != 0:
                    lines = (r.stdout + r.stderr).strip().splitlines()
                    errors = [ln for ln in lines if "error" in ln] or lines or [f"rc={r.returncode}"]
                    out.compile_error = errors[0].strip()
                    for b, info in inst["branches"].items():
                        out.statuses[b] = {t: "not_run" for t in info["tests"]}
                    return out
                committed = f"pb-testbed-check/{inst['instance_id'].lower()}:{uuid.uuid4().hex[:12]}"
                docker("commit", c.id, committed)
            image = committed
        for branch in inst["branches"]:
            run_branch(image, blobs / f"{branch}.tar.gz", branch, inst, out, keep_thread)
    finally:
        if committed:
            docker("rmi", "-f", committed, check=False)
        out.seconds = time.monotonic() - t0
    return out


def image_facts(task_id: str) -> list[str]:
    """Problems with the image's reference: mode, and any other copy of its bytes on the image."""
    script = (
        "set -e; f=/workspace/executable; stat -c %a $f; h=$(sha256sum $f | cut -c1-64); s=$(stat -c %s $f); "
        'find / -xdev -type f -size ${s}c -exec sha256sum {} + 2>/dev/null | grep "^$h " | cut -c67-; ls /workspace'
    )
    r = docker("run", "--rm", "--network", "none", "--label", LABEL, image_of(task_id), "bash", "-c", script)
    lines = r.stdout.split()
    problems = []
    if lines[0] != "111":
        problems.append(f"mode {lines[0]} != 111")
    copies = [x for x in lines[1:] if x.startswith("/")]
    if copies != ["/workspace/executable"]:
        problems.append(f"reference bytes found at {copies}")
    print(
        f"  image {image_of(task_id)}: mode {lines[0]}, reference bytes only at {copies}, "
        f"/workspace: {' '.join(x for x in lines[1:] if not x.startswith('/'))}"
    )
    return problems


def score(inst: dict, out: Outcome) -> tuple[int, int]:
    """Official score: active branches, ignored tests dropped, only `passed` counts."""
    ignored = get_ignored_tests(inst)
    tests = [
        (b, t, s)
        for b in get_active_branches(inst)
        for t, s in out.statuses.get(b, {}).items()
        if f"{b}/{t}" not in ignored
    ]
    return sum(s == "passed" for _, _, s in tests), len(tests)


def expectations(inst: dict, out: Outcome) -> list[str]:
    """What each subject must show; returns the violations."""
    tid, sub = inst["instance_id"], out.subject
    reasons = {
        f"{b}/{i['name']}": i["reasons"][0]["id"] for b, info in inst["branches"].items() for i in info["ignored_tests"]
    }
    passed, total = score(inst, out)
    bad = []
    if sub in ("reference", "good"):
        if tid == CALC:  # upstream fixture: its tests.json lacks the "eval." its JUnit names have
            ok = (passed, total) == (3, 6)  # 3 eval.* passes + 3 listed names not_run: the official 50%
            return [] if ok else [f"calculator scores {passed}/{total}, expected the known 3/6"]
        if passed != total or not total:
            bad.append(f"{sub} passed {passed}/{total} active non-ignored tests")
        for b, st in out.statuses.items():
            listed = set(inst["branches"][b]["tests"])
            if set(st) != listed:
                bad.append(f"{sub}: JUnit names != tests.json in {b}: {sorted(set(st) ^ listed)}")
        if sub == "reference":
            for name, rid in reasons.items():
                b, t = name.split("/", 1)
                if rid == "gold_fail" and out.statuses[b][t] == "passed":
                    bad.append(f"reference passes gold_fail test {name}")
    elif sub in ("compile_error", "no_compile_sh"):
        if not out.compile_error:
            bad.append(f"{sub} compiled")
    elif sub == "dummy":
        for name, rid in reasons.items():
            b, t = name.split("/", 1)
            if rid == "dummy_pass" and out.statuses[b][t] != "passed":
                bad.append(f"dummy does not pass dummy_pass test {name}")
        if passed:
            bad.append(f"dummy passes {passed} active tests")
    elif sub == "hang" and out.thread_method:  # the thread method os._exit()s the worker instead
        if not any(c and c[0] for c in out.crashes.values()):
            bad.append("hang (--thread): no xdist worker crash")
    elif sub == "hang":
        timeouts = [k for k, m in out.messages.items() if "Timeout" in m]
        if not timeouts:
            bad.append("hang: no test ended by pytest-timeout")
    elif sub == "killer":
        if not any(c and c[0] for c in out.crashes.values()):
            bad.append("killer: no xdist worker crash")
    elif sub == "wrong" and not 0 < passed < total:
        bad.append(f"wrong scores {passed}/{total}, expected partial")
    return bad


def report(inst: dict, out: Outcome, quiet: bool) -> None:
    passed, total = score(inst, out)
    ignored = get_ignored_tests(inst)
    active = set(get_active_branches(inst))
    extra = f" compile failed: {out.compile_error}" if out.compile_error else ""
    crashes = {b: c for b, c in out.crashes.items() if any(c)}
    if crashes:
        extra += f" xdist worker crashes per attempt: {crashes}"
    print(f"  {out.subject:<14} score {passed}/{total} ({out.seconds:.0f}s){extra}")
    if quiet:
        return
    for b, st in out.statuses.items():
        tag = "" if b in active else " (ignored branch)"
        for t, s in sorted(st.items()):
            mark = " [ignored test]" if f"{b}/{t}" in ignored else ""
            msg = out.messages.get(f"{b}/{t}", "")
            print(f"      {b}{tag} {t}: {s}{mark}{'  -- ' + msg if msg else ''}")


def official(inst: dict, subjects: list[str]) -> list[str]:
    """programbench's own Evaluator over the submissions, with --network none added."""
    import programbench.constants as pc

    if "--network=none" not in pc.DOCKER_RUN_ARGS:
        pc.DOCKER_RUN_ARGS.append("--network=none")  # eval.py shares this very list object
    from programbench.eval.eval import Evaluator

    tid, bad = inst["instance_id"], []
    for sub in subjects:
        if sub == "reference":
            continue
        sub_tar = STATE / "submissions" / sub / tid / "submission.tar.gz"
        t0 = time.monotonic()
        res = Evaluator(
            image_name=inst["image_name"],
            solution_branch="submission",
            submission_archive=sub_tar,
            blob_dir=STATE / "blobs" / tid,
            tests_branches=get_active_branches(inst),
            remove_hashes=inst.get("eval_clean_hashes", []),
            instance_id=tid,
            docker_cpus=int(CPUS),
            tests_by_branch={b: i["tests"] for b, i in inst["branches"].items()},
            ignored_tests=get_ignored_tests(inst),
            ignored_branches=set(inst["branches"]) - set(get_active_branches(inst)),
        ).run()
        final = res.for_branches(get_active_branches(inst)).without_ignored(get_ignored_tests(inst))
        print(
            f"  official {sub:<14} score {final.n_resolved}/{len(final)} error={final.error_code} "
            f"warnings={len(final.warnings)} ({time.monotonic() - t0:.0f}s)"
        )
        if sub == "good" and tid != CALC and final.score != 1.0:
            bad.append(f"official evaluator scores good solution {final.score:.2f}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--task", action="append", help="instance id (default: all fixtures + calculator)")
    ap.add_argument("-s", "--subject", action="append", help="reference, good or a bad variant (default: all)")
    ap.add_argument("-q", "--quiet", action="store_true", help="scores only, no per-test lines")
    ap.add_argument("-j", "--jobs", type=int, default=3, help="subjects evaluated in parallel")
    ap.add_argument("--official", action="store_true", help="also run programbench's Evaluator on the submissions")
    ap.add_argument("--thread", action="store_true", help="keep run.sh's --timeout-method=thread (no official patch)")
    args = ap.parse_args()

    pkg_calc = Path(__import__("programbench").__file__).parent / "data" / "tasks" / CALC
    task_dirs = {d.name: d for d in sorted((TB / "tasks").iterdir()) if (d / "task.yaml").exists()}
    task_dirs[CALC] = pkg_calc
    failures: list[str] = []
    for tid in args.task or list(task_dirs):
        inst = _load_single_instance(task_dirs[tid], include_tests=True)
        variants = sorted(p.name for p in (TB / "bad" / tid).glob("*/")) if (TB / "bad" / tid).is_dir() else []
        subjects = [s for s in ["reference", "good", *variants] if not args.subject or s in args.subject]
        print(f"== {tid}  active {get_active_branches(inst)}  all {list(inst['branches'])}")
        failures += [f"{tid}: {p}" for p in image_facts(tid)]

        def one(sub: str, inst: dict = inst, tid: str = tid) -> Outcome:
            tar = None if sub == "reference" else STATE / "submissions" / sub / tid / "submission.tar.gz"
            return evaluate(inst, sub, tar, keep_thread=args.thread)

        with ThreadPoolExecutor(args.jobs) as pool:
            for out in pool.map(one, subjects):
                report(inst, out, args.quiet)
                failures += [f"{tid}: {p}" for p in expectations(inst, out)]
        if args.official:
            failures += [f"{tid}: {p}" for p in official(inst, subjects)]
    print()
    if failures:
        print("EXPECTATIONS FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all expectations hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
