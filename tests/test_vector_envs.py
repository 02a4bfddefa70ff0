"""Every registered env vectorised the Gymnasium way: ``SyncVectorEnv`` and ``AsyncVectorEnv``
with their default arguments (the async one with shared memory) return, for the same seeds
and actions, exactly the observations, rewards, flags and infos of the single env.

Gymnasium reads a ``Text`` space's shared memory once, when the vector env is built, so
before :class:`trace_gym.env.base.SharedText` every async observation was the padding
(strings of tabs). Envs that need a missing extra or dataset use the local sample files of
``tests/data`` or are skipped with the reason.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import trace_gym
from trace_gym.env.base import AgentText, EnvUnavailable, SharedText

DATA = Path(__file__).parent / "data"
LOCAL = {
    "trace_gym/ContrastLab-v0": {"n_tasks": 256, "n_test": 64},  # a small world: built six times here
    "trace_gym/GSM8K-v0": {"data_files": {"train": str(DATA / "gsm8k_train.jsonl"), "test": str(DATA / "gsm8k_test.jsonl")}},
    "trace_gym/MATH-v0": {"data_files": str(DATA / "math_sample.jsonl")},
    "trace_gym/HotpotQA-v0": {"data_files": str(DATA / "hotpotqa_distractor_sample.json")},
    "trace_gym/2WikiMultiHopQA-v0": {"data_files": str(DATA / "2wikimultihopqa_sample.json")},
    "trace_gym/MuSiQue-v0": {"data_files": str(DATA / "musique_sample.jsonl")},
}
SEEDS = [3, 11]
STEPS = 2


def _kwargs(env_id: str) -> dict[str, Any]:
    return dict(LOCAL.get(env_id, {}))


def _single(env_id: str):
    try:
        return trace_gym.make(env_id, **_kwargs(env_id))
    except EnvUnavailable as exc:
        pytest.skip(f"{env_id} unavailable here: {exc}")
    except ImportError as exc:
        pytest.skip(f"{env_id} needs an optional package: {exc}")


def _reference(env_id: str) -> tuple[list[list[str]], list[list[tuple]]]:
    """The actions (per seed: the first turns of the task's demonstration, then malformed turns,
    so episodes go through tool and error observations) and what the single env returns for
    them: per seed, the reset and each step, up to the end of the episode (a vector env then
    resets that sub-env)."""
    env = _single(env_id)
    actions, out = [], []
    for seed in SEEDS:
        obs, info = env.reset(seed=seed)
        demo = list(env.demonstrate(env.state.task))[: STEPS - 1]
        turns = (demo + ["<tool_call>{not json</tool_call>"] * STEPS)[:STEPS]
        episode = [(obs, info)]
        for action in turns:
            obs, reward, terminated, truncated, info = env.step(action)
            episode.append((obs, float(reward), bool(terminated), bool(truncated), info))
            if terminated or truncated:
                break
        actions.append(turns)
        out.append(episode)
    env.close()
    return actions, out


def _info_of(infos: dict[str, Any], i: int) -> dict[str, Any]:
    """Sub-env ``i``'s info from a vector env's merged info dict (``key``/``_key`` pairs)."""
    return {k: (_info_of(v, i) if isinstance(v, dict) else v[i]) for k, v in infos.items()
            if not k.startswith("_") and infos.get(f"_{k}", np.ones(len(SEEDS), bool))[i]}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def _check(vec, env_id: str, actions: list[list[str]], ref: list[list[tuple]]) -> None:
    obs, infos = vec.reset(seed=SEEDS)
    assert len(obs) == len(SEEDS)
    for i in range(len(SEEDS)):
        assert obs[i] == ref[i][0][0], f"{env_id}: reset observation of sub-env {i}"
        assert _same(_info_of(infos, i), ref[i][0][1]), f"{env_id}: reset info of sub-env {i}"
    for t in range(STEPS):
        live = [i for i in range(len(SEEDS)) if len(ref[i]) > t + 1]
        if len(live) < len(SEEDS):
            break  # a sub-env finished: the vector env autoresets it at the next step
        obs, rewards, terminated, truncated, infos = vec.step([actions[i][t] for i in range(len(SEEDS))])
        for i in live:
            want_obs, want_reward, want_term, want_trunc, want_info = ref[i][t + 1]
            assert obs[i] == want_obs, f"{env_id}: step {t} observation of sub-env {i}"
            assert (float(rewards[i]), bool(terminated[i]), bool(truncated[i])) == (want_reward, want_term, want_trunc)
            assert _same(_info_of(infos, i), want_info), f"{env_id}: step {t} info of sub-env {i}"


@pytest.mark.parametrize("env_id", trace_gym.env_ids())
def test_sync_and_async_vector_envs_match_the_single_env(env_id):
    actions, ref = _reference(env_id)
    kwargs = _kwargs(env_id)
    fns = [lambda: gym.make(env_id, **kwargs)] * len(SEEDS)
    sync = gym.vector.SyncVectorEnv(fns)
    try:
        _check(sync, env_id, actions, ref)
    finally:
        sync.close()
    vec = gym.vector.AsyncVectorEnv(fns)  # defaults: shared memory on, copy on
    try:
        assert vec.shared_memory
        _check(vec, env_id, actions, ref)
    finally:
        vec.close()


def test_async_observations_are_snapshots_with_copy_and_live_without():
    """With ``copy=False`` the vector env hands out its live shared-memory view (as it does
    for arrays); the default ``copy=True`` returns a plain tuple that later steps leave alone."""
    fns = [lambda: gym.make("trace_gym/MathCalc-v0")] * 2
    vec = gym.vector.AsyncVectorEnv(fns, copy=False)
    try:
        live, _ = vec.reset(seed=[0, 1])
        assert isinstance(live, SharedText)
        before = copy.deepcopy(live)
        assert isinstance(before, tuple) and before == tuple(live) and all(before)
        vec.step(["<tool_call>{bad</tool_call>", "<tool_call>{bad</tool_call>"])
        assert all(o.startswith("Error") for o in live) and not any(o.startswith("Error") for o in before)
    finally:
        vec.close()


def test_text_encoding_round_trips_and_refuses_non_members():
    space = AgentText(64)
    text = "ünïcode ✓ tabs\tand newlines\n"
    flat = space.encode(text)
    assert flat.shape == (64,) and flat.dtype == np.int32
    assert list(flat[: len(text)]) == [space.character_index(c) for c in text]  # gymnasium's own indices
    assert (flat[len(text):] == len(space.character_set)).all()
    assert space.decode(flat) == text
    assert gym.spaces.utils.unflatten(space, gym.spaces.utils.flatten(space, text)) == text
    with pytest.raises(ValueError, match="max_length"):
        space.encode("x" * 65)
    with pytest.raises(ValueError, match="not in the space's charset"):
        space.encode("a\x00b")
