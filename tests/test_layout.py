"""The package's shape: no import circles, a light entry point, each pipeline step in a folder named after it."""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import pytest_programbench

PACKAGE = Path(pytest_programbench.__file__).parent
NAME = "pytest_programbench"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Imports under ``if TYPE_CHECKING:`` never run, so they cannot make a circle."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for inner in ast.walk(node))
    return hidden


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere (module level and inside functions alike)."""
    # sandbox/proxy/ holds what runs inside the container (scripts, not modules of the package)
    modules = {_module_name(path, package): path for path in package.rglob("*.py")
               if "proxy" not in path.relative_to(package).parts}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        hidden = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            for target in targets:
                imported = target
                while imported and imported not in modules:
                    imported = imported.rpartition(".")[0]
                # A package's __init__ is not an edge worth a circle (it holds only constants and docstrings).
                if imported and imported != name and modules[imported].name != "__init__.py":
                    graph[name].add(imported)
    return graph


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 40, "the walk found the package's modules"
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """Positive control: the same check on a package with a circle hidden inside a function."""
    package = tmp_path / NAME
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "one.py").write_text(f"from {NAME}.a import two\n")
    (package / "a" / "two.py").write_text(f"def later():\n    from {NAME}.a.one import thing\n")
    (package / "three.py").write_text(f"import typing\nif typing.TYPE_CHECKING:\n    from {NAME} import four\n")
    (package / "four.py").write_text(f"from {NAME} import three\n")
    graph = import_graph(package)
    with pytest.raises(CycleError) as caught:
        tuple(TopologicalSorter(graph).static_order())
    assert set(caught.value.args[1]) == {f"{NAME}.a.one", f"{NAME}.a.two"}


def test_the_entry_point_stays_light() -> None:
    """pytest loads the entry point in every project of the environment: it must not pull in the heavy parts."""
    probe = ("import sys, pytest_programbench.pytest_layer.plugin; "
             "print(' '.join(sorted(m for m in ('docker', 'programbench', 'httpx', 'huggingface_hub', 'jinja2', "
             "'requests', 'pytest_programbench.pytest_layer.session', 'pytest_programbench.engine') "
             "if m in sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_each_pipeline_step_has_a_folder() -> None:
    folders = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    assert {"pytest_layer", "pipeline", "tasks", "engine", "sandbox", "agents", "relay", "evaluation", "results",
            "scheduling", "core", "text"} <= folders
    flat = sorted(path.stem for path in PACKAGE.glob("*.py"))
    # Every floor has its own folder; the top level keeps only the labels.
    assert flat == ["__init__"], flat
