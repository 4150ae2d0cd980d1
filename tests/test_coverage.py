"""results/coverage.py on its own: which literals are options, what the parse cannot see, its bounds, and that it never
raises (a session's coverage is checked by tests/test_task_panel.py)."""

from __future__ import annotations

import io
import json
import tarfile
import textwrap
from pathlib import Path

import pytest

from pytest_programbench.results import coverage

TESTS = textwrap.dedent('''\
    import subprocess

    def run(*args, stdin=b""):
        return subprocess.run(["./executable", *args], input=stdin, capture_output=True)

    def test_numbers():
        assert run("-n", "--width=80", b"--bytes").returncode == 0

    def test_fstring(width=3):
        run(f"--columns={width}", "-", "--", "-3", "--not an option", "-x1")

    def test_built_at_run_time():
        flag = "-" + "q"  # not seen: built at run time
        run(flag)
''')


def _archive(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize(("text", "option"), [
    ("-n", "-n"), ("--width=80", "--width"), ("--show-ends", "--show-ends"), ("-x1", "-x1"), ("--a_b", "--a_b"),
    ("-", None), ("--", None), ("-3", None), ("--3", None), ("--not an option", None), ("-n 5", None), ("x-n", None),
    ("", None), ("---x", None),
])
def test_which_literals_are_options(text: str, option: str | None) -> None:
    assert coverage.option_of(text) == option


def test_hidden_options_from_every_python_source_of_the_archives(tmp_path: Path) -> None:
    first = _archive(tmp_path / "b1.tar.gz", {"eval/tests/test_a.py": TESTS.encode(),
                                              "eval/tests/data.txt": b'"--in-data"', "eval/run.sh": b"-v"})
    second = _archive(tmp_path / "b2.tar.gz", {"eval/tests/test_b.py": b'import x\nx.run("-n", "--other")\n',
                                               "eval/tests/broken.py": b"def (:\n"})
    found = coverage.hidden_options([first, second])
    assert dict(found.options) == {"-n": 2, "--width": 1, "--bytes": 1, "--columns": 1, "-x1": 1, "--other": 1}
    assert "-q" not in found.options, "an option built at run time is not seen"
    assert found.sources == 2
    assert found.notes == ["b2.tar.gz: eval/tests/broken.py: not parsed (SyntaxError)"]


def test_agent_options_from_the_call_log(tmp_path: Path) -> None:
    log = tmp_path / "binary-calls.jsonl"
    calls = [["/workspace/binary", "-n", "-n", "file"], ["/workspace/binary", "--width=9", "--", "-E"],
             ["binary", "-nE"], ["/workspace/binary"]]
    log.write_text("".join(json.dumps({"argv": argv}) + "\n" for argv in calls) + "not json\n" + '{"argv": 3}\n')
    found = coverage.agent_options(log)
    assert found is not None
    assert dict(found.options) == {"-n": 1, "--width": 1, "-nE": 1}, "-E after -- is an operand; -nE one option"
    assert found.calls == 4
    assert coverage.agent_options(tmp_path / "missing.jsonl") is None, "no agent ran: nothing measured"


def test_measure_names_what_was_never_tried_and_counts_what_was(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "b.tar.gz", {"eval/tests/test_a.py": TESTS.encode()})
    log = tmp_path / "binary-calls.jsonl"
    log.write_text(json.dumps({"argv": ["/workspace/binary", "-n", "--width=1"]}) + "\n")
    row = coverage.measure_task([archive], log)
    assert (row["total"], row["covered"]) == (5, 2)
    assert row["tried"] == ["--width", "-n"]
    assert row["never_tried"] == ["--bytes", "--columns", "-x1"]
    evaluate_only = coverage.measure_task([archive], tmp_path / "none.jsonl")
    assert (evaluate_only["total"], evaluate_only["covered"]) == (5, None)
    assert coverage.fraction(row) == 0.4
    assert coverage.run_figure([row, evaluate_only, None]) == {"tasks": 1, "covered": 2, "total": 5,
                                                                "fraction": 0.4, "mean_fraction": 0.4}


def test_bounded_and_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source over the per-file cap is skipped (said), the task's byte budget stops the parse (said), an archive
    that is not one is a note; nothing raises."""
    monkeypatch.setattr(coverage, "SOURCE_MAX", 1000)
    monkeypatch.setattr(coverage, "SOURCES_MAX", 1500)
    big = b"x = '-big'\n" + b"#" * 2000
    small = b"x = '-s'\n" + b"#" * 900
    archive = _archive(tmp_path / "b.tar.gz", {"a.py": big, "b.py": small, "c.py": small})
    garbage = tmp_path / "g.tar.gz"
    garbage.write_bytes(b"\x1f\x8bnot really gzip")
    found = coverage.hidden_options([archive, garbage, tmp_path / "missing.tar.gz"])
    assert dict(found.options) == {"-s": 1}
    assert found.notes[0] == "b.tar.gz: a.py not read (2011 bytes)"
    assert found.notes[1] == "b.tar.gz: c.py not read (909 bytes)", "the task's budget was spent"
    assert found.notes[2].startswith("g.tar.gz: cannot be read")
    assert found.notes[3].startswith("missing.tar.gz: cannot be read")

    monkeypatch.setattr(coverage, "hidden_options", lambda _archives: 1 / 0)
    failed = coverage.measure_task([archive], tmp_path / "none.jsonl")
    assert failed["total"] is None
    assert failed["notes"] == ["coverage not measured: ZeroDivisionError: division by zero"]


def test_over_attempts_and_between_runs() -> None:
    one = {"total": 3, "covered": 1, "tried": ["-a"], "never_tried": ["-b", "-c"]}
    two = {"total": 3, "covered": 2, "tried": ["-a", "-b"], "never_tried": ["-c"]}
    mean = coverage.mean_coverage([one, two, None])
    assert mean is not None
    assert (mean["covered"], mean["tried"], mean["never_tried"], mean["by_attempt"]) == (1.5, ["-a", "-b"], ["-c"],
                                                                                      [1, 2, None])
    task = coverage.compare_task(one, mean)
    assert task == {"total": 3, "base": 1, "new": 1.5, "delta": 0.5, "newly_tried": ["-b"], "no_longer_tried": []}
    result = coverage.compare_runs({"t": task}, [one], [mean])
    assert (result["more"], result["fewer"], result["same"]) == (1, 0, 0)
    line = coverage.compare_line(result)
    assert line == ("options the hidden tests pass, tried by the agent: 1/3 (33%) -> 1.5/3 (50%); over the 1 task(s) "
                    "both measured, 1 explored more, 0 less, 0 as much")
    assert coverage.compare_line(coverage.compare_runs({}, [None], [None])) is None
