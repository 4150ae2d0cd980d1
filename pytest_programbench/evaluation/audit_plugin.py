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

Only the tests the audit drew run (``PB_AUDIT_SELECT``: their JUnit names, one a line): the others are deselected
at collection, the same way in every process; when none can be matched every test runs, and the report says so
(``selected=all``), so the audit compares them all.

And in every process that loads it, from the moment it loads: every module the process loads from the submission's
files (under :data:`WORKSPACE`, outside the tests' tree), whatever its name, is measured from the process itself: an
audit hook (``sys.addaudithook``: it cannot be removed) sees each importable file opened and each module's code run;
at load and at the session's end, the loaded modules, the functions alive in the process (a module that took itself
out of ``sys.modules`` still has them) and the shared objects mapped into it are looked through. Each is reported the
moment it is seen, before the module's own code runs.

Reports go to one file, appended line by line (one ``write`` each: processes and xdist workers share it): the path in
``PB_AUDIT_REPORT`` (the harness makes it outside the plugin's read-only directory), else ``report`` beside this
file. ``loaded pid=N`` when the plugin loads; ``withheld=... failed=... every_phase=...`` right before a process's
first test (what it withheld, whether the variable is replaced in every phase or only around the test function);
``imported "<path>"`` for each module from the submission's files. The audit reads it to know the plugin was active
and what the test processes imported.
"""

import contextlib
import gc
import json
import os
import shutil
import sys
import types

import pytest

try:
    from _pytest import runner as _runner
except ImportError:  # every pytest has it; the wrapper around the test function still hides the variable then
    _runner = None  # type: ignore[assignment]
try:
    from _pytest.junitxml import mangle_test_address
except ImportError:  # without it no test can be named as the JUnit file names it: every test runs (SELECTED_ALL)
    mangle_test_address = None  # type: ignore[assignment]

TREE = "/workspace/eval"  # the harness rewrites this line with the hidden tests' tree (audit.plugin_source)
VARIABLE = "PYTEST_CURRENT_TEST"
STAND_IN = "tests/test_hidden.py::test_hidden ({})"  # pytest's shape: "<node id> (<phase>)"
WORKSPACE = os.path.dirname(TREE)  # the submission's files: a module loaded from here (outside TREE) is reported
REPORT_VARIABLE = "PB_AUDIT_REPORT"
SELECT_VARIABLE = "PB_AUDIT_SELECT"  # a file of the tests to run (JUnit names, without a leading "eval."), one a line
SELECTED_ALL = "all"
REPORT_NAME = "report"
MODULE_PREFIX = "pb_audit_"  # the name the harness loads this file under
PLUGIN_NAME = "pytest-programbench-audit"
HERE = os.path.dirname(os.path.realpath(__file__))
IMPORTABLE = (".py", ".pyc", ".pyo", ".so", ".pyd")  # what the import system opens or maps
SHOW_IMPORTS = 50  # paths reported per process (the rest are counted by the audit as "more")


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


def _report_path() -> str:
    return os.environ.get(REPORT_VARIABLE) or os.path.join(os.path.dirname(os.path.abspath(__file__)), REPORT_NAME)


class Report:
    """The report file, opened once and appended to (one ``os.write`` per line: no audit event, atomic between the
    processes that share it)."""

    def __init__(self, path: str) -> None:
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            self.fd = -1  # no report: the audit says the plugin was not seen

    def write(self, line: str) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.fd, line.encode("utf-8", "backslashreplace"))


def _outside_the_tests(path: str) -> bool:
    """Whether ``path`` names a file of the submission's (under WORKSPACE) that is neither the tests' (under TREE)
    nor this plugin's."""
    for form in (os.path.normpath(path), os.path.realpath(path)):
        if (form.startswith(WORKSPACE + os.sep) and not (form + os.sep).startswith(TREE + os.sep)
                and os.path.dirname(form) != HERE):
            return True
    return False


class ImportWatch:
    """The audit hook: reports each module file of the submission's that this process opens, maps or runs."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.checked: set[str] = set()  # every path looked at once (the hook runs for every module's code)
        self.reported = 0
        self.busy = False  # the hook's own work raises events too

    def __call__(self, event: str, args: "tuple[object, ...]") -> None:
        if event == "open" and args:
            path = args[0]
            mode = args[1] if len(args) > 1 else None
            if isinstance(mode, str) and any(c in mode for c in "wax+"):
                return
        elif event == "exec" and args:
            path = getattr(args[0], "co_filename", None)  # a module's code, run by the import system or exec()
        else:
            return
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if isinstance(path, str) and (event == "exec" or path.endswith(IMPORTABLE)):
            self.saw(path)

    def saw(self, path: str) -> None:
        if self.busy or path in self.checked or self.reported >= SHOW_IMPORTS or path.startswith("<"):
            return  # "<frozen os>", "<string>": code from no file
        self.busy = True
        try:
            self.checked.add(path)
            absolute = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
            if _outside_the_tests(absolute):
                self.reported += 1
                self.report.write(f"imported {json.dumps(absolute)}\n")
        except Exception:  # noqa: S110 - never the reason a test fails (a path it cannot look at is not reported)
            pass
        finally:
            self.busy = False

    def look_through(self) -> None:
        """Modules, functions and mapped shared objects already in the process."""
        for module in list(sys.modules.values()):
            source = getattr(module, "__file__", None)
            if isinstance(source, str):
                self.saw(source)
        for thing in gc.get_objects():
            if isinstance(thing, types.FunctionType):
                self.saw(thing.__code__.co_filename)
            elif isinstance(thing, types.ModuleType):
                source = getattr(thing, "__file__", None)
                if isinstance(source, str):
                    self.saw(source)
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].strip().endswith(IMPORTABLE):
                        self.saw(fields[5].strip())
        except OSError:
            pass


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
        _REPORT.write(line)


def junit_name(nodeid: str) -> str:
    """The name the JUnit file gives a test (``classname.name``, as the official parser joins them), without a
    leading ``eval.``."""
    full = ".".join(mangle_test_address(nodeid))
    return full[len("eval."):] if full.startswith("eval.") else full


def _selection() -> "set[str] | None":
    path = os.environ.get(SELECT_VARIABLE)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as chosen:
            return {line.strip() for line in chosen if line.strip()}
    except OSError:
        return None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: "list[pytest.Item]") -> None:
    """Only the tests the audit drew run (the same in every process: each collects the same items); when none of them
    can be matched, every test runs (the audit then compares them all: it costs more, it never sees less)."""
    wanted = _selection()
    if wanted is None:
        return
    chosen = [mangle_test_address is not None and junit_name(item.nodeid) in wanted for item in items]
    kept = [item for item, keep in zip(items, chosen) if keep]  # noqa: B905 - Python 3.6+ here: no strict=
    if not kept:
        _REPORT.write(f"selected={SELECTED_ALL} of={len(items)}\n")
        return
    dropped = [item for item, keep in zip(items, chosen) if not keep]  # noqa: B905 - as above
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)
    _REPORT.write(f"selected={len(kept)} of={len(kept) + len(dropped)}\n")


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(Audit(), PLUGIN_NAME)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _WATCH.look_through()  # what loaded since, by a way the hook does not see (an extension module)


def _start() -> ImportWatch:
    """The report opened and the watch installed: an audit hook is process-wide by nature and cannot be removed,
    which is the point (a module loaded later cannot switch the measure off)."""
    report = Report(_report_path())
    watch = ImportWatch(report)
    report.write(f"loaded pid={os.getpid()}\n")
    watch.look_through()  # what loaded before this plugin (an xdist worker imports its optional modules first)
    sys.addaudithook(watch)
    return watch


# Only where pytest loads this file as the audit's plugin (``pb_audit_<token>``), from the moment it does; never in
# the harness, which imports it as a module of its package for its names.
if __name__.startswith(MODULE_PREFIX):
    _WATCH = _start()
    _REPORT = _WATCH.report
