"""ContrastLab: difficulty specs, exact values, the env, the sim policy, and the agreement
of the vectorised fast path with the env driven by the sim policy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import trace_gym
from trace_gym.allocation.allocator import add_candidates
from trace_gym.sim import (
    DEFAULT_DIFFICULTY, ContrastLabSim, ContrastLabWorld, DifficultyError, parse_difficulty, word_tokens,
)
from trace_gym.forest.forest import TERMINAL, Forest
from trace_gym.policies.base import SamplingParams


# ----------------------------------------------------------------------------- difficulty specs


def test_difficulty_specs_parse_and_sample(tmp_path):
    rng = np.random.default_rng(0)
    beta = parse_difficulty("beta:2,5")
    assert beta.components == ((1.0, 2.0, 5.0),)
    assert abs(beta.sample(rng, 20000).mean() - 2 / 7) < 0.01
    mix = parse_difficulty("0.5*beta:0.3,3+0.5*beta:3,0.3")
    x = mix.sample(rng, 20000)
    assert 0.4 < (x < 0.5).mean() < 0.6  # two symmetric modes
    path = tmp_path / "p.txt"
    path.write_text("0.1, 0.9\n0.5\n")
    listed = parse_difficulty(str(path))
    assert listed.sample(rng, 5).tolist() == [0.1, 0.9, 0.5, 0.1, 0.9]
    assert parse_difficulty([0.2, 0.4]).values == (0.2, 0.4)


@pytest.mark.parametrize("spec, needle", [
    ("beta:0.3", "two parameters"),
    ("beta:-1,2", "positive"),
    ("0.4*beta:1,1+0.4*beta:2,2", "sum to 0.8"),
    ("0.5*gamma:1,1+0.5*beta:1,1", "unknown distribution"),
    ("x*beta:1,1", "not a number"),
    ("no/such/file.txt", "no file"),
    ("", "give beta"),
    ([0.5, 1.5], "[0, 1]"),
])
def test_bad_difficulty_specs_name_the_problem(spec, needle):
    with pytest.raises(DifficultyError, match=None) as info:
        parse_difficulty(spec)
    assert needle in str(info.value)


# ----------------------------------------------------------------------------- the world's exact values


def _enumerate_value(world: ContrastLabWorld, task: int, depth: int, on: int) -> float:
    """P(success | latent state after turn ``depth``) by summing over every sequence of
    (correct, recovery) draws of the remaining turns: an independent check of the DP."""
    r, left = world.recovery, int(world.turns[task]) - depth
    total = 0.0
    for draws in itertools.product((0, 1), repeat=2 * left):
        p, s = 1.0, on
        for k, (c, u) in enumerate(zip(draws[::2], draws[1::2])):
            q = world.q[task, depth + 1 + k]
            p *= (q if c else 1 - q) * (r if u else 1 - r)
            s = int(c and (s or u))
        total += p * s
    return total


@pytest.mark.parametrize("spread", [0.0, 1.5])
def test_root_value_is_the_drawn_difficulty_and_values_are_exact(spread):
    world = ContrastLabWorld(40, n_test=0, difficulty="beta:0.5,0.5", step_spread=spread, seed=3)
    assert np.allclose(world.root_value(np.arange(40)), world.p0, atol=1e-9)
    for task in range(0, 40, 7):
        for depth in range(int(world.turns[task]) + 1):
            for on in (0, 1):
                assert world.value(task, depth, on) == pytest.approx(_enumerate_value(world, task, depth, on), abs=1e-12)


def test_prompts_carry_difficulty_signal():
    world = ContrastLabWorld(2000, n_test=0, seed=1)
    easy_words = {"trivial", "routine", "elementary", "simple", "basic", "quick"}
    has_easy = np.array([bool(easy_words & set(p.split())) for p in world.prompts])
    assert world.p0[has_easy].mean() > world.p0[~has_easy].mean() + 0.2
    assert len(set(world.names)) == 2000


# ----------------------------------------------------------------------------- the env and the sim policy


def _play(env, policy, task_id: str, seed: int, branch_at: int | None = None):
    """One episode of ``policy`` on ``env``; returns (reward, turns [(obs, n_tokens, info)], snapshot at branch_at)."""
    obs, info = env.reset(seed=seed, options={"task_id": task_id})
    ids = policy.chat_ids(info["messages"])
    turns, snap = [], None
    while True:
        g = policy.generate([ids], SamplingParams())[0]
        obs, reward, term, trunc, info = env.step(g.text)
        turns.append((obs, len(g.token_ids), info))
        ids = ids + g.token_ids + policy.encode("\ntool: " + obs + "\n")
        if branch_at is not None and len(turns) == branch_at:
            snap = (env.snapshot(), list(ids), info["success_probability"])
        if term or trunc:
            return reward, turns, snap


def _category(text: str) -> str:
    last = text.rsplit("\n", 1)[-1]
    return "progress" if last.startswith("progress") else "error" if last.startswith("tool error") else \
        "neutral" if last.startswith("the tool returned") else "none"


@pytest.fixture(scope="module")
def small_world():
    return ContrastLabWorld(6, n_test=2, difficulty=[0.15, 0.5, 0.85, 0.3, 0.7, 0.05], turns=(3, 5), seed=7)


def test_env_episode_with_sim_policy(small_world):
    env = trace_gym.make("trace_gym/ContrastLab-v0", world=small_world)
    policy = trace_gym.make_policy("sim", world=small_world, seed=1)
    task = small_world.get(1)
    obs, info = env.reset(options={"task_id": task.id})
    assert obs == task.prompt and info["success_probability"] == pytest.approx(0.5)
    reward, turns, _ = _play(env, policy, task.id, seed=0)
    assert len(turns) == task.metadata["turns"] and reward in (0.0, 1.0)
    assert turns[-1][2]["success_probability"] == reward
    for obs, n_tok, info in turns[:-1]:
        assert _category(obs) in ("progress", "error", "neutral")
        assert 0 <= info["success_probability"] <= 1


def test_env_turns_with_bad_actions_are_errors_not_exceptions(small_world):
    env = trace_gym.make("trace_gym/ContrastLab-v0", world=small_world)
    task = small_world.get(int(np.argmax(small_world.turns[: small_world.n_tasks])))
    assert task.metadata["turns"] >= 4
    env.reset(options={"task_id": task.id})
    obs, r, term, trunc, info = env.step("no tags at all")
    assert obs.startswith("Error") and not term and info["on_track"] == 0
    obs, r, term, trunc, info = env.step('<tool_call>{"name": "act", "arguments": {"option": "Z"}}</tool_call>')
    assert "option must be one of" in obs and not term
    obs, r, term, trunc, info = env.step("<answer>A</answer>")  # answering before the last step
    assert term and r == 0.0 and "ends the episode unsolved" in obs


def test_demonstration_solves_the_task(small_world):
    env = trace_gym.make("trace_gym/ContrastLab-v0", world=small_world)
    for index in range(small_world.n_tasks):
        task = small_world.get(index)
        env.reset(options={"task_id": task.id})
        for action in env.demonstrate(task):
            obs, reward, term, trunc, info = env.step(action)
        assert term and reward == 1.0


def test_tokenizer_round_trips_and_policy_reports_logprobs(small_world):
    policy = trace_gym.make_policy("sim", world=small_world, seed=0)
    text = small_world.prompts[2] + "\n" + "progress: step 1 of 4 is done and the partial result checks out."
    assert policy.decode(policy.encode(text)) == text
    ids = policy.encode(small_world.prompts[2])
    gens = policy.generate([ids] * 200, SamplingParams(seed=5))
    q = policy.correct_probability(2, 1)
    correct = np.array([g.info["correct"] for g in gens])
    assert abs(correct.mean() - q) < 4 * math.sqrt(q * (1 - q) / 200)
    g = gens[0]
    assert g.text == policy.decode(g.token_ids) and len(g.logprobs) == len(g.token_ids)
    expected = math.log(q) if g.info["correct"] else math.log((1 - q) / (small_world.n_options - 1))
    assert sum(g.logprobs) == pytest.approx(expected - math.log(8))
    cold = policy.correct_probability(2, 1, temperature=0.5)
    assert (cold > q) == (q > 1 / small_world.n_options)
    cut = policy.generate([ids], SamplingParams(max_new_tokens=3))[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
    with pytest.raises(ValueError, match="names no ContrastLab task"):
        policy.generate([policy.encode("hello there")], SamplingParams())


def test_snapshot_restore_branches_reproducibly(small_world):
    env = trace_gym.make("trace_gym/ContrastLab-v0", world=small_world)
    policy = trace_gym.make_policy("sim", world=small_world, seed=2)
    _, _, (snap, ids, v) = _play(env, policy, small_world.task_id(1), seed=0, branch_at=1)

    def continue_from(branch_id):
        env.restore(snap, branch_id=branch_id)
        p = trace_gym.make_policy("sim", world=small_world, seed=branch_id)
        cur = list(ids)
        while True:
            g = p.generate([cur], SamplingParams())[0]
            obs, reward, term, trunc, info = env.step(g.text)
            cur += g.token_ids + p.encode("\ntool: " + obs + "\n")
            if term or trunc:
                return reward

    assert continue_from(3) == continue_from(3)
    rewards = np.array([continue_from(b) for b in range(400)])
    assert abs(rewards.mean() - v) < 4.5 * math.sqrt(v * (1 - v) / 400) + 1e-9


# ----------------------------------------------------------------------------- fast path == env path


def test_fast_path_agrees_with_env_path_in_distribution(small_world):
    tasks = [0, 1, 2]
    n_env, n_fast = 300, 3000
    env = trace_gym.make("trace_gym/ContrastLab-v0", world=small_world)
    policy = trace_gym.make_policy("sim", world=small_world, seed=11)
    env_stats, fast_stats = {}, {}
    for t in tasks:
        rewards, cats, toks = [], [], []
        for ep in range(n_env):
            reward, turns, _ = _play(env, policy, small_world.task_id(t), seed=ep)
            rewards.append(reward)
            cats += [_category(o) for o, _, _ in turns[:-1]]
            toks += [n for _, n, _ in turns]
        env_stats[t] = (np.mean(rewards), cats, np.mean(toks))
    forest = Forest()
    add_candidates(forest, small_world.candidates(np.array(tasks)))
    ContrastLabSim(small_world, seed=4).rollout(forest, np.repeat(forest.root_nodes.astype(np.int64), n_fast))
    for k, t in enumerate(tasks):
        nodes = np.flatnonzero(forest.tree == k)[1:]
        leaves = nodes[(forest.flags[nodes] & TERMINAL) > 0]
        inner = nodes[(forest.flags[nodes] & TERMINAL) == 0]
        fast_stats[t] = (forest.reward[leaves].mean(), [_category(forest.text[i]) for i in inner], forest.n_tokens[nodes].mean())
    for t in tasks:
        p = small_world.root_value(t)
        (er, ecats, etok), (fr, fcats, ftok) = env_stats[t], fast_stats[t]
        for rate, n in ((er, n_env), (fr, n_fast)):  # both match the exact value
            assert abs(rate - p) < 4.5 * math.sqrt(p * (1 - p) / n) + 1e-9
        for c in ("progress", "error", "neutral"):
            a, b = ecats.count(c) / len(ecats), fcats.count(c) / len(fcats)
            assert abs(a - b) < 4.5 * math.sqrt(b * (1 - b) / len(ecats)) + 0.01, (t, c, a, b)
        assert abs(etok - ftok) < 0.08 * ftok


def test_fast_path_branches_continue_from_the_exact_state(small_world):
    forest = Forest()
    add_candidates(forest, small_world.candidates(np.array([1])))
    sim = ContrastLabSim(small_world, seed=0)
    sim.rollout(forest, np.repeat(forest.root_nodes.astype(np.int64), 50))
    inner = forest.branchable()
    on = inner[np.isclose(forest.oracle[inner], small_world.value(1, forest.depth[inner], 1))]
    off = inner[~np.isin(inner, on)]
    for node in (on[0], off[0]):
        before = len(forest)
        sim.rollout(forest, np.full(2000, node))
        new = np.arange(before, len(forest))
        leaves = new[(forest.flags[new] & TERMINAL) > 0]
        v = forest.oracle[node]
        assert abs(forest.reward[leaves].mean() - v) < 4.5 * math.sqrt(v * (1 - v) / 2000) + 1e-9


# ----------------------------------------------------------------------------- learning mode


def test_learning_mode_improves_trained_tasks_only_with_contrast():
    world = ContrastLabWorld(64, n_test=16, seed=0)
    sim = ContrastLabSim(world, seed=0)
    start_train, start_test = world.mean_success("train"), world.mean_success("test")
    forest = Forest()
    add_candidates(forest, world.candidates(np.arange(64)))
    sim.rollout(forest, np.repeat(forest.root_nodes.astype(np.int64), 8))
    skills = world.skill.copy()
    assert world.reinforce(forest, np.zeros(len(forest))) == 0.0
    assert np.array_equal(world.skill, skills)
    for _ in range(15):
        forest = Forest()
        add_candidates(forest, world.candidates(np.arange(64)))
        sim.rollout(forest, np.repeat(forest.root_nodes.astype(np.int64), 8))
        world.reinforce(forest, forest.advantages("trace"), lr=2.0)
    assert world.mean_success("train") > start_train + 0.05
    assert world.mean_success("test") > start_test  # the shared skill transfers a little


def test_default_difficulty_gives_grpo_a_minority_of_mixed_groups():
    p = parse_difficulty(DEFAULT_DIFFICULTY).sample(np.random.default_rng(0), 100_000)
    mixed = np.mean(1 - p**8 - (1 - p) ** 8)
    assert 0.25 <= mixed <= 0.40


def test_word_tokens_join_back():
    text = 'x <think>a, b</think>\n<tool_call>{"k": 1}</tool_call>'
    assert "".join(word_tokens(text)) == text


# ----------------------------------------------------------------------------- honest cues and the evaluation set

from trace_gym.sim.evaluation import bayes_values, evaluation_set, last_observation_score  # noqa: E402
from trace_gym.sim.world import CAT_ERROR, CAT_NEUTRAL, CAT_PROGRESS  # noqa: E402


def test_default_cue_flip_is_the_smallest_that_keeps_the_regex_at_most_075_auc():
    """The documented rule for the default: the regex on the last observation scores at most
    0.75 AUC on the default world, and 0.05 less flipping would score above it."""
    regex = {}
    for flip in (None, 0.15, 0.0):
        kwargs = {} if flip is None else {"cue_flip": flip}
        world = ContrastLabWorld(2048, n_test=0, seed=0, **kwargs)
        regex[flip] = evaluation_set(world).references()["regex"]["prefixes"]["auc"]
    assert ContrastLabWorld(8, n_test=0).cue_flip == 0.2
    assert 0.6 < regex[None] <= 0.75 < regex[0.15]
    assert regex[0.0] > 0.85  # exact cues: the answer is nearly in the last observation


def test_observation_categories_follow_the_flip_and_noise_rates():
    world = ContrastLabWorld(4, n_test=0, obs_noise=0.25, cue_flip=0.1, seed=0)
    rng = np.random.default_rng(0)
    n = 200_000
    for on in (0, 1):
        cat = world.observation_category(np.full(n, on), rng.random(n), rng.random(n))
        rates = [np.mean(cat == c) for c in (CAT_PROGRESS, CAT_ERROR, CAT_NEUTRAL)]
        assert np.allclose(rates, world.cue_likelihood()[:, on], atol=0.005)
    assert last_observation_score("x\nprogress: step 1 of 3") == 1.0
    assert last_observation_score("x\ntool error: step 1") == 0.0
    assert last_observation_score("x\nthe tool returned a result") == 0.5


def _posterior_by_enumeration(world, info, forest, node, answer_key):
    """P(on track after ``node``) by enumerating the unobserved draws along its path: the
    recoveries, and without the answer key also whether each choice was right."""
    path = forest.path(node)
    task = world.index_of(forest.task_ids[forest.tree[node]])
    like = world.cue_likelihood()
    choices = (None,) if answer_key else (0, 1)
    num = den = 0.0
    for combo in itertools.product(itertools.product(choices, (0, 1)), repeat=len(path)):
        p, s = 1.0, 1
        for k, (i, (c, u)) in enumerate(zip(path, combo)):
            q = world.q[task, k + 1]
            if answer_key:
                c = int(info["correct"][i])
            else:
                p *= q if c else 1 - q
            p *= world.recovery if u else 1 - world.recovery
            s = int(c and (s or u))
            if info["category"][i] != 3:  # no observation after the final turn
                p *= like[info["category"][i], s]
        num += p * s
        den += p
    return num / den


def test_bayes_posteriors_are_calibrated_and_ordered():
    world = ContrastLabWorld(64, n_test=0, turns=(2, 5), seed=4)
    ev = evaluation_set(world, prompts=64, rollouts=20, seed=1)
    forest = ev.forest
    assert ev.bayes.shape == (len(forest),)
    # calibration: V - posterior has mean 0 within any group that the history determines
    depth = forest.depth[ev.prefixes]
    last = np.array([last_observation_score(forest.text[i]) for i in ev.prefixes])
    for post in (ev.bayes, ev.bayes_cues):
        err = ev.truth[ev.prefixes] - post[ev.prefixes]
        for d in np.unique(depth):
            for c in (0.0, 0.5, 1.0):
                sel = (depth == d) & (last == c)
                if sel.sum() >= 200:
                    tol = 0.02 + 4 * err[sel].std() / math.sqrt(sel.sum())
                    assert abs(err[sel].mean()) < tol, (d, c, err[sel].mean())
    # the answer key can only help; both beat the regex
    refs = ev.references()
    assert refs["bayes"]["prefixes"]["auc"] >= refs["bayes_cues"]["prefixes"]["auc"] - 1e-9
    assert refs["bayes_cues"]["prefixes"]["auc"] > refs["regex"]["prefixes"]["auc"]
    assert refs["exact"]["prefixes"]["auc"] >= refs["bayes"]["prefixes"]["auc"] - 1e-9


def test_bayes_filter_equals_brute_force_posterior():
    world = ContrastLabWorld(16, n_test=0, turns=(3, 4), seed=6)
    forest = Forest()
    add_candidates(forest, world.candidates(np.arange(16)))
    sim = ContrastLabSim(world, seed=2)
    sim.rollout(forest, np.repeat(forest.root_nodes.astype(np.int64), 6))
    info = sim.node_info(forest)
    inner = forest.branchable()
    task = np.array([world.index_of(t) for t in forest.task_ids])[forest.tree]
    for key in (True, False):
        post = bayes_values(world, forest, info, answer_key=key)
        for node in inner[:: max(1, inner.size // 40)]:
            p_on = _posterior_by_enumeration(world, info, forest, int(node), key)
            d = int(forest.depth[node])
            expect = p_on * world.v_on[task[node], d] + (1 - p_on) * world.v_off[task[node], d]
            assert post[node] == pytest.approx(expect, abs=1e-9)
    # the info the fast path records agrees with what it wrote
    leaves = forest.leaves()
    assert np.array_equal(info["latent"][leaves], forest.reward[leaves].astype(np.int8))
    for i in inner[:50]:
        assert last_observation_score(forest.text[i]) == {CAT_PROGRESS: 1.0, CAT_ERROR: 0.0, CAT_NEUTRAL: 0.5}[int(info["category"][i])]


def test_normalised_learning_steps_ignore_the_advantages_scale_and_charge_for_waste():
    world = ContrastLabWorld(32, n_test=8, seed=1)
    forest = Forest()
    add_candidates(forest, world.candidates(np.arange(32)))
    sim = ContrastLabSim(world, seed=1)
    sim.rollout(forest, np.repeat(forest.root_nodes.astype(np.int64), 8))
    adv = forest.advantages("grpo")
    skills = {}
    for normalize in (True, False):
        for scale in (1.0, 10.0):
            w = world.copy()
            w.reinforce(forest, scale * adv, lr=0.5, shared_lr=0.5, normalize=normalize)
            skills[normalize, scale] = (w.skill.copy(), w.shared_skill)
    assert np.allclose(skills[True, 1.0][0], skills[True, 10.0][0]) and skills[True, 1.0][1] == pytest.approx(skills[True, 10.0][1])
    assert not np.allclose(skills[False, 1.0][0], skills[False, 10.0][0])
    # by hand: the shared step is the mean of A (c - q) over every generated turn, A at unit RMS where non-zero
    info = sim.node_info(forest)
    task = np.array([world.index_of(t) for t in forest.task_ids])[forest.tree]
    nz = np.flatnonzero((forest.depth > 0) & (adv != 0))
    a = adv[nz] / np.sqrt(np.mean(adv[nz] ** 2))
    g = a * (info["correct"][nz] - world.q[task[nz], forest.depth[nz]])
    turns = np.count_nonzero(forest.depth > 0)
    assert skills[True, 1.0][1] - world.shared_skill == pytest.approx(0.5 * g.sum() / turns)
    per_task = np.zeros(world.skill.size)
    np.add.at(per_task, task[nz], g)
    assert np.allclose(skills[True, 1.0][0] - world.skill, 0.5 * per_task)


def test_prefix_weight_one_steps_as_if_every_trajectory_repeated_its_prefix():
    """``prefix_weight=1`` counts a turn shared by n trajectories n times: on a branched forest
    the plain step equals the step on the same trajectories with their prefixes repeated
    (each turn carrying its trajectory's leaf advantage); the scale-free step points the same
    way (its RMS is over the weighted turns, a different scalar)."""
    import forest_reference as ref

    world = ContrastLabWorld(16, n_test=4, seed=2)
    sim = ContrastLabSim(world, seed=2)
    forest = Forest()
    add_candidates(forest, world.candidates(np.arange(16)))
    sim.rollout(forest, np.repeat(forest.root_nodes.astype(np.int64), 2))
    sim.rollout(forest, forest.branchable()[::2].astype(np.int64))
    assert forest.n_trajectories > 32
    leaf_adv, adv = ref.leaf_advantages(forest, 2)
    flat, flat_adv = ref.unrolled(forest, leaf_adv)
    steps = {}
    for normalize in (False, True):
        for name, f, a, pw in (("weighted", forest, adv, 1.0), ("repeated", flat, flat_adv, 0.0), ("once", forest, adv, 0.0)):
            w = world.copy()
            w.reinforce(f, a, lr=0.5, shared_lr=0.5, normalize=normalize, prefix_weight=pw)
            steps[normalize, name] = np.append(w.skill - world.skill, w.shared_skill - world.shared_skill)
    assert np.allclose(steps[False, "weighted"], steps[False, "repeated"], rtol=1e-9, atol=1e-12)
    cos = steps[True, "weighted"] @ steps[True, "repeated"] / np.linalg.norm(steps[True, "weighted"]) / np.linalg.norm(steps[True, "repeated"])
    assert cos == pytest.approx(1.0, abs=1e-9)
    assert not np.allclose(steps[False, "once"], steps[False, "repeated"], rtol=1e-3)
    with pytest.raises(ValueError, match="prefix_weight"):
        world.copy().reinforce(forest, adv, prefix_weight=1.5)
