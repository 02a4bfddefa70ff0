"""``RLTrainer``: tree-aware policy optimisation with any allocator, on CPU or GPU.

One step (DESIGN.md, "Data flow of one training step"), in the order :meth:`RLTrainer.step`
runs it:

1-4. **One step** (:class:`~trace_gym.step.Step`, shared with the bench, the leaderboard and
   ``trace-gym rollout``): ``budget.prompts`` candidate prompts (an epoch-shuffled pass through
   each env's train split, a function of (seed, step)), the allocator's stage 1 and stage 2
   rolled out by the engine (sampling seeds a function of (seed, step), so a step replays
   exactly), backup, advantages under the run's estimator (the allocator's own unless
   ``advantage`` is set), metrics, and the predictor update (its calibration measured first).
5. **Policy update.** Every policy token of the forest carries loss exactly once, with its
   node's advantage. ``loss.packing: tree`` (default) runs each tree's tokens forward once
   (shared prefixes once) in packed rows whose attention mask and position ids give every
   token exactly its own root-to-node context; ``trajectory`` runs one sequence per
   trajectory (trainers/batching.py). PPO-clip with clip-higher,
   token-mean over the global batch (trainers/loss.py), AdamW with gradient accumulation
   over micro-batches, gradient clipping, bf16 autocast on CUDA.
6. **Weight sync** (``rollout.backend``, trainers/backends.py). The ``hf`` policy shares
   the trained module on CPU, so its weights are current after ``optimizer.step()`` (its KV
   store notices the change); on CUDA it generates with a bf16 copy that receives the fp32
   master weights after each update. ``vllm`` (in-process engine) and ``openai`` (servers)
   receive the full weights, or the LoRA adapter alone when training LoRA, after each
   update; servers get the trained weights before their first rollout too. Non-hf
   backends turn ``loss.is_correction`` on unless the config sets it.
7. **Log and checkpoint.** One JSON line per step in ``metrics.jsonl`` (and TensorBoard),
   with ``generated``, the step forest's :meth:`~trace_gym.forest.forest.Forest.fingerprint`;
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
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

import trace_gym
from trace_gym.forest.forest import Forest
from trace_gym.policies.base import SamplingParams, make_policy
from trace_gym.rollout.async_step import AsyncStep
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


class MetricsLog:
    """``metrics.jsonl`` (one record per step) plus TensorBoard when installed.

    No record is ever deleted: records a resumed or restarted run writes again are moved, in
    order, to ``metrics.replaced.jsonl`` (appended) before ``metrics.jsonl`` drops them."""

    def __init__(self, directory: Path, tensorboard: bool):
        self.path = directory / "metrics.jsonl"
        self.replaced = directory / "metrics.replaced.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(directory / "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                self.writer = None

    def truncate(self, last_step: int) -> None:
        """Move records after ``last_step`` (a resumed run writes them again) to
        ``metrics.replaced.jsonl``; a crash part-way leaves them in both files, never in neither."""
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        keep = [line for line in lines if json.loads(line)["step"] <= last_step]
        moved = [line for line in lines if json.loads(line)["step"] > last_step]
        if not moved:
            return
        with open(self.replaced, "a") as f:
            f.write("".join(line + "\n" for line in moved))
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one JSON line, synced to disk (a non-finite float is written as
        null), and its finite numbers to TensorBoard at ``record["step"]`` when that is on."""
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
        from trace_gym.trainers.backends import with_backend_defaults

        self.cfg = cfg = with_backend_defaults(config)  # loss.is_correction on for non-hf backends unless set
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

        # policy: the trained model, warm-started; rollouts go through rollout.backend
        # (trainers/backends.py): the hf policy shares the trained module (a bf16 copy on CUDA),
        # vllm and openai receive the weights after every update
        self.sim = cfg.model.name == "sim"
        self._shares_weights = True  # the rollout policy generates with the trained module itself
        self._synced_version: int | None = None  # param_version() of the weights the policy last received
        self._syncs = 0
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
            if cfg.rollout.backend != "hf" or cfg.rollout.engines:
                raise ValueError(f"model.name 'sim' rolls out ContrastLab's simulated policy itself: rollout.backend={cfg.rollout.backend} "
                                 f"and rollout.engines={cfg.rollout.engines} do not apply (leave them at hf and 0)")
            if cfg.rollout.mode == "async" and cfg.update_policy:
                raise ValueError("model.name 'sim' cannot train with rollout.mode=async: the simulated policy reads the skills its "
                                 "update changes in place, so generation and update cannot overlap (use mode sync)")
            self.policy = make_policy("sim", world=world, seed=cfg.seed)
        else:
            self._build_model()

        # allocation: the run's allocator, predictor and advantage, resolved in one place
        resolved = resolve_run(cfg.run_spec())
        self.allocator, self.predictor, self.budget = resolved.allocator, resolved.predictor, resolved.budget
        self.advantage = resolved.advantage
        self._policy_encoder = self.predictor is not None and getattr(self.predictor, "encoder_name", None) == "policy"
        if self._policy_encoder:
            if self.sim:
                raise ValueError("predictor lm with encoder=policy needs a transformer policy; model.name 'sim' has none "
                                 "(use encoder=minilm or another predictor)")
            if cfg.rollout.mode == "async":
                raise ValueError("predictor lm with encoder=policy cannot run with rollout.mode=async: it encodes histories with the "
                                 "weights the overlapping update is changing (use mode sync, or another encoder)")
            self.predictor.attach(self.model, self.tokenizer)
        r = cfg.rollout
        if self.sim and cfg.model.sim_fast and not r.streaming:
            self.source: Any = SimSource(world=self.policy.world, seed=cfg.seed)  # ContrastLab's fast path: same process
        else:
            params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
            self.source = EngineSource(self.envs, self.policy, params, seed=cfg.seed, weights=[e.weight for e in cfg.envs],
                                       workers=cfg.rollout.workers, worker_options={"num_cpus": r.actor_cpus})
        update = None
        if cfg.update_policy:
            update = (SimLearning(self.policy.world, cfg.model.sim_lr, cfg.model.sim_shared_lr, prefix_weight=cfg.loss.prefix_weight)
                      if self.sim else self._update)
        self.async_step: AsyncStep | None = None
        self._async_state: dict[str, Any] | None = None  # what a checkpoint holds of the generator's side (async)
        if r.mode == "async" and update is not None:
            self.stepper = Step(self.source, resolved, cfg.budget.prompts, streaming=r.streaming, stream_share=r.stream_share)
            self.async_step = AsyncStep(self.stepper, update if self.sim else self._update_policy, sync=self._sync_weights,
                                        max_staleness=r.max_staleness, before_next=self._snapshot_generator)
        else:
            self.stepper = Step(self.source, resolved, cfg.budget.prompts, update=update, streaming=r.streaming,
                                stream_share=r.stream_share)

        # bookkeeping
        self.step_index = 0
        self.task_scores: dict[str, list[float]] = {}
        """After :meth:`evaluate`: each env label's held-out tasks' own mean reward over their
        ``eval.k`` episodes, in task order (``per_task`` of
        :func:`~trace_gym.trainers.evaluate.evaluate_env`)."""
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

            path = str(warm_start(cfg.model.name, cfg.sft.sft(), tiny=cfg.model.tiny, log=sft_log))
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
        from trace_gym.trainers.backends import (bf16_copy_wanted, build_policy, build_router, check_trainable, load_generation_copy,
                                                 param_version)

        r = cfg.rollout
        if r.engines:
            # Ray engine actors behind a router: each loads `path` and receives the trained
            # weights after every update (_sync_weights)
            self._shares_weights = False
            self.policy = build_router(r, path, tokenizer=self.tokenizer, device=self.device.type, lora_rank=cfg.model.lora_rank)
            if cfg.update_policy:
                check_trainable(self.policy, lora=cfg.model.lora_rank > 0)
            self._synced_version = param_version(model)
        elif r.backend == "hf" and not bf16_copy_wanted(cfg, self.device) and r.mode == "sync":
            gen_model = model.get_base_model() if cfg.model.lora_rank > 0 else model  # LoRA layers live inside it
            self.policy = build_policy(r, path, tokenizer=self.tokenizer, model=gen_model)
        else:
            # a copy (hf: bf16 on CUDA; async: its own weights), vLLM's engine or servers: they
            # start from `path` and receive the trained weights after every update (_sync_weights)
            self._shares_weights = False
            gen_model = load_generation_copy(path, self.device, bf16=bf16_copy_wanted(cfg, self.device)) if r.backend == "hf" else None
            self.policy = build_policy(r, path, tokenizer=self.tokenizer, model=gen_model, lora_rank=cfg.model.lora_rank)
            if cfg.update_policy:
                check_trainable(self.policy, lora=cfg.model.lora_rank > 0)
            # a local copy or engine holds `path`'s weights already; servers hold unknown ones
            # until the first sync (at the first step or evaluation)
            self._synced_version = None if r.backend == "openai" else param_version(model)
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

    def close(self) -> None:
        """Stop background generation, env workers and engine actors, and release the rollout
        policy's resources. Safe to call more than once."""
        if self.async_step is not None:
            self.async_step.close()
        close = getattr(self.source, "close", None)
        if close is not None:
            close()  # the engine source closes its policy too
        else:
            self.policy.close()

    def step(self) -> dict[str, Any]:
        """One RL step (see the module docstring); returns and logs its metrics."""
        cfg = self.cfg
        t_step = time.perf_counter()
        step = self.step_index + 1

        # 1-6: candidates, allocation and rollouts, advantages, predictor, policy update (and weight sync)
        if self.async_step is not None:  # the next steps' generations overlap this update
            result = self.async_step.run(self.step_index, prefetch=cfg.steps - step)
        else:
            # weights the rollout policy lacks (a resumed run's, a server's first sync); the
            # source empties its prefix cache itself, so evaluation's KV cannot reach the step
            self._sync_weights()
            result = self.stepper.run(self.step_index)

        # 7. metrics, checkpoint
        self.step_index = step
        record = self._step_metrics(result.metrics)
        record["generated"] = result.forest.fingerprint()  # a rerun that generated the same has the same
        failed = int(result.metrics.get("spent/failed_trajectories", 0))
        if failed:  # spent budget without an outcome: say so, with the errors, every step it happens
            from trace_gym.rollout.source import failure_summary, source_failures

            errors = failure_summary(source_failures(self.source))
            self.say(f"warning: step {step}: {failed} of {int(result.metrics.get('spent/trajectories', 0))} trajectories failed"
                     + (f": {errors}" if errors else ""))
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

    def _snapshot_generator(self, result: Any) -> None:
        """Async: the generator-side state after this step's generation and before the next
        one changes it (the predictor, the allocator, the envs' RNGs): what a checkpoint of
        this step holds."""
        self._async_state = copy.deepcopy({
            "allocator": self.allocator.state_dict(),
            "predictor": self.predictor.state_dict() if self.predictor is not None else None,
            "env_rng": [env.np_random.bit_generator.state for env in self.envs],
        })

    # ------------------------------------------------------------------ 5: policy update

    def token_batch(self, forest: Forest, adv: np.ndarray) -> Any:
        """The forest's :class:`~trace_gym.trainers.batching.TokenBatch` under ``loss.packing``:
        every policy token of the forest is a loss token exactly once, in a packed tree row
        (``tree``) or in its trajectory's sequence (``trajectory``); see trainers/batching.py."""
        from trace_gym.trainers.batching import token_batch

        L = self.cfg.loss
        return token_batch(forest, adv, L.packing, skip_zero_advantage=L.skip_zero_advantage and L.kl_coef == 0,
                           max_tokens=L.pack_tokens, prefix_weight=L.prefix_weight)

    def _micro_batches(self, units: list[Any]) -> list[list[int]]:
        """Indices of ``units`` per micro-batch (at most ``optim.micro_batch_tokens`` padded tokens)."""
        from trace_gym.trainers.batching import micro_batches

        return micro_batches(units, self.cfg.optim.micro_batch_tokens)

    def _tensors(self, units: list[Any]) -> dict[str, torch.Tensor]:
        """The tensors of one micro-batch (:func:`~trace_gym.trainers.batching.collate`); packed
        rows get the 4D path mask the model's attention implementation takes."""
        from trace_gym.trainers.batching import check_attention, collate

        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.policy.pad_id)
        packed = any(u.ancestors is not None for u in units)
        impl = check_attention(self.model) if packed else "sdpa"
        dtype = next(self.model.parameters()).dtype
        return collate(units, pad, impl=impl, dtype=dtype, device=self.device)

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.model.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logits(self, model: Any, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """Next-token logits at the positions ``(t["rows"], t["cols"])`` that predict the loss
        tokens: the LM head runs on those only, not on every prompt and observation token.
        Packed rows pass their 4D path mask and position ids."""
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        backbone, head = getattr(inner, "model", None), getattr(inner, "lm_head", None)
        kwargs: dict[str, Any] = {"input_ids": t["ids"], "attention_mask": t["attn"], "use_cache": False}
        if "positions" in t:
            kwargs["position_ids"] = t["positions"]
        if backbone is not None and head is not None and getattr(inner.config, "final_logit_softcapping", None) is None:
            hidden = backbone(**kwargs).last_hidden_state
            return head(hidden[t["rows"], t["cols"]])
        return model(**kwargs).logits[t["rows"], t["cols"]]

    def _token_logp(self, model: Any, t: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False):
        """``(log-probs of the loss tokens in the loss layout [G, L], zero elsewhere; their
        entropies [K] when asked)``."""
        logits = self._logits(model, t).float()
        lp = token_logprobs(logits[None], t["targets"][None], temperature)[0]
        full = torch.zeros_like(t["mask"], dtype=lp.dtype).index_put((t["slot_rows"], t["slot_cols"]), lp)
        ent = entropy_from_logits(logits.detach(), temperature) if with_entropy else None
        return full, ent

    def _check_behaviour(self, units: list[Any]) -> None:
        """With ``loss.is_correction``, every loss token needs the rollout backend's behaviour
        log-prob: a NaN one is a ``ValueError`` naming the backend."""
        bad = sum(int(np.isnan(u.behaviour).sum()) for u in units)
        if bad:
            total = sum(u.loss_tokens for u in units)
            name = getattr(self.policy, "name", type(self.policy).__name__)
            raise ValueError(f"loss.is_correction=true weights each policy token by exp(old - behaviour log-prob), but the rollout "
                             f"backend {name!r} returned no behaviour log-prob (NaN) for {bad} of the {total} policy tokens of this "
                             f"step: use a backend that reports the log-prob of every token it generates (the end-of-turn token "
                             f"included), or set loss.is_correction=false")

    def _update_policy(self, forest: Forest, adv: np.ndarray) -> dict[str, float]:
        """Step 5: the PPO update on the forest's policy tokens (see the module docstring).
        With ``mini_batches > 1`` each optimizer step's normaliser is its share (in loss
        tokens, or trajectories for per-sequence aggregations) of the global one."""
        cfg, L = self.cfg, self.cfg.loss
        batch = self.token_batch(forest, adv)
        units = batch.units
        stats = {"update/sequences": sum(u.n_groups for u in units), "update/policy_tokens": batch.policy_tokens,
                 "update/trained_tokens": 0.0, "update/rows": len(units), "update/forward_tokens": batch.forward_tokens}
        if not units:
            stats.update({"update/skipped": 1.0, "update/lr": self.scheduler.get_last_lr()[0]})
            return stats
        if L.is_correction:
            self._check_behaviour(units)
        temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        token_mean = L.aggregation == "token-mean"
        norm_all = float(batch.weighted_tokens) if token_mean else float(batch.sequences)
        weight = [float((u.loss_tokens if u.weight is None else u.weight.sum()) if token_mean else u.n_groups) for u in units]
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
                    for i, u in enumerate(units):
                        with self._autocast():
                            old_cache[i] = self._token_logp(self.model, self._tensors([u]), temperature)[0]
            for epoch in range(L.ppo_epochs):
                perm = torch.randperm(len(units), generator=gen).tolist() if multi else list(range(len(units)))
                parts = [perm[k:: L.mini_batches] for k in range(L.mini_batches)]
                for part in parts:
                    if not part:
                        continue
                    # the normaliser of this optimizer step: its share of the global batch
                    norm = norm_all * sum(weight[i] for i in part) / sum(weight) if L.mini_batches > 1 else norm_all
                    self.optimizer.zero_grad(set_to_none=True)
                    for mb in self._micro_batches([units[i] for i in part]):
                        chosen = [part[j] for j in mb]
                        t = self._tensors([units[i] for i in chosen])
                        with self._autocast():
                            logp, ent = self._token_logp(self.model, t, temperature, with_entropy=(epoch == 0))
                        m = t["mask"]
                        if multi:
                            width = m.shape[1]
                            old = torch.cat([torch.nn.functional.pad(old_cache[i], (0, width - old_cache[i].shape[1])) for i in chosen])
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
                        behaviour = t["behaviour"]
                        out = policy_loss(logp, old, t["adv"], m, eps_low=L.eps_low, eps_high=L.eps_high,
                                          aggregation=L.aggregation, normaliser=norm, ref_logp=ref, kl_coef=L.kl_coef,
                                          behaviour_logp=behaviour if L.is_correction else None, is_cap=L.is_cap,
                                          weights=t["weight"] if L.prefix_weight > 0 else None)
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
                            known = (m > 0) & torch.isfinite(behaviour)  # a backend may leave some unreported
                            acc["behaviour_gap"] += float(torch.where(known, (old - behaviour).abs(), 0.0).sum())
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
        """Bring the rollout policy's weights up to date when the trained weights changed
        since its last sync (an optimizer step, a resume) or it never had them (servers).
        Nothing to do for the hf policy that shares the trained module. Otherwise
        :func:`~trace_gym.trainers.backends.push_weights`: the full weights (a bf16 copy,
        vLLM, servers; LoRA merged in), or the LoRA adapter alone where the backend loads
        adapters (vLLM, vLLM servers). A server that cannot take weights (allowed with
        ``update_policy: false`` only) keeps its own."""
        from trace_gym.trainers.backends import param_version, push_weights

        if self.model is None or self._shares_weights or not self.policy.sync_modes():
            return
        if self._synced_version is not None and param_version(self.model) == self._synced_version:
            return
        self._syncs += 1
        push_weights(self.policy, self.model, self.out / "weight-sync", self._syncs)
        self._synced_version = param_version(self.model)

    # ------------------------------------------------------------------ 7: metrics

    def _update(self, forest: Forest, adv: np.ndarray) -> dict[str, float]:
        """The policy update of a step (5) and the weight sync (6)."""
        out = self._update_policy(forest, adv)
        self._sync_weights()
        if self._policy_encoder:  # its cached embeddings came from the weights before this update
            self.predictor.refresh()
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
        """Held-out mean@k / pass@k per env (``eval/<env>/...``; each task's own score in
        :attr:`task_scores`); leaves every RNG as it was."""
        from trace_gym.trainers.evaluate import env_labels, evaluate_env, held_out_tasks

        cfg = self.cfg.eval
        step = self.step_index if step is None else step
        if self.async_step is not None:
            self.async_step.wait_idle()  # the rollout backend is free again (its next results are kept)
        self._sync_weights()  # evaluation goes through the rollout backend: it needs the current weights
        rng = capture_rng()
        out: dict[str, float] = {}
        scores: dict[str, list[float]] = {}
        try:
            for env, name in zip(self.envs, env_labels([env.env_id.split("/")[-1] for env in self.envs])):
                params = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=cfg.temperature,
                                        top_p=self.cfg.rollout.top_p, seed=step_seed(self.cfg.seed, step, 1))
                res = evaluate_env(self.policy, env, held_out_tasks(env, cfg.tasks, split=cfg.split), cfg.k, params)
                scores[name] = res["per_task"]
                for k in ("mean@k", "pass@k", "tool_call_rate", "answer_rate"):
                    out[f"eval/{name}/{k}"] = res[k]
                world = getattr(env, "world", None)
                if world is not None and hasattr(world, "mean_success"):
                    out[f"eval/{name}/exact_success"] = world.mean_success("test")
        finally:
            restore_rng(rng)
        self.task_scores = scores
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
        if self._async_state is not None:  # async: as they were before later generations ran ahead
            trainer.update(self._async_state)
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
        """Restore the newest readable checkpoint. Checkpoints that all fail to read raise
        :class:`~trace_gym.trainers.checkpoint.CheckpointError` (nothing in the run directory
        is touched); with no checkpoint at all the run starts from step 0 and its earlier
        records move to ``metrics.replaced.jsonl``."""
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
