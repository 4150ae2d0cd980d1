"""Consecutive small official steps run by one exec instead of one exec each.

Before a branch's tests, the official runs five short commands, each its own ``docker exec ... bash -lc``
(``restore_executable``, ``verify_executable_hash``, ``clean_stale_results``, ``patch_timeout_method`` and, with
reruns, ``install_pytest_timeout_retry``). Each costs an exec's round trips and a container process start for a few
milliseconds of work: about 0.05 s on a quiet host, 0.1-0.3 s on a loaded one, per step and per branch. Here one
exec runs a small driver (``bash -c``: no login profile of its own) that runs each step exactly as the official
would, ``bash -lc <command>`` in the workspace with no stdin, one after the other, and stops after the first
failure the official would stop on. What each step gives back stays its own:

* its stdout and stderr, each ended by a marker line carrying a random nonce, so the host splits the streams by
  step; every byte goes through the step's own :class:`OutputCap` (strict UTF-8, capped);
* its exit status, in the stdout marker;
* its end: a step ends when every process holding its stdout or stderr closed it (each stream goes through a
  ``cat`` the driver waits for), as an exec's stream does, so a step that leaves a writer behind runs into its own
  clock as it would alone;
* its clock: the host gives each step its official timeout from the moment the previous one ended, and on expiry
  does the official teardown (every process but init killed, the driver with it): that step timed out, and the
  steps after it are not in the batch's results, so the official pipeline runs each of them by itself.

The nonce is only readable by code running in the container, and code that runs there during these steps (a login
profile or a binary ``compile.sh`` replaced) already decides every step's output and status in the official
pipeline too. A marker that does not parse (only such code can write one) ends the batch as a clock does (the
official teardown, so the driver runs nothing more): that step's result is a failure naming it.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pytest_programbench.engine.container import ExecReader, OutputCap

# The driver: $1 the nonce, then one argument per step, "s<command>" (stop when it fails) or "a<command>" (accept).
# Each step's stderr goes through a cat to the exec's stderr and its stdout through a cat to the exec's stdout; the
# pipeline returns when both cats saw EOF, i.e. when every holder of the step's streams closed them.
DRIVER = r"""
nonce=$1; shift; i=0
for arg in "$@"; do
    ( bash -lc "${arg:1}" </dev/null 2>&1 1>&3 3>&- | cat >&2; exit "${PIPESTATUS[0]}" ) 3>&1 | cat
    rc=${PIPESTATUS[0]}
    printf '\n%s %d %d\n' "$nonce" "$i" "$rc"
    printf '\n%s %d\n' "$nonce" "$i" >&2
    if [ "$rc" -ne 0 ] && [ "${arg:0:1}" = s ]; then exit 0; fi
    i=$((i + 1))
done
"""
# "0" runs every step by itself (one exec each), as the official does.
ENV_STEP_BATCH = "PYTEST_PROGRAMBENCH_STEP_BATCH"
# A marker's fields after the nonce are at most this long; a longer unfinished one is not ours.
_MARKER_TAIL_MAX = 32


@dataclass(frozen=True)
class Step:
    """One official step as its ``_run_step`` call would run it."""

    name: str
    command: str
    timeout: int
    accept_failure: bool = False


@dataclass
class StepResult:
    """What one step of a batch gave: its streams (capped), status and time; ``problem`` when there is no status
    (its clock fired, or the batch's framing broke)."""

    step: Step
    out: OutputCap
    err: OutputCap
    returncode: int
    seconds: float
    problem: str = ""


class _Splitter:
    """Splits one stream of the driver at its markers, handing each step's bytes to that step's cap."""

    def __init__(self, nonce: bytes, caps: Sequence[OutputCap], *, with_status: bool) -> None:
        self.tag = b"\n" + nonce + b" "
        self.caps = caps
        self.with_status = with_status
        self.pending = bytearray()
        self.done = 0  # steps whose marker this stream has passed
        self.statuses: list[int] = []
        self.broken = ""

    def feed(self, data: bytes) -> None:
        if self.broken:
            return
        self.pending += data
        while not self.broken:
            at = self.pending.find(self.tag)
            if at < 0:
                self._emit(len(self.pending) - (len(self.tag) - 1))  # a tag's start may be at the very end
                return
            end = self.pending.find(b"\n", at + len(self.tag))
            if end < 0:
                if len(self.pending) - at - len(self.tag) > _MARKER_TAIL_MAX:
                    self.broken = "an unfinished step marker"
                self._emit(at)
                return
            self._emit(at)
            fields = bytes(self.pending[len(self.tag):end - at]).split()
            del self.pending[:end - at + 1]
            self._marker(fields)

    def _emit(self, n: int) -> None:
        if n <= 0:
            return
        if self.done < len(self.caps):
            self.caps[self.done].write(bytes(self.pending[:n]))
        else:
            self.broken = "output after the last step"
        del self.pending[:n]

    def _marker(self, fields: list[bytes]) -> None:
        expected = 2 if self.with_status else 1
        try:
            index = int(fields[0])
            status = int(fields[1]) if self.with_status else 0
        except (IndexError, ValueError):
            index, status = -1, 0
        if len(fields) != expected or index != self.done:
            self.broken = f"a step marker out of order ({b' '.join(fields)[:40]!r})"
            return
        self.statuses.append(status)
        self.done += 1


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(ENV_STEP_BATCH, "").strip() != "0"


def driver_argv(steps: Sequence[Step], nonce: str) -> list[str]:
    return ["bash", "-c", DRIVER, "pb-steps", nonce,
            *(("a" if step.accept_failure else "s") + step.command for step in steps)]


def new_nonce() -> str:
    return "pb-step-" + secrets.token_hex(16)


def collect(reader: ExecReader, steps: Sequence[Step], nonce: str, *, output_cap: int,
            started: float) -> tuple[list[StepResult], bool]:
    """Read the driver's streams: each step's result as it ends, under its own clock from the previous one's end.
    Returns the results of the steps that ended (the last may have a ``problem``) and whether the driver must be
    stopped (a clock fired, or its framing broke while it may still run steps): the caller then does the official
    teardown."""
    outs = [OutputCap(output_cap) for _ in steps]
    errs = [OutputCap(output_cap) for _ in steps]
    stdout = _Splitter(nonce.encode(), outs, with_status=True)
    stderr = _Splitter(nonce.encode(), errs, with_status=False)
    results: list[StepResult] = []
    step_started = started
    for i, step in enumerate(steps):
        def ended(i: int = i) -> bool:
            return bool(stdout.broken or stderr.broken) or (stdout.done > i and stderr.done > i)

        finished = reader.pump(step_started + step.timeout, {1: stdout.feed, 2: stderr.feed}, until=ended)
        now = time.monotonic()
        broken = stdout.broken or stderr.broken
        if broken:
            results.append(StepResult(step, outs[i], errs[i], -1, now - step_started,
                                      problem=f"the step's output could not be told apart: {broken}"))
            return results, True
        if stdout.done > i and stderr.done > i:
            status = stdout.statuses[i]
            results.append(StepResult(step, outs[i], errs[i], status, now - step_started))
            step_started = now
            if status != 0 and not step.accept_failure:
                return results, False
            continue
        if not finished:
            results.append(StepResult(step, OutputCap(output_cap), OutputCap(output_cap), -1, now - step_started,
                                      problem=f"Command timed out after {step.timeout}s"))
            return results, True
        # The driver's streams ended without this step's markers: something ended the driver itself.
        results.append(StepResult(step, outs[i], errs[i], -1, now - step_started,
                                  problem="the harness's step runner ended before the step did"))
        return results, False
    return results, False
