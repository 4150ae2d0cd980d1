"""Consecutive small official steps run by one exec instead of one exec each.

Before a branch's tests, the official runs five short commands, each its own ``docker exec ... bash -lc``
(``restore_executable``, ``verify_executable_hash``, ``clean_stale_results``, ``patch_timeout_method`` and, with
reruns, ``install_pytest_timeout_retry``). Each costs an exec's round trips and a container process start for a few
milliseconds of work: about 0.05 s on a quiet host, 0.1-0.3 s on a loaded one, per step and per branch. Here one
exec runs a small driver (``bash -c``: no login profile of its own) that runs each step as an exec of its own would,
one after the other, and stops after the first failure the official would stop on:

* what the step's process is given is an exec's: ``bash -lc <command>`` in the workspace, stdin ``/dev/null``, its
  own session (``setsid``: a ``kill 0`` in it reaches its own processes, never the driver), exactly the environment
  the exec started the driver with (the container's and the exec's variables, read back from the driver's
  ``/proc/self/environ``, through ``env -i``: no ``SHLVL``, ``PWD`` or ``_`` of the driver's shell), and only its
  three standard descriptors;
* its stdout and stderr, each ended by a marker line carrying a random nonce, so the host splits the streams by
  step; every byte goes through the step's own :class:`OutputCap` (strict UTF-8, capped);
* its exit status, in the stdout marker;
* its end: as an exec's. When an exec's process exits, the daemon waits at most 2 s for the rest of its output
  (moby's exit handling), then closes the exec's streams, whoever still holds them; the docker CLI and the SDK
  return then (measured: ``docker exec C bash -lc 'sleep 11 & echo hi'`` returns after 2.0-2.2 s, ``hi`` and
  whatever the child printed within that time kept). A step here ends when every holder of its output closed it
  or :data:`LINGER` seconds after its process exited; its readers are then left running, never killed, so a job
  still holding its output keeps writing into the exec's streams as it would into an exec's own (killed, it died of
  SIGPIPE at its next write where under ``docker exec`` it lives on). A step that ended the second way ends the
  batch: the
  daemon handles a container's exits one at a time, and the clean-up of an exec whose output is still held waits
  up to 2 s more, so a next exec then returns up to 2 s later (measured: 4.0 s back to back); the steps after it
  run by themselves, where the daemon's own timing applies;
* its clock: the host gives each step its official timeout from the moment the previous one ended, and on expiry
  does the official teardown (every process but init killed, the driver with it): that step timed out, and the
  steps after it are not in the batch's results, so the official pipeline runs each of them by itself.

What the driver needs beyond bash builtins (bash 4.4 or later, ``/usr/bin/setsid``, ``/usr/bin/env``, ``/bin/cat``,
``/proc``) is checked first; without it the driver runs nothing and every step runs by itself. The step's parent is
the driver, not a process outside the container (``$PPID`` is 0 for an exec's process): a difference only a login
profile can see. Not detected either: a ``compile.sh`` that replaces the driver's own tools (``setsid``, ``env``,
``cat``) changes the batched steps and not the official's (a change outside /workspace: an integrity flag).

The nonce is only readable by code running in the container, and code that runs there during these steps (a login
profile or a binary ``compile.sh`` replaced) already decides every step's output and status in the official
pipeline too. A marker that does not parse (only such code can write one) ends the batch as a clock does (the
official teardown, so the driver runs nothing more): that step's result is a failure naming it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pytest_programbench.core import environment
from pytest_programbench.engine.container import ExecReader, OutputCap

# Seconds a step's output is waited for after its process exited: moby waits 2 s for an exec's streams
# (daemon/monitor.go, the exec's exit event) before it closes them.
LINGER = 2
# The driver: $1 the nonce, $2 LINGER, then one argument per step, "s<command>" (stop when it fails) or "a<command>"
# (accept). The exec's stdout and stderr are kept as fds 5 and 6; the driver's own messages go nowhere. Per step: a
# "done" pipe (a fresh pipe reopened through /proc: builtins only) whose write end only two cats hold, so its EOF
# says both ended; the step's stdout and stderr, each a process substitution running one of those cats, writing to
# 5 or 6. The step runs in the foreground (a background job would have SIGINT and SIGQUIT ignored) with only fds
# 0-2. After it exits, the cats get LINGER seconds; still running (a job holds the step's output), they are left
# running, so the job's output stays read for as long as the exec's streams are (what `docker exec` gives it: the
# daemon drains them after the CLI returned), and the batch ends after this step ("last").
# The stdout marker: index, status, and "next", "last" or "skip" (nothing run: the driver cannot run here).
DRIVER = r"""
nonce=$1 linger=$2; shift 2
exec 5>&1 6>&2 1>/dev/null 2>/dev/null
pipe() { local h; exec {h}<> <(:); exec {pr}</proc/self/fd/$h {pw}>/proc/self/fd/$h {h}>&-; }
if ! { [ "${BASH_VERSINFO[0]:-0}" -gt 4 ] || { [ "${BASH_VERSINFO[0]}" = 4 ] && [ "${BASH_VERSINFO[1]}" -ge 4 ]; }; } \
    || [ ! -x /usr/bin/setsid ] || [ ! -x /usr/bin/env ] || [ ! -x /bin/cat ] || [ ! -r /proc/$$/environ ] \
    || ! ( pipe ); then
    printf '\n%s 0 0 skip\n' "$nonce" >&5; printf '\n%s 0\n' "$nonce" >&6; exit 0
fi
mapfile -t -d '' env0 </proc/$$/environ
i=0
for arg in "$@"; do
    pipe; done_r=$pr done_w=$pw
    exec {out_w}> >(exec /bin/cat >&5 6>&- {done_r}<&-); cat_out=$!
    exec {err_w}> >(exec /bin/cat >&6 5>&- {done_r}<&- {out_w}>&-); cat_err=$!
    exec {done_w}>&-
    /usr/bin/setsid /usr/bin/env -i -- "${env0[@]}" bash -lc "${arg:1}" </dev/null >&$out_w 2>&$err_w \
        {out_w}>&- {err_w}>&- {done_r}<&- 5>&- 6>&-
    rc=$?
    exec {out_w}>&- {err_w}>&-
    how=next
    read -r -t "$linger" -u "$done_r"
    if [ $? -gt 128 ]; then how=last; fi
    exec {done_r}<&-
    printf '\n%s %d %d %s\n' "$nonce" "$i" "$rc" "$how" >&5
    printf '\n%s %d\n' "$nonce" "$i" >&6
    if [ "$how" = last ] || { [ "$rc" -ne 0 ] && [ "${arg:0:1}" = s ]; }; then exit 0; fi
    i=$((i + 1))
done
"""
# The cap of a step whose output the official parses: none (a capped text must never be what it parses).
UNCAPPED = 1 << 62
# "0" runs every step by itself (one exec each), as the official does.
# How a step's stdout marker says the batch goes on.
NEXT, LAST, SKIP = "next", "last", "skip"
# A marker's fields after the nonce are at most this long; a longer unfinished one is not ours.
_MARKER_TAIL_MAX = 32


@dataclass(frozen=True)
class Step:
    """One official step as its ``_run_step`` call would run it."""

    name: str
    command: str
    timeout: int
    accept_failure: bool = False
    uncapped: bool = False  # the official parses its output (a hash): read whole, as the official reads it


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
        self.hows: list[str] = []  # stdout's: NEXT, LAST or SKIP per step
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
        expected = 3 if self.with_status else 1
        try:
            index = int(fields[0])
            status = int(fields[1]) if self.with_status else 0
            how = fields[2].decode("ascii") if self.with_status else NEXT
        except (IndexError, ValueError):
            index, status, how = -1, 0, ""
        if len(fields) != expected or index != self.done or how not in (NEXT, LAST, SKIP):
            self.broken = f"a step marker out of order ({b' '.join(fields)[:40]!r})"
            return
        self.statuses.append(status)
        self.hows.append(how)
        self.done += 1


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return environment.STEP_BATCH.enabled(environ)


def driver_argv(steps: Sequence[Step], nonce: str) -> list[str]:
    return ["bash", "-c", DRIVER, "pb-steps", nonce, str(LINGER),
            *(("a" if step.accept_failure else "s") + step.command for step in steps)]


def new_nonce() -> str:
    return "pb-step-" + secrets.token_hex(16)


def collect(reader: ExecReader, steps: Sequence[Step], nonce: str, *, output_cap: int,
            started: float) -> tuple[list[StepResult], bool]:
    """Read the driver's streams: each step's result as it ends, under its own clock from the previous one's end.
    Returns the results of the steps that ended (the last may have a ``problem``) and whether the driver must be
    stopped (a clock fired, or its framing broke while it may still run steps): the caller then does the official
    teardown."""
    outs = [OutputCap(UNCAPPED if step.uncapped else output_cap) for step in steps]
    errs = [OutputCap(UNCAPPED if step.uncapped else output_cap) for step in steps]
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
            if stdout.hows[i] == SKIP:  # the driver cannot run here: every step runs by itself
                return results, False
            status = stdout.statuses[i]
            results.append(StepResult(step, outs[i], errs[i], status, now - step_started))
            step_started = now
            if (status != 0 and not step.accept_failure) or stdout.hows[i] == LAST:
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
