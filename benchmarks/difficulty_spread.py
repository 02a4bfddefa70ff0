"""How unequal a real policy's prompts are, and so how much choosing prompts can gain at most.

    python benchmarks/difficulty_spread.py                          # configs/quick.yaml's warm start
    python benchmarks/difficulty_spread.py --steps 1,2,3,4 --k 16 --set sft.threads=2

Loads a config's policy as its RL run would start (the SFT warm start, built or read from the
cache), takes the candidate prompts its run would be offered at ``--steps`` (``--seed``'s
draw, ``budget.prompts`` a step) and samples ``--k`` complete episodes of each, through the
same rollout engine as training. Then, per prompt, its success rate, and:

* **spread**: the mean success rate, the share of prompts whose k episodes all fail, all
  succeed or mix, and the standard deviation of the prompts' true rates (the sample rates'
  variance less its binomial part).
* **root AUC ceiling**: the AUC, over single episodes, of the prompt's rate estimated from
  its other k - 1 episodes: about what a predictor that knew each prompt's rate would score
  at the roots (a little low: the estimate is noisy). Pooled over every prompt, and the mean
  within each step's candidates (what a step's ``predictor/root_auc`` ranks; a run's figure
  is over the roots its allocator chose, a narrower set).
* **mixed prompts a step**: of the ``budget.trajectories / budget.group_size`` prompts a
  step grpo samples, how many are expected to mix in a group of G: for G rollouts of random
  candidates (grpo), and of the candidates chosen for it by a rate known from half of each
  prompt's episodes and scored on the other half (unbiased: the U-statistic of P(mixed) over
  the held-out half). The difference is what any rule that chooses prompts before sampling
  them (pcl, TRACE's stage 1) can gain on this policy.

``--predictors hashed,hashed:shapes=true,lm`` then replays the steps for each predictor as
pcl would use it on this frozen policy: each step it scores the step's candidates (its AUC
over them, from one half of each prompt's episodes), picks the prompts predicted nearest 1/2
(pcl's ``nearest_half``: the same rule and tie draw) and learns only from those prompts'
first-half episodes; the prompts it picked are scored
on their other half as above (mixed prompts a step, after the first quarter of the steps).
So predictors can be compared on a real policy's prompts before any training run, and
against the ceiling above.

It measures the policy before RL only. Torch runs with ``--threads`` threads (default 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np


def mixed_probability(successes: np.ndarray, n: int, group: int) -> np.ndarray:
    """Unbiased estimate, from ``successes`` out of ``n`` episodes, of the probability that a
    fresh group of ``group`` episodes of the same prompt holds a success and a failure:
    1 - C(s, G)/C(n, G) - C(n - s, G)/C(n, G)."""
    if n < group:
        raise ValueError(f"need at least group={group} episodes per half, got {n}")
    s = np.asarray(successes, dtype=np.int64)
    total = math.comb(n, group)
    return np.array([1.0 - (math.comb(int(a), group) + math.comb(n - int(a), group)) / total for a in s])


def loo_auc(outcomes: np.ndarray) -> float:
    """AUC over every episode of ``outcomes`` ([prompts, k] of 0/1) of its prompt's success
    rate over the other k - 1 episodes."""
    from trace_gym.predictors.calibration import auc

    k = outcomes.shape[1]
    rest = (outcomes.sum(1, keepdims=True) - outcomes) / (k - 1)
    return auc(rest.ravel(), outcomes.ravel().astype(np.float64))


def report(outcomes: np.ndarray, steps: np.ndarray, group: int, per_step: int, seed: int = 0) -> list[str]:
    """The figures of the module docstring for ``outcomes`` ([prompts, k] of 0/1) whose
    prompts were offered at ``steps`` ([prompts]), grpo choosing ``per_step`` prompts a step
    in groups of ``group``."""
    n, k = outcomes.shape
    rate = outcomes.mean(1)
    binomial = float(np.mean(rate * (1 - rate)) / (k - 1))  # E of the sample rate's noise variance
    true_sd = math.sqrt(max(0.0, float(rate.var(ddof=1)) - binomial))
    pooled = loo_auc(outcomes)
    within = [loo_auc(outcomes[steps == s]) for s in np.unique(steps)]
    within = [a for a in within if np.isfinite(a)]
    half = k // 2
    rng = np.random.default_rng(seed)
    grpo, chosen = [], []
    for s in np.unique(steps):
        rows = np.flatnonzero(steps == s)
        for _ in range(20):  # which episodes form each half is arbitrary: average over splits
            perm = rng.permutation(k)
            pick, score = outcomes[rows][:, perm[:half]], outcomes[rows][:, perm[half:]]
            p_mix_sel = mixed_probability(pick.sum(1), half, group)
            p_mix_eval = mixed_probability(score.sum(1), k - half, group)
            best = np.argsort(-(p_mix_sel + 1e-9 * rng.random(rows.size)))[:per_step]
            grpo.append(per_step * p_mix_eval.mean())
            chosen.append(p_mix_eval[best].sum())
    return [f"prompts {n} ({len(np.unique(steps))} steps' candidates), {k} episodes each",
            f"success rate: mean {rate.mean():.3f}; prompts all failed {np.mean(rate == 0):.0%}, all succeeded "
            f"{np.mean(rate == 1):.0%}, mixed {np.mean((rate > 0) & (rate < 1)):.0%}; sd of the true rates {true_sd:.3f}",
            f"root AUC ceiling (each prompt's rate from its other {k - 1} episodes): pooled {pooled:.3f}, "
            f"within a step's candidates {np.mean(within):.3f}",
            f"mixed prompts a step ({per_step} prompts, groups of {group}): random (grpo) {np.mean(grpo):.2f}, "
            f"chosen by a rate known from {half} episodes {np.mean(chosen):.2f} ({np.mean(chosen) / np.mean(grpo):.2f} x)"]


def replay(spec: str, outcomes: np.ndarray, steps: np.ndarray, prompts: list[str], group: int, per_step: int,
           seed: int = 0) -> tuple[float, float]:
    """``(mean AUC over each step's candidates, mixed prompts a step)`` of the predictor
    ``spec`` replayed as the module docstring says (one split of each prompt's episodes)."""
    from trace_gym.allocators.pcl import nearest_half
    from trace_gym.forest.forest import History
    from trace_gym.predictors.base import make_predictor
    from trace_gym.predictors.calibration import auc
    from trace_gym.run import parse_options

    name, kwargs = parse_options(spec, "predictor")
    pred = make_predictor(name, **kwargs)
    rng = np.random.default_rng(seed)
    k = outcomes.shape[1]
    half = k // 2
    aucs, mixed = [], []
    order = np.unique(steps)
    for t, s in enumerate(order):
        rows = np.flatnonzero(steps == s)
        hist = [History(f"{s}/{i}", prompts[i], max_turns=0) for i in rows]
        perm = rng.permutation(k)
        learn, score = outcomes[rows][:, perm[:half]], outcomes[rows][:, perm[half:]]
        p = np.asarray(pred.predict(hist), dtype=np.float64)
        if t > 0:
            a = auc(p, learn.mean(1), np.full(rows.size, float(half)))
            if np.isfinite(a):
                aucs.append(a)
        pick = nearest_half(p, per_step, rng)
        if t >= len(order) // 4:
            mixed.append(mixed_probability(score[pick].sum(1), k - half, group).sum())
        pred.update([hist[i] for i in pick], learn[pick].mean(1), np.full(pick.size, float(half)))
    return float(np.mean(aucs)) if aucs else float("nan"), float(np.mean(mixed))


def sample(cfg, steps: list[int], k: int) -> tuple[np.ndarray, list[int], list[str]]:
    """``(outcomes [prompts, k] of 0/1, step of each prompt, prompts)``: ``k`` episodes of each
    candidate the run of ``cfg`` is offered at ``steps``, from its warm-started policy."""
    from dataclasses import replace

    from trace_gym.policies.base import SamplingParams
    from trace_gym.rollout.source import step_seed
    from trace_gym.task import candidate_indices
    from trace_gym.trainers.evaluate import episode_rewards, sample_episodes
    from trace_gym.trainers.rl import RLTrainer

    t0 = time.perf_counter()
    trainer = RLTrainer(cfg, log=lambda m: None)
    env, policy = trainer.envs[0], trainer.policy
    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
    src = env.tasks()
    size = int(src.size("train"))
    outcomes, step_of, prompts = [], [], []
    for step in steps:
        tasks = [src.get(i, "train") for i in candidate_indices(cfg.seed, step, size, cfg.budget.prompts)]
        forest = sample_episodes(policy, env, tasks, k, replace(params, seed=step_seed(cfg.seed, step)))
        per_tree = np.zeros((len(tasks), k))
        filled = np.zeros(len(tasks), dtype=np.int64)
        for tree, rew in zip(forest.tree[forest.traj_leaf], episode_rewards(forest)):
            per_tree[tree, filled[tree]] = rew >= 0.5
            filled[tree] += 1
        outcomes.append(per_tree)
        step_of += [step] * len(tasks)
        prompts += [t.prompt for t in tasks]
        print(f"step {step}: {len(tasks)} prompts x {k} episodes ({time.perf_counter() - t0:.0f} s)", flush=True)
    return np.concatenate(outcomes), step_of, prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/quick.yaml")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (as trace-gym train's)")
    ap.add_argument("--steps", default="1,2,3,4", help="whose candidates to sample (comma-separated step indices)")
    ap.add_argument("--seed", type=int, default=0, help="the run seed whose candidate draw is sampled")
    ap.add_argument("--k", type=int, default=16, help="episodes per prompt (at least 2 x budget.group_size)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--predictors", default="", help="comma-separated predictor specs to replay (see the module docstring)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write every prompt, its step and its outcomes here")
    ap.add_argument("--from-json", default=None, metavar="FILE", help="read the episodes an earlier --json wrote instead of sampling")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from trace_gym.trainers.config import load_config

    scratch = tempfile.mkdtemp(prefix="difficulty-spread-")  # the trainer's output folder: nothing is kept
    try:
        if args.from_json:
            saved = json.loads(open(args.from_json).read())
            args.config, args.set, args.seed = saved["config"], saved["set"], saved["seed"]
        cfg = load_config(args.config, [*args.set, f"seed={args.seed}", "log.progress=false", "log.tensorboard=false",
                                        f"model.threads={args.threads}", f"output_dir={scratch}"])
        if len(cfg.envs) != 1:
            raise SystemExit("difficulty_spread samples one env's prompts: give a config with one env")
        group, per_step = cfg.budget.group_size, cfg.budget.trajectories // cfg.budget.group_size
        print(f"# difficulty spread: {args.config} {' '.join(args.set)}; seed {args.seed}; torch threads {args.threads}", flush=True)
        if args.from_json:
            rows = saved["prompts"]
            outcomes = np.array([r["outcomes"] for r in rows], dtype=np.float64)
            step_of, prompts = [r["step"] for r in rows], [r["prompt"] for r in rows]
        else:
            steps = [int(s) for s in args.steps.split(",") if s.strip()]
            outcomes, step_of, prompts = sample(cfg, steps, args.k)
        if outcomes.shape[1] < 2 * group:
            raise SystemExit(f"need at least 2 x budget.group_size = {2 * group} episodes a prompt (half picks, half scores)")
        for line in report(outcomes, np.asarray(step_of), group, per_step, seed=args.seed):
            print(line)
        for spec in [x.strip() for x in args.predictors.split(",") if x.strip()]:
            a, m = replay(spec, outcomes, np.asarray(step_of), prompts, group, per_step, seed=args.seed)
            print(f"predictor {spec}: AUC over a step's candidates {a:.3f}; mixed prompts a step with pcl's choice {m:.2f}")
        if args.json:
            rows = [{"step": st, "prompt": pr, "outcomes": o.astype(int).tolist()} for st, pr, o in zip(step_of, prompts, outcomes)]
            with open(args.json, "w") as fh:
                json.dump({"config": args.config, "set": args.set, "seed": args.seed, "prompts": rows}, fh, indent=1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
