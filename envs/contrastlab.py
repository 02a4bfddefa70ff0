"""ContrastLab: a multi-turn agent simulator whose conditional success probability is exact.

ContrastLab exists to measure allocators at scale against an oracle. It has two faces
that run the *same* random process:

* :class:`ContrastLabEnv` (``trace_gym/ContrastLab-v0``), an :class:`~trace_gym.env.AgentEnv`
  driven turn by turn with text (any policy, the ``sim`` policy included), with
  snapshot/restore for branching;
* :class:`ContrastLabSim`, a vectorised numpy fast path that grows a whole
  :class:`~trace_gym.forest.Forest` at once (what ``trace-gym bench allocators`` uses).

Both read one :class:`ContrastLabWorld`: the tasks, and the simulated policy's skill on
each of them. The world is shared because the success probability of a prefix depends on
the policy that continues it; the ``sim`` policy (:mod:`trace_gym.policies.sim`) samples
its actions from the same skills.

The model (every modelling choice, stated so a reader can judge it)
--------------------------------------------------------------------

**Tasks.** Task ``i`` has ``T_i`` turns, drawn uniformly from the ``turns`` range
(2-6 by default) independently of its difficulty, and a target root success probability
``p_i`` drawn from the user's difficulty distribution (:func:`parse_difficulty`: a Beta,
a mixture of Betas, or an explicit list). The default, ``0.5*beta:0.3,3+0.5*beta:3,0.3``,
is bimodal: most prompts are nearly always solved or nearly never, as in RLVR practice;
GRPO with 8 rollouts per prompt finds about 34% of its groups mixed on it.

**Policy and latent state.** At every turn the policy picks one of ``n_options`` (4)
options; one of them, fixed per (task, turn) and hidden, is correct. The policy picks the
correct one with probability ``q_it = sigmoid(skill_i + shared_skill + offset_it)`` and
otherwise a uniformly random wrong one. The per-turn offsets are 0 by default (every turn
of a task equally hard); ``step_spread = s`` draws them from N(0, s^2), making some turns
of a task the crux. The env keeps a latent *on-track* bit ``s`` (1 at the start):
a wrong option always knocks the agent off track; a correct option keeps it on track, or,
when it is off track, brings it back with probability ``recovery`` (0.2). The last turn is
the final answer; the reward is ``s`` after it. This is a two-state Markov chain with
``P(on -> on) = q_it`` and ``P(off -> on) = q_it * recovery`` at turn t, so for a prefix
ending after turn ``t`` in state ``s`` the success probability is exact:

    V(H) = v_s(t),   v_on(T_i) = 1, v_off(T_i) = 0,
    v_on(t)  = q v_on(t+1) + (1-q) v_off(t+1),
    v_off(t) = q r v_on(t+1) + (1 - q r) v_off(t+1)      (q = q_i,t+1, r = recovery)

``skill_i`` is initialised by bisection so that ``v_on(0) = p_i`` exactly: the root
success probability under the initial policy *is* the drawn difficulty. ``V(H)`` is the
probability of success when continuing from the env state at ``H`` (the latent bit is part
of that state, as a tool's state is), which is what a branch from ``H`` does.

**Observations.** After a tool turn the env reports ``progress`` if the agent is on track
and a ``tool error`` if not, except that with probability ``obs_noise`` (0.2) it returns an
uninformative ``the tool returned a result`` instead. So the text of a prefix carries
strong but imperfect evidence of the latent state; a predictor that reads text cannot
reach the oracle, as in real agents. Malformed actions get an error observation and count
as a wrong option.

**Prompts.** Each prompt names the task (a unique made-up word, so per-prompt learners can
recognise recurring prompts), its number of steps, a random domain word (noise), and three
descriptor words. Each descriptor is drawn, with probability ``prompt_signal`` (0.5), from
the ten-word band of the task's difficulty decile, else from a random band. Prompts thus
carry partial, learnable information about difficulty, as real prompts do; a model that
reads only the descriptors cannot know ``p_i`` exactly. As a yardstick: the ``hashed``
predictor, after 30 steps of 1024 rollouts, ranks the roots of never-seen prompts with
AUC 0.88 (Spearman 0.73, R^2 0.56) at ``prompt_signal=0.5``, and 0.94 (0.86, 0.85) at
0.8. Allocators that rely on a predictor are sensitive to this setting.

**Tokens.** Each policy turn is a ``<think>`` sentence drawn uniformly from a fixed list of
eight (5 to 24 words long, so turn lengths vary) followed by a tool call, or by the answer
on the last turn. A turn's token count is its length under the ``sim`` policy's word-level
tokenizer; the fast path uses the same counts.

**Learning mode.** :meth:`ContrastLabWorld.reinforce` applies one REINFORCE step to the
skills from a forest's per-node advantages: for each policy turn with advantage ``A`` that
chose correctly (``c = 1``) or not (``c = 0``) at turn t, ``skill_i += lr * A * (c - q_it)`` (the
gradient of ``log pi(option)`` with respect to the correct option's logit) and
``shared_skill`` moves by ``shared_lr`` times the mean of those gradients, so held-out
tasks improve a little too. A step without contrast (all advantages zero) changes nothing.

**How the defaults were chosen.** ``recovery=0.2``, ``obs_noise=0.2``,
``prompt_signal=0.5`` and ``step_spread=0`` were fixed from the model's own statistics
(with ``recovery=0.2`` the latent state one turn before the end explains about 30% of the
outcome variance, after the first turn about 8%) before any allocator was compared, and
not changed afterwards; ``benchmarks/allocator_bench.py --world K=V`` reruns the comparison
with other settings.

**A consequence worth knowing.** Because ``V(H_t)`` is a martingale, a continuation from a
prefix of a failed rollout, taken at a fixed turn regardless of its value, succeeds less
often than a fresh rollout: ``E[V(H_t) | fail] = (p - E[V(H_t)^2]) / (1 - p) <= p``
(likewise it fails less often after a success). Uniform branching therefore mixes groups
less often per trajectory than fresh rollouts of the same prompt; only prefixes *chosen*
by their value can do better. This holds in any environment, not just here.

**What is not modelled.** Turn lengths do not depend on the latent state; the difficulty
of a task does not depend on its length; the policy does not see the latent bit (it
acts the same on and off track); sampling temperature other than 1 changes the policy
but the env's ``V(H)`` assumes temperature 1.

The fast path and the env path are tested to agree in distribution
(``tests/test_contrastlab.py``).
"""

from __future__ import annotations

import copy
import math
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trace_gym.env import AgentEnv, TurnResult
from trace_gym.forest import History, Forest
from trace_gym.react import ParsedTurn, format_answer, format_tool_call
from trace_gym.task import Split, Task
from trace_gym.tools import Tool

DEFAULT_DIFFICULTY = "0.5*beta:0.3,3+0.5*beta:3,0.3"

OPTIONS = "ABCDEFGH"

# ----------------------------------------------------------------------------- difficulty


class DifficultyError(ValueError):
    """A difficulty specification could not be understood; the message says why."""


@dataclass(frozen=True)
class Difficulty:
    """A distribution of root success probabilities.

    Either a mixture of Beta distributions (``components`` of ``(weight, a, b)``, weights
    summing to 1) or an explicit list of ``values`` (task ``i`` gets ``values[i % len]``).
    Build one with :func:`parse_difficulty`.
    """

    components: tuple[tuple[float, float, float], ...] = ()
    values: tuple[float, ...] = ()
    spec: str = ""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` success probabilities (float64 in [0, 1])."""
        if self.values:
            v = np.asarray(self.values, dtype=np.float64)
            return v[np.arange(n) % v.size].copy()
        w = np.array([c[0] for c in self.components])
        which = rng.choice(len(self.components), size=n, p=w / w.sum())
        out = np.empty(n)
        for j, (_, a, b) in enumerate(self.components):
            sel = which == j
            out[sel] = rng.beta(a, b, size=int(sel.sum()))
        return out

    def __str__(self) -> str:
        return self.spec


def _float(text: str, what: str, spec: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise DifficultyError(f"bad difficulty spec {spec!r}: {what} {text.strip()!r} is not a number") from None
    if not math.isfinite(x):
        raise DifficultyError(f"bad difficulty spec {spec!r}: {what} must be finite, got {text.strip()!r}")
    return x


def _values(values: Sequence[float], spec: str) -> Difficulty:
    vals = tuple(float(v) for v in values)
    if not vals:
        raise DifficultyError(f"bad difficulty spec {spec!r}: the list of probabilities is empty")
    bad = [v for v in vals if not (0.0 <= v <= 1.0)]
    if bad:
        raise DifficultyError(f"bad difficulty spec {spec!r}: probabilities must lie in [0, 1], got {bad[0]!r}")
    return Difficulty(values=vals, spec=spec)


def parse_difficulty(spec: "str | Sequence[float] | Difficulty") -> Difficulty:
    """Parse a difficulty distribution.

    Accepted forms:

    * ``"beta:A,B"``: Beta(A, B) with A, B > 0;
    * a mixture ``"W1*beta:A,B+W2*beta:C,D"`` whose weights sum to 1
      (e.g. ``"0.5*beta:0.3,3+0.5*beta:3,0.3"``);
    * a path to a file of probabilities (whitespace-, comma- or newline-separated, or a
      JSON list): task ``i`` gets the ``i``-th value, cycling;
    * a Python sequence of probabilities (same meaning), or a :class:`Difficulty`.

    Raises :class:`DifficultyError` naming the problem.
    """
    if isinstance(spec, Difficulty):
        return spec
    if not isinstance(spec, str):
        return _values(list(spec), f"<list of {len(spec)} values>")
    text = spec.strip()
    if not text:
        raise DifficultyError("bad difficulty spec '': give beta:A,B, a mixture such as 0.5*beta:0.3,3+0.5*beta:3,0.3, or a file")
    if "beta:" not in text:
        path = Path(text).expanduser()
        if not path.is_file():
            raise DifficultyError(
                f"bad difficulty spec {spec!r}: not beta:A,B, not a mixture of W*beta:A,B terms, and no file of that name exists"
            )
        raw = path.read_text()
        tokens = [t for t in re.split(r"[\s,\[\]]+", raw) if t]
        return _values([_float(t, "value", spec) for t in tokens], spec)
    components = []
    for term in text.split("+"):
        term = term.strip()
        if not term:
            raise DifficultyError(f"bad difficulty spec {spec!r}: empty term in the mixture")
        if "*" in term:
            w_text, dist = term.split("*", 1)
            weight = _float(w_text, "mixture weight", spec)
        else:
            weight, dist = 1.0, term
        dist = dist.strip()
        if not dist.startswith("beta:"):
            raise DifficultyError(f"bad difficulty spec {spec!r}: unknown distribution {dist!r} (only beta:A,B is supported)")
        params = dist[len("beta:"):].split(",")
        if len(params) != 2:
            raise DifficultyError(f"bad difficulty spec {spec!r}: beta needs two parameters A,B, got {dist!r}")
        a, b = (_float(p, "beta parameter", spec) for p in params)
        if a <= 0 or b <= 0:
            raise DifficultyError(f"bad difficulty spec {spec!r}: beta parameters must be positive, got {a:g},{b:g}")
        if weight <= 0:
            raise DifficultyError(f"bad difficulty spec {spec!r}: mixture weights must be positive, got {weight:g}")
        components.append((weight, a, b))
    total = sum(c[0] for c in components)
    if abs(total - 1.0) > 1e-6:
        raise DifficultyError(f"bad difficulty spec {spec!r}: mixture weights sum to {total:g}, expected 1")
    return Difficulty(components=tuple(components), spec=text)


# ----------------------------------------------------------------------------- text

_SYLLABLES = ["ka", "lo", "mi", "ve", "ru", "sa", "ne", "to", "bi", "da", "fu", "go", "ze", "pa", "ri", "xo"]
_DOMAINS = ["billing", "inventory", "travel", "payroll", "shipping", "calendar", "support", "ledger"]
# ten bands of descriptor words, from the hardest decile (0) to the easiest (9)
_BANDS = [
    ["intractable", "adversarial", "labyrinthine", "cryptic", "nightmarish", "byzantine", "treacherous", "arcane", "baffling", "forbidding"],
    ["gnarly", "convoluted", "obscure", "knotty", "perplexing", "thorny", "devious", "murky", "tangled", "opaque"],
    ["demanding", "intricate", "elaborate", "strenuous", "exacting", "laborious", "fiddly", "taxing", "stubborn", "prickly"],
    ["challenging", "involved", "layered", "nuanced", "subtle", "delicate", "tricky", "uneven", "twisty", "dense"],
    ["substantial", "sizeable", "moderate", "considered", "careful", "measured", "balanced", "mixed", "patient", "steady"],
    ["ordinary", "regular", "typical", "usual", "standard", "common", "middling", "average", "normal", "plain"],
    ["manageable", "tractable", "orderly", "sensible", "tidy", "clear", "neat", "structured", "direct", "fair"],
    ["easygoing", "gentle", "light", "friendly", "smooth", "relaxed", "breezy", "mild", "calm", "open"],
    ["simple", "basic", "quick", "short", "brief", "small", "minor", "easy", "familiar", "obvious"],
    ["trivial", "routine", "elementary", "effortless", "rote", "mechanical", "automatic", "canned", "scripted", "boilerplate"],
]
_THOUGHTS = [
    "Pick the next step.",
    "Check the request and choose an option.",
    "The last result tells me which option should come next here.",
    "Look again at the task and the previous results before choosing the next option.",
    "I will keep going with the plan and choose the option that fits this step of the task.",
    "Re-read the request, compare the options with what the tools said so far, then commit to one.",
    "Careful: the earlier results constrain this step, so reason about each option before choosing the most consistent one.",
    "Let me go through the task description once more, recall the results of the previous steps, weigh all four options against them, and pick one.",
]
SYSTEM_PROMPT = (
    "You are an agent that solves tasks step by step. In each turn, think inside <think>...</think>, "
    "then call the tool act with one option, as <tool_call>{\"name\": \"act\", \"arguments\": {\"option\": \"A\"}}</tool_call>; "
    "on the last step give the final option as <answer>A</answer>."
)
OBS_PROGRESS = "progress: step {t} of {T} is done and the partial result checks out."
OBS_ERROR = "tool error: step {t} of {T} failed; the result does not match the request."
OBS_NEUTRAL = "the tool returned a result for step {t} of {T}."
OBS_EARLY = "Error: the task needs {T} steps; an answer at step {t} ends the episode unsolved."
OBS_NOT_ANSWER = "Error: this was the last step; it needed an <answer>, so the episode ends unsolved."
# observation categories, shared by both paths
CAT_PROGRESS, CAT_ERROR, CAT_NEUTRAL, CAT_NONE = 0, 1, 2, 3


def action_text(thought: int, option: str, final: bool) -> str:
    """The ``sim`` policy's turn: thought sentence ``thought`` and an option (tool call or answer)."""
    body = format_answer(option) if final else format_tool_call("act", {"option": option})
    return f"<think>{_THOUGHTS[thought]}</think>\n{body}"


def observation_text(category: int, t: int, T: int) -> str:
    """The env's observation after tool turn ``t`` of ``T`` in a given category."""
    if category == CAT_NONE:
        return ""
    return (OBS_PROGRESS, OBS_ERROR, OBS_NEUTRAL)[category].format(t=t, T=T)


def node_text(action: str, observation: str) -> str:
    """The text a forest node holds for one turn (the fast path's convention): the action,
    then the observation on the next line when there is one."""
    return f"{action}\n{observation}" if observation else action


_TOKEN_RE = re.compile(r"</?[a-z_]+>|\s+|\w+|[^\w\s]")


def word_tokens(text: str) -> list[str]:
    """Split text into the word-level tokens of the ``sim`` tokenizer (tags, words,
    whitespace runs and single punctuation marks); joining them restores ``text``."""
    return _TOKEN_RE.findall(text)


# ----------------------------------------------------------------------------- the world


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _values_table(q: np.ndarray, turns: np.ndarray, recovery: float) -> tuple[np.ndarray, np.ndarray]:
    """v_on[i, d], v_off[i, d]: success probability after turn d of task i, on or off track,
    for per-turn correct probabilities q[i, t] (the chain of the module docstring)."""
    n, width = q.shape
    v_on, v_off = np.ones((n, width)), np.zeros((n, width))
    for d in range(width - 2, -1, -1):
        qn = q[:, d + 1]
        qr = qn * recovery
        live = d < turns  # at d >= T_i the episode is over: the value is the latent bit
        v_on[:, d] = np.where(live, qn * v_on[:, d + 1] + (1 - qn) * v_off[:, d + 1], 1.0)
        v_off[:, d] = np.where(live, qr * v_on[:, d + 1] + (1 - qr) * v_off[:, d + 1], 0.0)
    return v_on, v_off


def _solve_skill(p: np.ndarray, turns: np.ndarray, offset: np.ndarray, recovery: float) -> np.ndarray:
    """Skill logits with v_on[i, 0] = p_i (bisection: the root value increases with skill)."""
    lo, hi = np.full(p.size, -40.0), np.full(p.size, 40.0)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        v_on, _ = _values_table(_sigmoid(mid[:, None] + offset), turns, recovery)
        below = v_on[:, 0] < p
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return 0.5 * (lo + hi)


class ContrastLabWorld:
    """The tasks of ContrastLab and the simulated policy's skill on each (shared by the
    env, the fast path and the ``sim`` policy). See the module docstring for the model.

    Tasks ``0 .. n_tasks-1`` form the train split and ``n_tasks .. n_tasks+n_test-1`` the
    test split (index ``j`` of split ``test`` is task ``n_tasks + j``). Everything is a
    deterministic function of ``seed`` and the arguments.

    Args:
        n_tasks: train tasks.
        n_test: held-out tasks (same distribution).
        difficulty: root success distribution, anything :func:`parse_difficulty` takes.
        turns: (fewest, most) turns per task, drawn uniformly (2-6).
        n_options: options per turn (2-8).
        recovery: probability that a correct option brings an off-track agent back.
        obs_noise: probability that an observation is uninformative.
        prompt_signal: probability that a descriptor word comes from the task's own
            difficulty band.
        step_spread: standard deviation of per-turn offsets to the skill logit (0: every
            turn of a task is equally hard).
        seed: seeds the task draw.
    """

    def __init__(
        self,
        n_tasks: int = 2048,
        *,
        n_test: int = 512,
        difficulty: "str | Sequence[float] | Difficulty" = DEFAULT_DIFFICULTY,
        turns: tuple[int, int] = (2, 6),
        n_options: int = 4,
        recovery: float = 0.2,
        obs_noise: float = 0.2,
        prompt_signal: float = 0.5,
        step_spread: float = 0.0,
        seed: int = 0,
    ):
        if n_tasks < 1 or n_test < 0:
            raise ValueError(f"need n_tasks >= 1 and n_test >= 0, got {n_tasks}, {n_test}")
        if n_tasks + n_test > len(_SYLLABLES) ** 4:
            raise ValueError(f"at most {len(_SYLLABLES) ** 4} tasks")
        min_turns, max_turns = (int(x) for x in turns)
        if not 1 <= min_turns <= max_turns:
            raise ValueError(f"turns must be (fewest, most) with 1 <= fewest <= most, got {tuple(turns)}")
        if not 2 <= n_options <= len(OPTIONS):
            raise ValueError(f"n_options must be in [2, {len(OPTIONS)}], got {n_options}")
        for name, x in (("recovery", recovery), ("obs_noise", obs_noise), ("prompt_signal", prompt_signal)):
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {x}")
        if not step_spread >= 0:
            raise ValueError(f"step_spread must be >= 0, got {step_spread}")
        self.difficulty = parse_difficulty(difficulty)
        self.n_tasks, self.n_test = int(n_tasks), int(n_test)
        self.min_turns, self.max_turns = int(min_turns), int(max_turns)
        self.n_options = int(n_options)
        self.options = OPTIONS[: self.n_options]
        self.recovery, self.obs_noise, self.prompt_signal = float(recovery), float(obs_noise), float(prompt_signal)
        self.step_spread = float(step_spread)
        self.seed = int(seed)
        n = self.n_tasks + self.n_test
        rng = np.random.default_rng([self.seed, 0xC0A57])
        self.p0 = self.difficulty.sample(rng, n)
        self.turns = rng.integers(self.min_turns, self.max_turns + 1, size=n)
        self.correct = rng.integers(0, self.n_options, size=(n, self.max_turns + 1))
        perm = rng.permutation(len(_SYLLABLES) ** 4)[:n]
        self.names = ["".join(_SYLLABLES[(k >> (4 * j)) & 15] for j in range(4)) for k in perm]
        self._index = {name: i for i, name in enumerate(self.names)}
        band = np.clip((self.p0 * 10).astype(int), 0, 9)
        own = rng.random((n, 3)) < self.prompt_signal
        bands = np.where(own, band[:, None], rng.integers(0, 10, size=(n, 3)))
        words = rng.integers(0, 10, size=(n, 3))
        domains = rng.integers(0, len(_DOMAINS), size=n)
        self.prompts = [
            f"Task {self.names[i]}: a {' '.join(_BANDS[bands[i, j]][words[i, j]] for j in range(3))} "
            f"{_DOMAINS[domains[i]]} job in {self.turns[i]} steps. At each step call the tool act with the option "
            f"({', '.join(self.options)}) that advances the work; the last step is your answer, <answer>X</answer>."
            for i in range(n)
        ]
        # per-turn offsets of the skill logit (drawn last, so step_spread changes nothing else)
        self.step_offset = self.step_spread * rng.standard_normal((n, self.max_turns + 1))
        self.skill = _solve_skill(self.p0, self.turns, self.step_offset, self.recovery)
        self.shared_skill = 0.0
        self._refresh()

    # ------------------------------------------------------------------ values

    def _refresh(self) -> None:
        # q[i, t]: probability that the policy picks the correct option at turn t of task i
        self.q = _sigmoid(self.skill[:, None] + self.shared_skill + self.step_offset)
        self.v_on, self.v_off = _values_table(self.q, self.turns, self.recovery)

    def value(self, task: "int | np.ndarray", depth: "int | np.ndarray", on_track: "int | np.ndarray") -> np.ndarray:
        """Exact V(H) for prefixes ending after turn ``depth`` of ``task`` in latent state
        ``on_track`` (vectorised; at ``depth == turns`` it is the reward, ``on_track``)."""
        task, depth = np.asarray(task), np.asarray(depth)
        if np.any(depth > self.turns[task]) or np.any(depth < 0):
            raise ValueError("depth must lie in [0, the task's number of turns]")
        return np.where(np.asarray(on_track) > 0, self.v_on[task, depth], self.v_off[task, depth])

    def root_value(self, task: "int | np.ndarray") -> np.ndarray:
        """Success probability of a fresh rollout under the current policy."""
        return self.v_on[np.asarray(task), 0]

    def mean_success(self, split: Split = "train") -> float:
        """Mean root success probability over a split's tasks (a learning curve's y-axis)."""
        return float(self.root_value(self.split_indices(split)).mean())

    # ------------------------------------------------------------------ tasks

    def split_indices(self, split: Split = "train") -> np.ndarray:
        """Global task indices of a split."""
        if split == "train":
            return np.arange(self.n_tasks)
        if split == "test" or split == "validation":
            return np.arange(self.n_tasks, self.n_tasks + self.n_test)
        raise ValueError(f"unknown split {split!r}")

    def size(self, split: Split = "train") -> int:
        """Number of tasks in ``split``."""
        return len(self.split_indices(split))

    def global_index(self, index: int, split: Split = "train") -> int:
        """Global task index of ``index`` in ``split``."""
        idx = self.split_indices(split)
        if not 0 <= index < idx.size:
            raise IndexError(f"ContrastLab {split} split has {idx.size} tasks, no index {index}")
        return int(idx[index])

    def task_id(self, task: int) -> str:
        """Id of global task ``task`` (``contrastlab/<split>/<index>``)."""
        return f"contrastlab/train/{task}" if task < self.n_tasks else f"contrastlab/test/{task - self.n_tasks}"

    def index_of(self, task_id: str) -> int:
        """Global index of a task id (inverse of :meth:`task_id`)."""
        try:
            _, split, index = task_id.rsplit("/", 2)
            return self.global_index(int(index), "train" if split == "train" else "test")
        except (ValueError, IndexError):
            raise KeyError(f"ContrastLab: no task with id {task_id!r}") from None

    def index_of_name(self, name: str) -> int | None:
        """Global index of the task whose prompt names it ``name`` (None if unknown)."""
        return self._index.get(name)

    def get(self, index: int, split: Split = "train") -> Task:
        """Task ``index`` of ``split`` (the :class:`~trace_gym.task.TaskSource` protocol)."""
        i = self.global_index(index, split)
        return Task(
            id=self.task_id(i),
            prompt=self.prompts[i],
            ground_truth=[self.options[c] for c in self.correct[i, 1: self.turns[i] + 1]],
            metadata={"turns": int(self.turns[i]), "name": self.names[i], "initial_success": float(self.p0[i])},
            split="train" if i < self.n_tasks else "test",
        )

    def candidates(self, tasks: np.ndarray) -> list[History]:
        """Root histories for global task indices ``tasks`` (with their exact root value as
        ``oracle`` and their turn count as ``max_turns``), ready for
        :func:`trace_gym.allocator.add_candidates`."""
        v = self.root_value(tasks)
        return [History(self.task_id(int(i)), self.prompts[int(i)], oracle=float(v[k]), max_turns=int(self.turns[int(i)]))
                for k, i in enumerate(tasks)]

    def copy(self) -> "ContrastLabWorld":
        """An independent copy (skills included), e.g. one per allocator in a learning run."""
        return copy.deepcopy(self)

    # ------------------------------------------------------------------ learning mode

    _OPTION_RE = re.compile(r'"option":\s*"([A-Z])"|<answer>\s*([A-Z])\s*</answer>')

    def reinforce(self, forest: Forest, advantages: np.ndarray, lr: float = 1.0, shared_lr: float = 0.1) -> float:
        """One REINFORCE step on the skills from a forest's per-node ``advantages``
        (see the module docstring). Nodes are matched to tasks by ``forest.task_ids`` and to
        the option chosen by their text. Returns the mean absolute per-task gradient."""
        adv = np.asarray(advantages, dtype=np.float64)
        if adv.shape != (len(forest),):
            raise ValueError(f"advantages must have one value per node ({len(forest)}), got shape {adv.shape}")
        nodes = np.flatnonzero((forest.depth > 0) & (adv != 0) & np.isfinite(adv))
        if nodes.size == 0:
            return 0.0
        tree_task = np.array([self.index_of(t) for t in forest.task_ids], dtype=np.int64)
        task = tree_task[forest.tree[nodes]]
        depth = forest.depth[nodes]
        chosen = np.full(nodes.size, -1)
        for k, node in enumerate(nodes):
            m = self._OPTION_RE.search(forest.text[node])
            if m:
                chosen[k] = self.options.find(m.group(1) or m.group(2))
        col = np.minimum(depth, self.max_turns)
        hit = (chosen == self.correct[task, col]).astype(np.float64)
        g = adv[nodes] * (hit - self.q[task, col])
        grad = np.zeros(self.skill.size)
        np.add.at(grad, task, g)
        self.skill += lr * grad
        self.shared_skill += shared_lr * float(g.mean())
        self._refresh()
        touched = np.unique(task)
        return float(np.abs(grad[touched]).mean())


# ----------------------------------------------------------------------------- shared token tables

_TABLES: dict[int, dict[str, Any]] = {}


def _tables(world: ContrastLabWorld) -> dict[str, Any]:
    """Action texts and their token counts, indexed [thought, option, final] (cached per world)."""
    key = id(world)
    t = _TABLES.get(key)
    if t is None or t["world"]() is not world:
        texts = [[[action_text(j, o, bool(f)) for f in (0, 1)] for o in world.options] for j in range(len(_THOUGHTS))]
        n_tok = np.array([[[len(word_tokens(x)) for x in row] for row in grid] for grid in texts], dtype=np.int32)
        t = {"world": weakref.ref(world), "texts": texts, "n_tokens": n_tok}
        _TABLES[key] = t
    return t


# ----------------------------------------------------------------------------- the env


class ContrastLabEnv(AgentEnv):
    """``trace_gym/ContrastLab-v0``: the text face of ContrastLab (see the module docstring).

    Each turn the agent calls ``act`` with an option, or answers with ``<answer>X</answer>``
    on the task's last step. ``info["success_probability"]`` is the exact V(H) of the prefix
    ending at this turn (after ``reset``: the root's), ``info["on_track"]`` the latent bit.

    Args:
        world: the shared :class:`ContrastLabWorld`; when omitted, one is built from
            ``world_kwargs`` (``n_tasks``, ``difficulty``, ``seed`` ... of
            :class:`ContrastLabWorld`; its seed defaults to the env's).
    """

    env_id = "trace_gym/ContrastLab-v0"
    default_max_turns = 6
    system_prompt = SYSTEM_PROMPT

    def __init__(self, *, world: ContrastLabWorld | None = None, seed: int = 0, split: Split = "train",
                 max_turns: int | None = None, render_mode: str | None = None, **world_kwargs: Any):
        super().__init__(seed=seed, split=split, max_turns=max_turns, render_mode=render_mode)
        if world is None:
            world_kwargs.setdefault("seed", seed)
            world = ContrastLabWorld(**world_kwargs)
        elif world_kwargs:
            raise TypeError(f"pass either world= or world arguments, not both (got {sorted(world_kwargs)})")
        self.world = world
        self.max_turns = max(self.max_turns, world.max_turns) if max_turns is None else self.max_turns

    def tasks(self) -> ContrastLabWorld:
        return self.world

    def _task_index(self) -> int:
        assert self.state is not None
        return self.world.index_of(self.state.task.id)

    def build_tools(self, task: Task) -> list[Tool]:
        options = self.world.options

        def act(option: str) -> str:
            """Carry out the current step with one of the options.

            Args:
                option: The option letter for this step.
            """
            return option if option in options else f"Error: option must be one of {', '.join(options)}."

        return [Tool.from_function(act)]

    def initial_tool_state(self, task: Task) -> dict[str, int]:
        return {"on_track": 1}

    def demonstrate(self, task: Task) -> list[str]:
        opts = list(task.ground_truth)
        return [action_text(0, o, k == len(opts) - 1) for k, o in enumerate(opts)]

    def score(self, task: Task, answer: str) -> float:
        # the reward is the latent state after the last turn (see turn); score exists for the API
        return 0.0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = super().reset(seed=seed, options=options)
        i = self._task_index()
        info.update(success_probability=float(self.world.root_value(i)), on_track=1, turns=int(self.world.turns[i]))
        return obs, info

    def turn(self, parsed: ParsedTurn, action: str) -> TurnResult:
        st = self.state
        assert st is not None
        w = self.world
        i = self._task_index()
        t, T = st.turn, int(w.turns[i])
        final = t >= T
        problem = None
        option = None
        if parsed.error is not None:
            problem = self.error_observation(parsed.error)
        elif parsed.answer is not None:
            option = parsed.answer.strip()
            if not final:
                problem = OBS_EARLY.format(t=t, T=T)
        else:
            call = parsed.tool_calls[0]
            if len(parsed.tool_calls) > 1:
                problem = "Error: call act exactly once per step."
            elif call.name != "act":
                problem = self.run_tool_calls([call])  # the tool layer names the unknown tool
            else:
                checked = self._tools["act"].call(call.arguments)
                if checked.startswith("Error"):
                    problem = checked
                else:
                    option = checked
            if final and problem is None:
                problem = OBS_NOT_ANSWER
        correct = problem is None and option == w.options[w.correct[i, t]]
        on = int(st.tool_state["on_track"])
        u = st.rng.random(2)
        on = int(correct and (on == 1 or u[0] < w.recovery))
        st.tool_state["on_track"] = on
        early_end = parsed.answer is not None and not final
        if final or early_end:
            reward = float(on) if final and problem is None else 0.0
            info = {"success_probability": reward, "on_track": on}
            return TurnResult(problem or "", reward=reward, terminated=True, info=info)
        if problem is not None:
            obs = problem
        else:
            cat = CAT_NEUTRAL if u[1] < w.obs_noise else (CAT_PROGRESS if on else CAT_ERROR)
            obs = observation_text(cat, t, T)
        return TurnResult(obs, info={"success_probability": float(w.value(i, t, on)), "on_track": on})


# ----------------------------------------------------------------------------- the fast path


class ContrastLabSim:
    """Vectorised fast path of ContrastLab: grows a :class:`~trace_gym.forest.Forest` with
    the same process as :class:`ContrastLabEnv` driven by the ``sim`` policy at
    temperature 1, all live trajectories at once.

    ``rollout(forest, origins)`` is an :data:`trace_gym.allocator.RolloutFn`: it starts a
    trajectory at every origin (a root, or an inner node it generated earlier) and runs all
    of them to the end. Nodes get ``n_tokens`` (policy tokens), ``oracle`` (exact V), the
    terminal reward and the text ``node_text(action, observation)``. The latent state of
    each node is kept per forest, so branches continue from the exact env state.
    """

    def __init__(self, world: ContrastLabWorld, seed: int = 0):
        self.world = world
        self.rng = np.random.default_rng([int(seed), 0x51A])
        self._latent: "weakref.WeakKeyDictionary[Forest, np.ndarray]" = weakref.WeakKeyDictionary()
        self._tree_task: "weakref.WeakKeyDictionary[Forest, np.ndarray]" = weakref.WeakKeyDictionary()
        tab = _tables(world)
        self._act_tokens = tab["n_tokens"]
        # every node text the fast path can write, indexed [thought, option, final, category, turn, turns]
        T = world.max_turns
        shape = (len(_THOUGHTS), world.n_options, 2, 4, T + 1, T + 1)
        self._shape = shape
        self._texts = [
            node_text(tab["texts"][a][b][c], observation_text(e, f, g))
            for a, b, c, e, f, g in np.ndindex(*shape)
        ]

    def sample_pool(self, size: int, split: Split = "train") -> np.ndarray:
        """``size`` distinct global task indices drawn uniformly from ``split``."""
        idx = self.world.split_indices(split)
        return np.sort(self.rng.choice(idx, size=min(size, idx.size), replace=False))

    def _task_of_trees(self, forest: Forest) -> np.ndarray:
        cached = self._tree_task.get(forest)
        if cached is None or cached.size < forest.n_trees:
            start = 0 if cached is None else cached.size
            new = np.array([self.world.index_of(t) for t in forest.task_ids[start:]], dtype=np.int64)
            cached = new if cached is None else np.concatenate([cached, new])
            self._tree_task[forest] = cached
        return cached

    def _latent_of(self, forest: Forest) -> np.ndarray:
        lat = self._latent.get(forest)
        if lat is None or lat.size < len(forest):
            new = np.ones(max(len(forest), 2 * (0 if lat is None else lat.size)), dtype=np.int8)
            if lat is not None:
                new[: lat.size] = lat
            lat = new
            self._latent[forest] = lat
        return lat

    def rollout(self, forest: Forest, origins: np.ndarray) -> None:
        """Run one trajectory from each node in ``origins`` to its end (see the class docstring)."""
        origins = np.asarray(origins, dtype=np.int64)
        if origins.size == 0:
            return
        w, rng = self.world, self.rng
        tree_task = self._task_of_trees(forest)
        lat = self._latent_of(forest)
        is_root = forest.parent[origins] < 0
        trajs = np.array([forest.start_trajectory(int(o)) for o in origins], dtype=np.int64)
        task = tree_task[forest.tree[origins]]
        depth = forest.depth[origins].astype(np.int64)
        on = np.where(is_root, 1, lat[origins]).astype(np.int8)
        turns = w.turns[task]
        live = np.arange(origins.size)
        while live.size:
            tk, d = task[live], depth[live] + 1
            correct = rng.random(live.size) < w.q[tk, d]
            recover = rng.random(live.size) < w.recovery
            new_on = (correct & ((on[live] == 1) | recover)).astype(np.int8)
            final = d >= turns[live]
            noise = rng.random(live.size) < w.obs_noise
            # the option the policy wrote: the correct one, or a uniformly random wrong one
            wrong = (w.correct[tk, d] + rng.integers(1, w.n_options, size=live.size)) % w.n_options
            option = np.where(correct, w.correct[tk, d], wrong)
            thought = rng.integers(0, len(_THOUGHTS), size=live.size)
            cat = np.where(final, CAT_NONE, np.where(noise, CAT_NEUTRAL, np.where(new_on == 1, CAT_PROGRESS, CAT_ERROR)))
            n_tok = self._act_tokens[thought, option, final.astype(np.int64)]
            oracle = w.value(tk, d, new_on)
            flat = np.ravel_multi_index((thought, option, final.astype(np.int64), cat, d, turns[live]), self._shape)
            table = self._texts
            texts = [table[k] for k in flat.tolist()]
            ids = forest.add_nodes(trajs[live], n_tokens=n_tok, terminal=final, reward=new_on.astype(np.float64),
                                   oracle=oracle, texts=texts)
            lat = self._latent_of(forest)
            lat[ids] = new_on
            on[live] = new_on
            depth[live] = d
            live = live[~final]
