"""``AgentEnv``: the base class of every trace-gym environment.

Contract (read this before writing an env):

* One episode is one :class:`~trace_gym.task.Task`. ``reset(seed=, options=)`` takes
  ``options={"task": Task}``, ``{"task_id": str}`` or ``{"index": int}``; without options it
  draws a task index from the env's seeded RNG. The observation is the task's prompt; ``info``
  holds ``task_id``, ``tools`` (JSON schemas for ``apply_chat_template(tools=...)``) and
  ``messages`` (the system + user messages the policy should see).
* One ``step(action)`` is one ReAct turn: the policy's text in, the observation text out
  (tool results, an error message, or the next user message). The default turn logic
  (:meth:`AgentEnv.turn`) runs tool calls through the env's tools and scores an
  ``<answer>`` with :meth:`AgentEnv.score`; envs with other rules override ``turn``.
* Malformed actions never raise: they produce an error observation (``info["parse_error"]``).
* All mutable episode state lives in ``self.state`` (an :class:`EpisodeState`), tool state
  included, so ``snapshot()`` / ``restore()`` fork an episode exactly. ``restore(s,
  branch_id=b)`` additionally re-derives the episode RNG from (seed, b, turn): two forks with
  different branch ids diverge, the same branch id replays identically.
* ``demonstrate(task)`` returns a correct trajectory (the policy's turns) for SFT warm
  starts and tests.
* Two class-level hooks say what an env needs from outside, without building it:
  :meth:`AgentEnv.servers` (base URLs of servers it calls, checked before a run's first step by
  :func:`trace_gym.rollout.preflight.check_servers`) and :meth:`AgentEnv.hub_datasets` (Hub
  datasets it downloads; ``trace-gym envs`` reports it unavailable offline without trying).
* The observation and action spaces are :class:`AgentText`, which works in Gymnasium's
  ``SyncVectorEnv`` and ``AsyncVectorEnv`` (shared memory included: see :class:`SharedText`).
"""

from __future__ import annotations

import pickle
import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence, SupportsFloat

import gymnasium
import numpy as np
from gymnasium import spaces
from pydantic import BaseModel, ConfigDict

from trace_gym.env.react import ParsedTurn, ToolCall, parse_turn
from trace_gym.task import Split, Task, TaskSource
from trace_gym.env.tools import Tool


def _text_charset() -> frozenset[str]:
    # Every character a model or tool can emit in the Basic Multilingual Plane (no surrogates);
    # anything outside it is replaced by U+FFFD before it reaches an observation.
    ranges = [(0x09, 0x0A), (0x0D, 0x0D), (0x20, 0x7E), (0xA0, 0xD7FF), (0xE000, 0xFFFD)]
    return frozenset(chr(c) for lo, hi in ranges for c in range(lo, hi + 1))


TEXT_CHARSET: frozenset[str] = _text_charset()
_TEXT_TABLES: tuple[Any, ...] | None = None


def _text_tables() -> tuple[Any, ...]:
    """gymnasium's per-character tables for TEXT_CHARSET, built once per process."""
    global _TEXT_TABLES
    if _TEXT_TABLES is None:
        full = spaces.Text(1, min_length=0, charset=TEXT_CHARSET)
        codes = np.array([ord(c) for c in full.character_list], dtype="<u4")
        _TEXT_TABLES = (full._char_set, full._char_list, full._char_index, full._char_str, codes)
    return _TEXT_TABLES


class AgentText(spaces.Text):
    """A :class:`gymnasium.spaces.Text` over :data:`TEXT_CHARSET` (every BMP character but
    surrogates) that is cheap to build and to sample.

    Gymnasium's ``Text`` builds lookup tables over its charset in every instance (~0.2 s for
    63k characters) and samples by joining numpy string objects (~1 s per million
    characters); here the tables are shared and samples are decoded from code points.
    Contents, equality and masked sampling are ``Text``'s own.
    """

    _TABLE_ATTRS = ("_char_set", "_char_list", "_char_index", "_char_str")

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | np.random.Generator | None = None):
        super().__init__(max_length, min_length=min_length, charset="a", seed=seed)
        char_set, char_list, char_index, char_str, self._codes = _text_tables()
        if not all(hasattr(self, a) for a in self._TABLE_ATTRS):  # a gymnasium that stores them otherwise
            super().__init__(max_length, min_length=min_length, charset=TEXT_CHARSET, seed=seed)
            return
        self._char_set, self._char_list, self._char_index, self._char_str = char_set, char_list, char_index, char_str

    def __repr__(self) -> str:  # Text's repr lists all 63k characters
        return f"AgentText({self.min_length}, {self.max_length}, charset=TEXT_CHARSET)"

    # Copies and pickles carry the lengths and the RNG, not the 63k-entry tables (shared per
    # process): Gymnasium's vector envs deep-copy a space per sub-env and pickle it to each
    # worker, which otherwise took seconds.
    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_text, (type(self), self.max_length, self.min_length, self._np_random))

    def __deepcopy__(self, memo: dict) -> "AgentText":
        import copy

        return _rebuild_text(type(self), self.max_length, self.min_length, copy.deepcopy(self._np_random, memo))

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is not None or probability is not None:
            return super().sample(mask=mask, probability=probability)
        length = int(self.np_random.integers(self.min_length, self.max_length + 1))
        idx = self.np_random.integers(0, len(self._codes), size=length)
        return self._codes[idx].tobytes().decode("utf-32-le")

    # ------------------------------------------------------------------ flat encoding

    def encode(self, text: str) -> np.ndarray:
        """``text`` as Gymnasium flattens a ``Text`` value: ``max_length`` int32 indices into
        :attr:`character_list`, padded with ``len(character_set)``. Raises ``ValueError`` for a
        string that is not a member (too long, or a character outside the charset)."""
        if len(text) > self.max_length:
            raise ValueError(f"text of {len(text)} characters exceeds the space's max_length {self.max_length}")
        out = np.full(self.max_length, len(self._codes), dtype=np.int32)
        if text:
            codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
            idx = _code_index()[np.minimum(codes, 0x10FFFF)]
            if (idx < 0).any():
                bad = text[int(np.argmax(idx < 0))]
                raise ValueError(f"character {bad!r} (U+{ord(bad):04X}) is not in the space's charset")
            out[: len(text)] = idx
        return out

    def decode(self, indices: np.ndarray) -> str:
        """Inverse of :meth:`encode` (indices at or past ``len(character_set)`` are padding)."""
        idx = np.asarray(indices)
        idx = idx[(idx >= 0) & (idx < len(self._codes))]
        return self._codes[idx].tobytes().decode("utf-32-le")


_CODE_INDEX: np.ndarray | None = None


def _code_index() -> np.ndarray:
    """Code point -> index into TEXT_CHARSET's sorted character list (-1 outside it)."""
    global _CODE_INDEX
    if _CODE_INDEX is None:
        codes = _text_tables()[4]
        table = np.full(0x110000, -1, dtype=np.int32)
        table[codes] = np.arange(len(codes), dtype=np.int32)
        _CODE_INDEX = table
    return _CODE_INDEX


class SharedText(Sequence[str]):
    """The observations of an ``AsyncVectorEnv`` with shared memory, read from that memory
    whenever they are read: one string per sub-env.

    Gymnasium reads a space's shared memory once, when the vector env is built, and for
    every space but ``Text`` what it gets is a numpy view that later writes show through;
    for ``Text`` it gets a tuple of strings, fixed at that moment (padding, shown as
    strings of tabs). :class:`AgentText` registers its own shared-memory readers, so the
    vector env holds this live view instead; ``deepcopy`` (what the vector env returns with
    its default ``copy=True``) and :meth:`snapshot` give a plain tuple of the current strings.
    """

    def __init__(self, space: AgentText, buffer: Any, n: int):
        self.space, self.n = space, int(n)
        self._data = np.frombuffer(buffer.get_obj(), dtype=np.int32).reshape(self.n, space.max_length)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self.space.decode(self._data[j]) for j in range(*i.indices(self.n)))
        return self.space.decode(self._data[i])

    def snapshot(self) -> tuple[str, ...]:
        """The current strings, as a tuple."""
        return tuple(self[i] for i in range(self.n))

    def __deepcopy__(self, memo: dict) -> tuple[str, ...]:
        return self.snapshot()

    def __copy__(self) -> tuple[str, ...]:
        return self.snapshot()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (tuple, list, SharedText)) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SharedText({self.snapshot()!r})"


def _register_vector_support() -> None:
    """Teach Gymnasium's vector utilities :class:`AgentText`: shared memory that is read live
    (:class:`SharedText`) and a vectorised encoding (Gymnasium's loops over characters)."""
    from gymnasium.vector.utils import shared_memory as shm

    @shm.read_from_shared_memory.register(AgentText)
    def _read(space: AgentText, shared_memory: Any, n: int = 1) -> SharedText:
        return SharedText(space, shared_memory, n)

    @shm.write_to_shared_memory.register(AgentText)
    def _write(space: AgentText, index: int, value: str, shared_memory: Any) -> None:
        size = space.max_length
        destination = np.frombuffer(shared_memory.get_obj(), dtype=np.int32)
        destination[index * size: (index + 1) * size] = space.encode(value)

    from gymnasium.spaces import utils as space_utils

    @space_utils.flatten.register(AgentText)
    def _flatten(space: AgentText, x: str) -> np.ndarray:
        return space.encode(x)


_register_vector_support()


def _rebuild_text(cls: type, max_length: int, min_length: int, rng: np.random.Generator | None) -> AgentText:
    space = cls(max_length, min_length=min_length)
    space._np_random = rng
    return space


MAX_ACTION_CHARS = 1 << 20
MAX_OBSERVATION_CHARS = 1 << 16

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent that solves tasks step by step. In each turn, think inside <think>...</think>, "
    "then either call one or more tools, each as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, "
    "or give your final answer as <answer>...</answer>."
)


def clean_text(text: str, max_chars: int) -> str:
    """Make ``text`` a member of the env's Text spaces: known characters only, bounded length."""
    if not isinstance(text, str):
        text = str(text)
    if len(text) > max_chars:
        note = f"\n[... truncated {len(text) - max_chars} characters]"
        text = text[: max(0, max_chars - len(note))] + note
    if all(c in TEXT_CHARSET for c in text):
        return text
    return "".join(c if c in TEXT_CHARSET else "\ufffd" for c in text)


class EnvUnavailable(RuntimeError):
    """Raised by an env's constructor when something it needs is missing: an optional extra,
    a dataset that cannot be downloaded offline. The message says how to provide it; test
    suites that walk the registry skip such envs visibly."""


class EnvSnapshot(BaseModel):
    """A serialisable copy of one episode's state, tool state included."""

    model_config = ConfigDict(frozen=True)

    env_id: str
    turn: int
    payload: bytes

    def to_bytes(self) -> bytes:
        """Serialise (for checkpoints and JSONL records)."""
        return pickle.dumps((self.env_id, self.turn, self.payload))

    @classmethod
    def from_bytes(cls, data: bytes) -> "EnvSnapshot":
        """Inverse of :meth:`to_bytes`."""
        env_id, turn, payload = pickle.loads(data)
        return cls(env_id=env_id, turn=turn, payload=payload)


@dataclass
class EpisodeState:
    """Everything that changes during an episode. ``tool_state`` is the env's own (a dict,
    a simulated file system ...); it must be picklable."""

    task: Task
    rng: np.random.Generator
    turn: int = 0
    done: bool = False
    transcript: list[tuple[str, str]] = field(default_factory=list)  # (action, observation) per turn
    tool_state: Any = None
    seed: int = 0  # the episode's seed: forks derive their randomness from it and the branch id


@dataclass
class TurnResult:
    """What one turn produced, as returned by :meth:`AgentEnv.turn`."""

    observation: str
    reward: float = 0.0
    terminated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class AgentEnv(gymnasium.Env[str, str]):
    """Base class of multi-turn agent environments; see the module docstring for the contract.

    Subclasses set :attr:`env_id`, implement :meth:`tasks` (a :class:`TaskSource`),
    :meth:`score` and :meth:`demonstrate`, and usually :meth:`build_tools` and
    :meth:`initial_tool_state`.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi", "human"], "render_fps": 1}
    env_id: ClassVar[str] = "trace_gym/AgentEnv-v0"
    default_max_turns: ClassVar[int] = 8
    system_prompt: ClassVar[str] = DEFAULT_SYSTEM_PROMPT

    def __init__(
        self,
        *,
        seed: int = 0,
        split: Split = "train",
        max_turns: int | None = None,
        max_observation_chars: int = 8192,
        render_mode: str | None = None,
    ):
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.seed_value = int(seed)
        self.split: Split = split
        self.max_turns = int(max_turns or self.default_max_turns)
        self.max_observation_chars = int(min(max_observation_chars, MAX_OBSERVATION_CHARS))
        self.render_mode = render_mode
        self.observation_space = AgentText(MAX_OBSERVATION_CHARS, min_length=0)
        self.action_space = AgentText(MAX_ACTION_CHARS, min_length=0)
        self.state: EpisodeState | None = None
        self._tools: dict[str, Tool] = {}
        self._np_random, _ = gymnasium.utils.seeding.np_random(self.seed_value)

    # ------------------------------------------------------------------ subclass API

    def tasks(self) -> TaskSource:
        """The env's task source."""
        raise NotImplementedError

    @classmethod
    def servers(cls, **kwargs: Any) -> list[str]:
        """Base URLs of the servers an env built with ``kwargs`` calls during episodes (a
        retrieval server, ...). The default is none. Runs check that each answers before their
        first step (:func:`trace_gym.rollout.preflight.check_servers`), so a dead server stops
        the run with its URL instead of turning into zero rewards."""
        return []

    @classmethod
    def hub_datasets(cls, **kwargs: Any) -> list[str]:
        """Hugging Face Hub datasets (``"org/name"``) an env built with ``kwargs`` downloads;
        ``[]`` (the default) when it needs none, e.g. because ``kwargs`` point at local files.
        ``trace-gym envs`` reports such an env unavailable when the Hub is unreachable and the
        dataset is not in the local cache, without building it."""
        return []

    @classmethod
    def code_isolation(cls) -> dict[str, Any] | None:
        """For envs whose tools can run the policy's code: how that code is isolated on this
        machine (``{"isolation", "summary", "passed", "failed"}``: the level and the probes it
        passed). None (the default) for envs that run no code."""
        return None

    def score(self, task: Task, answer: str) -> float:
        """Reward in [0, 1] for a final ``answer`` to ``task``."""
        raise NotImplementedError

    def demonstrate(self, task: Task) -> list[str]:
        """A correct trajectory for ``task``: the policy's turns, in order."""
        raise NotImplementedError

    def build_tools(self, task: Task) -> list[Tool]:
        """The tools available in an episode of ``task``. Tools read and write
        ``self.state.tool_state`` so that snapshots capture them."""
        return []

    def initial_tool_state(self, task: Task) -> Any:
        """The tool state at the start of an episode."""
        return None

    def turn(self, parsed: ParsedTurn, action: str) -> TurnResult:
        """Apply one parsed turn. Default: answer -> score and end; tool calls -> run them."""
        assert self.state is not None
        if parsed.error is not None:
            return TurnResult(self.error_observation(parsed.error), info={"parse_error": parsed.error})
        if parsed.answer is not None:
            reward = float(self.score(self.state.task, parsed.answer))
            return TurnResult("", reward=reward, terminated=True, info={"answer": parsed.answer})
        return TurnResult(self.run_tool_calls(parsed.tool_calls), info={"tool_calls": len(parsed.tool_calls)})

    # ------------------------------------------------------------------ shared machinery

    def error_observation(self, message: str) -> str:
        """The observation shown for a turn the env could not act on."""
        return f"Error: {message}"

    def run_tool_calls(self, calls: list[ToolCall]) -> str:
        """Run each call through its tool; unknown tools and failures become error lines."""
        outputs = []
        for call in calls:
            t = self._tools.get(call.name)
            if t is None:
                known = ", ".join(sorted(self._tools)) or "none"
                outputs.append(f"Error: unknown tool {call.name!r} (available: {known}).")
            else:
                outputs.append(t.call(call.arguments))
        return "\n".join(outputs)

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """JSON schemas of the current episode's tools."""
        return [t.schema for t in self._tools.values()]

    def task_by_id(self, task_id: str) -> Task:
        """Look a task up by id. Ids of built-in sources end in ``/<split>/<index>``."""
        src = self.tasks()
        by_id = getattr(src, "by_id", None)
        if callable(by_id):
            return by_id(task_id)
        try:
            _, split, index = task_id.rsplit("/", 2)
            return src.get(int(index), split)  # type: ignore[arg-type]
        except (ValueError, KeyError, IndexError) as exc:
            raise KeyError(f"{self.env_id}: no task with id {task_id!r}") from exc

    def messages(self) -> list[dict[str, str]]:
        """The chat messages that open the current episode (system, user)."""
        assert self.state is not None
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": self.state.task.prompt}]

    def _info(self, **extra: Any) -> dict[str, Any]:
        assert self.state is not None
        info = {"task_id": self.state.task.id, "turn": self.state.turn}
        info.update(extra)
        return info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self.seed_value = int(seed)
        options = options or {}
        if "task" in options:
            task = options["task"]
            if not isinstance(task, Task):
                task = Task.model_validate(task)
        elif "task_id" in options:
            task = self.task_by_id(str(options["task_id"]))
        else:
            src = self.tasks()
            index = int(options["index"]) if "index" in options else int(self.np_random.integers(0, max(1, src.size(self.split))))
            task = src.get(index, self.split)
        rng = np.random.default_rng([self.seed_value, zlib.crc32(task.id.encode())])
        self.state = EpisodeState(task=task, rng=rng, tool_state=self.initial_tool_state(task), seed=self.seed_value)
        self._tools = {t.name: t for t in self.build_tools(task)}
        obs = clean_text(task.prompt, MAX_OBSERVATION_CHARS)
        return obs, self._info(tools=self.tool_schemas, messages=self.messages())

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        if self.state is None:
            raise RuntimeError(f"{self.env_id}: call reset() before step()")
        if self.state.done:
            raise RuntimeError(f"{self.env_id}: the episode has ended; call reset()")
        if not isinstance(action, str):
            action = str(action)
        action = action[:MAX_ACTION_CHARS]
        self.state.turn += 1
        result = self.turn(parse_turn(action), action)
        obs = clean_text(result.observation, self.max_observation_chars)
        truncated = not result.terminated and self.state.turn >= self.max_turns
        self.state.done = result.terminated or truncated
        self.state.transcript.append((action, obs))
        info = self._info(role=result.info.pop("role", "tool"), **result.info)
        if self.render_mode == "human":
            self.render()
        return obs, float(result.reward), bool(result.terminated), bool(truncated), info

    def transcript_text(self) -> str | None:
        """The episode so far as plain text (``None`` before reset)."""
        if self.state is None:
            return None
        lines = [f"[{self.env_id}] task {self.state.task.id}", f"USER: {self.state.task.prompt}"]
        for action, obs in self.state.transcript:
            lines.append(f"AGENT: {action}")
            if obs:
                lines.append(f"ENV: {obs}")
        return "\n".join(lines)

    def render(self) -> str | None:
        """``"ansi"`` (and no render mode): the transcript as text; ``"human"``: print it and
        return ``None``, as Gymnasium's render API asks."""
        text = self.transcript_text()
        if self.render_mode == "human":
            if text is not None:
                print(text)
            return None
        return text

    # ------------------------------------------------------------------ fork

    def snapshot(self) -> EnvSnapshot:
        """A copy of the current episode's state (tool state included)."""
        if self.state is None:
            raise RuntimeError(f"{self.env_id}: nothing to snapshot before reset()")
        return EnvSnapshot(env_id=self.env_id, turn=self.state.turn, payload=pickle.dumps(self.state))

    def restore(self, snapshot: EnvSnapshot, branch_id: int | None = None) -> None:
        """Return to ``snapshot``. With ``branch_id`` the episode RNG is re-derived from
        (episode seed, branch_id, turn), so forks diverge reproducibly, whichever env instance
        restores them; without it the RNG resumes where the snapshot left it (exact replay)."""
        if snapshot.env_id != self.env_id:
            raise ValueError(f"snapshot of {snapshot.env_id!r} cannot be restored into {self.env_id!r}")
        state: EpisodeState = pickle.loads(snapshot.payload)
        if branch_id is not None:
            seed = getattr(state, "seed", self.seed_value)
            state.rng = np.random.default_rng([int(seed), int(branch_id), state.turn])
        self.state = state
        self._tools = {t.name: t for t in self.build_tools(state.task)}

