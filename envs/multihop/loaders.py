"""HotpotQA, 2WikiMultiHopQA and MuSiQue as MultiHopQA task sources.

Each record becomes a :class:`~trace_gym.task.Task` whose metadata holds the record's
paragraphs, so an episode can search them with a per-question bm25s index (the distractor
setting: the question's own 10-20 paragraphs) or with one global index over every paragraph
of the loaded split (``index="global"``).

Records come from local files in the datasets' published JSON schemas (``data_files=``:
a ``.json`` list or a ``.jsonl`` file, or ``{"train": ..., "validation": ...}``), or, when
the Hugging Face Hub is reachable and the ``datasets`` extra is installed, from the Hub.
Offline without local files the source raises :class:`DatasetUnavailableError` saying which
file to pass.

Schemas read (both the original JSON and the Hub's column form, where they differ):

* HotpotQA (distractor): ``_id``/``id``, ``question``, ``answer``, ``type``, ``level``,
  ``supporting_facts`` (``[[title, sent_id], ...]`` or ``{"title": [...], "sent_id": [...]}``),
  ``context`` (``[[title, [sentences]], ...]`` or ``{"title": [...], "sentences": [[...]]}``).
* 2WikiMultiHopQA: ``_id``, ``question``, ``answer``, ``type``, ``context``,
  ``supporting_facts`` (as HotpotQA), ``evidences`` (``[[subject, relation, object], ...]``).
* MuSiQue: ``id``, ``question``, ``answer``, ``answer_aliases``, ``answerable``,
  ``paragraphs`` (``[{"idx", "title", "paragraph_text", "is_supporting"}]``),
  ``question_decomposition`` (``[{"id", "question", "answer", "paragraph_support_idx"}]``).
"""

from __future__ import annotations

import json
import os
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trace_gym.env.base import EnvUnavailable
from trace_gym.envs.retrieval import BM25Index, Passage
from trace_gym.task import Split, Task

QUESTION_PROMPT = (
    "Answer the question below. Use the search tool to look facts up, one search per turn. "
    "Finish with the short answer alone (a name, a year, or yes/no) inside <answer>...</answer>.\n\n"
    "Question: {question}"
)


class DatasetUnavailableError(EnvUnavailable):
    """The dataset cannot be loaded here (offline, or the ``datasets`` extra is missing); an
    :class:`~trace_gym.env.base.EnvUnavailable`, so registry walks skip the env visibly."""


def passage_id(title: str, text: str) -> str:
    """A stable id for a paragraph: its title and a checksum of its text (titles repeat in MuSiQue)."""
    return f"{title}|{zlib.crc32(text.encode()):08x}"


def _pairs(field: Any, key_a: str, key_b: str) -> list[tuple[Any, Any]]:
    """``[[a, b], ...]`` or the Hub's ``{key_a: [...], key_b: [...]}`` as a list of pairs."""
    if isinstance(field, dict):
        return list(zip(field.get(key_a, []), field.get(key_b, [])))
    return [(item[0], item[1]) for item in field or []]


def _paragraph(title: str, text: str) -> dict[str, str]:
    return {"id": passage_id(title, text), "title": title, "text": text}


def _wiki_record(record: dict[str, Any], source: str) -> dict[str, Any]:
    """HotpotQA and 2WikiMultiHopQA share the context/supporting_facts layout."""
    paragraphs = []
    for title, sentences in _pairs(record["context"], "title", "sentences"):
        text = " ".join(s.strip() for s in sentences if s.strip())
        paragraphs.append(_paragraph(str(title), text))
    by_title = {p["title"]: p["id"] for p in paragraphs}
    supporting: list[str] = []
    for title, _ in _pairs(record["supporting_facts"], "title", "sent_id"):
        pid = by_title.get(title)
        if pid is not None and pid not in supporting:
            supporting.append(pid)
    out = {
        "id": str(record.get("_id", record.get("id"))),
        "question": record["question"],
        "answers": [record["answer"]],
        "type": record.get("type", ""),
        "paragraphs": paragraphs,
        "supporting": supporting,
        "hops": max(2, len(supporting)),
    }
    if source == "hotpotqa":
        out["level"] = record.get("level", "")
    if "evidences" in record:
        out["evidences"] = [list(e) for e in record["evidences"]]
    return out


def _musique_record(record: dict[str, Any], source: str) -> dict[str, Any]:
    paragraphs = [_paragraph(p["title"], p["paragraph_text"]) for p in record["paragraphs"]]
    by_idx = {p["idx"]: paragraphs[j]["id"] for j, p in enumerate(record["paragraphs"])}
    supporting: list[str] = []
    for step in record.get("question_decomposition", []):  # the chain's order, for demonstrations
        pid = by_idx.get(step.get("paragraph_support_idx"))
        if pid is not None and pid not in supporting:
            supporting.append(pid)
    for j, p in enumerate(record["paragraphs"]):
        if p.get("is_supporting") and paragraphs[j]["id"] not in supporting:
            supporting.append(paragraphs[j]["id"])
    aliases = [a for a in record.get("answer_aliases", []) if a and a != record["answer"]]
    return {
        "id": str(record["id"]),
        "question": record["question"],
        "answers": [record["answer"], *aliases],
        "type": str(record["id"]).split("__")[0],
        "paragraphs": paragraphs,
        "supporting": supporting,
        "hops": max(2, len(record.get("question_decomposition", [])) or len(supporting)),
        "answerable": bool(record.get("answerable", True)),
    }


# name: (record converter, Hub id, Hub config, Hub split names)
DATASETS: dict[str, tuple[Callable[[dict[str, Any], str], dict[str, Any]], str, str | None, dict[str, str]]] = {
    "hotpotqa": (_wiki_record, "hotpotqa/hotpot_qa", "distractor", {"train": "train", "validation": "validation"}),
    "2wikimultihopqa": (_wiki_record, "xanhho/2WikiMultihopQA", None, {"train": "train", "validation": "dev", "test": "test"}),
    "musique": (_musique_record, "dgslibisey/MuSiQue", None, {"train": "train", "validation": "validation"}),
}


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a local file: a JSON list (the official releases) or JSON lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dataset file at {path}")
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records")
        return data
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
    return records


def _hub_records(name: str, split: str) -> list[dict[str, Any]]:
    _, hub_id, config, splits = DATASETS[name]
    hint = f"pass data_files=<local {name} file in its official JSON schema>"
    if split not in splits:
        raise DatasetUnavailableError(f"{name} has no {split!r} split on the Hub ({', '.join(splits)}); {hint}")
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        raise DatasetUnavailableError(f"{name}: the Hugging Face Hub is off (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE); {hint}")
    try:
        import datasets  # the `datasets` extra
    except ImportError:
        raise DatasetUnavailableError(f"{name}: loading from the Hub needs `pip install trace-gym[datasets]`; or {hint}") from None
    try:
        ds = datasets.load_dataset(hub_id, config, split=splits[split])
    except Exception as exc:  # network, auth, or a renamed dataset: say what to do instead
        raise DatasetUnavailableError(f"{name}: cannot load {hub_id!r} from the Hub ({type(exc).__name__}: {exc}); {hint}") from exc
    return [dict(row) for row in ds]


class QADatasetSource:
    """A multi-hop QA dataset as a task source.

    ``name`` is one of :data:`DATASETS`; ``data_files`` a local file (used for any split) or a
    ``{split: file}`` dict; without it the Hub is used. ``index`` is ``"question"`` (each
    episode searches its own paragraphs) or ``"global"`` (every paragraph of the split).
    Unanswerable MuSiQue records are skipped.
    """

    def __init__(self, name: str, *, data_files: str | Path | dict[str, str | Path] | None = None, index: str = "question"):
        if name not in DATASETS:
            raise ValueError(f"unknown dataset {name!r}; expected one of {sorted(DATASETS)}")
        if index not in ("question", "global"):
            raise ValueError(f"index must be 'question' or 'global', got {index!r}")
        self.name = name
        self.data_files = data_files
        self.index_mode = index
        self._records: dict[str, list[dict[str, Any]]] = {}
        self._global: dict[str, BM25Index] = {}
        self._per_question: OrderedDict[str, BM25Index] = OrderedDict()

    def records(self, split: Split) -> list[dict[str, Any]]:
        """The converted records of ``split`` (loaded on first use)."""
        if split not in self._records:
            convert = DATASETS[self.name][0]
            if self.data_files is None:
                raw = _hub_records(self.name, split)
            else:
                files = self.data_files if isinstance(self.data_files, dict) else {split: self.data_files}
                if split not in files:
                    raise DatasetUnavailableError(f"{self.name}: no file for split {split!r} in data_files ({sorted(files)})")
                raw = read_records(files[split])
            try:
                recs = [convert(r, self.name) for r in raw]
            except (KeyError, TypeError, IndexError) as exc:
                raise ValueError(f"{self.name}: a record does not follow the {self.name} schema ({type(exc).__name__}: {exc})") from None
            self._records[split] = [r for r in recs if r.get("answerable", True)]
        return self._records[split]

    def size(self, split: Split = "train") -> int:
        """Number of answerable records in ``split``."""
        return len(self.records(split))

    def get(self, index: int, split: Split = "train") -> Task:
        """Record ``index`` of ``split`` as a task."""
        recs = self.records(split)
        if not 0 <= index < len(recs):
            raise IndexError(f"{self.name} {split}: index {index} out of range (size {len(recs)})")
        r = recs[index]
        by_id = {p["id"]: p for p in r["paragraphs"]}
        steps = [{"query": by_id[pid]["title"], "passage_id": pid, "title": by_id[pid]["title"],
                  "need": f"what the {by_id[pid]['title']} article says", "fact": ""} for pid in r["supporting"]]
        meta = {k: v for k, v in r.items() if k not in ("id", "answers", "question")}
        meta.update(source=self.name, question=r["question"], steps=steps)
        return Task(id=f"{self.name}/{split}/{index}", prompt=QUESTION_PROMPT.format(question=r["question"]),
                    ground_truth={"answers": r["answers"], "candidates": []}, metadata=meta, split=split)

    def index_for(self, task: Task) -> BM25Index:
        """The index an episode of ``task`` searches."""
        if self.index_mode == "global":
            if task.split not in self._global:
                seen: dict[str, Passage] = {}
                for r in self.records(task.split):
                    for p in r["paragraphs"]:
                        seen.setdefault(p["id"], Passage(p["id"], p["title"], p["text"]))
                self._global[task.split] = BM25Index(seen.values())
            return self._global[task.split]
        idx = self._per_question.get(task.id)
        if idx is None:
            paragraphs = task.metadata.get("paragraphs") or []
            idx = BM25Index(Passage(p["id"], p["title"], p["text"]) for p in paragraphs)
            self._per_question[task.id] = idx
            if len(self._per_question) > 256:  # small indexes are cheap to rebuild
                self._per_question.popitem(last=False)
        else:
            self._per_question.move_to_end(task.id)
        return idx
