"""Collection, selection and opt-in, through real pytest sessions (pytester)."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from programbench.constants import TASKS_DIR
from programbench.utils.instance_filters import filter_instances
from programbench.utils.load_data import load_all_instances

from pytest_programbench.tasks import catalogue

pytestmark = pytest.mark.usefixtures("clean_env")


def collected_ids(pytester: pytest.Pytester, *args: str) -> list[str]:
    result = pytester.runpytest("--co", "-q", "-p", "no:cacheprovider", *args)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    return [line for line in result.outlines if line.startswith("programbench::")]


def task_ids(ids: list[str]) -> list[str]:
    return [i.removeprefix("programbench::") for i in ids]


@pytest.mark.parametrize(
    ("language", "count"), [("rust", 107), ("go", 46), ("c", 33), ("cpp", 12), ("haskell", 1), ("java", 1)]
)
def test_language_counts(pytester: pytest.Pytester, language: str, count: int) -> None:
    assert len(collected_ids(pytester, "--pb-language", language)) == count


@pytest.mark.parametrize(("level", "count"), [("easy", 27), ("medium", 120), ("hard", 18), ("unset", 35)])
def test_difficulty_counts(pytester: pytest.Pytester, level: str, count: int) -> None:
    assert len(collected_ids(pytester, "--pb-difficulty", level)) == count


def test_aliases_repeats_and_commas(pytester: pytest.Pytester) -> None:
    ids = collected_ids(pytester, "--pb-language", "rs,hs", "--pb-language", "go")
    assert len(ids) == 107 + 1 + 46


def test_all_benchmark_tasks_without_fixtures(pytester: pytest.Pytester) -> None:
    ids = task_ids(collected_ids(pytester, "--pb-filter", ".*"))
    assert len(ids) == 200
    assert not [i for i in ids if i.startswith("testorg__")]
    with_fixtures = task_ids(collected_ids(pytester, "--pb-include-fixtures"))
    assert "testorg__calculator.abc1234" in with_fixtures
    assert len(with_fixtures) == 201


def test_keyword_selection(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\npb_enable = true\n")
    assert collected_ids(pytester, "-k", "pandoc") == ["programbench::jgm__pandoc.5caad90"]


def test_markers_under_strict_markers(pytester: pytest.Pytester) -> None:
    ids = task_ids(collected_ids(pytester, "--pb-language", "go", "--strict-markers", "-m",
                                 "lang_go and difficulty_easy"))
    expected = sorted(i["instance_id"] for i in load_all_instances(include_tests=False)
                      if i["language"] == "go" and i.get("difficulty") == "easy")
    assert sorted(ids) == expected
    assert ids


def test_markers_select_across_languages(pytester: pytest.Pytester) -> None:
    ids = collected_ids(pytester, "--pb-filter", ".", "-m", "lang_haskell or lang_java", "--strict-markers")
    assert len(ids) == 2


def test_shuffle_is_reproducible_and_seeded(pytester: pytest.Pytester) -> None:
    first = collected_ids(pytester, "--pb-shuffle", "7")
    again = collected_ids(pytester, "--pb-shuffle", "7")
    other = collected_ids(pytester, "--pb-shuffle", "8")
    assert first == again
    assert first != other
    assert sorted(first) == sorted(other)


def test_filter_slice_shuffle_match_official_semantics(pytester: pytest.Pytester) -> None:
    """Seed 42 is the official one, so the official function gives the expected order (fixtures included)."""
    official = filter_instances(load_all_instances(TASKS_DIR, include_tests=False), filter_spec="[a-m]",
                                slice_spec="3:17", shuffle=True)
    ours = task_ids(collected_ids(pytester, "--pb-include-fixtures", "--pb-shuffle", "42", "--pb-filter", "[a-m]",
                                  "--pb-slice", "3:17"))
    assert ours == [i["instance_id"] for i in official]
    assert len(ours) == 14


def test_node_ids_and_header(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--co", "--pb-language", "java,go")
    result.stdout.fnmatch_lines([
        "programbench 1.2.5: 47 tasks selected (go 46, java 1)",
        # A listing runs nothing: the header names no run folder (it named one that was never created).
        "programbench run *: no run directory (a listing of the selection: nothing runs)",
    ])
    assert "pb-runs" not in result.stdout.str()
    assert "<ProgramBenchItem ajeetdsouza__zoxide.67ca1bc>" not in result.stdout.str()  # rust is not selected
    assert not (pytester.path / "pb-runs").exists(), "--co must not create a run directory"


# -- opt-in ---------------------------------------------------------------------------------------------------


def test_installed_but_not_opted_in_sees_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_one():\n    pass\n")
    result = pytester.runpytest("--co", "-q")
    assert "programbench::" not in result.stdout.str()
    result.stdout.fnmatch_lines(["test_plain.py::test_one", "1 test collected*"])
    assert "programbench 1.2.5" not in pytester.runpytest("--co").stdout.str()


def test_ini_opt_in_without_path_collects_only_the_benchmark(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\npb_enable = true\n")
    pytester.makepyfile(test_plain="def test_one():\n    pass\n")
    ids = pytester.runpytest("--co", "-q").outlines
    assert "test_plain.py::test_one" not in ids
    assert len([i for i in ids if i.startswith("programbench::")]) == 200


def test_ini_opt_in_with_explicit_path_collects_only_the_path(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\npb_enable = true\n")
    pytester.makepyfile(test_plain="def test_one():\n    pass\n")
    result = pytester.runpytest("--co", "-q", "test_plain.py")
    assert "programbench::" not in result.stdout.str()
    result.stdout.fnmatch_lines(["test_plain.py::test_one"])


def test_flag_with_explicit_path_collects_both(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_one():\n    pass\n")
    ids = pytester.runpytest("--co", "-q", "test_plain.py", "--pb-language", "java").outlines
    assert "test_plain.py::test_one" in ids
    assert "programbench::" + next(i["instance_id"] for i in load_all_instances(include_tests=False)
                                   if i["language"] == "java") in ids


def test_ini_opt_in_from_a_subdirectory_does_not_collect(pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\npb_enable = true\n")
    sub = pytester.mkdir("sub")
    (sub / "test_sub.py").write_text("def test_sub():\n    pass\n")
    monkeypatch.chdir(sub)
    result = pytester.runpytest("--co", "-q", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["sub/test_sub.py::test_sub"])
    assert "programbench::" not in result.stdout.str()


# Two valid, distinct, non-default values per option kind (or per option, where the kind's would be refused);
# generated over options.OPTIONS, so a new option is covered the day it is declared.
_SAMPLES: dict[str, tuple[str, str]] = {
    "language": ("go", "rust"), "difficulty": ("hard", "easy"), "pull": ("missing", "never"),
    "progress": ("lines:5", "live:2"), "token-price": ("1.5,2", "3,4"), "sandbox-memory": ("3g", "5g"),
    "memory": ("2g", "4g"), "slice": ("1:3", "0:2"), "filter": ("a.*", "b.*"),
    "docker-host": ("unix:///run/pb-a.sock", "unix:///run/pb-b.sock=2"),
    "score": ("official", "corrected"), "audit-hidden-tests": ("on", "off"),
}
_KIND_SAMPLES = {"int": ("7", "9"), "float": ("0.5", "0.75"), "str": ("one", "two"), "list": ("one", "two")}
_DIR_OPTIONS = ("tasks-dir", "submissions", "resume", "blob-dir", "compare", "agent-replay", "durations", "report")
_FILE_OPTIONS = ("gold-ledger", "registry-ignore")


def _samples(tmp: Path) -> dict[str, tuple[str, str]]:
    from pytest_programbench.pytest_layer.options import OPTIONS

    samples = {}
    for opt in OPTIONS:
        if opt.name in _DIR_OPTIONS:
            pair = tuple(str(tmp / f"{opt.name}-{side}") for side in ("a", "b"))
            for path in pair:
                Path(path).mkdir()
            samples[opt.name] = (pair[0], pair[1])
        elif opt.name in _FILE_OPTIONS:
            pair = tuple(str(tmp / f"{opt.name}-{side}.json") for side in ("a", "b"))
            for path in pair:
                Path(path).write_text("{}")
            samples[opt.name] = (pair[0], pair[1])
        elif opt.kind == "bool":
            samples[opt.name] = ("false", "true")  # the flag is store_const True: the ini says the other
        else:
            samples[opt.name] = _SAMPLES.get(opt.name) or _KIND_SAMPLES[opt.kind]
    return samples


def _settings(pytester: pytest.Pytester, ini: dict[str, str], cli: dict[str, str]) -> Any:
    from pytest_programbench.pytest_layer.options import BY_DEST, parse

    pytester.makeini("[pytest]\n" + "".join(f"{BY_DEST['pb_' + k.replace('-', '_')].ini} = {v}\n"
                                           for k, v in ini.items()))
    args: list[str] = []
    for name, value in cli.items():
        flag = BY_DEST["pb_" + name.replace("-", "_")]
        args += [flag.flag] if flag.kind == "bool" else [flag.flag, value]
    return parse(pytester.parseconfig(*args), environ=[])


def _fields_of(name: str) -> list[str]:
    """The Settings fields one option sets (progress sets two)."""
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.pytest_layer.options import BY_DEST

    fields = list(BY_DEST["pb_" + name.replace("-", "_")].settings_fields)
    assert set(fields) <= set(Settings.__dataclass_fields__), fields
    return fields


def test_every_option_has_an_ini_twin(pytester: pytest.Pytester) -> None:
    """Every option set only in the ini gives the same Settings as all set on the command line, none the default."""
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.pytest_layer.options import OPTIONS

    samples = {name: pair[1] for name, pair in _samples(pytester.path).items()}
    from_ini = _settings(pytester, samples, {})
    from_cli = _settings(pytester, {}, samples)
    default = Settings()
    for opt in OPTIONS:
        fields = _fields_of(opt.name)
        assert fields, f"{opt.flag} sets no Settings field"
        assert [getattr(from_ini, f) for f in fields] == [getattr(from_cli, f) for f in fields], opt.ini
        assert any(getattr(from_ini, f) != getattr(default, f) for f in fields), f"{opt.ini} left the default"
    assert from_ini == from_cli


def test_every_settings_field_is_set_by_exactly_one_option() -> None:
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.pytest_layer.options import OPTIONS

    fields = [name for opt in OPTIONS for name in opt.settings_fields]
    assert sorted(fields) == sorted(Settings.__dataclass_fields__)


def test_command_line_beats_ini(pytester: pytest.Pytester) -> None:
    """For every option the ini says one value, the command line another: the command line's is the result."""
    from pytest_programbench.pytest_layer.options import OPTIONS

    samples = _samples(pytester.path)
    ini = {name: pair[0] for name, pair in samples.items()}
    cli = {name: pair[1] for name, pair in samples.items()}
    both, only_cli, only_ini = _settings(pytester, ini, cli), _settings(pytester, {}, cli), _settings(pytester, ini, {})
    for opt in OPTIONS:
        for name in _fields_of(opt.name):
            assert getattr(both, name) == getattr(only_cli, name), f"{opt.ini} beat {opt.flag}"
            assert getattr(both, name) != getattr(only_ini, name), f"{opt.flag}: the two samples must differ"
    # And through collection, end to end: the ini selects haskell, the command line java.
    pytester.makeini("[pytest]\npb_enable = true\npb_language = haskell\n")
    ids = collected_ids(pytester, "--pb-language", "java")
    assert len(ids) == 1
    assert ids != ["programbench::jgm__pandoc.5caad90"]


# -- tasks dir ------------------------------------------------------------------------------------------------


def write_task(root: Path, instance_id: str, *, language: str = "c", difficulty: str | None = "easy",
               tests_json: str | None = None) -> Path:
    task = root / instance_id
    task.mkdir(parents=True)
    lines = ["repository: example/example", "commit: 0123456789abcdef", f"language: {language}"]
    if difficulty is not None:
        lines.append(f"difficulty: {difficulty}")
    (task / "task.yaml").write_text("\n".join(lines) + "\n")
    if tests_json is not None:
        (task / "tests.json").write_text(tests_json)
    return task


def test_tasks_dir_adds_and_overrides(pytester: pytest.Pytester) -> None:
    extra = pytester.mkdir("extra")
    write_task(extra, "someone__tool.1234567", language="zig")
    write_task(extra, "jgm__pandoc.5caad90", language="hs", difficulty="hard")
    result = pytester.runpytest("--co", "-q", "--pb-tasks-dir", str(extra), "--pb-filter", "someone|jgm",
                                "--strict-markers", "-m", "lang_zig or difficulty_hard")
    assert result.ret == 0, result.stdout.str()
    ids = [line for line in result.outlines if line.startswith("programbench::")]
    assert ids == ["programbench::jgm__pandoc.5caad90", "programbench::someone__tool.1234567"]
    header = pytester.runpytest("--co", "--pb-tasks-dir", str(extra), "--pb-filter", "someone|jgm")
    header.stdout.fnmatch_lines(["programbench overridden by --pb-tasks-dir: jgm__pandoc.5caad90"])


def test_language_choices_include_languages_of_the_tasks_dir(pytester: pytest.Pytester) -> None:
    extra = pytester.mkdir("extra")
    write_task(extra, "someone__tool.1234567", language="zig")
    assert task_ids(collected_ids(pytester, "--pb-tasks-dir", str(extra), "--pb-language", "zig")) == [
        "someone__tool.1234567"]


# -- usage errors ---------------------------------------------------------------------------------------------


def test_malformed_task_names_file_and_field(pytester: pytest.Pytester) -> None:
    extra = pytester.mkdir("extra")
    task = write_task(extra, "bad__task.0000000", difficulty="impossible")
    result = pytester.runpytest("--co", "--pb-tasks-dir", str(extra))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*malformed task: {task / 'task.yaml'}: field 'difficulty' is 'impossible'*"])
    (task / "task.yaml").write_text("repository: x\n")
    result = pytester.runpytest("--co", "--pb-tasks-dir", str(extra))
    result.stderr.fnmatch_lines([f"*{task / 'task.yaml'}: field 'language' is missing*"])
    (task / "task.yaml").write_text("language: [unclosed\n")
    result = pytester.runpytest("--co", "--pb-tasks-dir", str(extra))
    result.stderr.fnmatch_lines([f"*{task / 'task.yaml'}: cannot be read as YAML*"])


def test_running_with_nothing_to_run_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--pb-language", "go")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*nothing to run: pass --pb-agent CMD*--pb-submissions DIR*"])
    assert "skipped" not in result.stdout.str()


def test_the_counts_add_up() -> None:
    instances = [i for i in load_all_instances(include_tests=False) if not i["instance_id"].startswith("testorg__")]
    assert Counter(i["language"] for i in instances) == {"rs": 107, "go": 46, "c": 33, "cpp": 12, "hs": 1,
                                                        "java": 1}


# -- xdist ----------------------------------------------------------------------------------------------------


def test_xdist_workers_collect_identical_lists(pytester: pytest.Pytester) -> None:
    """A real ``-n 2`` session (xdist is off under --co): same node ids, same order, on both workers.

    The conftest records each worker's list and stops items from running: this test is about collection only.
    """
    extra = pytester.mkdir("extra")
    write_task(extra, "someone__tool.1234567", language="zig")
    pytester.makeconftest(textwrap.dedent("""
        import json, os
        import pytest

        def pytest_collection_finish(session):
            worker = os.environ.get("PYTEST_XDIST_WORKER", "controller")
            with open(f"ids-{worker}.json", "w") as f:
                json.dump([item.nodeid for item in session.items], f)

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_protocol(item, nextitem):
            return True  # collection-only test: never run the pipeline
    """))
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--pb-shuffle", "7",
                                           "--pb-tasks-dir", str(extra), "--pb-agent", "true")
    output = result.stdout.str() + result.stderr.str()
    assert "Different tests were collected" not in output
    import json

    gw0 = json.loads((pytester.path / "ids-gw0.json").read_text())
    gw1 = json.loads((pytester.path / "ids-gw1.json").read_text())
    assert gw0 == gw1
    assert len(gw0) == 201
    assert "programbench::someone__tool.1234567" in gw0
    assert gw0 != sorted(gw0), "--pb-shuffle 7 must shuffle"


def test_project_collection_never_enters_the_testbed() -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "."],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert collected, proc.stdout
    assert not [line for line in collected if not line.startswith("tests/")]
    assert (repo / "testbed" / "tasks").is_dir(), "the fixture tasks live in testbed/tasks"


def test_thread_timeout_method_is_warned(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--co", "-q", "--pb-filter", "jgm", "--timeout-method", "thread")
    result.stdout.fnmatch_lines(["*ProgramBenchWarning: pytest-timeout's thread method os._exit()s the whole worker*"])


def test_item_timeout_is_above_every_clock() -> None:
    """The outer backstop never fires while a legitimate clock runs: in every infrastructure attempt (the setup
    re-runs the pipeline up to 1 + --pb-infra-retries times) the agent's clock, compile.sh's, and every branch's
    in every retry round may all run out in full. Stated as lower bounds, not as the formula."""
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.pytest_layer.run_state import item_timeout
    from pytest_programbench.tasks.catalogue import Catalogue

    def active(task: Any) -> int:
        return sum(1 for info in task.load_instance()["branches"].values() if not info.get("ignored"))

    task = next(t for t in Catalogue.load() if t.instance_id == "alexpovel__srgn.89f943b")
    branches = active(task)
    assert branches > 2  # so that branch workers change the number of rounds
    cases = [
        Settings(submissions="x", compile_timeout=100, test_timeout=10, branch_retries=1, infra_retries=0),
        Settings(agent="true", agent_timeout=1000, compile_timeout=100, test_timeout=10, branch_workers=2,
                 branch_retries=0, infra_retries=0),
        Settings(agent="true", agent_timeout=1000, compile_timeout=100, test_timeout=10, branch_workers=1,
                 branch_retries=2, infra_retries=3),
        # A model endpoint: held requests give the clock back, up to the clock again or the retry budget.
        Settings(agent="true", agent_timeout=100, model_endpoint="http://127.0.0.1:9", model_retry_budget=5000,
                 compile_timeout=100, test_timeout=10, infra_retries=0),
        Settings(agent="true", agent_timeout=5000, model_endpoint="http://127.0.0.1:9", compile_timeout=100,
                 test_timeout=10, infra_retries=0),
    ]
    for settings in cases:
        workers = min(settings.branch_workers, branches)
        serial_rounds = -(-branches // workers)  # the slowest schedule of the branches over the workers
        given_back = {"http://127.0.0.1:9": max(settings.agent_timeout, settings.model_retry_budget)}
        agent = settings.agent_timeout + given_back.get(settings.model_endpoint or "", 0) if settings.agent else 0
        attempt = (agent + settings.compile_timeout
                   + serial_rounds * (1 + settings.branch_retries) * settings.test_timeout)
        assert item_timeout(task, settings) > (1 + settings.infra_retries) * attempt, settings
    # Every clock moves the backstop by at least its own growth times the attempts.
    base = cases[2]
    for field, grow in (("agent_timeout", 500), ("compile_timeout", 500), ("test_timeout", 50)):
        grown = Settings(**{**base.__dict__, field: getattr(base, field) + grow})
        assert item_timeout(task, grown) - item_timeout(task, base) >= grow * (1 + base.infra_retries), field
    # A model endpoint moves it by the most the agent's clock can be given back: the retry budget, or the clock again.
    for endpoint, most in ((cases[3], 5000), (cases[4], 5000)):
        plain = Settings(**{**endpoint.__dict__, "model_endpoint": None})
        assert item_timeout(task, endpoint) - item_timeout(task, plain) >= most, endpoint


def test_the_packaged_copy_is_the_official_read_and_never_trusted_stale(tmp_path: Path) -> None:
    """The catalogue's cached copy of the packaged tasks (tasks/catalogue.PackagedCopy) gives what programbench's loader
    gives; an edited task.yaml, a forged copy or an oversized one sends the read back to the official loader."""
    tasks = tmp_path / "tasks"
    for name in ("a__x.1111111", "b__y.2222222"):
        (tasks / name).mkdir(parents=True)
        (tasks / name / "task.yaml").write_text(f"language: go\ndifficulty: easy\nname: {name}\n")
    reads: list[int] = []

    def official() -> list[dict[str, Any]]:
        reads.append(1)
        return load_all_instances(tasks, include_tests=False)

    copy = catalogue.PackagedCopy(tmp_path / "cache", tasks)
    first = copy.load(official)
    assert first == load_all_instances(tasks, include_tests=False)
    assert (copy.load(official), len(reads)) == (first, 1), "the second read comes from the copy"
    # An edited task: a new signature, the official read again, the old copy gone.
    (tasks / "a__x.1111111" / "task.yaml").write_text("language: rust\ndifficulty: hard\n")
    edited = copy.load(official)
    assert [i["language"] for i in edited] == ["rust", "go"]
    assert len(reads) == 2
    assert len(list((tmp_path / "cache").glob("packaged-*.json"))) == 1
    # A forged copy (not a list of instances) or one past the size bound is not trusted.
    [kept] = (tmp_path / "cache").glob("packaged-*.json")
    for forged in ('{"instance_id": "evil"}', "[" + " " * (copy.max_bytes + 1) + "]"):
        kept.write_text(forged)
        assert copy.load(official) == edited
    assert len(reads) == 4
    # A value JSON cannot hold as it is (a date) is never cached: every read is the official one.
    (tasks / "b__y.2222222" / "task.yaml").write_text("language: go\ncreated: 2024-01-01\n")
    dated = copy.load(official)
    assert copy.load(official) == dated
    assert len(reads) == 6
