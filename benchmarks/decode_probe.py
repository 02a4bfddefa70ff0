"""How fast the ``hf`` backend decodes: ``HFPolicy.generate`` on a randomly initialised model
shaped like SmolLM2-135M (no weights needed, so it runs on a bare GPU machine).

    python benchmarks/decode_probe.py                 # CUDA when available, else CPU (one small case)
    python benchmarks/decode_probe.py --cases 8x200,128x200,128x600 --new-tokens 64

Each case ``NxL`` generates ``--new-tokens`` tokens for N random prompts of L tokens (after
a warm-up call), bf16 on CUDA, fp32 on CPU, and prints the wall time, new tokens/s and ms per
decode step (wall time / new tokens per row). The tokenizer is the tiny preset's (only its
special tokens matter: a random model rarely stops early, so every row runs to the limit).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trace_gym.policies.base import SamplingParams
    from trace_gym.policies.hf import HFPolicy
    from trace_gym.trainers.sft import resolve_base

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=None, help="NxL,... (default: 8x200,128x200,128x600 on CUDA, 8x200 on CPU)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cases = args.cases or ("8x200,128x200,128x600" if dev == "cuda" else "8x200")
    tok = AutoTokenizer.from_pretrained(resolve_base("tiny")[0])
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    net = LlamaForCausalLM(cfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    policy = HFPolicy(net, tokenizer=tok, max_batch_size=128, max_batch_tokens=65536)
    gen = torch.Generator().manual_seed(0)
    print(f"device {dev} ({torch.cuda.get_device_name(0) if dev == 'cuda' else f'{args.threads} threads'}), "
          f"SmolLM2-135M shape, random weights, {args.new_tokens} new tokens per row")
    for case in cases.split(","):
        n, length = (int(x) for x in case.lower().split("x"))
        prompts = [torch.randint(10, min(len(tok), 49000), (length,), generator=gen).tolist() for _ in range(n)]
        policy.generate(prompts[:2], SamplingParams(max_new_tokens=8))  # warm-up
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = policy.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens))
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        new = sum(len(o.token_ids) for o in out)
        print(f"{n} prompts x {length} tokens: {new} new tokens in {dt:.2f} s = {new / dt:,.0f} tokens/s, "
              f"{1e3 * dt / max(1, new / n):.0f} ms per decode step")


if __name__ == "__main__":
    main()
