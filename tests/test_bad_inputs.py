"""Every bad input of the earlier issues, one table, with the message each gets.

Three kinds of answer, each the right one for its input:

* ``usage`` — a configuration mistake: the session refuses to start (exit 4) with one line naming the option, the
  value and what would be valid. Nothing runs, nothing is created. The agent's inputs (``--pb-agent-env``, the
  prompt template, the model endpoint, mounts) are checked up front too: detectable before anything runs, they are
  usage errors (README: "what a run refuses at start-up"), never an error per item.
* ``error`` — the infrastructure cannot run the task (its metadata, hidden tests, image, engine, disk): the item is
  an error, with the message, never a score.
* ``failure`` — the submission's own fault: scored the official way (0 here), the message says why.

Placeholders in arguments: ``{tasks}`` (the test bed's tasks), ``{blobs}``, ``{subs}`` (good submissions),
``{tmp}`` (this test's directory; ``setup`` builds what a case needs there).

A usage error is decided by a plain function: the session's settings are read and checked once
(``RunState.from_config``: ``options.parse`` and the named ``_validate_*`` checks), before anything runs. Every usage
case is asked of that function in process (``test_usage_refused_by_the_validation``: the message, nothing written);
``WIRED`` keeps one real session per way a usage error reaches the user (refused while listing, refused at the start
of a run, refused over the test bed's own tasks) to prove the wiring: exit status 4, the one line, nothing written.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.engine.docker_engine import HOW_TO_START
from pytest_programbench.pytest_layer.run_state import RunState
from tests.conftest import Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

CATLIKE = "pbfix__catlike.c47c47c"
NOTHING_TO_RUN = "*nothing to run: pass --pb-agent CMD to run an agent, or --pb-submissions DIR*"


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    kind: str  # usage | error | failure
    message: str  # an fnmatch pattern of one output line
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path, Testbed], None] | None = None
    collect_only: bool = False  # usage cases that need no run


# -- set-ups ------------------------------------------------------------------------------------------------------


def _task_copy(tmp: Path, testbed: Testbed, tests_json: str | None = None, *, new_id: str = CATLIKE,
               dockerfile: bool = True, trees: bool = True) -> Path:
    task = tmp / "tasks" / new_id
    shutil.copytree(testbed.tasks_dir / CATLIKE, task)
    if tests_json is not None:
        (task / "tests.json").write_text(tests_json)
    if not dockerfile:
        (task / "Dockerfile").unlink()
    if not trees:
        shutil.rmtree(task / "tests")
    return task


def _submission(tmp: Path, data: bytes) -> None:
    (tmp / "subs" / CATLIKE).mkdir(parents=True)
    (tmp / "subs" / CATLIKE / "submission.tar.gz").write_bytes(data)


def _good_submission_bytes(testbed: Testbed) -> bytes:
    return (testbed.submissions / CATLIKE / "submission.tar.gz").read_bytes()


def _no_compile_sh(tmp: Path, testbed: Testbed) -> None:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("main.c")
        payload = b"int main(void) { return 0; }\n"
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    _submission(tmp, buffer.getvalue())


def _no_archives(tmp: Path, _testbed: Testbed) -> None:
    """A folder that looks like submissions and holds none: a task's folder with an archive of another name."""
    (tmp / "notsubs" / CATLIKE).mkdir(parents=True)
    (tmp / "notsubs" / CATLIKE / "submission.tgz").write_bytes(b"\x1f\x8b")


def _not_a_run(tmp: Path, _testbed: Testbed) -> None:
    (tmp / "notarun").mkdir()


def _a_finished_run(tmp: Path, _testbed: Testbed) -> None:
    (tmp / "oldrun").mkdir()
    (tmp / "oldrun" / "pb-run.json").write_text(json.dumps({"run_id": "0ld0ld00"}))


def _bad_difficulty(tmp: Path, _testbed: Testbed) -> None:
    task = tmp / "tasks" / "bad__task.0000000"
    task.mkdir(parents=True)
    (task / "task.yaml").write_text("language: c\ndifficulty: impossible\n")


def _empty_dirs(tmp: Path, _testbed: Testbed) -> None:
    for name in ("replay", "emptyblobs"):
        (tmp / name).mkdir()


def _image_missing(tmp: Path, testbed: Testbed) -> None:
    _task_copy(tmp, testbed, new_id="pbnoimage__catlike.c47c47c", dockerfile=False)
    shutil.copytree(testbed.blob_dir / CATLIKE, tmp / "blobs" / "pbnoimage__catlike.c47c47c")
    (tmp / "subs" / "pbnoimage__catlike.c47c47c").mkdir(parents=True)
    (tmp / "subs" / "pbnoimage__catlike.c47c47c" / "submission.tar.gz").write_bytes(_good_submission_bytes(testbed))


def _needs_a_pull(tmp: Path, testbed: Testbed) -> None:
    _image_missing(tmp, testbed)


EVAL = ("--pb-tasks-dir", "{tasks}", "--pb-blob-dir", "{blobs}", "--pb-filter", CATLIKE)
AGENT = (*EVAL, "--pb-agent", "true")
COPY = ("--pb-tasks-dir", "{tmp}/tasks", "--pb-blob-dir", "{blobs}", "--pb-submissions", "{subs}", "--pb-filter",
        CATLIKE)

CASES: list[Case] = [
    # -- selection (issue 2) ------------------------------------------------------------------------------------
    Case("language", ("--pb-language", "klingon"), "usage",
         "*--pb-language: unknown language 'klingon'; choose from c, cpp, go, haskell, java, rust*", collect_only=True),
    Case("difficulty", ("--pb-difficulty", "brutal"), "usage",
         "*--pb-difficulty: unknown difficulty 'brutal'; choose from easy, medium, hard, unset*", collect_only=True),
    Case("filter-regex", ("--pb-filter", "foo("), "usage", "*--pb-filter: 'foo(' is not a valid regex*",
         collect_only=True),
    Case("slice", ("--pb-slice", "1-3"), "usage", "*--pb-slice: '1-3' is not a slice; write A:B*", collect_only=True),
    Case("slice-not-numbers", ("--pb-slice", "a:b"), "usage", "*--pb-slice: 'a:b' is not a slice*", collect_only=True),
    Case("slice-left-nothing", ("--pb-language", "java", "--pb-slice", "5:9"), "usage",
         "*no ProgramBench task matched: --pb-slice '5:9' left nothing of 1 tasks*", collect_only=True),
    Case("shuffle", ("--pb-shuffle", "seven"), "usage", "*--pb-shuffle: 'seven' is not an integer*",
         collect_only=True),
    Case("tasks-dir-missing", ("--pb-tasks-dir", "/nonexistent/tasks"), "usage",
         "*--pb-tasks-dir: /nonexistent/tasks is not a directory*", collect_only=True),
    Case("nothing-matched", ("--pb-filter", "zzz_nothing"), "usage",
         "*no ProgramBench task matched: --pb-filter 'zzz_nothing' matched none of 200 tasks*", collect_only=True),
    Case("malformed-task-yaml", ("--pb-tasks-dir", "{tmp}/tasks"), "usage",
         "*malformed task: */bad__task.0000000/task.yaml: field 'difficulty' is 'impossible'*",
         setup=_bad_difficulty, collect_only=True),
    Case("nothing-to-run", ("--pb-language", "go"), "usage", NOTHING_TO_RUN),
    Case("empty-agent", ("--pb-language", "go", "--pb-agent", ""), "usage", "*--pb-agent*"),
    # -- evaluation options (issue 3) ---------------------------------------------------------------------------
    Case("pull", ("--pb-pull", "always"), "usage", "*--pb-pull: 'always' is not one of: never, missing*",
         collect_only=True),
    Case("min-score", ("--pb-min-score", "2"), "usage",
         "*--pb-min-score: 2.0 is out of range (minimum 0.0, maximum 1.0)*", collect_only=True),
    Case("memory", ("--pb-memory", "lots"), "usage", "*--pb-memory: 'lots' is not a size (examples: 512m, 8g, *",
         collect_only=True),
    Case("cpus", ("--pb-cpus", "0"), "usage", "*--pb-cpus: 0 is below the minimum of 1*", collect_only=True),
    Case("branch-workers", ("--pb-branch-workers", "0"), "usage", "*--pb-branch-workers: 0 is below the minimum of 1*",
         collect_only=True),
    Case("branch-retries", ("--pb-branch-retries", "-1"), "usage",
         "*--pb-branch-retries: -1 is below the minimum of 0*", collect_only=True),
    Case("compile-timeout", ("--pb-compile-timeout", "0"), "usage",
         "*--pb-compile-timeout: 0 is below the minimum of 1*", collect_only=True),
    Case("test-timeout", ("--pb-test-timeout", "1h"), "usage", "*--pb-test-timeout: '1h' is not an integer*",
         collect_only=True),
    Case("blob-dir-missing", ("--pb-blob-dir", "/nonexistent/blobs"), "usage",
         "*--pb-blob-dir: /nonexistent/blobs is not a directory*", collect_only=True),
    Case("blob-env-missing", ("--pb-language", "c"), "usage",
         "*PROGRAMBENCH_BLOB_DIR: /nonexistent/env-blobs is not a directory*",
         env={"PROGRAMBENCH_BLOB_DIR": "/nonexistent/env-blobs"}, collect_only=True),
    Case("submissions-missing", ("--pb-submissions", "/nonexistent/subs"), "usage",
         "*--pb-submissions: /nonexistent/subs is not a directory*", collect_only=True),
    Case("submissions-without-archives", (*EVAL, "--pb-submissions", "{tmp}/notsubs"), "usage",
         "*--pb-submissions: */notsubs holds no <id>/submission.tar.gz: expected one folder per task, named by its "
         "instance id, holding the task's submission.tar.gz", setup=_no_archives),
    Case("submission-archive-is-a-directory", (*EVAL, "--pb-submissions", "{tmp}/subs"), "usage",
         f"*--pb-submissions: */subs/{CATLIKE}/submission.tar.gz is a directory; a task's submission is a gzip tar "
         "archive of its source tree",
         setup=lambda tmp, _tb: (tmp / "subs" / CATLIKE / "submission.tar.gz").mkdir(parents=True)),
    # -- sandbox and agent options (issues 4, 5) ----------------------------------------------------------------
    Case("sandbox-cpus", ("--pb-sandbox-cpus", "0"), "usage", "*--pb-sandbox-cpus: 0.0 is out of range*",
         collect_only=True),
    Case("sandbox-memory", ("--pb-sandbox-memory", "lots"), "usage", "*--pb-sandbox-memory: 'lots' is not a size*",
         collect_only=True),
    Case("agent-timeout", ("--pb-agent-timeout", "abc"), "usage", "*--pb-agent-timeout: 'abc' is not an integer*",
         collect_only=True),
    Case("replay-missing", ("--pb-agent", "replay:/nonexistent/replay"), "usage",
         "*--pb-agent replay:DIR: /nonexistent/replay is not a directory*", collect_only=True),
    Case("agent-env-unset", (*AGENT, "--pb-agent-env", "PB_BAD_INPUT_UNSET"), "usage",
         "*--pb-agent-env: PB_BAD_INPUT_UNSET is not set on the host*"),
    Case("agent-env-name", (*AGENT, "--pb-agent-env", "1BAD=x"), "usage",
         "*--pb-agent-env: '1BAD' is not a variable name*"),
    Case("prompt-template-missing", (*AGENT, "--pb-prompt-template", "/nonexistent/prompt.j2"), "usage",
         "*--pb-prompt-template: /nonexistent/prompt.j2 is not a file*"),
    Case("model-endpoint-scheme", (*AGENT, "--pb-model-endpoint", "ftp://example.invalid/v1"), "usage",
         "*--pb-model-endpoint: model endpoint 'ftp://example.invalid/v1': the scheme must be http or https*"),
    Case("agent-mount-missing", (*AGENT, "--pb-agent-mount", "/nonexistent/mount"), "usage",
         "*--pb-agent-mount: /nonexistent/mount does not exist*"),
    # The command is asked for in the first sandbox, before the agent: the user's input, an error (never a 0). A
    # command not found at all: tests/test_rough_edges.py::test_a_missing_agent_command_ends_the_session_before_any_
    # evaluation (the same message, in the sandbox and on the host).
    Case("agent-not-executable", (*AGENT[:-2], "--pb-agent", "/etc/hostname --help"), "error",
         f"*--pb-agent '/etc/hostname --help': '/etc/hostname' is not executable in the sandbox of {CATLIKE}*"),
    Case("replay-without-the-task", (*AGENT[:-2], "--pb-agent", "replay:{tmp}/replay"), "failure",
         "*compile_failed: chmod: cannot access './compile.sh': No such file or directory*", setup=_empty_dirs),
    # -- options that need another (run_state's _validate_*) ---------------------------------------------------
    Case("gold-with-an-agent", ("--pb-language", "go", "--pb-gold", "2", "--pb-agent", "true"), "usage",
         "*--pb-gold N evaluates the reference itself: it runs no agent and takes no submissions (drop --pb-agent, "
         "--pb-submissions and --pb-attempts)*"),
    Case("ignore-flaky-without-a-ledger", ("--pb-language", "go", "--pb-agent", "true", "--pb-ignore-flaky"),
         "usage", "*--pb-ignore-flaky needs --pb-gold-ledger FILE: the ledger's tests are ignored*"),
    Case("budget-without-a-price", ("--pb-language", "go", "--pb-agent", "true", "--pb-budget", "5"), "usage",
         "*--pb-budget USD needs --pb-token-price IN,OUT: the price of the metered tokens*"),
    # -- run options (issue 6) ----------------------------------------------------------------------------------
    Case("infra-retries", ("--pb-infra-retries", "-1"), "usage", "*--pb-infra-retries: -1 is below the minimum of 0*",
         collect_only=True),
    Case("min-mean", ("--pb-min-mean", "1.5"), "usage", "*--pb-min-mean: 1.5 is out of range*", collect_only=True),
    Case("resume-missing", ("--pb-resume", "/nonexistent/run"), "usage",
         "*--pb-resume: /nonexistent/run is not a directory*", collect_only=True),
    Case("resume-not-a-run", ("--pb-language", "go", "--pb-agent", "true", "--pb-resume", "{tmp}/notarun"), "usage",
         "*--pb-resume: */notarun holds no pb-run.json; it is not a run directory*", setup=_not_a_run,
         collect_only=True),
    Case("output-holds-a-run", ("--pb-language", "go", "--pb-agent", "true", "--pb-output", "{tmp}/oldrun"),
         "usage", "*--pb-output: */oldrun already holds a run; pass --pb-resume */oldrun to continue it*",
         setup=_a_finished_run, collect_only=True),
    # -- tasks, hidden tests, images, engine, disk: errors ------------------------------------------------------
    Case("tests-json-not-json", COPY, "error",
         "*malformed task: */tasks/pbfix__catlike.c47c47c/tests.json: not valid JSON*",
         setup=lambda tmp, tb: (_task_copy(tmp, tb, "{not json"), None)[1]),
    Case("tests-json-branches", COPY, "error",
         "*malformed task: */tests.json: field 'branches' must be a mapping of branch -> info*",
         setup=lambda tmp, tb: (_task_copy(tmp, tb, '{"branches": []}'), None)[1]),
    Case("tests-json-branch-tests", COPY, "error", "*malformed task: */tests.json: branch 'b1' needs a 'tests' list*",
         setup=lambda tmp, tb: (_task_copy(tmp, tb, '{"branches": {"b1": {"tests": "all"}}}'), None)[1]),
    Case("no-hidden-tests", ("--pb-tasks-dir", "{tmp}/tasks", "--pb-blob-dir", "{tmp}/emptyblobs",
                             "--pb-submissions", "{subs}", "--pb-filter", CATLIKE), "error",
         "*: no hidden tests found (looked in blob dir */emptyblobs/pbfix__catlike.c47c47c/tests;"
         " task dir */tasks/pbfix__catlike.c47c47c/tests)*",
         setup=lambda tmp, tb: (_empty_dirs(tmp, tb), _task_copy(tmp, tb, trees=False), None)[2]),
    Case("image-missing", ("--pb-tasks-dir", "{tmp}/tasks", "--pb-blob-dir", "{tmp}/blobs", "--pb-submissions",
                           "{tmp}/subs", "--pb-pull", "never"), "error",
         "*image programbench/pbnoimage_1776_catlike.c47c47c:task_cleanroom_v6 is not present locally; not pulled "
         "(--pb-pull never); and * has no Dockerfile to build it from*", setup=_image_missing),
    Case("engine-unreachable", (*EVAL, "--pb-submissions", "{subs}"), "error",
         f"*Docker engine unreachable at unix:///nonexistent/docker.sock: there is no socket at "
         f"/nonexistent/docker.sock (dockerd is not running); {HOW_TO_START}*",
         env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"}),
    Case("disk-full-before-pull", ("--pb-tasks-dir", "{tmp}/tasks", "--pb-blob-dir", "{tmp}/blobs",
                                   "--pb-submissions", "{tmp}/subs"), "error",
         "*not enough disk space to pull programbench/pbnoimage_1776_catlike.c47c47c:task_cleanroom_v6: the Docker "
         "data root * has * free, 1000.0 TiB needed*", env={"PB_DISK_IMAGE_NEED": "1000t"}, setup=_needs_a_pull),
    # -- submissions: the submission's fault, scored ------------------------------------------------------------
    Case("submission-garbage", (*EVAL[:-2], "--pb-submissions", "{tmp}/subs", "--pb-filter", CATLIKE), "failure",
         "*invalid_submission_archive: */submission.tar.gz is not gzip-compressed (the evaluator unpacks it with "
         "tar -xzf)*", setup=lambda tmp, _tb: _submission(tmp, b"\x00garbage" * 64)),
    Case("submission-empty-file", (*EVAL[:-2], "--pb-submissions", "{tmp}/subs", "--pb-filter", CATLIKE), "failure",
         "*invalid_submission_archive: */submission.tar.gz is not gzip-compressed*",
         setup=lambda tmp, _tb: _submission(tmp, b"")),
    Case("submission-truncated", (*EVAL[:-2], "--pb-submissions", "{tmp}/subs", "--pb-filter", CATLIKE), "failure",
         "*invalid_submission_archive: */submission.tar.gz is not a readable gzip tar: EOFError*",
         setup=lambda tmp, tb: _submission(tmp, _good_submission_bytes(tb)[:300])),
    Case("submission-without-compile-sh", (*EVAL[:-2], "--pb-submissions", "{tmp}/subs", "--pb-filter", CATLIKE),
         "failure", "*compile_failed: chmod: cannot access './compile.sh': No such file or directory*",
         setup=_no_compile_sh),
]


def _expand(args: tuple[str, ...], tmp: Path, testbed: Testbed) -> list[str]:
    values = {"tasks": str(testbed.tasks_dir), "blobs": str(testbed.blob_dir), "subs": str(testbed.submissions),
              "tmp": str(tmp)}
    return [arg.format(**values) for arg in args]


def _lines(result: pytest.RunResult) -> list[str]:
    return result.outlines + result.errlines


# One real session per way a usage error reaches the user: refused while listing (--co), refused at the start of a
# run (no agent, no submissions), refused over the test bed's tasks (a check that reads the given directories).
WIRED = ("language", "nothing-to-run", "submissions-without-archives")
USAGE = [c for c in CASES if c.kind == "usage"]
SESSIONS = [c for c in CASES if c.kind != "usage" or c.id in WIRED]


def _arguments(case: Case, tmp: Path, testbed: Testbed, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The case's command line (after its set-up and environment)."""
    if case.setup is not None:
        case.setup(tmp, testbed)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PB_BAD_INPUT_UNSET", raising=False)
    args = ["-p", "no:cacheprovider", *_expand(case.args, tmp, testbed)]
    if "--pb-output" not in case.args:  # asked for, so that "no run directory" below can fail
        args += ["--pb-output", str(tmp / "run")]
    if case.collect_only:
        args.append("--co")
    elif case.kind != "usage":
        args += ["--pb-infra-retries", "0", "--junitxml", str(tmp / "junit.xml")]
    return args


def _written(tmp: Path) -> list[Path]:
    # pytester's own files, and pytest-benchmark's directory where that plugin is installed: not ours.
    return [p for p in sorted(p.relative_to(tmp) for p in tmp.rglob("*"))
            if p.parts[0] not in ("stdout", "stderr", ".benchmarks") and not p.parts[0].startswith("runpytest-")]


@pytest.mark.parametrize("case", USAGE, ids=[c.id for c in USAGE])
def test_usage_refused_by_the_validation(case: Case, pytester: pytest.Pytester, testbed: Testbed,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The check a session makes before anything runs, asked directly: the configuration pytest parses from the
    case's command line, the run's state made from it refuses it with the case's message, and nothing is written."""
    tmp = pytester.path
    args = _arguments(case, tmp, testbed, monkeypatch)
    before = _written(tmp)
    config = pytester.parseconfig(*args)
    with pytest.raises(pytest.UsageError) as refused:
        RunState.from_config(config)
    message = str(refused.value)
    assert "\n" not in message.strip(), message
    assert fnmatch.fnmatchcase(message, case.message), (message, case.message)
    assert not (tmp / "run").exists(), "a refused session creates no run directory"
    assert _written(tmp) == before, "a refused session writes nothing"


@pytest.mark.parametrize("case", SESSIONS, ids=[c.id for c in SESSIONS])
def test_bad_input(case: Case, pytester: pytest.Pytester, testbed: Testbed, monkeypatch: pytest.MonkeyPatch,
                   docker_client: Any) -> None:
    tmp = pytester.path
    args = _arguments(case, tmp, testbed, monkeypatch)
    before = _written(tmp)
    result = pytester.runpytest_subprocess(*args, timeout=600)
    text = "\n".join(_lines(result))

    if case.kind == "usage":
        assert result.ret == pytest.ExitCode.USAGE_ERROR, text[-3000:]
        result.stderr.fnmatch_lines([case.message])
        said = [line for line in result.errlines if line.strip()]
        assert len(said) == 1, said  # one line
        assert not (tmp / "run").exists(), "a refused session creates no run directory"
        assert _written(tmp) == before, "a refused session writes nothing"
        return
    outcomes = result.parseoutcomes()
    if case.kind == "error":
        assert outcomes.get("errors") == 1, text[-3000:]
        assert "failed" not in outcomes, text[-3000:]
        assert "passed" not in outcomes, text[-3000:]
        result.stdout.fnmatch_lines([case.message])
        assert "score" not in _junit_properties(tmp), "an error is never scored"
    else:
        assert case.kind == "failure"
        assert outcomes.get("failed") == 1, text[-3000:]
        result.stdout.fnmatch_lines(["*score 0.0000 (0/* tests passed), below --pb-min-score 1*", case.message])
        assert _junit_properties(tmp)["score"] == "0.0"


def _junit_properties(tmp: Path) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    path = tmp / "junit.xml"
    assert path.is_file(), "the session wrote no JUnit XML"
    return {p.get("name", ""): p.get("value", "") for p in ET.parse(path).getroot().iter("property")}


def test_the_table_covers_every_kind() -> None:
    kinds = {c.kind for c in CASES}
    assert kinds == {"usage", "error", "failure"}
    assert len({c.id for c in CASES}) == len(CASES)
    wired = {c.id: c for c in CASES if c.id in WIRED}
    assert set(wired) == set(WIRED), "every wired case is in the table"
    assert all(c.kind == "usage" for c in wired.values())
    assert {c.collect_only for c in wired.values()} == {True, False}, "listing and running sessions both wired"
