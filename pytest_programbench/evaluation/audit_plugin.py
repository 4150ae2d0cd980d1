"""The audit's pytest plugin: the hidden tests withheld from the program once pytest has collected them.

Loaded (``-p pb_audit_<token>``) into the hidden tests' pytest in an audit run only (:mod:`.audit`), never in the
official one. The harness copies this file, with :data:`TREE` set to the hidden tests' tree, into a fresh, verified
directory of an audit container (:mod:`.harness_material`), so it runs in the task image's Python and pytest: it is
stand-alone (Python 3.6+, any pytest with hook wrappers, no ``from __future__`` import).

In every process that runs tests, right before its first test:

* the source of every module imported from the test tree (the collected test modules, their helpers, each
  ``conftest.py`` and ``__init__.py``) and every other ``conftest.py`` there is emptied, every ``*.pyc`` and every
  ``__pycache__`` in the tree deleted; data files stay (legitimate tests read them). Emptied, not deleted: pytest
  stats a package's ``__init__.py`` again when it sets the package up before its first test (a deleted one fails
  every test with an ImportError). Not at ``pytest_collection_finish``: under xdist each worker collects by itself,
  and the first to finish would empty what another is still importing; a worker's first test comes only after every
  worker has collected (the controller schedules nothing before), and each worker imported the same files, so none
  of them holds anything when any test starts;
* ``PYTEST_CURRENT_TEST`` names no test for the rest of the session: pytest sets it before each phase of a test, and
  a stand-in of the same shape replaces it there (a test that reads it still finds a value), so the program's
  environment never names the running test.

Each such process writes one line to ``ran.<pid>`` beside this file (what it withheld, whether the variable is
replaced in every phase or only around the test function): the audit reads it to know the plugin was active.
"""

import os
import shutil
import sys

import pytest

try:
    from _pytest import runner as _runner
except ImportError:  # every pytest has it; the wrapper around the test function still hides the variable then
    _runner = None  # type: ignore[assignment]

TREE = "/workspace/eval"  # the harness rewrites this line with the hidden tests' tree (audit.plugin_source)
VARIABLE = "PYTEST_CURRENT_TEST"
STAND_IN = "tests/test_hidden.py::test_hidden ({})"  # pytest's shape: "<node id> (<phase>)"
REPORT_PREFIX = "ran."
PLUGIN_NAME = "pytest-programbench-audit"


def _inside(path: str, tree: str) -> bool:
    real = os.path.realpath(path)
    return real == tree or real.startswith(tree + os.sep)


def _imported_sources(session: pytest.Session, tree: str) -> "set[str]":
    """The collected test modules and every module imported from ``tree``: their files."""
    paths = set()
    for item in session.items:
        path = str(getattr(item, "path", None) or getattr(item, "fspath", "") or "")
        if path.endswith(".py"):  # a test collected from another kind of file may read it when it runs
            paths.add(path)
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if isinstance(source, str) and source.endswith((".py", ".pyc")):
            paths.add(source)
    return {p for p in paths if _inside(p, tree)}


def withhold(session: pytest.Session, tree: str) -> "tuple[int, list[str]]":
    """Empties or deletes what the program could read the tests from: how many entries, and what failed."""
    tree = os.path.realpath(tree)
    sources = _imported_sources(session, tree)
    compiled: set[str] = set()
    caches = []
    for directory, subdirs, files in os.walk(tree):
        if "__pycache__" in subdirs:
            subdirs.remove("__pycache__")
            caches.append(os.path.join(directory, "__pycache__"))
        sources.update(os.path.join(directory, name) for name in files if name == "conftest.py")
        compiled.update(os.path.join(directory, name) for name in files if name.endswith(".pyc"))
    done = 0
    failed = []
    for cache in caches:
        try:
            shutil.rmtree(cache)
            done += 1
        except OSError as exc:
            failed.append(f"{cache}: {exc}")
    for path in sorted(sources | compiled):
        try:
            if path in compiled or path.endswith(".pyc"):
                os.remove(path)
            else:
                os.truncate(path, 0)
            done += 1
        except FileNotFoundError:
            pass  # another worker was first
        except OSError as exc:
            failed.append(f"{path}: {exc}")
    return done, failed


def _hide_in_every_phase() -> bool:
    """Wraps pytest's setter of ``PYTEST_CURRENT_TEST`` (setup, call, teardown) so a stand-in replaces the value."""
    original = getattr(_runner, "_update_current_test_var", None) if _runner is not None else None
    if original is None:
        return False
    if getattr(original, "pb_audit", False):
        return True

    def update(item: pytest.Item, when: "str | None") -> None:
        original(item, when)
        if when is not None and VARIABLE in os.environ:
            os.environ[VARIABLE] = STAND_IN.format(when)

    setattr(update, "pb_audit", True)  # noqa: B010 - an attribute on a function
    setattr(_runner, "_update_current_test_var", update)  # noqa: B010 - pytest's own module
    return True


class Audit:
    """Per process: withholds once, before the first test; keeps the variable a stand-in around each test call."""

    def __init__(self) -> None:
        self.withheld = False
        self.every_phase = _hide_in_every_phase()

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: "pytest.Item | None") -> object:
        if not self.withheld:
            self.withheld = True
            self._withhold(item.session)
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> object:
        saved = os.environ.get(VARIABLE)
        if saved is not None:
            os.environ[VARIABLE] = STAND_IN.format("call")
        yield
        if saved is not None and VARIABLE in os.environ:
            os.environ[VARIABLE] = saved

    def _withhold(self, session: pytest.Session) -> None:
        try:
            removed, failed = withhold(session, TREE)
        except Exception as exc:  # said in the report: the audit is then inconclusive, never a pass
            removed, failed = 0, [f"{type(exc).__name__}: {exc}"]
        line = "withheld={} failed={} every_phase={} {}\n".format(
            removed, len(failed), int(self.every_phase), "; ".join(failed)[:500])
        here = os.path.dirname(os.path.abspath(__file__))
        try:
            with open(os.path.join(here, REPORT_PREFIX + str(os.getpid())), "w") as report:
                report.write(line)
        except OSError:
            pass  # no report: the audit says the plugin was not seen


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(Audit(), PLUGIN_NAME)
