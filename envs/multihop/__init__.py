"""``trace_gym/MultiHopQA-v0``: multi-hop question answering with a search tool.

An episode poses one question; each turn the policy either calls
``search(query)`` (the top-``topk`` passages come back, Search-R1's ``Doc i(Title: t) text``
layout) or answers with ``<answer>...</answer>``. Reward is exact match with the SQuAD/HotpotQA
normalisation (``reward="em"``, the default) or token F1 (``reward="f1"``); ``info`` of the
answer turn carries ``em``, ``f1`` and ``support_recall`` (the share of the question's
supporting passages the episode's searches returned). An answer that names both options of a
comparison question ("A or B") scores 0 under either reward.

Questions come from:

* ``source="world"`` (default): a generated world of ``world_size`` passages (deterministic
  in ``world_seed``; see :mod:`trace_gym.envs.multihop.world`): bridge and comparison
  questions of 2-4 hops, split by the entity they start from;
* ``source="hotpotqa" | "2wikimultihopqa" | "musique"``: the datasets, from ``data_files``
  or the Hub (:mod:`trace_gym.envs.multihop.loaders`), searched with a per-question index
  over their own paragraphs or a global one (``dataset_index="global"``). The same are
  registered as ``trace_gym/HotpotQA-v0``, ``trace_gym/2WikiMultiHopQA-v0`` and
  ``trace_gym/MuSiQue-v0``.

Search runs on a local bm25s index, or, with ``retriever="http://host:port"``, on a server
speaking Search-R1's retrieval API (``trace-gym serve-retriever`` is one); a stopped or slow
server gives an error observation within ``retriever_timeout`` seconds.

Tool state (snapshotted with the episode) is the list of queries, the passages each returned,
and a cursor per query: repeating a query pages to the next ``topk`` passages.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from trace_gym.env.base import AgentEnv, TurnResult
from trace_gym.envs.multihop.answers import best_over_answers, exact_match, f1_score, names_several
from trace_gym.envs.multihop.loaders import DATASETS, QUESTION_PROMPT, DatasetUnavailableError, QADatasetSource
from trace_gym.envs.multihop.world import DEFAULT_WORLD_SIZE, SPLIT_CODES, QuestionGenerator
from trace_gym.envs.multihop.worldindex import world, world_index
from trace_gym.envs.retrieval import BM25Index, RetrievalClient, RetrievalError, format_results
from trace_gym.env.react import ParsedTurn, format_answer, format_tool_call
from trace_gym.task import Split, Task
from trace_gym.env.tools import Tool, ToolError

__all__ = ["MultiHopQAEnv", "HotpotQAEnv", "TwoWikiMultiHopQAEnv", "MuSiQueEnv", "WorldQuestions", "world_questions",
           "QADatasetSource", "DatasetUnavailableError", "DEFAULT_WORLD_SIZE"]

MAX_QUERY_CHARS = 500
MAX_PAGES = 10


class WorldQuestions:
    """Task source of generated-world questions: ``get(i, split)`` is deterministic in
    ``(world_seed, world_size, split, i)``. Every step's query ranks its passage first in the
    world's index (checked when the question is drawn)."""

    SIZES = {"train": 1_000_000, "validation": 2_000, "test": 2_000}

    def __init__(self, world_seed: int = 0, world_size: int = DEFAULT_WORLD_SIZE):
        self.world_seed, self.world_size = int(world_seed), int(world_size)
        self.world = world(self.world_seed, self.world_size)
        index = world_index(self.world_seed, self.world_size)
        ids = [self.world.passage_id(i) for i in range(len(self.world.entities))]

        def ranks_first(query: str, passage: int) -> bool:
            hits = index.search(query, 1)
            return bool(hits) and hits[0][0].id == ids[passage]

        self.generator = QuestionGenerator(self.world, check=ranks_first)
        self.get = lru_cache(maxsize=4096)(self._get)  # type: ignore[method-assign]

    def size(self, split: Split = "train") -> int:
        """Questions per split (a bound: the generator can draw more train questions)."""
        return self.SIZES[split]

    def _get(self, index: int, split: Split = "train") -> Task:
        if split not in SPLIT_CODES:
            raise KeyError(f"unknown split {split!r}")
        if not 0 <= int(index) < self.size(split):
            raise IndexError(f"MultiHopQA {split}: index {index} out of range (size {self.size(split)})")
        q = self.generator.question(split, int(index))
        w = self.world
        steps = [{"query": s.query, "passage_id": w.passage_id(s.passage), "title": w.entities[s.passage].name,
                  "need": s.need, "fact": s.fact} for s in q.steps]
        return Task(
            id=f"MultiHopQA-w{self.world_seed}n{self.world_size}/{split}/{index}",
            prompt=QUESTION_PROMPT.format(question=q.text),
            ground_truth={"answers": [q.answer], "candidates": q.candidates},
            metadata={"source": "world", "world_seed": self.world_seed, "world_size": self.world_size,
                      "question": q.text, "type": q.kind, "hops": q.hops, "template": q.template,
                      "steps": steps, "supporting": [s["passage_id"] for s in steps]},
            split=split,
        )

    def index_for(self, task: Task) -> BM25Index:
        """The world's index (shared by every episode)."""
        return world_index(self.world_seed, self.world_size)


@lru_cache(maxsize=4)
def world_questions(world_seed: int = 0, world_size: int = DEFAULT_WORLD_SIZE) -> WorldQuestions:
    """The shared :class:`WorldQuestions` of a world (envs of one world share its task cache)."""
    return WorldQuestions(world_seed, world_size)


class MultiHopQAEnv(AgentEnv):
    """Multi-hop QA with a ``search`` tool; see the module docstring.

    Args:
        seed: episode seed (task draws, fork randomness).
        split: ``"train"``, ``"validation"`` or ``"test"``.
        max_turns: turns per episode (default 6: up to 4 hops, an answer, one spare).
        source: ``"world"`` or a dataset name (``hotpotqa``, ``2wikimultihopqa``, ``musique``).
        world_seed, world_size: the generated world (``source="world"``).
        data_files, dataset_index: dataset files and index mode (dataset sources).
        topk: passages per search.
        reward: ``"em"`` (exact match) or ``"f1"``.
        retriever: URL of a Search-R1 retrieval server; local bm25s when ``None``.
        retriever_timeout: seconds a search may take before it becomes an error observation.
    """

    env_id = "trace_gym/MultiHopQA-v0"
    default_max_turns = 6

    def __init__(
        self,
        *,
        seed: int = 0,
        split: Split = "train",
        max_turns: int | None = None,
        source: str = "world",
        world_seed: int = 0,
        world_size: int = DEFAULT_WORLD_SIZE,
        data_files: Any = None,
        dataset_index: str = "question",
        topk: int = 3,
        reward: str = "em",
        retriever: str | None = None,
        retriever_timeout: float = 5.0,
        max_observation_chars: int = 8192,
        render_mode: str | None = None,
    ):
        super().__init__(seed=seed, split=split, max_turns=max_turns, max_observation_chars=max_observation_chars,
                         render_mode=render_mode)
        if reward not in ("em", "f1"):
            raise ValueError(f"reward must be 'em' or 'f1', got {reward!r}")
        if not 1 <= int(topk) <= 20:
            raise ValueError(f"topk must be between 1 and 20, got {topk}")
        self.topk = int(topk)
        self.reward_kind = reward
        if source == "world":
            self.source: WorldQuestions | QADatasetSource = world_questions(int(world_seed), int(world_size))
        elif source in DATASETS:
            self.source = QADatasetSource(source, data_files=data_files, index=dataset_index)
            self.source.records(split)  # fail here, with what to do, rather than at the first reset
        else:
            raise ValueError(f"unknown source {source!r}; expected 'world' or one of {sorted(DATASETS)}")
        self.retriever = RetrievalClient(retriever, timeout=retriever_timeout) if retriever else None

    @classmethod
    def servers(cls, *, retriever: str | None = None, **kwargs: Any) -> list[str]:
        """The retrieval server of ``retriever=`` (none with the local bm25s index)."""
        return [retriever] if retriever else []

    @classmethod
    def hub_datasets(cls, *, source: str = "world", data_files: Any = None, **kwargs: Any) -> list[str]:
        """The Hub dataset of a dataset ``source`` without ``data_files`` (none for the generated world)."""
        source = getattr(cls, "dataset", "") or source
        return [DATASETS[source][1]] if source in DATASETS and data_files is None else []

    # ------------------------------------------------------------------ AgentEnv API

    def tasks(self) -> WorldQuestions | QADatasetSource:
        """The question source."""
        return self.source

    def initial_tool_state(self, task: Task) -> dict[str, Any]:
        """Queries asked, passage ids each returned, and the next page per query."""
        return {"queries": [], "retrieved": [], "cursor": {}}

    def build_tools(self, task: Task) -> list[Tool]:
        """One tool, ``search``, bound to this env's current episode."""

        def search(query: str) -> str:
            """Search the encyclopedia and return the best-matching passages. Repeating a query returns the next passages.

            Args:
                query: What to look for, such as the name of a person, film, company or place.
            """
            return self._search(query)

        return [Tool.from_function(search)]

    def _search(self, query: str) -> str:
        assert self.state is not None
        query = " ".join(query.split())
        if not query:
            raise ToolError("the query is empty; search for a name or a few words")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolError(f"the query is {len(query)} characters long; keep it under {MAX_QUERY_CHARS}")
        tool_state = self.state.tool_state
        key = query.lower()
        page = tool_state["cursor"].get(key, 0)
        if page >= MAX_PAGES:
            raise ToolError(f"no further pages for {query!r}; try another query")
        depth = (page + 1) * self.topk
        try:
            if self.retriever is not None:
                hits = self.retriever.search(query, depth)
            else:
                hits = self.source.index_for(self.state.task).search(query, depth)
        except RetrievalError as exc:
            raise ToolError(f"search failed: {exc}") from None
        hits = hits[page * self.topk: depth]
        tool_state["cursor"][key] = page + 1
        tool_state["queries"].append(query)
        tool_state["retrieved"].append([p.id for p, _ in hits])
        if not hits and page > 0:
            return f"No more passages for {query!r}."
        return format_results(hits)

    def score(self, task: Task, answer: str) -> float:
        """EM (or F1) against the gold answers; an answer naming both options of a comparison scores 0."""
        gt = task.ground_truth or {}
        answers = gt.get("answers") or []
        if names_several(answer, gt.get("candidates") or []):
            return 0.0
        metric = exact_match if self.reward_kind == "em" else f1_score
        return best_over_answers(metric, answer, answers)

    def turn(self, parsed: ParsedTurn, action: str) -> TurnResult:
        """The default turn, plus ``em``, ``f1`` and ``support_recall`` in the answer turn's info."""
        result = super().turn(parsed, action)
        if result.terminated and parsed.answer is not None:
            assert self.state is not None
            task = self.state.task
            answers = (task.ground_truth or {}).get("answers") or []
            supporting = set(task.metadata.get("supporting") or [])
            seen = {pid for row in self.state.tool_state["retrieved"] for pid in row}
            result.info.update(
                em=best_over_answers(exact_match, parsed.answer, answers),
                f1=best_over_answers(f1_score, parsed.answer, answers),
                support_recall=len(supporting & seen) / len(supporting) if supporting else 0.0,
                searches=len(self.state.tool_state["queries"]),
            )
        return result

    def demonstrate(self, task: Task) -> list[str]:
        """Search each passage of the question's chain in order, then answer. The thoughts
        state what each result established and what is needed next."""
        steps = task.metadata.get("steps") or []
        answer = ((task.ground_truth or {}).get("answers") or [""])[0]
        turns: list[str] = []
        previous = ""
        for j, step in enumerate(steps):
            if j == 0:
                thought = f"To answer this, I first need to find {step['need']}. Let me search for {step['query']}."
            elif previous:
                thought = f"The search results say {previous}. Next I need to find {step['need']}."
            else:
                thought = f"Next I need to find {step['need']}."
            turns.append(f"<think>{thought}</think>\n" + format_tool_call("search", {"query": step["query"]}))
            previous = step.get("fact", "")
        facts = [s["fact"] for s in steps if s.get("fact")]
        if len(facts) > 1:
            final = f"The search results say {facts[-1]}. Putting it together: {'; '.join(facts)}. So the answer is {answer}."
        elif facts:
            final = f"The search results say {facts[-1]}. So the answer is {answer}."
        else:
            final = f"The passages I found answer the question: {answer}."
        turns.append(f"<think>{final}</think>\n" + format_answer(answer))
        return turns

    def close(self) -> None:
        """Release the retrieval client, if any."""
        if self.retriever is not None:
            self.retriever.close()
            self.retriever = None
        super().close()


class _DatasetQAEnv(MultiHopQAEnv):
    dataset: str = ""

    def __init__(self, *, data_files: Any = None, dataset_index: str = "question", **kwargs: Any):
        if "source" in kwargs:
            raise TypeError(f"{self.env_id} reads {self.dataset}; use MultiHopQA-v0 for another source")
        super().__init__(source=self.dataset, data_files=data_files, dataset_index=dataset_index, **kwargs)


class HotpotQAEnv(_DatasetQAEnv):
    """``trace_gym/HotpotQA-v0``: HotpotQA (distractor setting) with a search tool over each
    question's paragraphs. ``data_files``: the official JSON (e.g. ``hotpot_dev_distractor_v1.json``)
    or ``{split: file}``; without it the Hub (``datasets`` extra, online). Offline without files
    the constructor raises :class:`DatasetUnavailableError`."""

    env_id = "trace_gym/HotpotQA-v0"
    dataset = "hotpotqa"


class TwoWikiMultiHopQAEnv(_DatasetQAEnv):
    """``trace_gym/2WikiMultiHopQA-v0``: 2WikiMultiHopQA, as :class:`HotpotQAEnv`."""

    env_id = "trace_gym/2WikiMultiHopQA-v0"
    dataset = "2wikimultihopqa"


class MuSiQueEnv(_DatasetQAEnv):
    """``trace_gym/MuSiQue-v0``: MuSiQue (answerable questions; gold answer or any alias
    scores), as :class:`HotpotQAEnv`."""

    env_id = "trace_gym/MuSiQue-v0"
    dataset = "musique"
