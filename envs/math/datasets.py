"""GSM8K/MATH data for the math envs: loading through ``datasets`` (hub or local files) and
row-backed task sources.

:func:`load_rows` loads the hub dataset, or local files of the same schema given as
``data_files=`` (or ``path=``); offline without them it raises
:class:`~trace_gym.env.base.EnvUnavailable` saying how to pass them.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from trace_gym.env.base import EnvUnavailable
from trace_gym.task import Split, Task

__all__ = ["gsm8k_answer", "load_rows"]

_DATA_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_ROWS_CACHE: dict[Any, dict[str, list[dict[str, Any]]]] = {}


def _freeze(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return str(x)


def _builder_for(data_files: Any) -> str:
    files = list(data_files.values()) if isinstance(data_files, dict) else [data_files]
    flat = [f for x in files for f in (x if isinstance(x, (list, tuple)) else [x])]
    kinds = {_DATA_EXTENSIONS.get(os.path.splitext(str(f))[1].lower()) for f in flat}
    if len(kinds) != 1 or None in kinds:
        raise ValueError(f"data_files must all be one of {sorted(_DATA_EXTENSIONS)}; got {flat!r}")
    return kinds.pop()  # type: ignore[return-value]


def load_rows(env_name: str, hub_path: str, hub_config: str | None, *, path: str | None = None,
              name: str | None = None, data_files: Any = None, fields: tuple[str, ...] = ()) -> dict[str, list[dict[str, Any]]]:
    """Rows of a dataset by split, through ``datasets``.

    ``data_files`` (a file, a list, or ``{split: files}``; JSONL, JSON, CSV or Parquet) or a
    local ``path`` are used as given; otherwise the hub dataset ``hub_path``/``hub_config``
    is loaded, and when that fails (offline, ``HF_HUB_OFFLINE=1``) :class:`EnvUnavailable`
    says how to pass local files with ``fields``.
    """
    key = (hub_path, path, name, _freeze(data_files))
    if key in _ROWS_CACHE:
        return _ROWS_CACHE[key]
    try:
        import datasets
    except ImportError as exc:
        raise EnvUnavailable(f"{env_name} needs the 'datasets' package: pip install 'trace-gym[datasets]'") from exc
    if data_files is None and path is not None and os.path.isfile(path):
        data_files, path = path, None
    schema = f"with the fields {', '.join(fields)}" if fields else "of the same schema"
    try:
        if data_files is not None:
            ds = datasets.load_dataset(_builder_for(data_files), data_files=data_files)
        else:
            config = name if name is not None else (hub_config if path is None else None)
            ds = datasets.load_dataset(path or hub_path, config)
    except Exception as exc:  # offline, unreachable, unknown dataset: connection errors come in many types
        if data_files is not None:
            raise
        raise EnvUnavailable(
            f"{env_name}: the dataset {path or hub_path!r} could not be loaded ({type(exc).__name__}); offline, pass "
            f"local files {schema} with data_files='file.jsonl' (or {{'train': ..., 'test': ...}}) or path='dir'. "
            f"Cause: {str(exc)[:300]}"
        ) from exc
    rows = {str(split): [dict(r) for r in ds[split]] for split in ds}
    missing = sorted({f for split_rows in rows.values() for r in split_rows[:1] for f in fields if f not in r})
    if missing:
        raise ValueError(f"{env_name}: the data lacks the field(s) {missing}; expected rows {schema}")
    _ROWS_CACHE[key] = rows
    return rows


class _RowTasks:
    """Tasks from dataset rows: ``get(i, split)`` is row ``i`` of ``split``. Datasets without a
    validation split get one carved from the end of train (``min(500, 10%)`` rows)."""

    def __init__(self, env_name: str, rows: dict[str, list[dict[str, Any]]], to_task: Callable[[dict[str, Any], str, int], Task],
                 keep: Callable[[dict[str, Any]], bool] | None = None):
        rows = {k: [r for r in v if keep is None or keep(r)] for k, v in rows.items()}
        if "validation" not in rows and "train" in rows:
            n_val = min(500, len(rows["train"]) // 10)
            if n_val:
                rows["validation"], rows["train"] = rows["train"][-n_val:], rows["train"][:-n_val]
        self.env_name, self.rows, self.to_task = env_name, rows, to_task

    def size(self, split: Split = "train") -> int:
        """Rows in ``split`` (0 when the data has no such split)."""
        return len(self.rows.get(split, ()))

    def get(self, index: int, split: Split = "train") -> Task:
        """The task of row ``index`` of ``split``."""
        if split not in self.rows:
            raise KeyError(f"{self.env_name}: the data has no {split!r} split (it has {sorted(self.rows)})")
        rows = self.rows[split]
        if not 0 <= index < len(rows):
            raise IndexError(f"{self.env_name}: index {index} out of range for {split!r} ({len(rows)} tasks)")
        return self.to_task(rows[index], split, index)


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution (after ``####``), without thousands separators."""
    tail = solution.rsplit("####", 1)[-1].strip()
    return tail.replace(",", "").replace("$", "").strip()


def _math_level(row: dict[str, Any]) -> int | None:
    m = re.search(r"\d+", str(row.get("level", "")))
    return int(m.group()) if m else None
