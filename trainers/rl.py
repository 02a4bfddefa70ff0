"""``RLTrainer``: tree-aware policy optimisation with any allocator, on CPU or GPU.

One step (DESIGN.md, "Data flow of one training step"), in the order :meth:`RLTrainer.step`
runs it:

1-4. **One step** (:class:`~trace_gym.step.Step`, shared with the bench, the leaderboard and
   ``trace-gym rollout``): ``budget.prompts`` candidate prompts (an epoch-shuffled pass through
   each env's train split, a function of (seed, step)), the allocator's stage 1 and stage 2
   rolled out by the engine (sampling seeds a function of (seed, step), so a step replays
   exactly), backup, advantages under the run's estimator (the allocator's own unless
   ``advantage`` is set), metrics, and the predictor update (its calibration measured first).
5. **Policy update.** Each trajectory becomes one token sequence (prompt, its ancestors'
   turns, its own turns); only the tokens this trajectory generated carry loss (mask 1), so
   every policy token of the forest is trained on exactly once. PPO-clip with clip-higher,
   token-mean over the global batch (trainers/loss.py), AdamW with gradient accumulation
   over micro-batches, gradient clipping, bf16 autocast on CUDA.
6. **Weight sync.** The ``hf`` policy shares the trained module, so its weights are
   current after ``optimizer.step()`` (its KV store notices the change); another backend
   receives the new weights through :meth:`~trace_gym.policies.base.Policy.load_weights`.
7. **Log and checkpoint.** One JSON line per step in ``metrics.jsonl`` (and TensorBoard);
   an atomic checkpoint (model, optimizer, scheduler, predictor, allocator, every RNG,
   data cursors, step, counters).

``model.name: sim`` trains ContrastLab's simulated policy instead (its learning mode): the
same loop, with step 5 a REINFORCE update of the simulated skills.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

import trace_gym
from trace_gym.forest.forest import Forest
from trace_gym.policies.base import SamplingParams, make_policy
from trace_gym.rollout.source import EngineSource, step_seed
from trace_gym.run import resolve_run
from trace_gym.sim.learning import SimLearning
from trace_gym.sim.source import SimSource
from trace_gym.step import Step
from trace_gym.trainers.checkpoint import CheckpointManager, capture_rng, restore_rng
from trace_gym.trainers.config import RLConfig
from trace_gym.trainers.loss import entropy_from_logits, policy_loss, token_logprobs
from trace_gym.trainers.sft import lr_lambda, resolve_base, warm_start

TIME_KEYS = ("time/",)  # metrics that measure wall time (differ between otherwise identical runs)


@dataclass
class TrainSequence:
    """One trajectory as the loss sees it."""

    ids: np.ndarray  # int64 [T]
    mask: np.ndarray  # float32 [T]: 1 on the tokens this trajectory generated
    adv: np.ndarray  # float32 [T]: the advantage of the node that owns each token
    behaviour: np.ndarray  # float32 [T]: the engine's log-probs


class MetricsLog:
    """``metrics.jsonl`` (one record per step) plus TensorBoard when installed."""

    def __init__(self, directory: Path, tensorboard: bool):
        self.path = directory / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(directory / "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                self.writer = None

    def truncate(self, last_step: int) -> None:
        """Drop records after ``last_step`` (a resumed run writes them again)."""
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step":
                    self.writer.add_scalar(k, v, record["step"])
            self.writer.flush()

    def read(self) -> list[dict[str, Any]]:
        """All records written so far."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


class RLTrainer:
    """Trains a policy with an allocator; see the module docstring for the step.

    ``RLTrainer(config).train()`` runs ``config.steps`` steps; with ``resume=True`` it
    continues from the newest readable checkpoint in ``config.output_dir`` (a corrupt newest
    one is reported and the one before it used), and the steps it then runs produce the same
    metrics as an uninterrupted run.
    """

    def __init__(self, config: RLConfig, *, resume: bool = False, log: Callable[[str], None] | None = None):
        self.cfg = cfg = config
        self.say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.model.threads:
            torch.set_num_threads(cfg.model.threads)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % (2**32))
        torch.manual_seed(cfg.seed)

        # envs: one instance each (the engines restore snapshots into it)
        self.envs = [trace_gym.make(e.id, **{"seed": cfg.seed, **e.kwargs}) for e in cfg.envs]

        # policy: the trained model, warm-started, shared with the hf rollout backend
        self.sim = cfg.model.name == "sim"
        self.device = torch.device("cpu")
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.ref_model: Any = None
        self.sft_summary: dict[str, Any] = {}
        if self.sim:
            world = getattr(self.envs[0], "world", None)
            if world is None or len(self.envs) != 1:
                raise ValueError("model.name 'sim' trains ContrastLab's simulated policy: use exactly one env, trace_gym/ContrastLab-v0")
            self.policy = make_policy("sim", world=world, seed=cfg.seed)
        else:
            self._build_model()

        # allocation: the run's allocator, predictor and advantage, resolved in one place
        resolved = resolve_run(cfg.run_spec())
        self.allocator, self.predictor, self.budget = resolved.allocator, resolved.predictor, resolved.budget
        self.advantage = resolved.advantage
        if self.predictor is not None and getattr(self.predictor, "encoder_name", None) == "policy":
            self.predictor.attach(self.model, self.tokenizer)
        r = cfg.rollout
        if self.sim and cfg.model.sim_fast:
            self.source: Any = SimSource(world=self.policy.world, seed=cfg.seed)  # ContrastLab's fast path: same process
        else:
            params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
            self.source = EngineSource(self.envs, self.policy, params, seed=cfg.seed, weights=[e.weight for e in cfg.envs])
        update = None
        if cfg.update_policy:
            update = SimLearning(self.policy.world, cfg.model.sim_lr, cfg.model.sim_shared_lr) if self.sim else self._update
        self.stepper = Step(self.source, resolved, cfg.budget.prompts, update=update)

        # bookkeeping
        self.step_index = 0
        self._checkpoint_seconds = 0.0
        self.totals = {"trajectories": 0, "generated_tokens": 0, "tool_calls": 0, "prefill_tokens": 0}
        self.ckpt = CheckpointManager(self.out / "checkpoints", keep_last=cfg.checkpoint.keep_last)
        self.metrics = MetricsLog(self.out, cfg.log.tensorboard)
        if resume:
            self._resume()
        else:
            if self.ckpt.steps():
                raise FileExistsError(f"{self.out} already holds checkpoints: pass --resume to continue that run, or use another output_dir")
            self.metrics.truncate(-1)
        # written only once the run is known to be this config's (a refused resume leaves it alone)
        (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

    # ------------------------------------------------------------------ construction

    def _build_model(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.cfg
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per weight file is noise in a training log
        base, _ = resolve_base(cfg.model.name, cfg.model.tiny)
        path = base
        if cfg.sft.enabled:
            t0 = time.perf_counter()
            def sft_log(r: dict[str, float]) -> None:
                if r["step"] % max(1, int(r["steps"]) // 10) == 0 or r["step"] == r["steps"]:
                    self.say(f"SFT step {int(r['step'])}/{int(r['steps'])}  loss {r['loss']:.3f}  ({time.perf_counter() - t0:.0f} s)")

            path = str(warm_start(cfg.model.name, cfg.sft.sft(), tiny=cfg.model.tiny, threads=cfg.model.threads, log=sft_log))
            summary_file = Path(path) / "sft_summary.json"
            self.sft_summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
            self.say(f"SFT warm start: {path} ({time.perf_counter() - t0:.1f} s; cached after the first run)")
        device = cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # fp32 master weights; bf16 only inside autocast on CUDA
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        if cfg.model.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
            model.config.use_cache = True  # generation still uses the KV cache; training passes use_cache=False
        if cfg.model.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                                                     lora_dropout=cfg.model.lora_dropout, target_modules=cfg.model.lora_targets,
                                                     task_type="CAUSAL_LM"))
        self.model = model
        gen_model = model.get_base_model() if cfg.model.lora_rank > 0 else model  # LoRA layers live inside it
        self.policy = make_policy("hf", model=gen_model, tokenizer=self.tokenizer, max_batch_size=cfg.rollout.max_batch_size,
                                  **cfg.rollout.policy_kwargs)
        params = [p for p in model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2))
        updates = cfg.steps * cfg.loss.ppo_epochs * cfg.loss.mini_batches
        if o.schedule == "cosine":
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(updates, o.warmup_steps / max(1, updates)))
        else:
            w = max(1, o.warmup_steps)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / w))
        if cfg.loss.kl_coef > 0 and cfg.model.lora_rank == 0:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        model.eval()

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps; returns every step's metrics record (this run's and earlier)."""
        cfg = self.cfg
        display = _Display(cfg.steps, enabled=cfg.log.progress, say=self.say)
        with display:
            display.update(self.step_index, {})
            if self.step_index == 0 and cfg.eval.every:
                self._log_eval_only(0)
            while self.step_index < cfg.steps:
                record = self.step()
                display.update(self.step_index, record)
            if self.step_index % max(cfg.checkpoint.every, 1) and cfg.checkpoint.every:
                self.save()
        if cfg.checkpoint.every == 0:
            self.save()
        return self.metrics.read()

    def step(self) -> dict[str, Any]:
        """One RL step (see the module docstring); returns and logs its metrics."""
        cfg = self.cfg
        t_step = time.perf_counter()
        step = self.step_index + 1
        self._clear_policy_cache()

        # 1-6: candidates, allocation and rollouts, advantages, predictor, policy update (and weight sync)
        result = self.stepper.run(self.step_index)

        # 7. metrics, checkpoint
        self.step_index = step
        record = self._step_metrics(result.metrics)
        if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.steps):
            t0 = time.perf_counter()
            record.update(self.evaluate(step))
            record["time/eval"] = time.perf_counter() - t0
        record["time/step"] = time.perf_counter() - t_step
        record["time/checkpoint_previous"] = self._checkpoint_seconds
        # the record goes out before the checkpoint: killed in between, the resumed run
        # repeats this step and rewrites its record (records after the checkpoint are dropped)
        self.metrics.write(record)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            t0 = time.perf_counter()
            self.save()
            self._checkpoint_seconds = time.perf_counter() - t0
        return record

    # ------------------------------------------------------------------ 1-2: candidates and rollouts

    def _clear_policy_cache(self) -> None:
        # A KV prefix cache carried over from other calls (evaluation) would make this step's
        # numerics depend on them; a resumed run must see exactly what the original saw.
        store = getattr(self.policy, "store", None)
        if store is not None and hasattr(store, "clear"):
            store.clear()

    # ------------------------------------------------------------------ 5: policy update

    def token_batch(self, forest: Forest, adv: np.ndarray) -> tuple[list[TrainSequence], int, int]:
        """``(sequences, policy tokens, sequences with policy tokens)`` of the forest: one
        sequence per trajectory, loss only on the tokens that trajectory generated."""
        from trace_gym.rollout.engine import sequence

        out: list[TrainSequence] = []
        n_tokens = n_seqs = 0
        for t in range(forest.n_trajectories):
            leaf = int(forest.traj_leaf[t])
            if leaf == int(forest.traj_origin[t]):
                continue  # failed before its first turn
            seq = sequence(forest, leaf)
            own = (seq.mask == 1) & (forest.traj[seq.node] == t)
            if not own.any():
                continue
            n_tokens += int(own.sum())
            n_seqs += 1
            a = adv[seq.node].astype(np.float32)
            if self.cfg.loss.skip_zero_advantage and self.cfg.loss.kl_coef == 0 and not np.any(a[own] != 0):
                continue
            out.append(TrainSequence(seq.ids, own.astype(np.float32), a, seq.logprobs.astype(np.float32)))
        return out, n_tokens, n_seqs

    def _micro_batches(self, seqs: list[TrainSequence]) -> list[list[TrainSequence]]:
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
        batches, cur, width = [], [], 0
        for i in order:
            w = max(width, len(seqs[i].ids))
            if cur and w * (len(cur) + 1) > self.cfg.optim.micro_batch_tokens:
                batches.append(cur)
                cur, w = [], len(seqs[i].ids)
            cur.append(seqs[i])
            width = w
        if cur:
            batches.append(cur)
        return batches

    def _tensors(self, batch: list[TrainSequence]) -> dict[str, torch.Tensor]:
        width = max(len(s.ids) for s in batch)
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.policy.pad_id)
        out = {
            "ids": torch.full((len(batch), width), pad, dtype=torch.long),
            "attn": torch.zeros((len(batch), width), dtype=torch.long),
            "mask": torch.zeros((len(batch), width)),
            "adv": torch.zeros((len(batch), width)),
            "behaviour": torch.zeros((len(batch), width)),
        }
        for r, s in enumerate(batch):
            n = len(s.ids)
            out["ids"][r, :n] = torch.from_numpy(s.ids)
            out["attn"][r, :n] = 1
            out["mask"][r, :n] = torch.from_numpy(s.mask)
            out["adv"][r, :n] = torch.from_numpy(s.adv)
            out["behaviour"][r, :n] = torch.from_numpy(s.behaviour)
        return {k: v.to(self.device) for k, v in out.items()}

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.model.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logits(self, model: Any, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Next-token logits at positions ``(rows, cols)`` only: the LM head runs on the
        positions that carry loss, not on every prompt and observation token."""
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        backbone, head = getattr(inner, "model", None), getattr(inner, "lm_head", None)
        if backbone is not None and head is not None and getattr(inner.config, "final_logit_softcapping", None) is None:
            hidden = backbone(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
            return head(hidden[rows, cols])
        return model(input_ids=ids, attention_mask=attn, use_cache=False).logits[rows, cols]

    def _token_logp(self, model: Any, t: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False):
        """``([B, T-1] log-probs of the next tokens, zero off the loss positions; entropies)``."""
        target_mask = t["mask"][:, 1:]
        rows, cols = torch.nonzero(target_mask > 0, as_tuple=True)
        logits = self._logits(model, t["ids"], t["attn"], rows, cols).float()
        targets = t["ids"][:, 1:][rows, cols]
        lp = token_logprobs(logits[None], targets[None], temperature)[0]
        full = torch.zeros_like(target_mask, dtype=lp.dtype).index_put((rows, cols), lp)
        ent = entropy_from_logits(logits.detach(), temperature) if with_entropy else None
        return full, ent

    def _update_policy(self, forest: Forest, adv: np.ndarray) -> dict[str, float]:
        cfg, L = self.cfg, self.cfg.loss
        seqs, n_tokens, n_seqs = self.token_batch(forest, adv)
        stats = {"update/sequences": len(seqs), "update/policy_tokens": n_tokens, "update/trained_tokens": 0.0}
        if not seqs:
            stats.update({"update/skipped": 1.0, "update/lr": self.scheduler.get_last_lr()[0]})
            return stats
        temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        norm_all = float(n_tokens) if L.aggregation == "token-mean" else float(n_seqs)
        # old log-probs: on-policy with a single update they equal the current ones (detached)
        old_cache: dict[int, torch.Tensor] = {}
        multi = L.ppo_epochs * L.mini_batches > 1
        gen = torch.Generator().manual_seed(step_seed(cfg.seed, self.step_index + 1, 2))
        acc = {"loss": 0.0, "tokens": 0.0, "clip_low": 0.0, "clip_high": 0.0, "kl": 0.0, "entropy": 0.0, "ratio": 0.0,
               "is_weight": 0.0, "behaviour_gap": 0.0}
        grad_norms = []
        self.model.train()
        try:
            if multi:
                with torch.no_grad():
                    for i, s in enumerate(seqs):
                        with self._autocast():
                            old_cache[i] = self._token_logp(self.model, self._tensors([s]), temperature)[0]
            for epoch in range(L.ppo_epochs):
                perm = torch.randperm(len(seqs), generator=gen).tolist() if multi else list(range(len(seqs)))
                parts = [perm[k:: L.mini_batches] for k in range(L.mini_batches)]
                for part in parts:
                    if not part:
                        continue
                    chosen = [seqs[i] for i in part]
                    # the normaliser of this optimizer step: its share of the global batch
                    norm = norm_all * len(part) / len(seqs) if L.mini_batches > 1 else norm_all
                    self.optimizer.zero_grad(set_to_none=True)
                    index = {id(seqs[i]): i for i in part}
                    for mb in self._micro_batches(chosen):
                        t = self._tensors(mb)
                        with self._autocast():
                            logp, ent = self._token_logp(self.model, t, temperature, with_entropy=(epoch == 0))
                        m = t["mask"][:, 1:]
                        if multi:
                            width = m.shape[1]
                            old = torch.stack([torch.nn.functional.pad(old_cache[index[id(s)]][0], (0, width - old_cache[index[id(s)]].shape[1]))
                                               for s in mb])
                        else:
                            old = logp.detach()
                        ref = None
                        if L.kl_coef > 0:
                            with torch.no_grad(), self._autocast():
                                if self.ref_model is not None:
                                    ref = self._token_logp(self.ref_model, t, temperature)[0]
                                else:  # LoRA: the reference is the model without its adapters
                                    with self.model.disable_adapter():
                                        ref = self._token_logp(self.model, t, temperature)[0]
                        behaviour = t["behaviour"][:, 1:]
                        out = policy_loss(logp, old, t["adv"][:, 1:], m, eps_low=L.eps_low, eps_high=L.eps_high,
                                          aggregation=L.aggregation, normaliser=norm, ref_logp=ref, kl_coef=L.kl_coef,
                                          behaviour_logp=behaviour if L.is_correction else None, is_cap=L.is_cap)
                        out.loss.backward()
                        acc["loss"] += float(out.loss.detach())
                        if epoch == 0:
                            acc["tokens"] += out.tokens
                            acc["clip_low"] += out.clip_low
                            acc["clip_high"] += out.clip_high
                            acc["kl"] += out.kl
                            acc["ratio"] += out.ratio
                            acc["is_weight"] += out.is_weight
                            if ent is not None:
                                acc["entropy"] += float(ent.sum())
                            acc["behaviour_gap"] += float(((old - behaviour).abs() * m).sum())
                    params = [p for p in self.model.parameters() if p.requires_grad]
                    grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)))
                    self.optimizer.step()
                    self.scheduler.step()
        finally:
            self.model.eval()
        tok = max(acc["tokens"], 1.0)
        stats.update({
            "update/loss": acc["loss"] / (L.ppo_epochs),
            "update/trained_tokens": acc["tokens"],
            "update/clip_low": acc["clip_low"] / tok,
            "update/clip_high": acc["clip_high"] / tok,
            "update/clip_ratio": (acc["clip_low"] + acc["clip_high"]) / tok,
            "update/kl": acc["kl"] / tok,
            "update/entropy": acc["entropy"] / tok,
            "update/ratio": acc["ratio"] / tok,
            "update/is_weight": acc["is_weight"] / tok,
            "update/behaviour_logp_gap": acc["behaviour_gap"] / tok,
            "update/grad_norm": float(np.mean(grad_norms)),
            "update/lr": self.scheduler.get_last_lr()[0],
        })
        return stats

    def _sync_weights(self) -> None:
        """Bring the rollout policy's weights up to date (a no-op for the in-process hf policy)."""
        target = getattr(self.policy, "model", None)
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        if target is inner or target is self.model:
            return
        if hasattr(self.model, "merge_adapter"):  # LoRA: send merged weights, keep the adapters
            self.model.merge_adapter()
            try:
                state = {k.replace(".base_layer", ""): v for k, v in inner.state_dict().items() if "lora_" not in k}
            finally:
                self.model.unmerge_adapter()
        else:
            state = self.model.state_dict()
        self.policy.load_weights(state)

    # ------------------------------------------------------------------ 7: metrics

    def _update(self, forest: Forest, adv: np.ndarray) -> dict[str, float]:
        """The policy update of a step (5) and the weight sync (6)."""
        out = self._update_policy(forest, adv)
        self._sync_weights()
        return out

    def _step_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The step's record: the step's metrics with running totals."""
        for k, key in (("trajectories", "spent/trajectories"), ("generated_tokens", "spent/generated_tokens"),
                       ("tool_calls", "spent/tool_calls"), ("prefill_tokens", "spent/prefill_tokens")):
            self.totals[k] += int(metrics.get(key, 0))
        return {"step": self.step_index, **metrics, "total/trajectories": self.totals["trajectories"],
                "total/generated_tokens": self.totals["generated_tokens"], "total/tool_calls": self.totals["tool_calls"]}

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """Held-out mean@k / pass@k per env (``eval/<env>/...``); leaves every RNG as it was."""
        from trace_gym.trainers.evaluate import evaluate_env, held_out_tasks

        cfg = self.cfg.eval
        step = self.step_index if step is None else step
        rng = capture_rng()
        out: dict[str, float] = {}
        try:
            for env in self.envs:
                params = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=cfg.temperature,
                                        top_p=self.cfg.rollout.top_p, seed=step_seed(self.cfg.seed, step, 1))
                res = evaluate_env(self.policy, env, held_out_tasks(env, cfg.tasks, split=cfg.split), cfg.k, params)
                name = env.env_id.split("/")[-1]
                for k in ("mean@k", "pass@k", "tool_call_rate", "answer_rate"):
                    out[f"eval/{name}/{k}"] = res[k]
                world = getattr(env, "world", None)
                if world is not None and hasattr(world, "mean_success"):
                    out[f"eval/{name}/exact_success"] = world.mean_success("test")
        finally:
            restore_rng(rng)
            self._clear_policy_cache()
        return out

    def _log_eval_only(self, step: int) -> None:
        rec = {"step": step, **self.evaluate(step)}
        self.metrics.write(rec)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (one entry per checkpoint file)."""
        trainer = {
            "step": self.step_index, "totals": dict(self.totals), "rng": capture_rng(),
            "fingerprint": self.cfg.fingerprint(),
            "allocator": self.allocator.state_dict(),
            "predictor": self.predictor.state_dict() if self.predictor is not None else None,
            "env_rng": [env.np_random.bit_generator.state for env in self.envs],
        }
        if self.sim:
            w = self.policy.world
            trainer["sim"] = {"skill": w.skill.copy(), "shared_skill": float(w.shared_skill), "policy_rng": self.policy.rng.bit_generator.state,
                              "fast_rng": self.source.rng_state() if isinstance(self.source, SimSource) else None}
            return {"trainer": trainer}
        return {"trainer": trainer, "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def save(self) -> Path:
        """Write a checkpoint of the current step."""
        return self.ckpt.save(self.step_index, self.state_dict())

    def _resume(self) -> None:
        found = self.ckpt.load_latest(map_location=self.device if not self.sim else "cpu")
        if found is None:
            self.say(f"no checkpoint in {self.ckpt.directory}: starting from step 0")
            self.metrics.truncate(-1)
            return
        step, state = found
        tr = state["trainer"]
        if tr["fingerprint"] != self.cfg.fingerprint():
            raise ValueError(f"the checkpoint of step {step} in {self.out} was written with another config; resume with the same config (see {self.out / 'config.yaml'})")
        if not self.sim:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            w = self.policy.world
            w.skill[:] = tr["sim"]["skill"]
            w.shared_skill = tr["sim"]["shared_skill"]
            w._refresh()  # recompute the success tables from the restored skills
            self.policy.rng.bit_generator.state = tr["sim"]["policy_rng"]
            if isinstance(self.source, SimSource) and tr["sim"].get("fast_rng") is not None:
                self.source.set_rng_state(tr["sim"]["fast_rng"])
        self.allocator.load_state_dict(tr["allocator"])
        if self.predictor is not None and tr["predictor"] is not None:
            self.predictor.load_state_dict(tr["predictor"])
        for env, s in zip(self.envs, tr["env_rng"]):
            env.np_random.bit_generator.state = s
        self.totals = dict(tr["totals"])
        self.step_index = int(tr["step"])
        restore_rng(tr["rng"])
        self.metrics.truncate(self.step_index)
        self.say(f"resumed from the checkpoint of step {self.step_index}")


class _Display:
    """A rich progress bar with the latest metrics (one line per step when not a terminal)."""

    KEYS = (("reward/mean", "reward"), ("effective_ratio", "eff"), ("effective_sample_ratio", "esr"),
            ("update/loss", "loss"), ("predictor/brier", "brier"), ("time/step", "s/step"))

    def __init__(self, total: int, enabled: bool, say: Callable[[str], None]):
        self.total, self.say = total, say
        self.progress = None
        if enabled:
            from rich.console import Console

            console = Console(stderr=True)
            if console.is_terminal:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                self.progress = Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                         TextColumn("{task.fields[info]}"), console=console)
                self.task = self.progress.add_task("train", total=total, info="")
        self.enabled = enabled

    def __enter__(self) -> "_Display":
        if self.progress is not None:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def update(self, step: int, record: dict[str, Any]) -> None:
        info = "  ".join(f"{short} {record[k]:.3g}" for k, short in self.KEYS if isinstance(record.get(k), (int, float)))
        evals = "  ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in record.items() if k.startswith("eval/") and k.endswith("/mean@k"))
        if evals:
            info += "  held-out " + evals
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=info)
        elif self.enabled and record:
            self.say(f"step {step}/{self.total}  {info}")
