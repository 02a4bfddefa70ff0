"""``trace-gym train`` and ``trace-gym eval``.

    trace-gym train --config configs/quick.yaml [--resume] [key=value ...]
    trace-gym train --help-config                      # every config key, documented
    trace-gym eval --config configs/quick.yaml         # the run's latest checkpoint (or its SFT start)
    trace-gym eval --model smollm2-135m --env trace_gym/MathCalc-v0 --tasks 50 --k 4
    trace-gym eval --model DIR --env ToolCalls-v0 --env-arg difficulty=1 --env-arg max_turns=6
    trace-gym eval --config configs/quick.yaml rollout.backend=vllm   # through vLLM's engine

Evaluation goes through the config's ``rollout.backend`` (``hf``, ``vllm``, ``openai``): the
evaluated weights are loaded into it; ``openai`` servers that cannot take weights are
evaluated with the weights they hold (a note says so).

Both commands are entry points of the group ``trace_gym.commands`` (:func:`train_command`,
:func:`eval_command`), the way any plug-in adds a ``trace-gym`` subcommand.

Errors: a bad config, key, model, env or server is raised and reported by ``trace-gym`` as one
``error: ...`` line with exit status 2 (:mod:`trace_gym.cli.errors`). ``train`` checks the
run's servers (:func:`trace_gym.rollout.preflight.check_servers`) and model before the trainer
is built, and a start that fails leaves no run folder behind that it created.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def train_command(subparsers: Any) -> argparse.ArgumentParser:
    """train a policy with an allocator (RL, with an optional SFT warm start)"""
    help_ = (train_command.__doc__ or "").strip()
    parser = subparsers.add_parser("train", help=help_, description=help_)
    configure_train(parser)
    return parser


def eval_command(subparsers: Any) -> argparse.ArgumentParser:
    """evaluate a policy: mean@k and pass@k on held-out tasks"""
    help_ = (eval_command.__doc__ or "").strip()
    parser = subparsers.add_parser("eval", help=help_, description=help_)
    configure_eval(parser)
    return parser


def configure_train(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym train``."""
    parser.add_argument("--config", default=None, help="YAML config (see configs/); default: the built-in defaults")
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir from its newest readable checkpoint")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its meaning and default, then exit")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides with dotted keys, e.g. allocator=grpo budget.trajectories=64 optim.lr=1e-4")
    parser.set_defaults(func=run_train)


def configure_eval(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym eval``."""
    parser.add_argument("--config", default=None, help="a training config: evaluates its run's latest checkpoint (or, before any, its SFT start)")
    parser.add_argument("--run", default=None, help="a run directory: its config.yaml and latest checkpoint (instead of --config)")
    parser.add_argument("--model", default=None, help="evaluate this model instead: 'tiny', an alias (smollm2-135m), a directory or a hub id")
    parser.add_argument("--sft", action="store_true", help="with --config: evaluate the SFT warm start, not the RL checkpoint")
    parser.add_argument("--env", action="append", default=None, help="env id (repeatable); default: the config's envs, or MathCalc")
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="env constructor argument (JSON value), repeatable; applies to every evaluated env, over the config's")
    parser.add_argument("--tasks", type=int, default=None, help="held-out tasks per env (default: the config's eval.tasks)")
    parser.add_argument("--k", type=int, default=None, help="samples per task for mean@k / pass@k (default: eval.k)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: eval.temperature)")
    parser.add_argument("--split", default=None, choices=["test", "validation"], help="held-out split (default: eval.split)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per-turn token limit (default: rollout.max_new_tokens)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as for train")
    parser.set_defaults(func=run_eval)


def _load(args: argparse.Namespace):
    """The config of ``--config`` / ``--run`` with the overrides; a bad one raises
    ``ConfigError`` (a ``ValueError``) naming the key."""
    from trace_gym.cli.errors import UsageError
    from trace_gym.trainers.config import load_config

    path = args.config
    run = getattr(args, "run", None)
    if run:
        if args.config:
            raise UsageError("give --config or --run, not both")
        path = str(Path(run) / "config.yaml")
        if not Path(path).is_file():
            raise UsageError(f"--run {run}: no config.yaml there (is it a run folder of `trace-gym train`?)")
    return load_config(path, args.overrides)


def preflight(cfg: Any) -> None:
    """What can be checked before a trainer is built: every env is registered and takes its arguments, the
    model resolves (``tiny``, an alias, a directory, or a cached hub id offline), and the
    servers the run calls (retrieval, an OpenAI-compatible backend) answer. Raises the
    error that says what is wrong (``ValueError``, ``FileNotFoundError``, ``ServerUnavailable``)."""
    from trace_gym.registry import check_env
    from trace_gym.rollout.preflight import check_servers

    for env in cfg.envs:
        check_env(env.id, env.kwargs)
    if cfg.model.name not in ("tiny", "sim"):
        from trace_gym.policies.models import resolve_model

        resolve_model(cfg.model.name)
    spec = cfg.run_spec()
    check_servers(spec.envs, spec.policy)


def _build_trainer(cfg: Any, **kwargs: Any) -> Any:
    """``RLTrainer(cfg, **kwargs)``; when that fails, the output folder it created (it did not
    exist before) is removed, so a failed start leaves nothing behind."""
    import shutil

    from trace_gym.trainers.rl import RLTrainer

    out = Path(cfg.output_dir)
    existed = out.exists()
    try:
        return RLTrainer(cfg, **kwargs)
    except BaseException:
        if not existed and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        raise


def run_train(args: argparse.Namespace) -> int:
    """``trace-gym train``."""
    if args.help_config:
        from trace_gym.trainers.config import describe_fields

        print("\n".join(describe_fields()))
        return 0
    cfg = _load(args)
    preflight(cfg)
    trainer = _build_trainer(cfg, resume=args.resume)
    try:
        records = trainer.train()
    finally:
        trainer.close()
    last = next((r for r in reversed(records) if "effective_ratio" in r), {})
    evals = {k: v for k, v in (records[-1] if records else {}).items() if k.startswith("eval/")}
    summary = {"output_dir": cfg.output_dir, "steps": trainer.step_index,
               "effective_ratio": last.get("effective_ratio"), "reward/mean": last.get("reward/mean"), **evals}
    print(json.dumps(summary, indent=1))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """``trace-gym eval``: held-out mean@k and pass@k per env."""
    if args.model and args.model != "tiny":  # a bad model fails at once, before torch is imported
        from trace_gym.policies.models import resolve_model

        resolve_model(args.model)
    cfg = _load(args)
    cfg.envs = eval_envs(cfg.envs, args.env, args.env_arg)  # a bad env or argument fails before torch is imported
    import torch
    from rich.console import Console
    from rich.table import Table

    import trace_gym
    from trace_gym.policies.base import SamplingParams
    from trace_gym.trainers.evaluate import env_labels, evaluate_env, held_out_tasks

    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    if cfg.model.name == "sim" and not args.model:
        return _eval_sim(args, cfg)
    envs = [trace_gym.make(spec.id, seed=cfg.seed, **spec.kwargs) for spec in cfg.envs]  # before the model: a bad argument fails fast
    source, policy = _eval_policy(args, cfg)
    k = args.k or cfg.eval.k
    params = SamplingParams(max_new_tokens=args.max_new_tokens or cfg.rollout.max_new_tokens,
                            temperature=cfg.eval.temperature if args.temperature is None else args.temperature,
                            top_p=cfg.rollout.top_p, seed=cfg.seed if args.seed is None else args.seed)
    results: dict[str, Any] = {"model": source, "k": k, "envs": {}}
    for env, label in zip(envs, env_labels([env.env_id for env in envs])):
        tasks = held_out_tasks(env, args.tasks or cfg.eval.tasks, split=args.split or cfg.eval.split)
        results["envs"][label] = evaluate_env(policy, env, tasks, k, params)
    policy.close()
    table = Table(title=f"held-out evaluation of {source} (k={k})")
    for col in ("env", "mean@k", "pass@k", "tool calls", "answered", "tasks"):
        table.add_column(col)
    for env_id, r in results["envs"].items():
        table.add_row(env_id, f"{r['mean@k']:.3f}", f"{r['pass@k']:.3f}", f"{r['tool_call_rate']:.2f}", f"{r['answer_rate']:.2f}", str(r["tasks"]))
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def eval_envs(configured: list[Any], ids: list[str] | None, env_args: list[str]) -> list[Any]:
    """The envs ``trace-gym eval`` evaluates: the ``--env`` ids (short ids such as ``MathCalc-v0``
    allowed; each keeps the config's kwargs when the config has that env) or else the config's
    envs, every one with the ``--env-arg`` arguments on top of its kwargs. Each is checked
    without being built: an unknown id raises ``UnknownNameError``, and an argument its
    constructor does not take raises ``ValueError`` naming the ones it does, where the
    constructor's signature lists them (else building the env reports it)."""
    from trace_gym.registry import check_env
    from trace_gym.run import EnvSpec, env_id, parse_assignments

    extra = parse_assignments(env_args, "--env-arg")
    if ids:
        kwargs = {spec.id: spec.kwargs for spec in configured}
        chosen = [(full, kwargs.get(full, {})) for full in map(env_id, ids)]
    else:
        chosen = [(spec.id, spec.kwargs) for spec in configured]
    envs = [EnvSpec(id=i, kwargs={**own, **extra}) for i, own in chosen]
    for spec in envs:
        check_env(spec.id, spec.kwargs)
    return envs


def _eval_policy(args: argparse.Namespace, cfg: Any) -> tuple[str, Any]:
    """The policy to evaluate (through ``rollout.backend``) and a description of where its
    weights came from."""
    from trace_gym.trainers.backends import eval_policy
    from trace_gym.trainers.checkpoint import CheckpointManager
    from trace_gym.trainers.sft import resolve_base, warm_start

    def build(model_dir: str, state: Any, label: str) -> tuple[str, Any]:
        policy, note = eval_policy(cfg, model_dir, state, device=cfg.model.device)
        if note:
            print(f"note: {note}", file=sys.stderr)
            label = f"the model served at {', '.join(cfg.rollout.servers)} (not {label})"
        elif cfg.rollout.backend != "hf":
            label += f" via {cfg.rollout.backend}"
        return label, policy

    if args.model:
        path, _ = resolve_base(args.model, cfg.model.tiny)
        return build(path, None, args.model)
    start, _ = resolve_base(cfg.model.name, cfg.model.tiny)
    if cfg.sft.enabled:
        start = str(warm_start(cfg.model.name, cfg.sft.sft(), tiny=cfg.model.tiny))
    if args.sft:
        return build(start, None, f"{start} (SFT warm start)")
    ckpt = CheckpointManager(Path(cfg.output_dir) / "checkpoints")
    found = ckpt.load_latest()
    if found is None:
        return build(start, None, f"{start} (no checkpoint in {cfg.output_dir})")
    step, state = found
    return build(start, state["model"], f"{cfg.output_dir} step {step}")


def _eval_sim(args: argparse.Namespace, cfg: Any) -> int:
    """ContrastLab's simulated policy lives in its env's world: evaluate it through the trainer
    (restored from the run's checkpoint when there is one)."""
    from trace_gym.trainers.checkpoint import CheckpointManager

    if args.tasks:
        cfg.eval.tasks = args.tasks
    if args.k:
        cfg.eval.k = args.k
    resume = bool(CheckpointManager(Path(cfg.output_dir) / "checkpoints").steps())
    trainer = _build_trainer(cfg, resume=resume, log=lambda msg: print(msg, file=sys.stderr))
    results = {"model": f"sim ({cfg.output_dir} step {trainer.step_index})", "k": cfg.eval.k, "envs": trainer.evaluate()}
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0
