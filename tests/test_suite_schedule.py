"""The suite's own schedule (tests/durations.py): modules longest first from a run's JUnit XML, as the plugin schedules
tasks; and the order a real xdist session hands whole modules out in (``--dist loadfile --no-loadscope-reorder``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import durations
from tests.conftest import REPO


def _junit(path: Path, cases: list[tuple[str, float]]) -> Path:
    body = "".join(f'<testcase classname="{c}" name="t{i}" time="{t}"/>' for i, (c, t) in enumerate(cases))
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def test_a_runs_junit_gives_seconds_per_module(tmp_path: Path) -> None:
    """Every test case of a module counts (class-scoped ones too), over several files (the suite's streams); a
    classname that names no module of the tree is left out."""
    (tmp_path / "tests").mkdir()
    for name in ("test_a", "test_b"):
        (tmp_path / "tests" / f"{name}.py").write_text("")
    first = _junit(tmp_path / "one.xml", [("tests.test_a", 1.5), ("tests.test_a.TestX", 2.0), ("tests.test_b", 4)])
    second = _junit(tmp_path / "two.xml", [("tests.test_b", 0.5), ("elsewhere.test_c", 9)])
    assert durations.read_junit([first, second], tmp_path) == {"tests/test_a.py": 3.5, "tests/test_b.py": 4.5}


def test_the_file_is_written_longest_first_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "durations.json"
    durations.write({"tests/test_b.py": 2.04, "tests/test_a.py": 30.0, "tests/test_c.py": 2.04}, path)
    assert list(json.loads(path.read_text())) == ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"]
    assert durations.load(path) == {"tests/test_a.py": 30.0, "tests/test_b.py": 2.0, "tests/test_c.py": 2.0}
    path.write_text("not json")
    assert durations.load(path) == {}, "an unreadable file orders nothing (pytest's own order stays)"


def test_modules_are_ordered_longest_first_stable_within_a_module() -> None:
    items = ["a1", "b1", "a2", "c1", "d1", "b2"]
    path_of = {id(i): f"tests/test_{i[0]}.py" for i in items}
    seconds = {"tests/test_a.py": 10.0, "tests/test_b.py": 300.0, "tests/test_c.py": 40.0}
    # d is unknown: it weighs as the median module (40 s), after c (seen first) and before a.
    assert durations.order_modules(items, seconds, path_of) == ["b1", "b2", "c1", "d1", "a1", "a2"]
    assert durations.order_modules(items, {}, path_of) == ["a1", "a2", "b1", "b2", "c1", "d1"], "no file: as seen"


def test_the_committed_file_names_modules_of_this_tree() -> None:
    recorded = durations.load()
    assert recorded, "tests/durations.json is committed"
    assert all((REPO / module).is_file() for module in recorded), sorted(m for m in recorded
                                                                        if not (REPO / m).is_file())


def test_xdist_hands_out_the_longest_module_first(pytester: pytest.Pytester) -> None:
    """A real session of the project's conftest with a durations file: under --dist loadfile --no-loadscope-reorder
    the single worker runs the modules in the file's order, longest first, not in the order they were named."""
    for name in ("short", "long", "middle"):
        pytester.makepyfile(**{f"test_{name}": "def test_one():\n    pass\n"})
    pytester.makeconftest(
        "import json\nfrom pathlib import Path\nfrom tests import durations\n\n"
        "def pytest_collection_modifyitems(items):\n"
        "    seconds = json.loads(Path('durations.json').read_text())\n"
        "    path_of = {id(i): i.path.name for i in items}\n"
        "    items[:] = durations.order_modules(items, seconds, path_of)\n")
    (pytester.path / "durations.json").write_text(json.dumps({"test_short.py": 1, "test_long.py": 90,
                                                              "test_middle.py": 20}))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "1", "--dist", "loadfile",
                                           "--no-loadscope-reorder", "-v", "test_short.py", "test_middle.py",
                                           "test_long.py")
    result.assert_outcomes(passed=3)
    ran = [line.split("::")[0].split()[-1] for line in result.outlines if "PASSED" in line and "::" in line]
    assert ran == ["test_long.py", "test_middle.py", "test_short.py"], result.stdout.str()[-2000:]
