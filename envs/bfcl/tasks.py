"""BFCL's data as task sources: the categories' entries with their possible answers, split
by a fixed hash of BFCL's id."""

from __future__ import annotations

import functools
import json
import zlib
from typing import Any, Sequence

from trace_gym.envs.bfcl.vendor import _BFCL_NAME, MULTI_TURN_CATEGORIES, SINGLE_TURN_CATEGORIES, require_bfcl
from trace_gym.task import Split, Task

__all__ = ["BFCLMultiTurnTasks", "BFCLTasks", "load_category", "multi_turn_function_docs"]

def _read_jsonl(path: Any) -> list[dict[str, Any]]:
    with path.open("r", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=None)
def load_category(category: str) -> tuple[tuple[dict[str, Any], Any], ...]:
    """BFCL's entries of one category, each paired with its possible answer (``None`` for
    irrelevance), in BFCL's order. Read once per process."""
    if category not in SINGLE_TURN_CATEGORIES + MULTI_TURN_CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; choose from {SINGLE_TURN_CATEGORIES + MULTI_TURN_CATEGORIES}")
    bfcl = require_bfcl()
    name = _BFCL_NAME.get(category, category)
    prompt_file = bfcl.data_dir / f"{bfcl.VERSION_PREFIX}_{name}.json"
    entries = _read_jsonl(prompt_file)
    if category == "irrelevance":
        return tuple((e, None) for e in entries)
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(bfcl.data_dir / "possible_answer" / prompt_file.name)}
    missing = [e["id"] for e in entries if e["id"] not in answers]
    if missing:
        raise ValueError(f"BFCL data is inconsistent: no possible answer for {missing[:3]}")
    return tuple((e, answers[e["id"]]) for e in entries)


@functools.lru_cache(maxsize=None)
def multi_turn_function_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """The function docs BFCL shows a model for one API simulator class."""
    bfcl = require_bfcl()
    return tuple(_read_jsonl(bfcl.data_dir / "multi_turn_func_doc" / bfcl.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]))


def _split_of(bfcl_id: str) -> Split:
    # A fixed hash of BFCL's id: the same task always lands in the same split (70/10/20).
    bucket = zlib.crc32(bfcl_id.encode()) % 10
    return "test" if bucket < 2 else "validation" if bucket == 2 else "train"


def _user_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages)


class BFCLTasks:
    """BFCL's single-turn tasks of the chosen categories as a :class:`~trace_gym.task.TaskSource`.

    Each BFCL entry is assigned to a split by a fixed hash of its id (70% train, 10% validation,
    20% test). A task's id is ``"bfcl/<BFCL id>"``; its ``metadata`` holds ``bfcl_id``,
    ``category`` and ``functions`` (BFCL's raw docs, what the checker reads); ``ground_truth`` is
    BFCL's possible answer (``None`` for irrelevance).
    """

    def __init__(self, categories: Sequence[str] = SINGLE_TURN_CATEGORIES):
        unknown = [c for c in categories if c not in SINGLE_TURN_CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"unknown BFCL categories {unknown or list(categories)}; choose from {SINGLE_TURN_CATEGORIES}")
        self.categories = tuple(categories)
        self._tasks: dict[str, list[Task]] = {"train": [], "validation": [], "test": []}
        self._by_id: dict[str, Task] = {}
        for category in self.categories:
            for entry, answer in load_category(category):
                split = _split_of(entry["id"])
                task = Task(
                    id=f"bfcl/{entry['id']}",
                    prompt=_user_text(entry["question"][0]),
                    ground_truth=answer,
                    metadata={"bfcl_id": entry["id"], "category": category, "functions": entry["function"]},
                    split=split,
                )
                self._tasks[split].append(task)
                self._by_id[task.id] = task

    def get(self, index: int, split: Split = "train") -> Task:
        """The ``index``-th task of ``split`` (BFCL's order, categories concatenated)."""
        tasks = self._tasks[split]
        if not 0 <= index < len(tasks):
            raise IndexError(f"BFCL {split} split has {len(tasks)} tasks; index {index} is out of range")
        return tasks[index]

    def size(self, split: Split = "train") -> int:
        """Number of tasks in ``split``."""
        return len(self._tasks[split])

    def by_id(self, task_id: str) -> Task:
        """Look a task up by its id (``bfcl/<BFCL id>``) or by BFCL's id."""
        task = self._by_id.get(task_id) or self._by_id.get(f"bfcl/{task_id}")
        if task is None:
            raise KeyError(f"no BFCL task with id {task_id!r} in categories {self.categories}")
        return task

    def all(self) -> list[Task]:
        """Every task, all splits."""
        return list(self._by_id.values())


class BFCLMultiTurnTasks(BFCLTasks):
    """BFCL's ``multi_turn_base`` tasks. ``prompt`` is the first user message;
    ``metadata["user_turns"]`` all of them; ``initial_config`` and ``involved_classes`` set up
    the simulators; ``ground_truth`` is BFCL's call sequence per user turn."""

    def __init__(self, categories: Sequence[str] = MULTI_TURN_CATEGORIES):
        unknown = [c for c in categories if c not in MULTI_TURN_CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"unknown BFCL multi-turn categories {unknown or list(categories)}; choose from {MULTI_TURN_CATEGORIES}")
        self.categories = tuple(categories)
        self._tasks = {"train": [], "validation": [], "test": []}
        self._by_id = {}
        for category in self.categories:
            for entry, answer in load_category(category):
                split = _split_of(entry["id"])
                turns = [_user_text(t) for t in entry["question"]]
                task = Task(
                    id=f"bfcl/{entry['id']}",
                    prompt=turns[0],
                    ground_truth=answer,
                    metadata={
                        "bfcl_id": entry["id"],
                        "category": category,
                        "user_turns": turns,
                        "initial_config": entry.get("initial_config", {}),
                        "involved_classes": list(entry["involved_classes"]),
                    },
                    split=split,
                )
                self._tasks[split].append(task)
                self._by_id[task.id] = task


@functools.lru_cache(maxsize=None)
def _task_source(kind: str, categories: tuple[str, ...]) -> BFCLTasks:
    return BFCLMultiTurnTasks(categories) if kind == "multi" else BFCLTasks(categories)


def _categories(category: str | Sequence[str] | None, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if category is None or category == "all":
        return allowed
    cats = (category,) if isinstance(category, str) else tuple(category)
    bad = [c for c in cats if c not in allowed]
    if bad or not cats:
        raise ValueError(f"unknown BFCL category {bad or list(cats)}; choose from {allowed} or 'all'")
    return cats
