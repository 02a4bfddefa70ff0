"""How high the effective sample ratio can go when a prompt's difficulty is learnt from its
outcomes: the exact Bayesian learner, with the true difficulty distribution, on the
allocation bench's workload.

    python benchmarks/esr_ceiling.py                                  # the four distributions, 3 seeds
    python benchmarks/esr_ceiling.py --difficulty beta:0.5,0.5 --seeds 0,1,2,3,4
    python benchmarks/esr_ceiling.py --difficulty beta:0.80,1.70 --candidates 64 \
        --trajectories 128 --group-size 4 --steps 8 --seeds 0,1,2,3,4,5,6,7,8,9   # a procedural env

Each of ``--pool`` prompts gets a success probability p from ``--difficulty`` (the bench's
parser, so the same distributions as ``trace-gym bench allocators``), and a rollout is a
Bernoulli(p) outcome; there are no turns and no cues. With ``--candidates B`` each step
instead offers B prompts never seen before, as a procedural env (ToolCalls, MathCalc) offers
its candidates: no rule knows anything of a prompt before the step's own rollouts, and the
rules choose among the B. The learner knows the distribution
exactly and keeps every prompt's success and failure counts, so its posterior over p (on a
grid of 400 points, denser near 0 and 1) is exact: nothing that learns a prompt's difficulty from outcomes knows
more. Each step spends M rollouts; the ESR is the share of them in a mixed prompt, where
GRPO's advantage is non-zero, averaged over the steps. Rules:

* ``grpo``: M / G random prompts, G rollouts each.
* ``greedy``: the M / G prompts most likely, under their posterior, to mix in G rollouts,
  G each (pcl with the exact posterior).
* ``thompson``: the same ranking with each p drawn from its posterior (explores).
* ``tree``: stage 1 as ``greedy`` with groups of G / 2; the other half of M then goes one
  rollout at a time where its expected gain in effective trajectories is highest: a
  still-pure prompt gains all of its rollouts plus one if the next outcome disagrees, a
  mixed prompt gains one. It stands for a tree allocator whose branches carry a fresh
  rollout's outcome distribution (V is a martingale); the cues that let a real one pick
  better prefixes are not in this model.
* ``concentrated``: ``tree`` with groups of 3G / 4 on half as many prompts (M / 2G).
* ``oracle``: ``greedy`` with p known.

What it bounds: allocators that learn prompts' difficulty from outcomes (pcl, trace's stage
1) at M / G prompts. It does not bound what reading the turns' cues adds (ContrastLab's
``oracle`` allocator, with exact values at every prefix, is that). Ratios are to ``grpo``'s
ESR on the same seed; intervals are 95% t-intervals over seeds.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from seed_stats import interval  # the benchmarks' 95% t-interval; this script's folder is on sys.path
from trace_gym.sim.difficulty import DEFAULT_DIFFICULTY, parse_difficulty

RULES = ("grpo", "greedy", "thompson", "tree", "concentrated", "oracle")
DISTRIBUTIONS = (DEFAULT_DIFFICULTY, "beta:0.5,0.5", "beta:0.5,2", "beta:2,0.5")
# p = sin^2(pi u / 2) on a uniform u grid: denser near 0 and 1, where U-shaped densities
# (Beta(a, b) with a or b < 1) put their mass; each point's weight carries the Jacobian.
_U = (np.arange(400) + 0.5) / 400
GRID = np.sin(np.pi * _U / 2) ** 2
_JACOBIAN = np.pi / 2 * np.sin(np.pi * _U)


def log_prior(spec: str) -> np.ndarray:
    """The difficulty distribution's log weights on ``GRID`` (normalised over the grid)."""
    d = parse_difficulty(spec)
    if d.values:  # each listed value at its nearest grid point
        nearest = np.abs(np.asarray(d.values, dtype=float)[:, None] - GRID[None, :]).argmin(axis=1)
        dens = np.bincount(nearest, minlength=GRID.size).astype(float) + 1e-12
    else:
        dens = np.zeros(GRID.size)
        for w, a, b in d.components:
            lbeta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
            dens += w * np.exp((a - 1) * np.log(GRID) + (b - 1) * np.log1p(-GRID) - lbeta)
        dens *= _JACOBIAN
    dens /= dens.sum()
    return np.log(dens)


def posterior(prior: np.ndarray, s: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Per prompt, the posterior weights over ``GRID`` after ``s`` successes and ``f`` failures."""
    logw = prior[None, :] + s[:, None] * np.log(GRID)[None, :] + f[:, None] * np.log1p(-GRID)[None, :]
    logw -= logw.max(axis=1, keepdims=True)
    w = np.exp(logw)
    return w / w.sum(axis=1, keepdims=True)


def p_mixed(q: np.ndarray, m: int) -> np.ndarray:
    """Probability that ``m`` rollouts of a prompt with success probability ``q`` are mixed."""
    return 1.0 - q ** m - (1.0 - q) ** m


def run(rule: str, spec: str, seed: int, pool: int, trajectories: int, group: int, steps: int,
        candidates: int | None = None) -> float:
    """Mean ESR over ``steps`` steps of ``rule``. With ``candidates``, each step offers that
    many prompts never seen before (a procedural env's draw; ``pool`` is then unused), so
    what a rule learns of a prompt is only what the step's own rollouts show."""
    rng = np.random.default_rng(seed)
    if candidates is not None:
        pool = steps * candidates
    p = parse_difficulty(spec).sample(rng, pool)
    prior = log_prior(spec)
    s, f = np.zeros(pool), np.zeros(pool)
    pmix_grid = {m: p_mixed(GRID, m) for m in range(1, group + 1)}
    esr = []
    for step in range(steps):
        if rule in ("tree", "concentrated"):
            m1 = group // 2 if rule == "tree" else max(1, (3 * group) // 4)
            n = trajectories // group if rule == "tree" else trajectories // (2 * group)
        else:
            m1, n = group, trajectories // group
        offered = np.arange(pool) if candidates is None else np.arange(step * candidates, (step + 1) * candidates)
        n = min(n, offered.size)
        if rule == "grpo":
            idx = rng.choice(offered, n, replace=False)
        elif rule == "oracle":
            idx = offered[np.argsort(-p_mixed(p[offered], m1))[:n]]
        elif rule == "thompson":
            w = posterior(prior, s[offered], f[offered])
            draw = GRID[(w.cumsum(axis=1) < rng.random((offered.size, 1))).sum(axis=1).clip(0, GRID.size - 1)]
            idx = offered[np.argsort(-p_mixed(draw, m1))[:n]]
        else:
            idx = offered[np.argsort(-(posterior(prior, s[offered], f[offered]) @ pmix_grid[m1]))[:n]]
        succ, size = np.zeros(n), np.zeros(n)

        def roll(target: np.ndarray, k: np.ndarray | int) -> None:
            """``k`` more rollouts of each of the step's prompts ``target``, counted and learnt from."""
            out = rng.binomial(k, p[idx[target]]).astype(float)
            succ[target] += out
            size[target] += k
            s[idx[target]] += out
            f[idx[target]] += k - out

        roll(np.arange(n), m1)
        rest = trajectories - m1 * n
        while rest > 0 and rule in ("tree", "concentrated"):
            mixed = (succ > 0) & (succ < size)
            pure = np.flatnonzero(~mixed)
            mean = posterior(prior, s[idx[pure]], f[idx[pure]]) @ GRID
            gain = np.where(succ[pure] > 0, 1.0 - mean, mean) * (size[pure] + 1.0)
            worth = gain > 1.0
            if not worth.any():
                # the rest goes to the mixed prompts (each rollout there counts); none: to all
                target = np.flatnonzero(mixed) if mixed.any() else np.arange(n)
                k = np.full(target.size, rest // target.size)
                k[: rest % target.size] += 1
                roll(target, k)
                break
            order = pure[worth][np.argsort(-gain[worth])][:rest]  # one more rollout each, best first
            roll(order, 1)
            rest -= order.size
        mixed = (succ > 0) & (succ < size)
        esr.append(float(size[mixed].sum()) / trajectories)
    return float(np.mean(esr))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--difficulty", action="append", help="a difficulty spec; repeatable (default: the bench's four)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--candidates", type=int, default=None,
                    help="B fresh prompts offered per step instead of one pool (procedural envs: ToolCalls, MathCalc)")
    ap.add_argument("--trajectories", type=int, default=1024, help="M per step")
    ap.add_argument("--group-size", type=int, default=8, help="G")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rules", default=",".join(RULES))
    args = ap.parse_args(argv)
    rules = args.rules.split(",")
    for r in rules:
        if r not in RULES:
            ap.error(f"unknown rule {r!r}; known: {', '.join(RULES)}")
    if args.group_size < 2 or args.trajectories < 2 * args.group_size or args.pool < 1 or args.steps < 1:
        ap.error("need --group-size >= 2, --trajectories >= 2 x group size, --pool >= 1, --steps >= 1")
    if args.candidates is not None and args.candidates < 1:
        ap.error("need --candidates >= 1")
    seeds = [int(x) for x in args.seeds.split(",")]
    t0 = time.perf_counter()
    for spec in args.difficulty or DISTRIBUTIONS:
        runs = {r: [run(r, spec, sd, args.pool, args.trajectories, args.group_size, args.steps, args.candidates) for sd in seeds]
                for r in sorted(set(rules) | {"grpo"}, key=RULES.index)}
        offer = f"pool {args.pool}" if args.candidates is None else f"{args.candidates} fresh prompts a step"
        print(f"\n### difficulty {spec}: {offer}, M = {args.trajectories}, G = {args.group_size}, "
              f"{args.steps} steps, seeds {args.seeds}; exact posterior, outcomes only\n")
        print("| rule | ESR % | x grpo |\n|---|---|---|")
        for r in rules:
            m, h = interval([100 * x for x in runs[r]])
            ratio, rh = interval([x / g for x, g in zip(runs[r], runs["grpo"])])
            print(f"| {r} | {m:.1f} ± {h:.1f} | {ratio:.2f} ± {rh:.2f} |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
