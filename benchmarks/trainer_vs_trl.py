"""Our RL trainer beside TRL's ``GRPOTrainer``, and tree packing on TRACE's trees.

    pip install -e ".[bench]"                       # TRL
    python benchmarks/trainer_vs_trl.py             # 1 thread, 6 measured steps each, 2 rounds
    python benchmarks/trainer_vs_trl.py --threads 2 --steps 4 --rounds 1

**Part 1, throughput.** Both trainers train the same model (the tiny preset, warm-started by
SFT on MathCalc demonstrations so rewards are mixed; trained once and cached) with GRPO on the
same prompts: each step offers the 8 MathCalc prompts our trainer's step offers (the text our
rollout engine renders, given to TRL as plain-text prompts) with 8 completions each (64 per
step), at most 32 new tokens, temperature 1, one turn (``max_turns: 1``), the env's own
reward (TRL's reward function steps the same env), no KL term, PPO clip 0.2/0.28, AdamW at the
same learning rate, gradient clip 1, fp32, on CPU. Ours runs the ``grpo`` allocator and the
``grpo`` advantage. Each trainer runs in its own process with the torch thread count fixed
(``--threads``, also ``OMP_NUM_THREADS``); the two alternate for ``--rounds`` rounds, so load
from other processes on the machine falls on both. A step's wall time (generation, reward,
loss, backward, optimizer; for ours also allocation, metrics and the predictor) is measured
after ``--warmup`` steps; completions/s is 64 over the median step time.

**Part 2, forward tokens per loss token.** Our trainer with the ``trace`` allocator (and its
tree-aware advantage) on MathCalc with up to 4 turns (the calculator, then the answer), 64
trajectories over 8 prompts per step, half of them stage-2 branches. For each step's forest
the token batch is built with ``loss.packing: tree`` and ``trajectory``: tokens run forward
(no padding) per loss token, with the trainer's ``skip_zero_advantage`` and without it (every
policy token a loss token). The update of the last forest is timed in both packings (forward
and backward, no optimizer step).

The last line reads ``ratio_vs_trl=X packed_tokens_per_loss_token=Y unpacked_tokens_per_loss_token=Z``
(X: our completions/s over TRL's; Y and Z with ``skip_zero_advantage`` on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, GROUP, NEW_TOKENS, LR, SEED = 8, 8, 32, 1e-5, 0
WORLD = {"n_options": 2, "n_tasks": 512, "n_test": 64}
ENV = {"id": "trace_gym/ContrastLab-v0", "kwargs": {**WORLD, "turns": [1, 1]}}
TREE_ENV = {"id": "trace_gym/ContrastLab-v0", "kwargs": {**WORLD, "turns": [2, 3]}}
TINY = {"envs": ["trace_gym/ContrastLab-v0"], "hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 768, "vocab_size": 512, "corpus_tasks": 300}
SFT = {"envs": [{"id": "trace_gym/ContrastLab-v0", "kwargs": {**WORLD, "turns": [1, 3]}}],
       "tasks": 600, "epochs": 3, "lr": 2e-3, "batch_size": 16, "micro_batch_size": 16, "strip_thoughts": True}


def fix_threads(threads: int) -> None:
    """Fix torch's CPU threads (and OpenMP's) for this process."""
    import torch

    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already fixed, or parallel work started: leave it
            pass


def warm_model(threads: int) -> str:
    """The SFT-warmed tiny preset's directory (trained on first use, then cached)."""
    from trace_gym.trainers.presets import TinySpec
    from trace_gym.trainers.sft import SFTConfig, warm_start

    t0 = time.perf_counter()
    path = warm_start("tiny", SFTConfig.model_validate({**SFT, "threads": threads}), tiny=TinySpec(**TINY))
    print(f"warm-started model: {path} ({time.perf_counter() - t0:.0f} s; cached after the first run)", flush=True)
    return str(path)


def our_config(model: str, threads: int, steps: int, out: str, *, env: dict, allocator: str, advantage: str | None) -> Any:
    from trace_gym.trainers.config import RLConfig

    return RLConfig.model_validate({
        "seed": SEED, "steps": steps, "output_dir": out, "deterministic": False, "envs": [env],
        "model": {"name": model, "threads": threads}, "sft": {"enabled": False},
        "rollout": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "top_p": 1.0, "max_batch_size": PROMPTS * GROUP},
        "allocator": allocator, "advantage": advantage,
        "budget": {"trajectories": PROMPTS * GROUP, "prompts": PROMPTS, "group_size": GROUP},
        "loss": {"eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0},
        "optim": {"lr": LR, "grad_clip": 1.0},
        "checkpoint": {"every": 0}, "log": {"tensorboard": False, "progress": False}})


# ----------------------------------------------------------------------------- workers (one process each)


def worker_ours(model: str, threads: int, steps: int) -> dict[str, Any]:
    from trace_gym.trainers.rl import RLTrainer

    fix_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        trainer = RLTrainer(our_config(model, threads, steps, out, env=ENV, allocator="grpo", advantage="grpo"), log=lambda m: None)
        times, records = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            rec = trainer.step()
            times.append(time.perf_counter() - t0)
            records.append(rec)
    keys = ("time/rollout", "time/update", "reward/mean", "update/sequences", "spent/trajectories", "spent/generated_tokens")
    return {"step_times": times, "threads": __import__("torch").get_num_threads(),
            "records": [{k: r.get(k) for k in keys} for r in records]}


def prompts_of_our_steps(model: str, steps: int) -> list[dict[str, str]]:
    """The prompts our trainer offers at steps ``0..steps-1`` (rendered exactly as its engine
    renders them) as TRL dataset rows, in order."""
    import trace_gym
    from trace_gym.policies.hf import HFPolicy
    from trace_gym.task import candidate_indices

    env = trace_gym.make(ENV["id"], **{"seed": SEED, **ENV["kwargs"]})
    policy = HFPolicy(model, device="cpu")
    src = env.tasks()
    rows = []
    for step in range(steps):
        for i in candidate_indices(SEED, step, int(src.size("train")), PROMPTS):
            task = src.get(i, "train")
            _, info = env.reset(options={"task": task})
            ids = policy.render_prompt(info.get("messages") or env.messages(), info.get("tools") or [])
            text = policy.tokenizer.decode(ids, skip_special_tokens=False)
            if policy.tokenizer(text, add_special_tokens=False)["input_ids"] != list(ids):
                raise RuntimeError(f"prompt of task {task.id} does not re-tokenise to the same ids")
            rows.append({"prompt": text, "task_id": task.id})
    return rows


def worker_trl(model: str, threads: int, steps: int) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import trace_gym

    fix_threads(threads)
    env = trace_gym.make(ENV["id"], **{"seed": SEED, **ENV["kwargs"]})

    def env_reward(prompts, completions, task_id, **_: Any) -> list[float]:
        """The env's reward for a one-turn episode: the same judge our trainer's rollouts get."""
        out = []
        for text, tid in zip(completions, task_id):
            env.reset(options={"task": env.task_by_id(tid)})
            _, reward, *_ = env.step(text)
            out.append(float(reward))
        return out

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            if not self.marks:
                self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

    rows = prompts_of_our_steps(model, steps)
    tok = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=PROMPTS * GROUP, gradient_accumulation_steps=1, num_generations=GROUP,
            max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, max_steps=steps, num_train_epochs=1,
            shuffle_dataset=False, seed=SEED, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
            fp16=False, dataloader_num_workers=0, log_completions=False, disable_dropout=True)
        trainer = GRPOTrainer(model=net, reward_funcs=env_reward, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, callbacks=[clock])
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
    times = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    return {"step_times": times, "threads": torch.get_num_threads(),
            "records": [{k: h.get(k) for k in ("reward", "num_tokens", "completions/mean_length", "step_time")} for h in logs]}


def run_worker(kind: str, model: str, threads: int, steps: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--model", model, "--threads", str(threads),
                               "--steps", str(steps), "--result", fh.name], env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
        return json.loads(Path(fh.name).read_text())


# ----------------------------------------------------------------------------- part 2: TRACE's trees


def tree_tokens(model: str, threads: int, steps: int) -> dict[str, Any]:
    """Forward tokens per loss token under both packings on the forests of ``steps`` TRACE steps."""
    from trace_gym.trainers.batching import token_batch
    from trace_gym.trainers.rl import RLTrainer

    fix_threads(threads)
    sums = {k: 0 for k in ("tree", "trajectory", "loss", "tree_all", "trajectory_all", "loss_all", "trajectories", "branches")}
    last: list[Any] = []
    with tempfile.TemporaryDirectory() as out:
        trainer = RLTrainer(our_config(model, threads, steps, out, env=TREE_ENV, allocator="trace", advantage=None), log=lambda m: None)
        L = trainer.cfg.loss
        update = trainer.stepper.update

        def measured(forest, adv):
            for skip, suffix in ((L.skip_zero_advantage, ""), (False, "_all")):
                batches = {p: token_batch(forest, adv, p, skip_zero_advantage=skip, max_tokens=L.pack_tokens) for p in ("tree", "trajectory")}
                assert batches["tree"].loss_tokens == batches["trajectory"].loss_tokens
                sums["loss" + suffix] += batches["tree"].loss_tokens
                for p, b in batches.items():
                    sums[p + suffix] += b.forward_tokens
            sums["trajectories"] += forest.n_trajectories
            sums["branches"] += int(sum(1 for o in forest.traj_origin if forest.parent[o] >= 0))
            last[:] = [forest, adv]
            return update(forest, adv)

        trainer.stepper.update = measured
        for _ in range(steps):
            trainer.step()
        # the last forest's update in both packings: forward and backward, weights kept
        trainer.optimizer.step = lambda *a, **k: None
        trainer.scheduler.step = lambda *a, **k: None
        seconds = {}
        for packing in ("trajectory", "tree", "trajectory", "tree"):
            trainer.cfg.loss.packing = packing
            t0 = time.perf_counter()
            trainer._update_policy(*last)
            seconds.setdefault(packing, []).append(time.perf_counter() - t0)
    return {**sums, "update_seconds": {k: min(v) for k, v in seconds.items()}}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process (fixed)")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per trainer and round")
    ap.add_argument("--warmup", type=int, default=1, help="steps run before measuring")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of TRL then ours")
    ap.add_argument("--tree-steps", type=int, default=3, help="TRACE steps for the token figures")
    ap.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        res = (worker_ours if args.worker == "ours" else worker_trl)(args.model, args.threads, args.steps)
        Path(args.result).write_text(json.dumps(res))
        return 0

    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    import torch
    import transformers
    import trl

    fix_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
          f"torch threads fixed at {args.threads} in every process; {os.cpu_count()} CPUs", flush=True)
    model = warm_model(args.threads)
    total = args.warmup + args.steps
    times: dict[str, list[float]] = {"trl": [], "ours": []}
    for r in range(args.rounds):
        for kind in ("trl", "ours"):
            res = run_worker(kind, model, args.threads, total)
            assert res["threads"] == args.threads
            measured = res["step_times"][args.warmup:]
            times[kind] += measured
            rewards = [rec.get("reward") if kind == "trl" else rec.get("reward/mean") for rec in res["records"]]
            print(f"round {r + 1} {kind:>4}: step s " + " ".join(f"{t:.2f}" for t in res["step_times"])
                  + "  reward/step " + " ".join(f"{x:.2f}" for x in rewards if x is not None), flush=True)
            if kind == "ours":
                print("            ours: rollout s " + " ".join(f"{rec['time/rollout']:.2f}" for rec in res["records"])
                      + "  update s " + " ".join(f"{rec['time/update']:.2f}" for rec in res["records"])
                      + "  trained trajectories " + " ".join(str(rec["update/sequences"]) for rec in res["records"]), flush=True)
    per_step = PROMPTS * GROUP
    rate = {k: per_step / statistics.median(v) for k, v in times.items()}
    ratio = rate["ours"] / rate["trl"]
    print(f"completions/s (median of {len(times['trl'])} steps, {per_step} completions per step): "
          f"TRL GRPOTrainer {rate['trl']:.1f}, ours {rate['ours']:.1f}, ratio {ratio:.2f} (target >= 1.5)", flush=True)

    tok = tree_tokens(model, args.threads, args.tree_steps)
    packed, unpacked = tok["tree"] / tok["loss"], tok["trajectory"] / tok["loss"]
    print(f"TRACE trees ({args.tree_steps} steps, {tok['trajectories']} trajectories, {tok['branches']} branches): "
          f"{tok['loss']} loss tokens (skip_zero_advantage), forward tokens {tok['tree']} packed vs {tok['trajectory']} per trajectory; "
          f"every policy token: {tok['loss_all']} loss tokens, forward {tok['tree_all']} packed vs {tok['trajectory_all']} "
          f"({tok['tree_all'] / tok['loss_all']:.2f} vs {tok['trajectory_all'] / tok['loss_all']:.2f} per loss token)", flush=True)
    print("update of the last TRACE forest (forward+backward, s): " + ", ".join(f"{k} {v:.2f}" for k, v in tok["update_seconds"].items()),
          flush=True)
    print(f"ratio_vs_trl={ratio:.2f} packed_tokens_per_loss_token={packed:.2f} unpacked_tokens_per_loss_token={unpacked:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
