"""Allocators on ContrastLab at an equal budget: the reference workload on several difficulty
distributions, with the acceptance targets checked against the figures.

Reference workload: pool 512 candidate prompts per step drawn from 2048 train tasks,
M = 1024 trajectories per step, 30 steps, m_min = 2, root_fraction = 0.5, G = 8, the world's
default (noisy) cues.

    python benchmarks/allocator_bench.py                   # seed 0: default + 3 more distributions
    python benchmarks/allocator_bench.py --seeds 0,1,2     # three seeds; targets checked on the means
    python benchmarks/allocator_bench.py --steps 10        # quicker
    python benchmarks/allocator_bench.py --world cue_flip=0.0   # the exact cues of earlier versions
    python benchmarks/allocator_bench.py --extra trace:m_min=6:root_fraction=0.75   # more rows

Every distribution runs every built-in allocator (``grpo``, ``uniform``, ``dapo``, ``pcl``,
``knapsack``, ``greso``, ``vip``, the default ``trace``, ``trace-paper``, ``oracle``,
``oracle-er``); the default distribution also runs the stage ablations and
``knapsack:predictor=hashed`` (Knapsack RL on TRACE's predictor). *Competitors* are the
allocators a user would otherwise pick: grpo, uniform, dapo, pcl, knapsack, greso, vip.

Targets, checked on every distribution (means over seeds; PASS/MISS with the figures):

* the default ``trace``'s effective sample ratio under its own advantage >= 1.5 x grpo's;
* ... and >= every competitor's (each under its own advantage);
* ``oracle-er``'s effective ratio >= every allocator's;

and, on the default distribution, GRPO's effective ratio in [25%, 40%] (the simulator's
calibration to the paper's GRPO runs). The last line reads ``targets_met=K/N``. Nothing is
tuned here. Calibration (AUC of each predictor on the bench's one evaluation set, roots and
prefixes apart) is printed beside the Bayes-optimal AUC on the same set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from trace_gym.cli.bench import print_table, world_settings
from trace_gym.sim.bench import DEFAULT_ALLOCATORS, BenchConfig, run_bench
from trace_gym.sim import DEFAULT_DIFFICULTY

OTHERS = ["beta:0.5,0.5", "beta:0.5,2", "beta:2,0.5"]
ALL = DEFAULT_ALLOCATORS.split(",") + ["trace-paper"]
EXTRA = ["knapsack:predictor=hashed"]
COMPETITORS = ("grpo", "uniform", "dapo", "pcl", "knapsack", "greso", "vip")


def _fmt(x, pct=True):
    return "-" if x is None else (f"{100 * x:.1f}%" if pct else f"{x:.3f}")


def _summary(runs: dict[int, dict[str, dict]], diff: str) -> None:
    """Mean (and per-seed) figures of every allocator on one distribution."""
    seeds = sorted(runs)
    specs = list(runs[seeds[0]][diff]["allocators"])
    print(f"\n{diff}: means over seeds {', '.join(map(str, seeds))}")
    print(f"  {'allocator':28s} {'adv.':6s} {'eff. ratio':>10s} {'(per seed)':24s} {'ESR own':>8s} {'ESR grpo':>9s} "
          f"{'ESR trace':>9s} {'AUC roots':>9s} {'AUC pref.':>9s} {'prompts':>7s}")
    mean = lambda xs: statistics.fmean(xs) if xs and all(x is not None for x in xs) else None  # noqa: E731
    for spec in specs:
        rows = [runs[s][diff]["allocators"][spec] for s in seeds]
        er = [r["effective_ratio"] for r in rows]
        by = lambda adv: mean([r["effective_sample_ratio_by_advantage"][adv]["trajectories"] for r in rows])  # noqa: E731
        cal = lambda part: mean([((r["calibration"] or {}).get(part) or {}).get("auc") for r in rows])  # noqa: E731
        print(f"  {spec:28s} {rows[0]['effective_sample_ratio']['advantage'][:6]:6s} {_fmt(mean(er)):>10s} "
              f"{' '.join(_fmt(x) for x in er):24s} {_fmt(mean([r['effective_sample_ratio']['trajectories'] for r in rows])):>8s} "
              f"{_fmt(by('grpo')):>9s} {_fmt(by('trace')):>9s} {_fmt(cal('roots'), False):>9s} {_fmt(cal('prefixes'), False):>9s} "
              f"{statistics.fmean(r['prompts'] for r in rows):7.0f}")
    refs = runs[seeds[0]][diff]["evaluation"]
    print(f"  reference AUCs on the evaluation set (seed {seeds[0]}; prefixes / roots): exact V "
          f"{_fmt(refs['exact']['prefixes']['auc'], False)} / {_fmt(refs['exact']['roots']['auc'], False)}, Bayes-optimal "
          f"{_fmt(refs['bayes']['prefixes']['auc'], False)}, Bayes without the answer key "
          f"{_fmt(refs['bayes_cues']['prefixes']['auc'], False)}, regex on the last observation "
          f"{_fmt(refs['regex']['prefixes']['auc'], False)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=None, help="one seed (same as --seeds N)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default: %(default)s)")
    ap.add_argument("--predictor", default=None,
                    help="predictor for every allocator that uses one, e.g. hashed:counts=false (default: each one's own)")
    ap.add_argument("--world", default="", metavar="K=V,...",
                    help="ContrastLab settings for a sensitivity run, e.g. cue_flip=0.1 (default: the documented defaults)")
    ap.add_argument("--extra", default="", metavar="SPEC,...",
                    help="more allocator specs for every distribution, shown in the summaries (not in the targets), "
                         "e.g. trace:m_min=6:root_fraction=0.75")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    args = ap.parse_args()
    seeds = [args.seed] if args.seed is not None else [int(s) for s in args.seeds.split(",") if s.strip()]
    world = world_settings(args.world)
    diffs = [DEFAULT_DIFFICULTY, *OTHERS]
    runs: dict[int, dict[str, dict]] = {}
    t0 = time.perf_counter()
    for seed in seeds:
        runs[seed] = {}
        for diff in diffs:
            allocs = (ALL + EXTRA if diff == DEFAULT_DIFFICULTY else ALL) + [x for x in args.extra.split(",") if x]
            cfg = BenchConfig(allocators=allocs, difficulty=diff, steps=args.steps, seed=seed, world=world,
                              predictor=args.predictor)
            t = time.perf_counter()
            runs[seed][diff] = run_bench(cfg)
            if len(seeds) == 1:
                print_table(runs[seed][diff])
                print(f"  ({time.perf_counter() - t:.1f} s for {len(allocs)} allocators)\n")
            else:
                print(f"seed {seed} {diff}: {time.perf_counter() - t:.1f} s for {len(allocs)} allocators", flush=True)
    for diff in diffs:
        _summary(runs, diff)
    print()
    checks = []

    def check(label: str, ok: bool, detail: str) -> None:
        checks.append(ok)
        print(f"{'PASS' if ok else 'MISS'}  {label}: {detail}")

    def fig(diff: str, key) -> dict[str, float]:
        """Mean over seeds of ``key(figures)`` per row label."""
        labels = list(runs[seeds[0]][diff]["allocators"])
        return {k: statistics.fmean(key(runs[s][diff]["allocators"][k]) for s in seeds) for k in labels}

    er = fig(DEFAULT_DIFFICULTY, lambda r: r["effective_ratio"])
    check("GRPO effective ratio in [25%, 40%] (default distribution)", 0.25 <= er["grpo"] <= 0.40, f"{er['grpo']:.1%}")
    label = {k: k for k in ALL}
    if args.predictor:  # rows whose predictor was replaced carry it in their name
        cfg = BenchConfig(predictor=args.predictor)
        label = {k: cfg.label(k) for k in ALL}
    for diff in diffs:
        own = fig(diff, lambda r: r["effective_sample_ratio"]["trajectories"])
        er = fig(diff, lambda r: r["effective_ratio"])
        adv = runs[seeds[0]][diff]["allocators"][label["trace"]]["effective_sample_ratio"]["advantage"]
        t, g = own[label["trace"]], own["grpo"]
        check(f"{diff}: trace ESR (own adv. {adv}) >= 1.5 x grpo's", t >= 1.5 * g, f"{t:.1%} vs {g:.1%} = {t / g:.2f} x")
        best = max((c for c in COMPETITORS), key=lambda c: own[label[c]])
        check(f"{diff}: trace ESR (own adv.) >= every competitor's", t >= own[label[best]],
              f"{t:.1%} vs best competitor {best} {own[label[best]]:.1%} ("
              + ", ".join(f"{c} {own[label[c]]:.1%}" for c in COMPETITORS) + ")")
        top = max(er, key=er.get)
        check(f"{diff}: oracle-er effective ratio >= everyone's", er["oracle-er"] >= er[top] - 1e-12,
              f"oracle-er {er['oracle-er']:.1%}, best other {max((k for k in er if k != 'oracle-er'), key=er.get)} "
              f"{max(v for k, v in er.items() if k != 'oracle-er'):.1%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({str(s): r for s, r in runs.items()}, fh, indent=1)
    print(f"total {time.perf_counter() - t0:.1f} s (machine shared; seeds {', '.join(map(str, seeds))})")
    print(f"targets_met={sum(checks)}/{len(checks)}")


if __name__ == "__main__":
    main()
