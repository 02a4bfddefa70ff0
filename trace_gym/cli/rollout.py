"""``trace-gym rollout``: one step of rollout trees for an env, policy and allocator, written as JSONL."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Sequence

from trace_gym.cli.errors import UsageError
from trace_gym.rollout.engine import write_jsonl
from trace_gym.run import RunSpec, parse_assignments


def _kv(items: Sequence[str], flag: str = "--policy-arg") -> dict[str, Any]:
    try:
        return parse_assignments(list(items), flag)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def configure_rollout(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym rollout``."""
    parser.add_argument("env", help="environment id, e.g. MathCalc-v0 (short for trace_gym/MathCalc-v0)")
    parser.add_argument("--policy", default="hf", help="policy backend: hf, vllm, openai, sim (default hf)")
    parser.add_argument("--model", default="smollm2-135m",
                        help="model alias (tiny, smollm2-135m; see `trace-gym list models`), local directory or hub id "
                             "(hf, vllm); the served model's name (openai)")
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="env constructor argument (JSON value), repeatable")
    parser.add_argument("--base-url", default=None, help="server URL for --policy openai (e.g. http://127.0.0.1:8000/v1)")
    parser.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE", help="extra backend argument (JSON value), repeatable")
    parser.add_argument("--allocator", default="grpo", help="allocator with options, e.g. trace:stage1=uniform (default grpo)")
    parser.add_argument("--predictor", default=None, help="predictor (default: the allocator's own; 'none' for none)")
    parser.add_argument("--advantage", default=None, help="advantage estimator (default: the allocator's own)")
    parser.add_argument("--trajectories", type=int, default=16, help="M: trajectories per step (default 16)")
    parser.add_argument("--prompts", type=int, default=4, help="B: candidate prompts (default 4)")
    parser.add_argument("--group-size", type=int, default=None, help="G: rollouts per prompt for fixed-group allocators (default M / B)")
    parser.add_argument("--root-fraction", type=float, default=0.5, help="share of M spent on bare rollouts (default 0.5)")
    parser.add_argument("--step", type=int, default=0, help="which step's candidates and sampling seeds (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per-turn token limit (default 128)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=None, help="episode turn limit (default: the env's)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--workers", type=int, default=0, help="env steps in N Ray actors (the ray extra; default 0: in this process)")
    parser.add_argument("--engines", type=int, default=0, help="the policy in N Ray actors behind a prefix-affinity router (default 0)")
    parser.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs each Ray actor reserves (default 1; less for actors that wait)")
    parser.add_argument("--streaming", action="store_true", help="no waves: each turn as soon as its env step returns, stage 2 per prompt")
    parser.add_argument("--out", default="trees.jsonl", help="output JSONL, one record per node (default trees.jsonl)")
    parser.add_argument("--no-snapshots", action="store_true", help="leave env snapshots out of the JSONL")
    parser.set_defaults(func=run_rollout)


def rollout_spec(args: argparse.Namespace) -> RunSpec:
    """The :class:`~trace_gym.run.RunSpec` of a ``trace-gym rollout`` command line."""
    policy_kwargs = _kv(args.policy_arg)
    if args.policy == "openai" and args.base_url:
        policy_kwargs.setdefault("base_url", args.base_url)
    if args.policy != "sim":
        policy_kwargs.setdefault("model", args.model)
    else:
        policy_kwargs.setdefault("fast", False)  # token-level trees through the engine, not the simulator's fast path
    if args.policy == "hf" and args.threads:
        policy_kwargs.setdefault("num_threads", args.threads)
    policy_kwargs.update(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    env_kwargs = _kv(getattr(args, "env_arg", []), "--env-arg")
    if args.max_turns:
        env_kwargs["max_turns"] = args.max_turns
    return RunSpec(
        envs=[{"id": args.env, "kwargs": env_kwargs}], policy={"name": args.policy, "kwargs": policy_kwargs},
        allocator=args.allocator, predictor=args.predictor, advantage=args.advantage, seed=args.seed,
        budget={"trajectories": args.trajectories, "prompts": args.prompts, "root_fraction": args.root_fraction,
                "group_size": args.group_size or max(1, args.trajectories // max(1, args.prompts))},
    )


def check_model(spec: RunSpec) -> None:
    """Resolve the model of a local backend (``hf``, ``vllm``) before anything heavy is loaded:
    an alias is built on first use (``tiny``), a path that is not a directory or, offline, a
    hub id that is not cached raises ``FileNotFoundError`` naming the aliases."""
    model = spec.policy.kwargs.get("model")
    if spec.policy.name in ("hf", "vllm") and isinstance(model, str):
        from trace_gym.policies.models import resolve_model

        resolve_model(model)


def run_rollout(args: argparse.Namespace) -> int:
    """``trace-gym rollout``: one :class:`~trace_gym.step.Step` of trees, written as JSONL.

    Everything that can be wrong with the command line (env id and arguments, allocator and
    its options, model, servers) is checked before the first trajectory, and raised: one
    ``error:`` line, exit status 2 (:mod:`trace_gym.cli.errors`)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trace_gym.registry import check_env, make
    from trace_gym.rollout.preflight import check_servers
    from trace_gym.run import resolve_run
    from trace_gym.step import Step, make_source

    console = Console(stderr=True)
    if args.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    spec = rollout_spec(args)
    for env in spec.envs:  # the env ids and their arguments, before anything is built
        check_env(env.id, env.kwargs)
    resolve_run(spec)  # the allocator's option values, the predictor
    check_model(spec)
    check_servers(spec.envs, spec.policy)
    for env in spec.envs:  # what only building shows (a dataset that cannot load, a bad value)
        make(env.id, **env.kwargs).close()
    status = 0
    progress = Progress(TextColumn("[bold]rollout[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=console, transient=False)
    task_bar = progress.add_task("rollout", total=args.trajectories, info="")
    done_before = [0]

    def on_wave(stats: dict[str, int]) -> None:
        done = done_before[0] + stats["finished"] + stats["failed"]
        progress.update(task_bar, completed=done, info=f"live {stats['live']}")
        if stats["live"] == 0:
            done_before[0] = done

    if args.workers < 0 or args.engines < 0 or args.actor_cpus <= 0:
        raise ValueError("--workers and --engines must be >= 0 and --actor-cpus > 0")
    source = make_source(spec, progress=on_wave, workers=args.workers, engines=args.engines, actor_cpus=args.actor_cpus)
    step = Step.from_spec(spec, source, streaming=args.streaming)
    with progress:
        result = step.run(args.step)
    forest, spend = result.forest, result.spend
    failures = list(getattr(source, "failures", []))
    if failures:
        # the forest keeps every node generated; the failed trajectories are spent budget without a reward
        status = 1
        console.print(f"[red]error:[/] {len(failures)} trajectories could not be finished; first error: {failures[0].error}")
        for f in failures[:10]:
            console.print(f"  trajectory {f.traj} (from node {f.origin}, stopped after node {f.last_node}): {f.error}")
    n = write_jsonl(forest, args.out, snapshots=not args.no_snapshots)
    m = result.metrics
    summary = {
        "env": spec.envs[0].id, "policy": args.policy, "allocator": str(spec.allocator), "advantage": str(step.advantage),
        "nodes": n, "out": args.out, "effective_ratio": round(m["effective_ratio"], 4),
        "effective_sample_ratio": round(m["effective_sample_ratio"], 4), "spend": spend.as_dict(), "counters": dict(forest.counters),
    }
    console.print_json(json.dumps(summary))
    if hasattr(source, "close"):
        source.close()
    return status
