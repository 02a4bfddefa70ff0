"""ContrastLab's world: tasks, the simulated policy's skills, and the exact success probability V(H) of every prefix.

One :class:`ContrastLabWorld` is read by the env (:mod:`trace_gym.sim.env`), the fast path
(:mod:`trace_gym.sim.fast`) and the ``sim`` policy (:mod:`trace_gym.sim.policy`), which run
the same random process (the env and the fast path are tested to agree in distribution,
``tests/test_contrastlab.py``). The model:

**Tasks.** Task ``i`` has ``T_i`` turns, drawn uniformly from the ``turns`` range (2-6 by
default) independently of its difficulty, and a target root success probability ``p_i``
drawn from the ``difficulty`` distribution (:func:`~trace_gym.sim.difficulty.parse_difficulty`;
default ``0.5*beta:0.3,3+0.5*beta:3,0.3``, bimodal).

**Policy and latent state.** At every turn the policy picks one of ``n_options`` (4)
options; one of them, fixed per (task, turn) and hidden, is correct. The policy picks the
correct one with probability ``q_it = sigmoid(skill_i + shared_skill + offset_it)`` and
otherwise a uniformly random wrong one; the offsets are 0 unless ``step_spread = s`` draws
them from N(0, s^2). The latent *on-track* bit (1 at the start) becomes 0 after a wrong
option; after a correct one it stays 1, or goes from 0 to 1 with probability ``recovery``
(0.2). The last turn is the final answer; the reward is the bit after it. For a prefix
ending after turn ``t`` in state ``s`` the success probability is exact:

    V(H) = v_s(t),   v_on(T_i) = 1, v_off(T_i) = 0,
    v_on(t)  = q v_on(t+1) + (1-q) v_off(t+1),
    v_off(t) = q r v_on(t+1) + (1 - q r) v_off(t+1)      (q = q_i,t+1, r = recovery)

``skill_i`` is set by bisection so that ``v_on(0) = p_i``. ``V(H)`` is the success
probability of continuing from the env state at ``H`` (latent bit included), i.e. of a
branch from ``H``, under the ``sim`` policy at temperature 1.

**Observations.** After a tool turn the env returns, with probability ``obs_noise`` (0.2),
the uninformative ``the tool returned a result``; otherwise it reports the latent bit, as
``progress`` (on track) or a ``tool error`` (off track), *flipped* with probability
``cue_flip`` (0.2: an on-track agent reads ``tool error`` and an off-track one ``progress``).
So ``P(progress | on) = P(error | off) = (1 - obs_noise)(1 - cue_flip)`` and
``P(error | on) = P(progress | off) = (1 - obs_noise) cue_flip``. A malformed action gets an
error observation and counts as a wrong option. The default ``cue_flip`` is the smallest
multiple of 0.05 at which the three-way reading of the last observation (progress / neutral /
error) scores at most 0.75 AUC against the outcome of the default world's prefixes (the
cues of an agent's tools are a hint, not the answer); :mod:`trace_gym.sim.evaluation`
measures it, and the Bayes-optimal posterior of V given the whole history beside it.

**Prompts.** Each prompt names the task (a unique made-up word), its number of steps, a
random domain word and three descriptor words; each descriptor comes, with probability
``prompt_signal`` (0.5), from the ten-word band of the task's difficulty decile, else from
a random band.

**Tokens.** Each policy turn is a ``<think>`` sentence drawn uniformly from a fixed list of
eight (5 to 24 words) followed by a tool call, or by the answer on the last turn. A turn's
token count is its length under the ``sim`` policy's word-level tokenizer; the fast path
uses the same counts.

**Learning mode.** :meth:`ContrastLabWorld.reinforce` applies one REINFORCE step to the
skills from a forest's per-node advantages: for each policy turn with advantage ``A`` that
chose correctly (``c = 1``) or not (``c = 0``) at turn t, ``skill_i += lr * A * (c - q_it)``
(the gradient of ``log pi(option)`` with respect to the correct option's logit), and
``shared_skill`` moves by ``shared_lr`` times the mean of those gradients. With
``normalize=True`` (what :class:`~trace_gym.sim.learning.SimLearning` does by default) the
advantages are first scaled to unit RMS over the turns where they are non-zero, and the
shared skill moves by the mean over *every* generated turn, so an estimator's overall scale
does not set its step and turns without an advantage dilute it (a token-mean loss).

**Not modelled.** Turn lengths do not depend on the latent state; a task's difficulty does
not depend on its length; the policy does not see the latent bit; ``V(H)`` assumes
sampling temperature 1.

Why the simulator is built this way: the README's "Design notes".
"""

from __future__ import annotations

import copy
import re
import weakref
from typing import Any, Sequence

import numpy as np

from trace_gym.forest.forest import History, Forest
from trace_gym.env.react import format_answer, format_tool_call
from trace_gym.task import Split, Task

from trace_gym.sim.difficulty import DEFAULT_DIFFICULTY, OPTIONS, Difficulty, parse_difficulty


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
        cue_flip: probability that an informative observation reports the opposite of the
            latent bit (0: the cue is exact when present; 0.5: it carries nothing).
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
        cue_flip: float = 0.2,
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
        for name, x in (("recovery", recovery), ("obs_noise", obs_noise), ("cue_flip", cue_flip),
                        ("prompt_signal", prompt_signal)):
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
        self.cue_flip = float(cue_flip)
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

    def cue_likelihood(self) -> np.ndarray:
        """``L[category, state]``: the probability of each observation category (progress,
        error, neutral) given the latent bit after the turn (state 0: off track, 1: on)."""
        n, f = self.obs_noise, self.cue_flip
        return np.array([[(1 - n) * f, (1 - n) * (1 - f)],    # progress | off, on
                         [(1 - n) * (1 - f), (1 - n) * f],    # error
                         [n, n]])                             # neutral

    def observation_category(self, on: np.ndarray, u_noise: np.ndarray, u_flip: np.ndarray) -> np.ndarray:
        """The category of the observation after a tool turn ending in latent state ``on``,
        from two uniform draws per turn (shared by the env and the fast path): neutral if
        ``u_noise < obs_noise``, else the bit, flipped if ``u_flip < cue_flip``."""
        reported = np.asarray(on).astype(bool) ^ (np.asarray(u_flip) < self.cue_flip)
        return np.where(np.asarray(u_noise) < self.obs_noise, CAT_NEUTRAL, np.where(reported, CAT_PROGRESS, CAT_ERROR))

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
        :func:`trace_gym.allocation.allocator.add_candidates`."""
        v = self.root_value(tasks)
        return [History(self.task_id(int(i)), self.prompts[int(i)], oracle=float(v[k]), max_turns=int(self.turns[int(i)]))
                for k, i in enumerate(tasks)]

    def copy(self) -> "ContrastLabWorld":
        """An independent copy (skills included), e.g. one per allocator in a learning run."""
        return copy.deepcopy(self)

    # ------------------------------------------------------------------ learning mode

    _OPTION_RE = re.compile(r'"option":\s*"([A-Z])"|<answer>\s*([A-Z])\s*</answer>')

    def reinforce(self, forest: Forest, advantages: np.ndarray, lr: float = 1.0, shared_lr: float = 0.1,
                  normalize: bool = False, prefix_weight: float = 0.0) -> float:
        """One REINFORCE step on the skills from a forest's per-node ``advantages``
        (see the module docstring). Nodes are matched to tasks by ``forest.task_ids`` and to
        the option chosen by their text. Returns the mean absolute per-task gradient.

        ``normalize=False``: plain SGD, ``skill_i += lr * sum_i A (c - q)`` over the task's
        nodes and ``shared += shared_lr * mean A (c - q)`` over the nodes with a non-zero
        advantage; an estimator's overall scale is then its step size.

        ``normalize=True``: the advantages are first divided by their root mean square over
        the nodes where they are non-zero (scale-free, as PPO implementations normalise a
        batch's advantages), and the shared skill moves by ``shared_lr`` times the mean of
        ``A (c - q)`` over *every* generated turn of the forest (as a token-mean loss averages
        over every generated token: turns without an advantage dilute the step, so wasted
        samples cost learning). Per-task steps are sums over the task's turns as above.

        ``prefix_weight`` = alpha counts each turn ``n ** alpha`` times in every sum, mean and
        RMS above (n: the finished trajectories through it), as the trainer's
        ``loss.prefix_weight`` weights a token (:meth:`Forest.prefix_weights`): 0 counts a shared
        turn once, 1 once per trajectory through it."""
        adv = np.asarray(advantages, dtype=np.float64)
        weight = forest.prefix_weights(prefix_weight)  # first: a bad value is refused even when nothing moves
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
        w = weight[nodes]
        a = adv[nodes]
        if normalize:
            a = a / float(np.sqrt(np.sum(w * a**2) / np.sum(w)))
        g = w * a * (hit - self.q[task, col])
        grad = np.zeros(self.skill.size)
        np.add.at(grad, task, g)
        self.skill += lr * grad
        if normalize:
            turns = float(weight[forest.depth > 0].sum())
            self.shared_skill += shared_lr * float(g.sum()) / max(turns, 1.0)
        else:
            self.shared_skill += shared_lr * float(g.sum() / w.sum())
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

