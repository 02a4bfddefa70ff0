"""Scale-out benchmark: env workers on Ray, and one-step-off async.

1. **Env workers.** Env steps per second through the whole engine path (sim policy on
   ContrastLab, generation in this process, one batched call per wave) with the env's ``act``
   tool sleeping ``--latency`` seconds per call (a slow tool: an interpreter, a retrieval
   server), run in-process (``workers=0``) and on 1, 2 and 4 Ray env workers. Every
   configuration runs the same steps (same seed), so they do the same env steps; the rate is
   env steps / rollout time. Targets: 1.8x the one-worker rate with 2 workers, 3.2x with 4.
2. **Async.** Step time of ``--async-steps`` steps, sync (:class:`~trace_gym.step.Step` with
   the update) vs one-step-off (:class:`~trace_gym.rollout.async_step.AsyncStep`), with a
   simulated update that sleeps as long as one step's generation took (measured first, or
   ``--update-s``). The share of generation time hidden behind the update is
   ``(sync step time - async step time) / generation time`` over the steps after the first
   (the first has nothing to overlap with). Target: at least 0.7.

Ray starts locally here with ``--ray-cpus`` logical CPUs (the workers wait on the tool, so
they need no real cores); a cluster of RAY_ADDRESS is joined instead when it is set.

    python benchmarks/scale_bench.py                       # about a minute on 2 busy cores
    python benchmarks/scale_bench.py --latency 0.1 --steps 1 --async-steps 4

The last line reads ``speedup_2=X speedup_4=Y async_hidden=Z``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from trace_gym.env.tools import Tool
from trace_gym.forest.forest import Forest
from trace_gym.rollout.async_step import AsyncStep
from trace_gym.rollout.source import EngineSource
from trace_gym.run import RunSpec
from trace_gym.sim.env import ContrastLabEnv
from trace_gym.step import Step, make_source


class SlowToolLab(ContrastLabEnv):
    """ContrastLab whose ``act`` tool takes ``latency_s`` seconds per call (sleeping: a tool
    that waits on something else)."""

    def __init__(self, *, latency_s: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.latency_s = float(latency_s)

    def build_tools(self, task):
        (act,) = super().build_tools(task)
        latency = self.latency_s

        def slow_act(option: str) -> str:
            """Carry out the current step with one of the options.

            Args:
                option: The option letter for this step.
            """
            time.sleep(latency)
            return act.fn(option)

        return [Tool.from_function(slow_act, name="act")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", type=float, default=0.1, help="seconds per tool call (default 0.1)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--steps", type=int, default=1, help="steps per worker count")
    p.add_argument("--ray-cpus", type=int, default=4)
    p.add_argument("--async-steps", type=int, default=4)
    p.add_argument("--async-prompts", type=int, default=64)
    p.add_argument("--async-trajectories", type=int, default=256)
    p.add_argument("--update-s", type=float, default=None, help="simulated update time (default: one step's generation time)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def spec(args, prompts: int, trajectories: int) -> RunSpec:
    return RunSpec(envs=[{"id": "ContrastLab-v0", "kwargs": {"n_tasks": 256, "n_test": 32}}],
                   policy={"name": "sim", "kwargs": {"fast": False}}, allocator="trace",
                   budget={"trajectories": trajectories, "prompts": prompts, "group_size": 2}, seed=args.seed)


def env_rate(args, workers: int) -> tuple[float, int, float]:
    """(env steps per second, env steps, rollout seconds) with ``workers`` env workers (0: in-process)."""
    s = spec(args, args.prompts, args.trajectories)
    base = make_source(s)
    env = SlowToolLab(world=base.envs[0].world, seed=s.seed, latency_s=args.latency)
    source = EngineSource([env], base.policy, base.params, seed=s.seed, workers=workers)
    step = Step.from_spec(s, source=source)
    try:
        if workers:
            source.add_candidates(Forest(), 0, 1)  # start the actors outside the timing
        n, secs = 0, 0.0
        for t in range(args.steps):
            r = step.run(t)
            n += len(r.forest) - r.forest.n_trees  # one env step per non-root node
            secs += r.metrics["time/rollout"]
        return n / secs, n, secs
    finally:
        source.close()


def async_hidden(args) -> tuple[float, dict]:
    s = spec(args, args.async_prompts, args.async_trajectories)
    gen_times = []

    def timed(step):
        t0 = time.perf_counter()
        r = step.run(0)
        return r, time.perf_counter() - t0

    _, g = timed(Step.from_spec(s))  # warm-up + the generation time the update is sized to
    upd = args.update_s if args.update_s is not None else g

    def update(forest, adv):
        time.sleep(upd)
        return {}

    sync = Step.from_spec(s, update=update)
    t_sync = []
    for t in range(args.async_steps):
        r = sync.run(t)
        t_sync.append(r.metrics["time/step"])
        gen_times.append(r.metrics["time/step"] - r.metrics["time/update"])
    a = AsyncStep(Step.from_spec(s), update)
    t_async, stale = [], []
    try:
        for t in range(args.async_steps):
            r = a.run(t)
            t_async.append(r.metrics["time/step"])
            stale.append(r.metrics["async/staleness"])
    finally:
        a.close()
    gen = float(np.mean(gen_times[1:]))
    hidden = (float(np.mean(t_sync[1:])) - float(np.mean(t_async[1:]))) / gen
    info = {"generation_s": gen, "update_s": upd, "sync_step_s": float(np.mean(t_sync[1:])),
            "async_step_s": float(np.mean(t_async[1:])), "staleness": stale}
    return max(0.0, min(1.0, hidden)), info


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    print(f"# env workers: ContrastLab, act tool latency {args.latency * 1000:.0f} ms, {args.prompts} prompts, "
          f"{args.trajectories} trajectories x {args.steps} step(s); cpus={os.cpu_count()}, load={os.getloadavg()[0]:.1f}")
    rates = {}
    for w in [0] + list(args.workers):
        rate, n, secs = env_rate(args, w)
        rates[w] = rate
        print(f"workers={w}{' (in-process)' if w == 0 else ''}: {n} env steps in {secs:.2f} s = {rate:.1f} steps/s"
              + (f"  ({rate / rates[1]:.2f}x one worker)" if w > 1 and 1 in rates else ""))
        sys.stdout.flush()
    ray.shutdown()
    hidden, info = async_hidden(args)
    print(f"# async: generation {info['generation_s']:.2f} s/step, simulated update {info['update_s']:.2f} s; "
          f"sync {info['sync_step_s']:.2f} s/step, one-step-off {info['async_step_s']:.2f} s/step; staleness {info['staleness']}")
    s2 = rates.get(2, float("nan")) / rates.get(1, float("nan"))
    s4 = rates.get(4, float("nan")) / rates.get(1, float("nan"))
    print(f"speedup_2={s2:.2f} speedup_4={s4:.2f} async_hidden={hidden:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
