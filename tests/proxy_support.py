"""Shared fixtures and helpers of the proxy/sandbox tests: the fixtures (``engine``, ``run_labels``, ``probe_image``)
reach every module through tests/conftest.py; the helpers and constants are imported from here. Not a test module.

Everything here needs Docker and the test bed (``bash testbed/setup.sh``). A missing engine or image FAILS the
test with instructions: these tests are never skipped.

Besides the test bed's fixture tasks, the tests build one image of their own from the test bed's base image: a
"probe" reference program (``PROBE_C``) installed the official way (``/workspace/executable``, mode 111) that can
print what a reference sees (argv, env, ids, fds, terminal), crash, die by a signal, wait for signals, read
``/proc/self/mem``, stream data... The image is cached by the hash of its source.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shlex
import tarfile
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pytest_programbench.engine.docker_engine import EngineRun, Engines, Labels, sweep
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.sandbox.proxy_build import DAEMON_SOURCE
from pytest_programbench.sandbox.sandbox import Sandbox


def load_daemon(module_name: str) -> ModuleType:
    """The proxy daemon's source (a single stdlib file that runs inside the sandbox) loaded here as a module of its
    own name, so its functions can be called and its constants compared on the host."""
    spec = importlib.util.spec_from_file_location(module_name, DAEMON_SOURCE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

BASE_IMAGE = "pb-testbed-base:latest"
CATLIKE = "programbench/pbfix_1776_catlike.c47c47c:task_cleanroom_v6"
TUIISH = "programbench/pbfix_1776_tuiish.7e1a0b2:task_cleanroom_v6"
RPN = "programbench/pbfix_1776_rpn.0b5e55e:task_cleanroom_v6"
CALCULATOR = "programbench/testorg_1776_calculator.abc1234:task_cleanroom_v6"
PROBE_REPO = "pbtest-proxy-probe"
CACHE_LABEL = "pytest-programbench.test-cache"
DIRECT = "/opt/direct/executable"  # a copy of the reference the agent may run directly (tests only)
RUNNER = "/opt/pbtest/runner.py"

PROBE_C = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

extern char **environ;

static void status_line(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[512];
    if (!f) { printf("%s ?\n", key); return; }
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, strlen(key)) == 0) fputs(line, stdout);
    fclose(f);
}

static void on_signal(int sig) {
    char buf[64];
    int n = snprintf(buf, sizeof buf, "got %s\n", sigabbrev_np(sig));
    if (write(1, buf, (size_t)n) < 0) _exit(99);
    if (sig == SIGTERM) _exit(42);
}

static int copy(int fd, const char *name) {
    static char buf[1 << 16];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n == 0) return 0;
        if (n < 0) { fprintf(stderr, "probe: %s: %s\n", name, strerror(errno)); return 1; }
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(1, buf + off, (size_t)(n - off));
            if (w < 0) { fprintf(stderr, "probe: write: %s\n", strerror(errno)); return 1; }
            off += w;
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: probe COMMAND [ARG...]\n"); return 2; }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "argv")) {
        for (int i = 0; i < argc; i++) printf("[%s]\n", argv[i]);
        return 0;
    }
    if (!strcmp(cmd, "env")) {
        for (char **e = environ; *e; e++) printf("%s\n", *e);
        return 0;
    }
    if (!strcmp(cmd, "exit")) {
        printf("out\n");
        fflush(stdout);
        fprintf(stderr, "err\n");
        return argc > 2 ? atoi(argv[2]) : 0;
    }
    if (!strcmp(cmd, "signal")) {
        printf("dying\n");
        fflush(stdout);
        int sig = argc > 2 ? atoi(argv[2]) : SIGTERM;
        signal(sig, SIG_DFL);
        raise(sig);
        return 98;
    }
    if (!strcmp(cmd, "segv")) {
        volatile int *p = NULL;
        *p = 1;
        return 97;
    }
    if (!strcmp(cmd, "cat")) {
        int rc = 0;
        if (argc == 2) return copy(0, "-");
        for (int i = 2; i < argc; i++) {
            int fd = strcmp(argv[i], "-") ? open(argv[i], O_RDONLY) : 0;
            if (fd < 0) { fprintf(stderr, "probe: %s: %s\n", argv[i], strerror(errno)); rc = 1; continue; }
            rc |= copy(fd, argv[i]);
            if (fd) close(fd);
        }
        return rc;
    }
    if (!strcmp(cmd, "ids")) {
        gid_t groups[64];
        int n = getgroups(64, groups);
        printf("uid=%d euid=%d gid=%d egid=%d groups=", getuid(), geteuid(), getgid(), getegid());
        for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", groups[i]);
        char cwd[4096];
        printf("\ncwd=%s\n", getcwd(cwd, sizeof cwd) ? cwd : "?");
        mode_t m = umask(0);
        printf("umask=%03o\n", m);
        printf("dumpable=%d\n", prctl(PR_GET_DUMPABLE));
        struct rlimit rl;
        getrlimit(RLIMIT_CORE, &rl);
        printf("core=%lld/%lld\n", (long long)rl.rlim_cur, (long long)rl.rlim_max);
        getrlimit(RLIMIT_NOFILE, &rl);
        printf("nofile=%lld/%lld\nlimits=", (long long)rl.rlim_cur, (long long)rl.rlim_max);
        for (int r = 0; r < 16; r++) {
            getrlimit(r, &rl);
            printf("%lld/%lld ", (long long)rl.rlim_cur, (long long)rl.rlim_max);
        }
        printf("\n");
        printf("isatty=%d%d%d\n", isatty(0), isatty(1), isatty(2));
        status_line("SigIgn");
        status_line("SigBlk");
        status_line("NoNewPrivs");
        return 0;
    }
    if (!strcmp(cmd, "touch")) {
        int fd = open(argv[2], O_CREAT | O_WRONLY | O_TRUNC, 0666);
        if (fd < 0) { fprintf(stderr, "probe: %s: %s\n", argv[2], strerror(errno)); return 1; }
        struct stat st;
        fstat(fd, &st);
        printf("uid=%d gid=%d mode=%03o\n", st.st_uid, st.st_gid, st.st_mode & 0777);
        return 0;
    }
    if (!strcmp(cmd, "sleep")) {
        printf("pid=%d\n", getpid());
        fflush(stdout);
        sleep(argc > 2 ? (unsigned)atoi(argv[2]) : 30);
        return 0;
    }
    if (!strcmp(cmd, "waitsig")) {
        int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH};
        for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) signal(sigs[i], on_signal);
        printf("ready\n");
        fflush(stdout);
        for (int i = 0; i < 600; i++) pause();
        return 0;
    }
    if (!strcmp(cmd, "selfmem")) {
        int fd = open("/proc/self/mem", O_RDONLY);
        if (fd < 0) { fprintf(stderr, "probe: /proc/self/mem: %s\n", strerror(errno)); return 1; }
        unsigned char buf[16];
        if (pread(fd, buf, sizeof buf, (off_t)(unsigned long)&main) != (ssize_t)sizeof buf) {
            fprintf(stderr, "probe: read /proc/self/mem: %s\n", strerror(errno));
            return 1;
        }
        for (size_t i = 0; i < sizeof buf; i++) printf("%02x", buf[i]);
        printf("\n");
        return 0;
    }
    if (!strcmp(cmd, "tty")) {
        printf("isatty=%d%d%d\n", isatty(0), isatty(1), isatty(2));
        int fd = open("/dev/tty", O_RDWR);
        printf("devtty=%s\n", fd >= 0 ? "ok" : strerror(errno));
        if (fd >= 0) {
            printf("foreground=%d\n", tcgetpgrp(fd) == getpgrp());
            struct winsize ws;
            if (ioctl(fd, TIOCGWINSZ, &ws) == 0) printf("size=%dx%d\n", ws.ws_col, ws.ws_row);
        }
        return 0;
    }
    if (!strcmp(cmd, "fds")) {
        DIR *d = opendir("/proc/self/fd");
        struct dirent *e;
        while (d && (e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.' || atoi(e->d_name) == dirfd(d)) continue;
            char path[64], target[4096];
            snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
            ssize_t n = readlink(path, target, sizeof target - 1);
            target[n > 0 ? n : 0] = 0;
            printf("%s -> %s\n", e->d_name, strncmp(target, "pipe:", 5) ? target : "pipe");
        }
        return 0;
    }
    if (!strcmp(cmd, "big")) {
        static char buf[1 << 16];
        memset(buf, 'x', sizeof buf);
        long long left = argc > 2 ? atoll(argv[2]) : 0;
        while (left > 0) {
            ssize_t w = write(1, buf, left < (long long)sizeof buf ? (size_t)left : sizeof buf);
            if (w <= 0) return 1;
            left -= w;
        }
        return 0;
    }
    fprintf(stderr, "probe: unknown command %s\n", cmd);
    return 2;
}
"""

# Runs one or more commands (as whoever runs it) and prints their results as JSON: used for the direct and the
# proxied execution alike, so that both see exactly the same caller.
RUNNER_PY = r"""
import base64, json, os, resource, signal, subprocess, sys
specs = json.loads(sys.stdin.read())
results = []
for spec in specs:
    def prepare(spec=spec):
        for number in spec.get("ignore", []):
            signal.signal(number, signal.SIG_IGN)
        if spec.get("core") is not None:
            resource.setrlimit(resource.RLIMIT_CORE, (spec["core"], resource.getrlimit(resource.RLIMIT_CORE)[1]))
        if spec.get("umask") is not None:
            os.umask(spec["umask"])
        for number, soft, hard in spec.get("limits", []):
            resource.setrlimit(number, (soft, hard))
    needs_prepare = (spec.get("ignore") or spec.get("core") is not None or spec.get("umask") is not None
                     or spec.get("limits"))
    try:
        done = subprocess.run(spec["argv"], executable=spec["exe"], env=spec.get("env"), cwd=spec.get("cwd"),
                              input=base64.b64decode(spec.get("stdin", "")), capture_output=True,
                              timeout=spec.get("timeout", 60), preexec_fn=prepare if needs_prepare else None)
        results.append({"rc": done.returncode, "out": base64.b64encode(done.stdout).decode(),
                        "err": base64.b64encode(done.stderr).decode()})
    except subprocess.TimeoutExpired:
        results.append({"rc": "timeout", "out": "", "err": ""})
print(json.dumps(results))
"""


def fail_without_docker(reason: str) -> None:
    pytest.fail(f"{reason}. These tests need the Docker engine and the test bed: run `bash testbed/setup.sh` "
                "(as root) first. They are never skipped.", pytrace=False)


@contextlib.contextmanager
def environment_engine() -> Iterator[Any]:
    """A client of the environment's engine (the plugin's reliable one), from engines the caller owns and closes
    on exit: no library code makes one behind a caller outside a session."""
    engines = Engines(EngineRun.from_environment())
    try:
        yield engines.client()
    finally:
        engines.reset()


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    """The test session's client of the environment's engine."""
    try:
        with environment_engine() as client:
            yield client
    except EngineUnavailable as exc:  # at first contact, before the yield
        fail_without_docker(str(exc))


def require_image(engine: Any, ref: str) -> str:
    from docker.errors import ImageNotFound

    try:
        return str(engine.images.get(ref).id)
    except ImageNotFound:
        fail_without_docker(f"image {ref} is missing")
        raise  # unreachable


@pytest.fixture(scope="session")
def run_labels(engine: Any) -> Iterator[Labels]:
    """Labels of this test session's containers; everything left is swept at the end."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "controller")
    labels = Labels(f"pbtest-proxy-{uuid.uuid4().hex[:10]}", worker)
    yield labels
    sweep(labels.run_id, engine=engine)


@pytest.fixture(scope="session")
def probe_image(engine: Any) -> str:
    """The probe reference in an official-layout image (built from the test bed's base, cached by hash)."""
    require_image(engine, BASE_IMAGE)
    digest = hashlib.sha256((PROBE_C + BASE_IMAGE + require_image(engine, BASE_IMAGE)).encode()).hexdigest()[:12]
    ref = f"{PROBE_REPO}:{digest}"
    from docker.errors import ImageNotFound
    from filelock import FileLock

    lock = Path(tempfile.gettempdir()) / f"pbtest-proxy-probe-{digest}.lock"
    with FileLock(str(lock), timeout=600):
        try:
            engine.images.get(ref)
            return ref
        except ImageNotFound:
            pass
        container = engine.containers.create(BASE_IMAGE, command=["sleep", "600"], entrypoint=[], user="0:0",
                                             network_mode="none", labels={CACHE_LABEL: digest}, detach=True)
        try:
            container.start()
            container.put_archive("/tmp", _tar({"probe.c": PROBE_C.encode()}))
            script = ("set -e; mkdir -p /workspace; gcc -O2 -Wall -o /workspace/executable /tmp/probe.c; "
                      "chmod 111 /workspace/executable; rm /tmp/probe.c; "
                      "printf '# probe\\nA test reference.\\n' > /workspace/README.md; "
                      "mkdir -p /workspace/manual; echo 'probe manual' > /workspace/manual/probe.1.txt")
            result = container.exec_run(["sh", "-c", script])
            assert result.exit_code == 0, result.output.decode()
            container.commit(repository=PROBE_REPO, tag=digest,
                             conf={"Labels": {CACHE_LABEL: digest}, "Cmd": ["bash"], "WorkingDir": "/workspace"})
        finally:
            container.remove(force=True)
    # Earlier versions of the probe are left alone: on a shared engine they may be another checkout's current one.
    return ref


def _tar(files: dict[str, bytes], mode: int = 0o644) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def open_sandbox(image: str, labels: Labels, engine: Any, **kwargs: Any) -> Sandbox:
    options: dict[str, Any] = {"cpus": 2.0, "memory": 2 << 30, "lifetime": 1800, "engine": engine}
    options.update(kwargs)
    return Sandbox(image, labels=labels, **options).start()


def expose_direct_copy(box: Sandbox) -> None:
    """Tests only: a copy of the reference the agent may run directly, plus the runner script."""
    script = (f"set -e; mkdir -p -m 711 /opt/direct /opt/pbtest; cp /var/lib/pb-proxy/executable {DIRECT}; "
              f"chmod 111 {DIRECT}")
    result = box.exec(script, user="root", workdir="/", timeout=60)
    assert result.exit_code == 0, result.text
    box.put_file(RUNNER_PY.encode(), RUNNER, mode=0o644, owner="root")


def agent(box: Sandbox, script: str, *, timeout: float = 60, user: str = "agent") -> tuple[int | None, str]:
    result = box.exec(["bash", "-c", script], timeout=timeout, user=user)
    return result.exit_code, result.text


AGENT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/pbagent", "LANG": "C.UTF-8",
             "FOO": "bar baz", "EMPTY": ""}


def run_both(box: Sandbox, cases: Sequence[dict[str, Any]], *, user: str = "agent") -> list[tuple[dict[str, Any],
                                                                                               dict[str, Any]]]:
    """Each case (argv incl. argv[0], optional stdin bytes, env, cwd, ignore, core, umask) run directly and
    through /workspace/binary by the same runner: [(direct, proxied), ...] with rc/out/err decoded."""
    specs = []
    for case in cases:
        base = {"argv": list(case["argv"]), "env": case.get("env", AGENT_ENV), "cwd": case.get("cwd", "/workspace/src"),
                "stdin": base64.b64encode(case.get("stdin", b"")).decode(), "ignore": case.get("ignore", []),
                "core": case.get("core"), "umask": case.get("umask"), "limits": case.get("limits", []),
                "timeout": case.get("timeout", 60)}
        # The proxy sets PYTHONNOUSERSITE=1 for the reference (daemon.FORCED_ENV): the direct run gets it too.
        specs.append({**base, "exe": DIRECT, "env": {**base["env"], "PYTHONNOUSERSITE": "1"}})
        specs.append({**base, "exe": "/workspace/binary"})
    box.put_file(json.dumps(specs).encode(), "/tmp/pbtest-specs.json", owner="root", mode=0o644)
    result = box.exec(f"python3 {RUNNER} < /tmp/pbtest-specs.json", timeout=600, user=user, workdir="/")
    assert result.exit_code == 0, result.text
    decoded = []
    for item in json.loads(result.text.strip().splitlines()[-1]):
        decoded.append({"rc": item["rc"], "out": base64.b64decode(item["out"]), "err": base64.b64decode(item["err"])})
    return [(decoded[i], decoded[i + 1]) for i in range(0, len(decoded), 2)]


def quote(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
