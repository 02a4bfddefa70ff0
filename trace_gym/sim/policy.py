"""The ``sim`` policy: ContrastLab's simulated agent behind the token-level Policy interface.

It reads the task from its token prefix (the task's name word in the prompt) and the turn
from the number of ``<think>`` tokens after it, then samples one turn exactly as the
ContrastLab model says (see :mod:`trace_gym.sim.world`): the task's correct option
with probability ``q_i``, otherwise a uniformly random wrong one, after one of a fixed list
of thought sentences. It shares its :class:`~trace_gym.sim.world.ContrastLabWorld`
with the env, so the env's exact ``V(H)`` is the success probability under this policy.

Tokens come from :class:`WordTokenizer`, a word-level tokenizer over ContrastLab's own
vocabulary (words, tags, punctuation and whitespace runs; anything else is ``<unk>``), so
the rollout engine can drive it token in, token out. No torch.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import numpy as np

from trace_gym.sim.world import (
    OBS_EARLY, OBS_ERROR, OBS_NEUTRAL, OBS_NOT_ANSWER, OBS_PROGRESS, SYSTEM_PROMPT, _THOUGHTS, ContrastLabWorld,
    action_text, word_tokens,
)
from trace_gym.forest.forest import Forest
from trace_gym.policies.base import Generation, Policy, SamplingParams


class WordTokenizer:
    """Word-level tokenizer: ``encode(text)`` splits with
    :func:`~trace_gym.sim.world.word_tokens` and maps each piece to its id (``<unk>``,
    id 0, for pieces outside the vocabulary); ``decode(ids)`` joins the pieces back, so
    ``decode(encode(text)) == text`` for any text made of known pieces."""

    unk = "<unk>"

    def __init__(self, vocab: Sequence[str]):
        pieces = [self.unk] + sorted(set(vocab) - {self.unk})
        self.id_to_piece = pieces
        self.piece_to_id = {p: i for i, p in enumerate(pieces)}

    @classmethod
    def for_world(cls, world: ContrastLabWorld) -> "WordTokenizer":
        """The vocabulary of everything ``world``'s env and policy can write."""
        texts = [SYSTEM_PROMPT, *world.prompts, "user: ", "assistant: ", "system: ", "tool: ", "\n", " "]
        for j in range(len(_THOUGHTS)):
            for o in world.options:
                texts += [action_text(j, o, False), action_text(j, o, True)]
        for T in range(1, world.max_turns + 1):
            for t in range(1, T + 1):
                texts += [s.format(t=t, T=T) for s in (OBS_PROGRESS, OBS_ERROR, OBS_NEUTRAL, OBS_EARLY)]
        texts += [OBS_NOT_ANSWER, "0123456789", *"0123456789"]
        vocab: set[str] = set()
        for text in texts:
            vocab.update(word_tokens(text))
        return cls(sorted(vocab))

    def __len__(self) -> int:
        return len(self.id_to_piece)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        get = self.piece_to_id.get
        return [get(p, 0) for p in word_tokens(text)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return "".join(self.id_to_piece[i] for i in ids)


class SimPolicy(Policy):
    """ContrastLab's simulated agent (see the module docstring).

    Args:
        world: the :class:`ContrastLabWorld` shared with the env (``env.world``); when
            omitted, one is built from ``world_kwargs`` (same defaults as the env, so a
            default env and a default policy agree).
        seed: seeds sampling when ``SamplingParams.seed`` is not given.
        call_latency_s, prompt_latency_s: each :meth:`generate` call sleeps
            ``call_latency_s + prompt_latency_s x prompts`` (a simulated accelerator, for
            scale-out benchmarks of several engines). Timing only: samples do not change.

    ``SamplingParams.temperature`` scales the option logits (the env's ``V(H)`` is exact at
    temperature 1); ``max_new_tokens`` truncates a turn (``finish_reason="length"``).
    """

    name = "sim"

    def __init__(self, world: ContrastLabWorld | None = None, seed: int = 0, *, call_latency_s: float = 0.0,
                 prompt_latency_s: float = 0.0, **world_kwargs: Any):
        if call_latency_s < 0 or prompt_latency_s < 0:
            raise ValueError(f"latencies must be >= 0, got {call_latency_s}, {prompt_latency_s}")
        self.call_latency_s, self.prompt_latency_s = float(call_latency_s), float(prompt_latency_s)
        if world is None:
            world = ContrastLabWorld(**world_kwargs)
        elif world_kwargs:
            raise TypeError(f"pass either world= or world arguments, not both (got {sorted(world_kwargs)})")
        self.world = world
        self.tokenizer = WordTokenizer.for_world(world)
        self.rng = np.random.default_rng([int(seed), 0x5151])
        pid = self.tokenizer.piece_to_id
        self._name_ids = {pid[n]: i for i, n in enumerate(world.names)}
        self._think_id = pid["<think>"]
        self._option_ids = {pid[o]: k for k, o in enumerate(world.options)}

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (the policy's tokenizer)."""
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode(ids)

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of chat messages, each rendered as ``"<role>: <content>\\n"`` (the sim's
        chat template)."""
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages))

    def render_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """The opening chat (:meth:`chat_ids`) and the first ``"assistant: "`` header. The
        sim knows its one tool, so ``tools`` is not rendered."""
        return self.chat_ids(messages) + self.encode("assistant: ")

    def render_observation(self, observation: str, *, role: str = "tool", closed: bool = True) -> list[int]:
        """A newline closing the turn, the observation as a ``role`` message, and the next
        ``"assistant: "`` header."""
        return self.encode("\n") + self.chat_ids([{"role": role, "content": observation}]) + self.encode("assistant: ")

    # ------------------------------------------------------------------ generation

    def locate(self, prefix: Sequence[int]) -> tuple[int, int]:
        """(global task index, turn about to be played, 1-based) read from a token prefix."""
        task, pos = None, -1
        for k in range(len(prefix) - 1, -1, -1):
            i = self._name_ids.get(prefix[k])
            if i is not None:
                task, pos = i, k
                break
        if task is None:
            raise ValueError("sim policy: the prefix names no ContrastLab task (is it the prompt of a ContrastLab env of the same world?)")
        turns_done = sum(1 for tok in prefix[pos + 1:] if tok == self._think_id)
        return task, turns_done + 1

    def correct_probability(self, task: int, turn: int = 1, temperature: float = 1.0) -> float:
        """Probability that the policy picks the correct option at ``turn`` of ``task``."""
        w = self.world
        z = w.skill[task] + w.shared_skill + w.step_offset[task, min(max(turn, 0), w.max_turns)]
        if temperature == 1.0:
            return float(1.0 / (1.0 + math.exp(-z)))
        k = self.world.n_options - 1
        logit = (z + math.log(k)) / max(temperature, 1e-6)
        return float(1.0 / (1.0 + k * math.exp(-logit))) if logit > -700 else 0.0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        if self.call_latency_s or self.prompt_latency_s:
            time.sleep(self.call_latency_s + self.prompt_latency_s * len(prompts))
        rng = np.random.default_rng(params.seed) if params.seed is not None else self.rng
        w = self.world
        out = []
        n_thoughts = len(_THOUGHTS)
        for prefix in prompts:
            task, t = self.locate(prefix)
            final = t >= int(w.turns[task])
            col = min(t, w.max_turns)
            q = self.correct_probability(task, col, params.temperature)
            right = int(w.correct[task, col])
            u = rng.random(3)
            correct = u[0] < q
            option = right if correct else (right + 1 + int(u[1] * (w.n_options - 1))) % w.n_options
            thought = int(u[2] * n_thoughts)
            text = action_text(thought, w.options[option], final)
            ids = self.encode(text)
            logprobs = [0.0] * len(ids)
            logprobs[0] = -math.log(n_thoughts)
            opt_pos = max(k for k, tok in enumerate(ids) if tok in self._option_ids)
            p_opt = q if correct else (1.0 - q) / (w.n_options - 1)
            logprobs[opt_pos] = math.log(max(p_opt, 1e-300))
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, logprobs, finish = ids[: params.max_new_tokens], logprobs[: params.max_new_tokens], "length"
                text = self.decode(ids)
            out.append(Generation(ids, logprobs, text, finish, info={"task": w.task_id(task), "turn": t, "correct": bool(correct)}))
        return out

    # ------------------------------------------------------------------ learning mode

    def learn(self, forest: Forest, advantages: np.ndarray, lr: float = 1.0, shared_lr: float = 0.1) -> float:
        """One REINFORCE step of the simulated policy on a forest's per-node advantages
        (:meth:`ContrastLabWorld.reinforce`); the shared world, hence the env's V(H), changes."""
        return self.world.reinforce(forest, advantages, lr=lr, shared_lr=shared_lr)
