"""Scale-out benchmark: env workers on Ray, and one-step-off async.

1. **Env workers.** Env steps per second through the whole engine path (sim policy on
   ContrastLab, generation in this process, one batched call per wave) with the env's ``act``
   tool sleeping ``--latency`` seconds per call (a slow tool: an interpreter, a retrieval
   server), run in-process (``workers=0``) and on 1, 2 and 4 Ray env workers. Every
   configuration runs the same steps (same seed), so they do the same env steps; the rate is
   env steps / rollout time, in waves (the default: each wave's steps split into one chunk per
   worker) and streaming (each step to the least busy worker as soon as its turn is
   generated). Targets: 1.8x the one-worker rate with 2 workers, 3.2x with 4; the last line
   gives streaming's (``speedup_2``, ``speedup_4``), the line before it waves'.
2. **Engines.** Rollout time of ``--engine-steps`` steps through an
   :class:`~trace_gym.rollout.router.EngineRouter` of 1, 2 and 4 Ray engine actors (the sim
   policy with a simulated accelerator: each call takes ``--call-latency`` s plus
   ``--prompt-latency`` s per prompt), against one engine; also the share of turns and
   branches that went to the engine holding their prefix.
3. **Streaming.** Step time and allocation outcome (effective ratio, effective sample ratio
   under trace's advantage) of waves vs streaming
   (:class:`~trace_gym.rollout.stream.EngineStream`, a prompt's stage 2 as soon as its stage 1
   is done) on 4 env workers, with a tool whose latency varies from call to call
   (``--latency`` x [0.1, 1.9]), over ``--stream-steps`` steps.
4. **Async.** Step time of ``--async-steps`` steps, sync (:class:`~trace_gym.step.Step` with
   the update) vs one-step-off (:class:`~trace_gym.rollout.async_step.AsyncStep`), with a
   simulated update that sleeps as long as one step's generation took (measured first, or
   ``--update-s``). The share of generation time hidden behind the update is
   ``(sync step time - async step time) / generation time`` over the steps after the first
   (the first has nothing to overlap with). Target: at least 0.7.

Ray starts locally here with ``--ray-cpus`` logical CPUs (the workers wait on the tool, so
they need no real cores); a cluster of RAY_ADDRESS is joined instead when it is set.

    python benchmarks/scale_bench.py                       # about a minute on 2 busy cores
    python benchmarks/scale_bench.py --latency 0.1 --steps 1 --async-steps 4

The last two lines read ``engines_2=A engines_4=B streaming_step_speedup=C waves_speedup_2=D
waves_speedup_4=E`` and ``speedup_2=X speedup_4=Y async_hidden=Z`` (env workers, streaming).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from trace_gym.forest.forest import Forest
from trace_gym.rollout.async_step import AsyncStep
from trace_gym.rollout.source import EngineSource
from trace_gym.run import RunSpec
from trace_gym.sim.env import ContrastLabEnv
from trace_gym.step import Step, make_source


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", type=float, default=0.1, help="seconds per tool call (default 0.1)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--steps", type=int, default=1, help="steps per worker count")
    p.add_argument("--ray-cpus", type=int, default=4)
    p.add_argument("--async-steps", type=int, default=4)
    p.add_argument("--async-prompts", type=int, default=64)
    p.add_argument("--async-trajectories", type=int, default=256)
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--engine-steps", type=int, default=2)
    p.add_argument("--call-latency", type=float, default=0.02, help="simulated seconds per generation call")
    p.add_argument("--prompt-latency", type=float, default=0.004, help="simulated seconds per prompt of a call")
    p.add_argument("--stream-steps", type=int, default=4)
    p.add_argument("--update-s", type=float, default=None, help="simulated update time (default: one step's generation time)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def spec(args, prompts: int, trajectories: int) -> RunSpec:
    return RunSpec(envs=[{"id": "ContrastLab-v0", "kwargs": {"n_tasks": 256, "n_test": 32}}],
                   policy={"name": "sim", "kwargs": {"fast": False}}, allocator="trace",
                   budget={"trajectories": trajectories, "prompts": prompts, "group_size": 2}, seed=args.seed)


def env_rate(args, workers: int, streaming: bool = False) -> tuple[float, int, float]:
    """(env steps per second, env steps, rollout seconds) with ``workers`` env workers (0:
    in-process), in waves or streaming."""
    s = spec(args, args.prompts, args.trajectories)
    base = make_source(s)
    env = ContrastLabEnv(world=base.envs[0].world, seed=s.seed, tool_latency_s=args.latency)
    source = EngineSource([env], base.policy, base.params, seed=s.seed, workers=workers)
    step = Step.from_spec(s, source=source, streaming=streaming)
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


def engine_rate(args, engines: int) -> tuple[float, dict]:
    """(rollout seconds per step, router stats) with ``engines`` sim engine actors."""
    from trace_gym.rollout.router import EngineRouter

    s = spec(args, args.prompts, args.trajectories)
    base = make_source(s)
    router = EngineRouter.on_ray("sim", {"world": base.envs[0].world, "seed": s.seed, "call_latency_s": args.call_latency,
                                         "prompt_latency_s": args.prompt_latency}, engines=engines, num_cpus=0.25)
    try:
        step = Step.from_spec(s, source=EngineSource(base.envs, router, base.params, seed=s.seed))
        secs = sum(step.run(t).metrics["time/rollout"] for t in range(args.engine_steps))
        return secs / args.engine_steps, dict(router.stats)
    finally:
        router.close()


def streaming(args) -> dict[str, dict[str, float]]:
    """Waves vs streaming on 4 env workers with a jittered tool: mean step time, effective
    ratio and effective sample ratio (trace's advantage) over ``--stream-steps`` steps."""
    s = spec(args, args.prompts, args.trajectories)
    s = RunSpec(**{**s.model_dump(), "envs": [{"id": "ContrastLab-v0", "kwargs": {"n_tasks": 256, "n_test": 32,
                                                                            "tool_latency_s": args.latency, "tool_latency_jitter": 0.9}}]})
    out = {}
    for mode in ("waves", "streaming"):
        base = make_source(s)
        source = EngineSource(base.envs, base.policy, base.params, seed=s.seed, workers=4, worker_options={"num_cpus": 0.5})
        try:
            source.add_candidates(Forest(), 0, 1)  # start the actors outside the timing
            step = Step.from_spec(s, source=source, streaming=mode == "streaming")
            rs = [step.run(t) for t in range(args.stream_steps)]
        finally:
            source.close()
        out[mode] = {"step_s": float(np.mean([r.metrics["time/step"] for r in rs])),
                     "effective_ratio": float(np.mean([r.metrics["effective_ratio"] for r in rs])),
                     "esr_trace": float(np.mean([r.metrics["effective_sample_ratio/trace"] for r in rs]))}
    return out


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
    rates: dict[tuple[str, int], float] = {}
    for mode in ("waves", "streaming"):
        for w in [0] + list(args.workers):
            rate, n, secs = env_rate(args, w, streaming=mode == "streaming")
            rates[mode, w] = rate
            one = rates.get((mode, 1))
            print(f"{mode} workers={w}{' (in-process)' if w == 0 else ''}: {n} env steps in {secs:.2f} s = {rate:.1f} steps/s"
                  + (f"  ({rate / one:.2f}x one worker)" if w > 1 and one else ""))
            sys.stdout.flush()
    print(f"# engines: sim policy as a simulated accelerator ({args.call_latency * 1000:.0f} ms per call + "
          f"{args.prompt_latency * 1000:.0f} ms per prompt), {args.engine_steps} step(s)")
    engine_s = {}
    for n in args.engines:
        secs, stats = engine_rate(args, n)
        engine_s[n] = secs
        routed = stats["affine"] + stats["spilled"]
        print(f"engines={n}: rollout {secs:.2f} s/step" + (f"  ({engine_s[1] / secs:.2f}x one engine)" if n > 1 and 1 in engine_s else "")
              + f"; prompts with a known prefix sent to its engine: {stats['affine']}/{routed}; per engine {stats['per_engine']}")
        sys.stdout.flush()
    print(f"# streaming vs waves: 4 env workers, tool latency {args.latency * 1000:.0f} ms x [0.1, 1.9], {args.stream_steps} steps")
    st = streaming(args)
    for mode, m in st.items():
        print(f"{mode}: {m['step_s']:.2f} s/step, effective ratio {m['effective_ratio']:.3f}, effective sample ratio (trace) {m['esr_trace']:.3f}")
    ray.shutdown()
    hidden, info = async_hidden(args)
    print(f"# async: generation {info['generation_s']:.2f} s/step, simulated update {info['update_s']:.2f} s; "
          f"sync {info['sync_step_s']:.2f} s/step, one-step-off {info['async_step_s']:.2f} s/step; staleness {info['staleness']}")
    def speedup(mode: str, w: int) -> float:
        return rates.get((mode, w), float("nan")) / rates.get((mode, 1), float("nan"))

    s2, s4 = speedup("streaming", 2), speedup("streaming", 4)
    e2 = engine_s.get(1, float("nan")) / engine_s.get(2, float("nan"))
    e4 = engine_s.get(1, float("nan")) / engine_s.get(4, float("nan"))
    print(f"engines_2={e2:.2f} engines_4={e4:.2f} streaming_step_speedup={st['waves']['step_s'] / st['streaming']['step_s']:.2f} "
          f"waves_speedup_2={speedup('waves', 2):.2f} waves_speedup_4={speedup('waves', 4):.2f}")
    print(f"speedup_2={s2:.2f} speedup_4={s4:.2f} async_hidden={hidden:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
