"""Step 1 of the pipeline: the task catalogue.

The 200 benchmark tasks come from the official ``programbench`` package; ``--pb-tasks-dir`` adds tasks in the same
on-disk layout. Collection reads only ``task.yaml`` (cheap); ``tests.json`` is read when an item runs.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.core.cache import cache_dir

FIXTURE_PREFIX = "testorg__"

# Canonical language names; task.yaml uses the short forms (rs, hs).
LANGUAGE_ALIASES: Mapping[str, str] = {
    "rs": "rust", "rust": "rust", "hs": "haskell", "haskell": "haskell", "c": "c", "cpp": "cpp", "c++": "cpp",
    "go": "go", "golang": "go", "java": "java",
}
CORE_LANGUAGES = ("c", "cpp", "go", "rust", "haskell", "java")
DIFFICULTIES = ("easy", "medium", "hard", "unset")


class CatalogueError(Exception):
    """A task on disk that cannot be read: names the file and the field."""


def canonical_language(raw: str) -> str:
    lowered = raw.strip().lower()
    return LANGUAGE_ALIASES.get(lowered, lowered)


@dataclass(frozen=True)
class Task:
    """One ProgramBench task as the plugin sees it. Plain data: cheap to build for 200 tasks at collection."""

    instance_id: str
    language: str
    difficulty: str
    image_name: str
    task_dir: Path
    packaged: bool
    overridden: bool = False
    eval_clean_hashes: tuple[str, ...] = ()
    repository: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_fixture(self) -> bool:
        return self.instance_id.startswith(FIXTURE_PREFIX)

    @property
    def dockerfile(self) -> Path | None:
        path = self.task_dir / "Dockerfile"
        return path if path.is_file() else None

    def load_instance(self) -> dict[str, Any]:
        """The official instance dict, tests.json included (what ``load_all_instances`` gives)."""
        instance = dict(self.raw)
        tests_file = self.task_dir / "tests.json"
        if tests_file.exists():
            try:
                data = json.loads(tests_file.read_text())
            except (OSError, ValueError) as exc:
                raise CatalogueError(f"{tests_file}: not valid JSON ({exc})") from exc
            if not isinstance(data, dict) or not isinstance(data.get("branches", {}), dict):
                raise CatalogueError(f"{tests_file}: field 'branches' must be a mapping of branch -> info")
            instance.update(data)
        instance.setdefault("branches", {})
        for branch, info in instance["branches"].items():
            if not isinstance(info, dict) or not isinstance(info.get("tests", []), list):
                raise CatalogueError(f"{tests_file}: branch {branch!r} needs a 'tests' list")
        return instance


def _task_from_config(config: Mapping[str, Any], task_dir: Path, *, packaged: bool) -> Task:
    from programbench.constants import image_name_from_instance_id  # noqa: PLC0415 - lazy: programbench, kept out of the entry point

    yaml_path = task_dir / "task.yaml"
    language = config.get("language")
    if not isinstance(language, str) or not language.strip():
        raise CatalogueError(f"{yaml_path}: field 'language' is missing or not a string")
    difficulty = config.get("difficulty")
    if difficulty is None:
        difficulty = "unset"
    if not isinstance(difficulty, str) or difficulty not in DIFFICULTIES:
        raise CatalogueError(f"{yaml_path}: field 'difficulty' is {difficulty!r}; expected one of "
                             f"{', '.join(d for d in DIFFICULTIES if d != 'unset')} or absent")
    hashes = config.get("eval_clean_hashes") or []
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        raise CatalogueError(f"{yaml_path}: field 'eval_clean_hashes' must be a list of sha256 strings")
    instance_id = task_dir.name
    raw = {**config, "instance_id": instance_id, "image_name": image_name_from_instance_id(instance_id)}
    return Task(
        instance_id=instance_id,
        language=canonical_language(language),
        difficulty=difficulty,
        image_name=raw["image_name"],
        task_dir=task_dir,
        packaged=packaged,
        eval_clean_hashes=tuple(hashes),
        repository=str(config.get("repository", "")),
        raw=raw,
    )


def _read_task_yaml(task_dir: Path) -> dict[str, Any]:
    yaml_path = task_dir / "task.yaml"
    try:
        config = yaml.load(yaml_path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogueError(f"{yaml_path}: cannot be read as YAML ({exc})") from exc
    if not isinstance(config, dict):
        raise CatalogueError(f"{yaml_path}: expected a mapping of fields, got {type(config).__name__}")
    return config


def load_tasks_dir(root: Path) -> list[Task]:
    """Tasks in the official layout under ``root`` (``<id>/task.yaml``)."""
    dirs = sorted(d for d in root.iterdir() if d.is_dir() and (d / "task.yaml").is_file())
    return [_task_from_config(_read_task_yaml(d), d, packaged=False) for d in dirs]


@functools.cache
def _packaged_instances() -> tuple[dict[str, Any], ...]:
    from programbench.constants import TASKS_DIR  # noqa: PLC0415 - lazy: programbench, kept out of the entry point
    from programbench.utils.load_data import load_all_instances  # noqa: PLC0415 - lazy: programbench, kept out of the entry point

    return tuple(PackagedCopy(cache_dir("catalogue"), TASKS_DIR).load(
        lambda: load_all_instances(TASKS_DIR, include_tests=False)))


@dataclass(frozen=True)
class PackagedCopy:
    """The packaged tasks as programbench's loader read them, kept as JSON in the plugin's cache under a signature of
    every ``task.yaml`` (name, size, mtime): a session and each xdist worker start without parsing 200 YAML files
    (0.1 s). A missing, changed, unreadable or oversized copy is never trusted: the official loader reads the tasks
    again, and its answer is kept only when JSON gives it back equal."""

    directory: Path
    tasks_dir: Path
    max_bytes: int = 8 << 20

    def signature(self) -> str:
        digest = hashlib.sha256(f"{version('programbench')}\0{self.tasks_dir}".encode())
        for task_dir in sorted(self.tasks_dir.iterdir()):
            try:
                stat = (task_dir / "task.yaml").stat()
            except OSError:
                continue
            digest.update(f"\0{task_dir.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
        return digest.hexdigest()[:32]

    def load(self, official: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        path = self.directory / f"packaged-{self.signature()}.json"
        kept = self._read(path)
        if kept is not None:
            return kept
        instances = official()
        try:
            text = json.dumps(instances)
            if json.loads(text) == instances and len(text) <= self.max_bytes:
                atomic_write_text(path, text)
                for stale in self.directory.glob("packaged-*.json"):  # another programbench's, or edited tasks'
                    if stale != path:
                        stale.unlink(missing_ok=True)
        except (OSError, TypeError, ValueError):
            pass  # a value JSON cannot hold, or a cache that cannot be written: the official read stands alone
        return instances

    def _read(self, path: Path) -> list[dict[str, Any]] | None:
        try:
            with path.open("rb") as handle:
                raw = handle.read(self.max_bytes + 1)
            data = json.loads(raw) if len(raw) <= self.max_bytes else None
        except (OSError, ValueError):
            return None
        if not isinstance(data, list) or not all(isinstance(i, dict) and isinstance(i.get("instance_id"), str)
                                                 for i in data):
            return None
        return data


def packaged_instances() -> list[dict[str, Any]]:
    """The tasks packaged in programbench, as its loader reads them (task.yaml, no tests), read once per process:
    the catalogue and the summary's benchmark ids both need them (0.1-0.2 s a read). Copies: no caller can change
    another's."""
    return copy.deepcopy(list(_packaged_instances()))


def load_packaged() -> list[Task]:
    from programbench.constants import TASKS_DIR  # noqa: PLC0415 - lazy: programbench, kept out of the entry point

    return [_task_from_config(i, TASKS_DIR / i["instance_id"], packaged=True) for i in packaged_instances()]


@dataclass(frozen=True)
class Catalogue:
    tasks: tuple[Task, ...]

    @classmethod
    def load(cls, tasks_dirs: Iterable[str | Path] = (), *, include_fixtures: bool = False) -> Catalogue:
        by_id: dict[str, Task] = {}
        for task in load_packaged():
            if task.is_fixture and not include_fixtures:
                continue
            by_id[task.instance_id] = task
        for root in tasks_dirs:
            for task in load_tasks_dir(Path(root)):
                replaced = by_id.get(task.instance_id)
                overridden = replaced is not None and replaced.packaged
                by_id[task.instance_id] = replace(task, overridden=True) if overridden else task
        return cls(tuple(sorted(by_id.values(), key=lambda t: t.instance_id)))

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(sorted({*CORE_LANGUAGES, *(t.language for t in self.tasks)}))

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)
