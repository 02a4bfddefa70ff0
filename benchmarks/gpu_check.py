"""GPU check: the ``hf`` backend in bf16 on CUDA, and three RL training steps on SmolLM2-135M.

    python benchmarks/gpu_check.py            # about 3-5 minutes on one H200; under 8 by design
    python benchmarks/gpu_check.py --peak-tflops 989 --model smollm2-135m

Two measurements, both on the first CUDA device:

1. **Generation**: :class:`~trace_gym.policies.hf.HFPolicy` loads the model in bf16 and samples
   ``--gen-prompts`` prompts x ``--gen-tokens`` new tokens (temperature 1, stop tokens
   ignored by counting only what was generated) after a warm-up call. Prints generated
   tokens/s and its model FLOPs utilisation.
2. **Training**: :class:`~trace_gym.trainers.rl.RLTrainer` with ``rollout.backend: hf`` for 3
   steps on MathCalc (no SFT; ``loss.skip_zero_advantage: false`` so every policy token runs
   forward and backward even when the untrained model earns no reward): fp32 master
   weights, bf16 autocast for the loss, rollouts from the bf16 copy synced after every
   update. Prints per step and overall: rollout tokens/s, training tokens/s (tokens run
   through the loss forward per second of the update phase, weight sync included) and MFU.

MFU = achieved model FLOP/s / ``--peak-tflops`` (default 790, the figure used for an H200's
dense bf16 peak in this project). Model FLOPs are counted as 2 x N per generated or
prefilled token and 6 x N per trained token, N the parameters outside the embedding, plus the
LM head (2 x d x V per generated token, 6 x d x V per loss token); attention's
sequence-length term is left out (short sequences), so MFU is slightly understated.

Without CUDA it prints why and exits with status 0 (nothing to measure). The last line is
``gen_tokens_per_s=X train_tokens_per_s=Y gen_mfu=A train_mfu=B``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

NEEDED = ("torch", "transformers", "numpy", "numba", "gymnasium", "pydantic", "yaml", "safetensors", "trace_gym")


def _missing() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def model_flops_per_token(model) -> tuple[float, float]:
    """``(N, d x V)``: parameters outside the input embedding, and the LM head's size."""
    emb = model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters()) - emb.numel()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    head_size = float(emb.numel()) if tied else float(head.weight.numel()) if head is not None else 0.0
    if not tied and head is not None:
        n -= head.weight.numel()
    return float(n), head_size


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_generation(model_dir: str, prompts: int, tokens: int, peak: float, device: str = "cuda") -> dict[str, float]:
    import torch

    from trace_gym.policies.base import SamplingParams, make_policy

    policy = make_policy("hf", model=model_dir, device=device, max_batch_size=prompts)
    if device.startswith("cuda"):
        assert policy.model.dtype == torch.bfloat16, policy.model.dtype
    n, head = model_flops_per_token(policy.model)
    batch = [policy.render_prompt([{"role": "user", "content": f"Write a long story about the number {i}."}])
             for i in range(prompts)]
    policy.generate(batch[:8], SamplingParams(max_new_tokens=16, seed=0))  # warm-up (kernels, allocator)
    policy.reset_cache()
    _sync(device)
    t0 = time.perf_counter()
    gens = policy.generate(batch, SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=1))
    _sync(device)
    dt = time.perf_counter() - t0
    generated = sum(len(g.token_ids) for g in gens)
    prefilled = sum(int(g.info.get("prefill_tokens", 0)) for g in gens)
    flops = 2 * n * (generated + prefilled) + 2 * head * generated
    out = {"gen_seconds": dt, "gen_tokens": generated, "gen_tokens_per_s": generated / dt,
           "gen_mfu": flops / dt / (peak * 1e12), "params_non_embedding": n}
    print(f"generation ({str(policy.model.dtype).removeprefix('torch.')}, {prompts} prompts x up to {tokens} tokens): {generated} tokens in {dt:.2f} s = "
          f"{out['gen_tokens_per_s']:.0f} tokens/s, MFU {100 * out['gen_mfu']:.2f}%", flush=True)
    del policy
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def check_training(model_dir: str, steps: int, trajectories: int, prompts: int, max_new_tokens: int, peak: float,
                   out_dir: str, device: str = "cuda") -> dict[str, float]:
    import torch

    from trace_gym.trainers.config import load_config
    from trace_gym.trainers.rl import RLTrainer

    overrides = {
        "seed": 0, "steps": steps, "output_dir": out_dir, "model.name": model_dir, "model.device": device,
        "model.bf16": True, "sft.enabled": False, "rollout.backend": "hf", "rollout.max_new_tokens": max_new_tokens,
        "rollout.max_batch_size": trajectories, "envs": [{"id": "trace_gym/MathCalc-v0", "kwargs": {"max_turns": 2}}],
        "allocator": "grpo", "budget.trajectories": trajectories, "budget.prompts": prompts,
        "budget.group_size": max(2, trajectories // prompts), "loss.skip_zero_advantage": False,
        "deterministic": False, "eval.every": 0, "checkpoint.every": 0, "log.progress": False, "log.tensorboard": False,
    }
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    t0 = time.perf_counter()
    trainer = RLTrainer(cfg, log=lambda msg: print(msg, flush=True))
    setup = time.perf_counter() - t0
    gen_model = trainer.policy.model
    if device.startswith("cuda"):
        assert gen_model.dtype == torch.bfloat16 and gen_model is not trainer.model, "expected a bf16 rollout copy"
    assert next(trainer.model.parameters()).dtype == torch.float32
    n, head = model_flops_per_token(trainer.model)
    rows = []
    for _ in range(steps):
        rec = trainer.step()
        fwd, loss_tok = rec.get("update/forward_tokens", 0.0), rec.get("update/trained_tokens", 0.0)
        t_upd, t_roll = rec["time/update"], rec["time/rollout"]
        gen = rec.get("spent/generated_tokens", 0)
        flops = 6 * n * fwd + 6 * head * loss_tok
        rows.append((fwd, loss_tok, t_upd, gen, t_roll, flops))
        print(f"step {rec['step']}: rollouts {gen} tokens in {t_roll:.2f} s ({gen / max(t_roll, 1e-9):.0f} tokens/s); "
              f"update {fwd:.0f} forward tokens ({loss_tok:.0f} with loss) in {t_upd:.2f} s "
              f"({fwd / max(t_upd, 1e-9):.0f} tokens/s, MFU {100 * flops / max(t_upd, 1e-9) / (peak * 1e12):.2f}%)", flush=True)
    measured = rows[1:] if len(rows) > 1 else rows  # the first step pays for kernel warm-up
    fwd = sum(r[0] for r in measured)
    t_upd = sum(r[2] for r in measured)
    gen = sum(r[3] for r in measured)
    t_roll = sum(r[4] for r in measured)
    flops = sum(r[5] for r in measured)
    out = {"setup_seconds": setup, "train_tokens_per_s": fwd / t_upd, "train_mfu": flops / t_upd / (peak * 1e12),
           "rollout_tokens_per_s": gen / t_roll,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")}
    print(f"training ({steps} steps, steps 2-{steps} measured): {out['train_tokens_per_s']:.0f} training tokens/s, "
          f"MFU {100 * out['train_mfu']:.2f}%, rollouts {out['rollout_tokens_per_s']:.0f} tokens/s, "
          f"peak memory {out['peak_memory_gib']:.1f} GiB", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model alias or directory (default smollm2-135m)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="the GPU's dense bf16 peak in TFLOP/s (default 790)")
    ap.add_argument("--gen-prompts", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trajectories", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--device", default=None, help="default: cuda when available; 'cpu' only smoke-tests this script")
    args = ap.parse_args(argv)

    missing = _missing()
    if "torch" in missing:
        print("gpu_check: torch is not installed; nothing to measure")
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print("gpu_check: no CUDA device on this machine; this check measures the hf backend in bf16 on a GPU, "
              "so there is nothing to measure here")
        return 0
    if missing:
        print(f"gpu_check: missing Python packages {', '.join(missing)}: install trace-gym first "
              "(`pip install -e .`; offline, with the dependencies already there: `pip install --no-deps --no-build-isolation -e .`)")
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from trace_gym.policies.models import resolve_model

    t0 = time.perf_counter()
    model_dir = resolve_model(args.model)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    print(f"gpu_check on {name}, torch {torch.__version__}, model {model_dir} "
          f"(resolved in {time.perf_counter() - t0:.1f} s), peak {args.peak_tflops:.0f} TFLOP/s", flush=True)
    figures = check_generation(model_dir, args.gen_prompts, args.gen_tokens, args.peak_tflops, device)
    with tempfile.TemporaryDirectory(prefix="trace-gym-gpu-check-") as tmp:
        figures.update(check_training(model_dir, args.steps, args.trajectories, args.prompts, args.max_new_tokens,
                                      args.peak_tflops, tmp, device))
    figures["total_seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    print(f"gen_tokens_per_s={figures['gen_tokens_per_s']:.0f} train_tokens_per_s={figures['train_tokens_per_s']:.0f} "
          f"gen_mfu={figures['gen_mfu']:.4f} train_mfu={figures['train_mfu']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
