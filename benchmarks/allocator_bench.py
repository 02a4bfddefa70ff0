"""Allocators on ContrastLab at an equal budget: the reference workload of issue #2 on
several difficulty distributions, with the acceptance targets checked against the figures.

Reference workload: pool 512 candidate prompts per step drawn from 2048 train tasks,
M = 1024 trajectories per step, 30 steps, m_min = 2, root_fraction = 0.5, G = 8.

    python benchmarks/allocator_bench.py                 # default + 3 more distributions
    python benchmarks/allocator_bench.py --steps 10      # quicker

Targets (issue #2): GRPO effective ratio in [25%, 40%] on the default distribution;
TRACE effective ratio >= 60% and >= 0.85 x oracle; TRACE effective sample ratio >= 1.8 x
GRPO's; oracle >= trace > uniform > grpo (effective ratio) on at least three distributions.
Each figure is printed next to its target with PASS/MISS; nothing is tuned here.
The last line reads ``targets_met=K/N ordering_distributions=D``.
"""

from __future__ import annotations

import argparse
import json
import time

from trace_gym.bench import DEFAULT_ALLOCATORS, BenchConfig, print_table, run_bench
from trace_gym.envs.contrastlab import DEFAULT_DIFFICULTY

OTHERS = ["beta:0.5,0.5", "beta:0.5,2", "beta:2,0.5"]
CORE = ["grpo", "uniform", "trace", "oracle", "pcl"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world", default="", metavar="K=V,...",
                    help="ContrastLab settings for a sensitivity run, e.g. prompt_signal=0.8 (default: the documented defaults)")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    args = ap.parse_args()
    world = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.world.split(",") if item)}
    runs = {}
    t0 = time.perf_counter()
    for diff in [DEFAULT_DIFFICULTY, *OTHERS]:
        allocs = DEFAULT_ALLOCATORS.split(",") if diff == DEFAULT_DIFFICULTY else CORE
        cfg = BenchConfig(allocators=allocs, difficulty=diff, steps=args.steps, seed=args.seed, world=world)
        t = time.perf_counter()
        runs[diff] = run_bench(cfg)
        print_table(runs[diff])
        print(f"  ({time.perf_counter() - t:.1f} s for {len(allocs)} allocators)\n")
    checks = []

    def check(label: str, ok: bool, detail: str) -> None:
        checks.append(ok)
        print(f"{'PASS' if ok else 'MISS'}  {label}: {detail}")

    d = runs[DEFAULT_DIFFICULTY]["allocators"]
    er = {k: v["effective_ratio"] for k, v in d.items()}
    esr = {k: v["effective_sample_ratio"]["trajectories"] for k, v in d.items()}
    esr_auto = {k: v["effective_sample_ratio_by_advantage"]["trace" if k in ("trace", "uniform", "oracle") else "grpo"]["trajectories"]
                for k, v in d.items()}
    check("GRPO effective ratio in [25%, 40%]", 0.25 <= er["grpo"] <= 0.40, f"{er['grpo']:.1%}")
    check("TRACE effective ratio >= 60%", er["trace"] >= 0.60,
          f"{er['trace']:.1%} (last third of the steps: {d['trace']['effective_ratio_last_third']:.1%})")
    check("TRACE effective ratio >= 0.85 x oracle", er["trace"] >= 0.85 * er["oracle"],
          f"{er['trace']:.1%} vs oracle {er['oracle']:.1%} = {er['trace'] / er['oracle']:.2f} x "
          f"(last third: {d['trace']['effective_ratio_last_third'] / d['oracle']['effective_ratio_last_third']:.2f} x)")
    check("TRACE effective sample ratio >= 1.8 x GRPO (grpo advantage for all)", esr["trace"] >= 1.8 * esr["grpo"],
          f"{esr['trace']:.1%} vs {esr['grpo']:.1%} = {esr['trace'] / esr['grpo']:.2f} x")
    check("TRACE effective sample ratio >= 1.8 x GRPO (trace advantage for tree allocators)",
          esr_auto["trace"] >= 1.8 * esr_auto["grpo"],
          f"{esr_auto['trace']:.1%} vs {esr_auto['grpo']:.1%} = {esr_auto['trace'] / esr_auto['grpo']:.2f} x")
    ordered = partial = 0
    for diff, run in runs.items():
        e = {k: v["effective_ratio"] for k, v in run["allocators"].items()}
        parts = [e["oracle"] >= e["trace"], e["trace"] > e["uniform"], e["uniform"] > e["grpo"]]
        ordered += all(parts)
        partial += parts[0] and parts[1] and e["trace"] > e["grpo"]
        print(f"      {diff:32s} oracle {e['oracle']:.1%} {'>=' if parts[0] else '<'} trace {e['trace']:.1%} "
              f"{'>' if parts[1] else '<='} uniform {e['uniform']:.1%} {'>' if parts[2] else '<='} grpo {e['grpo']:.1%}"
              f"   (pcl {e['pcl']:.1%})")
    check("oracle >= trace > uniform > grpo on >= 3 distributions", ordered >= 3,
          f"holds on {ordered} of {len(runs)} (oracle >= trace > uniform and trace > grpo: {partial} of {len(runs)})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=2)
    print(f"total {time.perf_counter() - t0:.1f} s (machine shared; single run, seed {args.seed})")
    print(f"targets_met={sum(checks)}/{len(checks)} ordering_distributions={ordered}")


if __name__ == "__main__":
    main()
