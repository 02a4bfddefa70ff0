"""What makes two ``hf`` runs with the same seed sample different tokens, under each of
``HFPolicy``'s samplers (``sampler="wave"``, the default, and ``sampler="row"``).

    python benchmarks/sampler_divergence.py                      # released smollm2-135m
    python benchmarks/sampler_divergence.py --model DIR          # e.g. a warm start's directory

It renders the opening chats of ``--rows`` MathCalc test tasks (levels 1-3) as one wave and
generates one turn of ``--new-tokens`` tokens for ``--seeds`` seeds (one call per seed, a
fresh policy with its default prefix store per setting), then counts the rows whose tokens
differ from the reference setting (``max_batch_size`` = rows, this CPU's default kernels):

* **rerun**: the same setting again (the control: 0 rows expected);
* **batch cap**: ``max_batch_size`` = rows / 2, so each wave runs in two chunks;
* **kernels**: the same setting in a subprocess with torch, MKL and oneDNN held to AVX2
  (``ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``), which rounds like
  another CPU would; skipped where the default kernels are already AVX2 or older.

Every difference starts as a rounding difference that moves one sampled token; what the
table shows is how far each sampler lets that one token spread. torch runs ``--threads``
threads (default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

KERNELS_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def opening_chats(policy, rows: int) -> list[list[int]]:
    """Token ids of the opening chats of the first ``rows`` MathCalc test tasks."""
    import trace_gym

    env = trace_gym.make("trace_gym/MathCalc-v0", levels=[1, 2, 3])
    prompts = []
    for i in range(rows):
        task = env.unwrapped.tasks().get(i, "test")
        _, info = env.reset(options={"task": task})
        messages = info.get("messages") or env.unwrapped.messages()
        prompts.append(policy.render_prompt(messages, info.get("tools") or []))
    return prompts


def sample(model: str, sampler: str, batch: int, rows: int, seeds: int, new_tokens: int) -> list[list[list[int]]]:
    """Per seed, the tokens of every row: one fresh policy, one ``generate`` call per seed."""
    from trace_gym.policies.base import SamplingParams
    from trace_gym.policies.hf import HFPolicy

    policy = HFPolicy(model, max_batch_size=batch, max_batch_tokens=1 << 20, sampler=sampler)
    prompts = opening_chats(policy, rows)
    return [[g.token_ids for g in policy.generate(prompts, SamplingParams(max_new_tokens=new_tokens, seed=s))]
            for s in range(seeds)]


def differing_rows(a: list[list[list[int]]], b: list[list[list[int]]]) -> int:
    return sum(x != y for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model alias or directory (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=128, help="rows in the wave (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=10, help="calls, one per seed (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per row (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--samplers", default="wave,row", help="comma-separated (default: %(default)s)")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # internal: the kernels subprocess writes its tokens here
    args = ap.parse_args(argv)
    if args.rows < 2 or args.seeds < 1 or args.new_tokens < 1:
        ap.error("--rows must be >= 2, --seeds and --new-tokens >= 1")
    import torch

    torch.set_num_threads(args.threads)
    samplers = args.samplers.split(",")
    if args.dump:
        out = {s: sample(args.model, s, args.rows, args.rows, args.seeds, args.new_tokens) for s in samplers}
        with open(args.dump, "w") as f:
            json.dump(out, f)
        return

    capability = torch.backends.cpu.get_cpu_capability()
    other_kernels = capability.upper().startswith("AVX512")
    total = args.rows * args.seeds
    print(f"{args.model}: {args.seeds} seeds x {args.rows} MathCalc opening chats, {args.new_tokens} new tokens, "
          f"temperature 1, torch {torch.__version__} with {args.threads} threads, kernels {capability}")
    if other_kernels:
        dump = os.path.join(tempfile.mkdtemp(), "avx2.json")
        cmd = [sys.executable, __file__, "--model", args.model, "--rows", str(args.rows), "--seeds", str(args.seeds),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--samplers", args.samplers, "--dump", dump]
        subprocess.run(cmd, check=True, env={**os.environ, **KERNELS_AVX2})
        with open(dump) as f:
            avx2 = json.load(f)
    print(f"rows whose tokens differ from the reference ({args.rows} rows in one chunk, kernels {capability}), of {total}:")
    print(f"{'sampler':<8} {'rerun':>8} {'batch cap ' + str(args.rows // 2):>14} {'AVX2 kernels':>14}")
    for s in samplers:
        ref = sample(args.model, s, args.rows, args.rows, args.seeds, args.new_tokens)
        rerun = differing_rows(ref, sample(args.model, s, args.rows, args.rows, args.seeds, args.new_tokens))
        halves = differing_rows(ref, sample(args.model, s, args.rows // 2, args.rows, args.seeds, args.new_tokens))
        kernels = f"{differing_rows(ref, avx2[s]):>14}" if other_kernels else f"{'skipped':>14}"
        print(f"{s:<8} {rerun:>8} {halves:>14} {kernels}")


if __name__ == "__main__":
    main()
