"""``RLConfig``: everything a training run reads, as pydantic models (YAML files in ``configs/``).

Every field is documented once, here, in its ``description``; ``trace-gym train --help-config``
prints them all. A config is loaded with :func:`load_config` (a YAML file plus ``key=value``
overrides with dotted keys, e.g. ``allocator=grpo budget.trajectories=64 optim.lr=1e-4``). Unknown keys and
bad values fail with :class:`ConfigError`, which names the offending key and, for a typo,
the closest valid key.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trace_gym.trainers.presets import TinySpec
from trace_gym.run import BudgetSpec, ComponentSpec, EnvSpec, RunSpec, parse_options
from trace_gym.trainers.sft import SFTConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The policy model."""

    name: str = Field("tiny", description="'tiny' (the from-scratch preset, see `tiny`), a model alias such as 'smollm2-135m', a local HF directory or a hub id (offline: from the local cache).")
    tiny: TinySpec = Field(default_factory=TinySpec, description="Architecture and tokenizer corpus of the tiny preset (used when name is 'tiny').")
    device: str | None = Field(None, description="'cpu', 'cuda', 'cuda:1'...; default CUDA when available.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass (saves memory; on CUDA mostly).")
    bf16: bool = Field(True, description="On CUDA: bfloat16 autocast for the loss forward (master weights stay fp32) and, with rollout.backend hf, rollouts from a bf16 copy of the weights synced after every update. Ignored on CPU.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (fix it for reproducible timings and results).")
    sim_lr: float = Field(1.0, gt=0, description="Learning rate of the simulated policy's REINFORCE update (name 'sim' only).")
    sim_shared_lr: float = Field(0.1, ge=0, description="Learning rate of its shared skill, which moves held-out tasks too (name 'sim' only).")
    sim_fast: bool = Field(True, description="Roll the simulated policy out with ContrastLab's vectorised fast path (same process, same forests) instead of the text engine (name 'sim' only).")
    lora_rank: int = Field(0, ge=0, description="LoRA rank through peft; 0 trains all weights.")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    lora_targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                    description="Module names LoRA adapts.")


class SFTSection(SFTConfig):
    """The SFT warm start run before RL (cached; see trainers/sft.py for its fields)."""

    enabled: bool = Field(True, description="Warm-start the policy with SFT on demonstrations before RL.")

    def sft(self) -> SFTConfig:
        """The :class:`SFTConfig` (the cache key leaves ``enabled`` out)."""
        return SFTConfig(**self.model_dump(exclude={"enabled"}))


class RolloutSection(_Section):
    """How rollouts are sampled."""

    max_new_tokens: int = Field(64, ge=1, description="Token limit of one generated turn.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (also used to recompute log-probs in the loss).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_batch_size: int = Field(64, ge=1, description="Rows per generation forward pass.")
    workers: int = Field(0, ge=0, description="Env workers: N >= 1 runs env steps (tools included) in N Ray actors (needs the 'ray' extra; joins the cluster of RAY_ADDRESS / `ray start`, else starts a local Ray); generation stays in the trainer. 0 (default): env steps in the trainer's process. Same results either way.")
    backend: Literal["hf", "vllm", "openai"] = Field("hf", description="Engine of every rollout and evaluation: 'hf' (transformers in this process; it shares the trained module on CPU and uses a bf16 copy on CUDA), 'vllm' (vLLM's engine in this process, prefix caching, weights synced after every update), 'openai' (the OpenAI-compatible servers in `servers`, e.g. `vllm serve`; weights synced where the servers allow it, see trainers/backends.py). Non-hf backends turn loss.is_correction on unless it is set.")
    servers: list[str] = Field(default_factory=list, description="backend 'openai': API roots of the servers (http://host:8000/v1), replicas of one model; each task's trajectories go to one server.")
    engines: int = Field(0, ge=0, description="Generation engines: N >= 1 runs N Ray actors that each hold the backend ('hf' or 'vllm') with the current weights, behind a router that keeps prefix affinity (a turn or branch goes to the engine that generated its prefix) and balances load (trace_gym/rollout/router.py); each actor asks for one GPU on CUDA. 0 (default): the backend in the trainer's process. For 'openai', list several servers instead.")
    actor_cpus: float = Field(1.0, gt=0, description="CPUs each Ray actor (env worker or engine) reserves from Ray's scheduler; lower it (e.g. 0.25) for actors that mostly wait on tools, servers or a GPU.")
    streaming: bool = Field(False, description="Roll out trajectory by trajectory instead of in waves (a turn is generated as soon as its env step returns) and start a prompt's stage 2 as soon as its own stage 1 is done (trace_gym/allocation/streaming.py). Forests then depend on timing, so runs are not bit-reproducible.")
    stream_share: float = Field(1.0, ge=0, le=1, description="With streaming: the share of the stage-2 budget planned per prompt as its stage 1 ends (split in proportion to its stage-1 rollouts); the rest is planned over the whole forest once everything in flight is done.")
    mode: Literal["sync", "async"] = Field("sync", description="'async': the generation of the next step(s) overlaps this step's update, at most max_staleness updates behind (trace_gym/rollout/async_step.py); turns loss.is_correction on unless set. The 'hf' backend then generates with its own copy of the weights, synced before each generation. 'sync' (default): generate, then update.")
    max_staleness: int = Field(1, ge=1, description="With mode 'async': how many updates a step's rollouts may lag the weights they train.")
    policy_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra arguments of the rollout backend (hf: share_prefix, kv_cache_tokens, max_batch_tokens, sampler ('row' makes a row's tokens independent of the batch caps; see HFPolicy); vllm: dtype, enforce_eager, max_model_len, gpu_memory_utilization, block_size ...; openai: dialect, concurrency, timeout, weight_sync, sync_dir ...).")

    @model_validator(mode="after")
    def _check_backend(self) -> "RolloutSection":
        if self.backend == "openai" and not self.servers:
            raise ValueError("backend 'openai' needs servers: the API roots of OpenAI-compatible servers, e.g. [http://127.0.0.1:8000/v1]")
        if self.backend != "openai" and self.servers:
            raise ValueError(f"servers are used by backend 'openai' only (backend is {self.backend!r})")
        if self.engines and self.backend == "openai":
            raise ValueError("engines starts Ray actors for the 'hf' or 'vllm' backend; with 'openai' list the servers in `servers` instead")
        return self



class LossSection(_Section):
    """The policy loss (trainers/loss.py)."""

    eps_low: float = Field(0.2, ge=0, lt=1, description="PPO clip below: ratio >= 1 - eps_low.")
    eps_high: float = Field(0.28, ge=0, description="PPO clip above (clip-higher): ratio <= 1 + eps_high.")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field("token-mean", description="How per-token losses are reduced over the global batch.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL penalty to the reference (the policy after SFT); 0 keeps no reference model.")
    is_correction: bool = Field(False, description="Truncated importance sampling against the rollout engine's behaviour log-probs (for engines other than the trainer's own model, e.g. vLLM).")
    is_cap: float = Field(2.0, gt=0, description="Truncation of that importance weight.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass (the batch is split into this many).")
    skip_zero_advantage: bool = Field(True, description="Leave trajectories whose policy tokens all have advantage 0 out of the forward pass (they add nothing to the loss when kl_coef is 0; they still count in the token-mean denominator).")
    packing: Literal["tree", "trajectory"] = Field("tree", description="How the loss forward reaches the policy tokens: 'tree' packs each tree's tokens once (shared prefixes once) with an attention mask and position ids under which every token sees exactly its own root-to-node path (needs sdpa or eager attention); 'trajectory' runs one sequence per trajectory (shared prefixes once per branch). Both give the same loss and gradients up to float rounding.")
    prefix_weight: float = Field(0.0, ge=0, le=1, description="Weight n ** prefix_weight on the loss of each policy token whose node n finished trajectories share (trainers/batching.py): 0 trains a shared prefix once with its trajectories' mean advantage; 1 gives it their sum, the gradient of training every trajectory as its own sequence; 0.5 the square root between them, the weight TreeRL's 1/sqrt(|L(s)|) gives a shared prefix (the 'treerl' advantage already divides, so TreeRL's own update is 'treerl' with 1). Only trees with branches are affected; needs aggregation 'token-mean'.")
    pack_tokens: int = Field(2048, ge=64, description="Longest packed row of 'tree' packing: trajectories are added to a row (with the ancestors it lacks) up to this many tokens; a larger tree is split into rows that each repeat the ancestors they need. A row's attention is dense over all its tokens.")

    @model_validator(mode="after")
    def _check_prefix_weight(self) -> "LossSection":
        if self.prefix_weight > 0 and self.aggregation != "token-mean":
            raise ValueError(f"loss.prefix_weight weights tokens within the token-mean normaliser; with aggregation "
                             f"{self.aggregation!r} set prefix_weight: 0")
        return self


class OptimSection(_Section):
    """The optimizer."""

    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="Learning rate after warm-up.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    micro_batch_tokens: int = Field(8192, ge=64, description="Padded tokens per forward pass (gradient accumulation splits the batch).")


class EvalSection(_Section):
    """Held-out evaluation during training (and `trace-gym eval`)."""

    every: int = Field(0, ge=0, description="Evaluate every this many steps (and before the first and after the last); 0: never during training.")
    tasks: int = Field(64, ge=1, description="Held-out tasks per env.")
    k: int = Field(1, ge=1, description="Samples per task (mean@k, pass@k).")
    split: Literal["test", "validation"] = Field("test", description="Held-out split.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of evaluation episodes (0: greedy).")


class CheckpointSection(_Section):
    """Checkpoints (trainers/checkpoint.py)."""

    every: int = Field(1, ge=0, description="Save every this many steps (and after the last); 0: only at the end.")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept.")


class LogSection(_Section):
    """Metrics and display."""

    tensorboard: bool = Field(True, description="Also write TensorBoard scalars (when the tensorboard package is installed).")
    progress: bool = Field(True, description="Show a rich progress display (falls back to one line per step when not a terminal).")


class RLConfig(_Section):
    """A training run: SFT warm start, then RL with an allocator (see trainers/rl.py)."""

    seed: int = Field(0, description="Seeds everything: SFT order, sampling, allocators, predictor, data order.")
    steps: int = Field(20, ge=1, description="RL steps.")
    output_dir: str = Field("runs/quick", description="Run directory: metrics.jsonl, checkpoints/, tensorboard/, config.yaml.")
    deterministic: bool = Field(True, description="torch.use_deterministic_algorithms: a resumed run repeats the original exactly (needs a fixed `model.threads`).")
    envs: list[EnvSpec] = Field(default_factory=lambda: [EnvSpec(id="trace_gym/MathCalc-v0")], description="Training envs (id, kwargs, weight): prompts per step are split over them by weight.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    sft: SFTSection = Field(default_factory=SFTSection, description="SFT warm start.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Sampling.")
    allocator: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="trace"), description="Allocator and its options: 'trace', 'trace:stage1=uniform' or {name: trace, kwargs: {stage1: uniform}}. A `seed` option defaults to the run's seed.")
    predictor: ComponentSpec | None = Field(None, description="Predictor of V(H) ('hashed', 'lm:encoder=policy', ...); null: the allocator's own; 'none': no predictor.")
    advantage: ComponentSpec | None = Field(None, description="Advantage estimator the policy is updated with ('trace', 'grpo', 'trace:scale=group', ...); null: the allocator's own.")
    budget: BudgetSpec = Field(default_factory=lambda: BudgetSpec(trajectories=32, prompts=16), description="M (trajectories), B (prompts) and the per-prompt limits of one step.")
    update_policy: bool = Field(True, description="False: allocate, roll out and train the predictor only; the policy stays as loaded.")
    loss: LossSection = Field(default_factory=LossSection, description="Policy loss.")
    optim: OptimSection = Field(default_factory=OptimSection, description="Optimizer.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out evaluation.")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="Checkpoints.")
    log: LogSection = Field(default_factory=LogSection, description="Metrics and display.")

    @model_validator(mode="after")
    def _check(self) -> "RLConfig":
        if not self.envs:
            raise ValueError("envs: give at least one environment")
        return self

    def run_spec(self) -> RunSpec:
        """The run this config trains: its envs, policy, allocator, predictor, advantage, budget and seed."""
        if self.model.name == "sim":
            policy: dict[str, Any] = {"name": "sim"}
        elif self.rollout.backend == "openai":
            policy = {"name": "openai", "kwargs": {"base_url": list(self.rollout.servers), "tokenizer": self.model.name}}
        else:
            policy = {"name": self.rollout.backend, "kwargs": {"model": self.model.name}}
        return RunSpec(envs=self.envs, policy=policy, allocator=self.allocator, predictor=self.predictor,
                       advantage=self.advantage, budget=self.budget, seed=self.seed)

    def fingerprint(self) -> str:
        """Hash of everything that shapes the training numbers (not the output directory,
        evaluation, checkpointing or display): a resumed run must match it. The step count is
        in it when the learning rate depends on it (``optim.schedule: cosine``); with a
        constant schedule a run can be resumed with more steps to extend it."""
        exclude: dict[str, bool] = {"output_dir": True, "log": True, "eval": True, "checkpoint": True}
        if self.optim.schedule != "cosine":
            exclude["steps"] = True
        data = self.model_dump(mode="json", exclude=exclude)
        for key in SCALE_KEYS:  # added later: at their defaults they leave earlier runs' fingerprints as they were
            if key not in self.rollout.model_fields_set or getattr(self.rollout, key) == RolloutSection.model_fields[key].default:
                data["rollout"].pop(key, None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


SCALE_KEYS = ("engines", "actor_cpus", "streaming", "stream_share", "mode", "max_staleness")
"""Scale-out keys of ``rollout`` that enter the fingerprint only when set to something else than their default."""


# ----------------------------------------------------------------------------- loading


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and how to fix it."""


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the (sub)model a validation error location points into."""
    cls: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        cls = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if cls is None:
            return []
    return list(getattr(cls, "model_fields", {}))


def explain(exc: ValidationError, model: type[BaseModel] = RLConfig) -> str:
    """One line per problem: ``key: what is wrong (hint)``."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            known = _fields_at(model, loc)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean '{'.'.join(str(p) for p in loc[:-1] + (close[0],))}'?" if close else f"valid keys here: {', '.join(known)}"
            lines.append(f"{key}: unknown key ({hint})")
        else:
            lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        if isinstance(node, list):
            node = node[int(p)]
            continue
        if isinstance(node.get(p), str) and p in ("allocator", "predictor", "advantage", "policy"):
            # the string form "trace:stage1=uniform" of a component, opened up for a dotted key
            name, kwargs = parse_options(node[p])
            node[p] = {"name": name, "kwargs": kwargs}
        node = node.setdefault(p, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"{dotted}: '{p}' is not a section")
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RLConfig:
    """Read ``path`` (YAML; None: the defaults) and apply ``key=value`` overrides (values
    are parsed as YAML, so ``optim.lr=3e-4``, ``eval.every=5``, ``model.lora_rank=8``)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of keys to values")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-4)")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        _set(data, key.strip(), value)
    try:
        return RLConfig.model_validate(data)
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        raise ConfigError(f"bad config{where}:\n{explain(exc)}") from None


def describe_fields(model: type[BaseModel] = RLConfig, prefix: str = "") -> list[str]:
    """``key: description (default)`` for every field, sections expanded (for --help-config)."""
    out = []
    for name, field in model.model_fields.items():
        key = prefix + name
        ann = field.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if sub is not None:
            out.append(f"{key}: {field.description}")
            out += describe_fields(sub, key + ".")
        else:
            default = field.get_default(call_default_factory=True)
            out.append(f"{key}: {field.description} [default: {json.dumps(default, default=str)}]")
    return out
