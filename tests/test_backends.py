"""``rollout.backend`` without vLLM (the vLLM tests are tests/test_vllm*.py): config checks and
defaults, the openai backend's routing of each task to one server and its weight-sync
protocol against a fake vLLM server, the trainer refusing servers that cannot take weights,
and LoRA weight pushes that leave the trained weights untouched."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from trace_gym.policies.base import SamplingParams, make_policy
from trace_gym.trainers.backends import check_trainable, merged_state, param_version, push_weights, with_backend_defaults
from trace_gym.trainers.config import ConfigError, load_config

from shared_smollm2 import smollm2_path

SYNC_PATHS = ["/v1/completions", "/v1/models", "/collective_rpc", "/reset_prefix_cache", "/v1/load_lora_adapter",
              "/v1/unload_lora_adapter"]


class FakeServer:
    """A loopback server that answers like ``vllm serve`` (token-level completions; with
    ``sync=True`` also dev mode and runtime LoRA) and records every request."""

    def __init__(self, sync: bool, token: int = 1000, eot: int = 2, refuse_resets: int = 0):
        self.calls: list[tuple[str, dict]] = []
        self.refuse_resets = refuse_resets  # the next resets answer success=false, as vLLM while blocks are held
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, code: int, data: dict) -> None:
                raw = json.dumps(data).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/openapi.json":
                    paths = SYNC_PATHS if sync else SYNC_PATHS[:2]
                    return self._reply(200, {"paths": {p: {} for p in paths}})
                if self.path == "/v1/models":
                    return self._reply(200, {"data": [{"id": "fake-model"}]})
                return self._reply(404, {"error": "not found"})

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n) or b"null") or {}
                outer.calls.append((self.path.split("?")[0], body))
                if self.path == "/v1/completions":
                    toks = [token, token + len(outer.calls) % 7, eot]
                    return self._reply(200, {"choices": [{"text": "", "finish_reason": "stop", "logprobs": {
                        "tokens": [f"token_id:{t}" for t in toks], "token_logprobs": [-0.5, -0.25, -0.125]}}],
                        "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 3}})
                if sync and self.path.split("?")[0] in SYNC_PATHS:
                    if not self.path.startswith("/reset"):
                        return self._reply(200, {})
                    refused, outer.refuse_resets = outer.refuse_resets > 0, max(0, outer.refuse_resets - 1)
                    return self._reply(200, {"success": not refused})
                return self._reply(404, {"error": "not found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers: list[FakeServer] = []

    def start(sync: bool = True, refuse_resets: int = 0) -> FakeServer:
        servers.append(FakeServer(sync, eot=_eot(), refuse_resets=refuse_resets))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _eot() -> int:
    from transformers import AutoTokenizer

    from trace_gym.policies.chat import ChatTemplate

    return ChatTemplate(AutoTokenizer.from_pretrained(smollm2_path())).eot_id


# ----------------------------------------------------------------------------- config


def test_backend_config_is_checked_and_non_hf_backends_turn_is_correction_on():
    with pytest.raises(ConfigError, match=r"rollout.*servers"):
        load_config(None, ["rollout.backend=openai"])
    with pytest.raises(ConfigError, match=r"rollout.*openai"):
        load_config(None, ["rollout.servers=[http://127.0.0.1:8000/v1]"])
    with pytest.raises(ConfigError, match="rollout.backend"):
        load_config(None, ["rollout.backend=sglang"])
    assert not with_backend_defaults(load_config(None, [])).loss.is_correction
    for extra in (["rollout.backend=vllm"], ["rollout.backend=openai", "rollout.servers=[http://h:8000/v1]"]):
        cfg = load_config(None, extra)
        out = with_backend_defaults(cfg)
        assert out.loss.is_correction and not cfg.loss.is_correction  # a copy: the caller's config is unchanged
        assert not with_backend_defaults(load_config(None, extra + ["loss.is_correction=false"])).loss.is_correction
    spec = load_config(None, ["rollout.backend=openai", "rollout.servers=[http://h:8000/v1]"]).run_spec()
    assert spec.policy.name == "openai" and spec.policy.kwargs["base_url"] == ["http://h:8000/v1"]
    assert load_config(None, ["rollout.backend=vllm", "model.name=smollm2-135m"]).run_spec().policy.name == "vllm"


# ----------------------------------------------------------------------------- openai backend


def test_openai_backend_sends_every_task_to_one_server(fake):
    a, b = fake(sync=False), fake(sync=False)
    policy = make_policy("openai", base_url=[a.url, b.url], tokenizer=smollm2_path(), dialect="vllm")
    roots = [policy.render_prompt([{"role": "user", "content": f"task {i}"}]) for i in range(4)]
    assert [policy.server_of(r) for r in roots] == [0, 1, 0, 1]  # opening prompts in turn
    later = [r + [11, 12, 13] for r in roots] + [r + [14] for r in roots]  # next turns and branches
    assert [policy.server_of(p) for p in later] == [0, 1, 0, 1] * 2
    gens = policy.generate(roots + later, SamplingParams(max_new_tokens=3, seed=0))
    assert all(g.finish_reason == "stop" and g.logprobs == [-0.5, -0.25, -0.125] for g in gens)
    got_a = sorted(tuple(body["prompt"]) for _, body in a.calls)
    got_b = sorted(tuple(body["prompt"]) for _, body in b.calls)
    assert got_a == sorted(tuple(p) for p in (roots + later) if policy.server_of(p) == 0) and len(got_a) == 6
    assert got_b == sorted(tuple(p) for p in (roots + later) if policy.server_of(p) == 1) and len(got_b) == 6
    stray = list(range(5, 40))
    assert policy.server_of(stray) == policy.server_of(list(stray)) in (0, 1)  # unknown prompts: a stable hash


def test_openai_retries_a_refused_cache_reset_and_then_says_which_server_refused(fake, tmp_path):
    # vLLM answers success=false while requests hold blocks and says to retry; a reset that never
    # happens would let one step's KV reach the next, or old weights' KV serve new weights
    busy, stuck = fake(refuse_resets=2), fake(refuse_resets=10**6)
    policy = make_policy("openai", base_url=busy.url, tokenizer=smollm2_path())
    policy.reset_cache()
    assert busy.paths() == ["/reset_prefix_cache"] * 3
    policy = make_policy("openai", base_url=[busy.url, stuck.url], tokenizer=smollm2_path(), sync_dir=str(tmp_path))
    policy.RESET_RETRY_S = 0.5
    root = stuck.url.removesuffix("/v1")
    with pytest.raises(RuntimeError, match=f"{root} did not empty its prefix cache"):
        policy.reset_cache()
    with pytest.raises(RuntimeError, match=f"{root} did not empty its prefix cache"):
        policy.load_weights({"lm_head.weight": torch.zeros(2, 2)})
    assert 2 < stuck.paths().count("/reset_prefix_cache") < 100


def test_openai_weight_sync_speaks_vllms_endpoints(fake, tmp_path):
    srv = [fake(), fake()]
    policy = make_policy("openai", base_url=[s.url for s in srv], tokenizer=smollm2_path(), sync_dir=str(tmp_path / "sync"))
    assert policy.sync_modes() == {"weights", "adapter"}
    emb = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.norm.weight": torch.ones(4)}  # tied
    policy.load_weights(state)
    from safetensors.torch import load_file

    for s in srv:
        assert s.paths() == ["/collective_rpc", "/reset_prefix_cache"]
        rpc = s.calls[0][1]
        assert rpc["method"] == "reload_weights" and Path(rpc["kwargs"]["weights_path"]) == tmp_path / "sync" / "weights"
    written = load_file(str(tmp_path / "sync" / "weights" / "model.safetensors"))
    assert set(written) == set(state) and all(torch.equal(written[k], v) for k, v in state.items())

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    for s in srv:
        s.calls.clear()
    policy.load_adapter(str(adapter))
    policy.load_adapter(str(adapter))
    prompt = policy.render_prompt([{"role": "user", "content": "hi"}])
    policy.generate([prompt], SamplingParams(max_new_tokens=3))
    for s in srv:
        loads = [body for p, body in s.calls if p == "/v1/load_lora_adapter"]
        assert [x["lora_name"] for x in loads] == ["trace-gym-adapter-1", "trace-gym-adapter-2"]
        assert Path(loads[1]["lora_path"]) == tmp_path / "sync" / "trace-gym-adapter-2"  # copied where servers read
        assert [body["lora_name"] for p, body in s.calls if p == "/v1/unload_lora_adapter"] == ["trace-gym-adapter-1"]
    assert [body["model"] for s in srv for p, body in s.calls if p == "/v1/completions"] == ["trace-gym-adapter-2"]
    assert not (tmp_path / "sync" / "trace-gym-adapter-1").exists()


def test_train_refuses_a_server_that_cannot_take_weights(fake, capsys, tmp_path):
    from trace_gym.cli.main import main
    from trace_gym.trainers.rl import RLTrainer

    plain = fake(sync=False)
    policy = make_policy("openai", base_url=plain.url, tokenizer=smollm2_path())
    assert policy.sync_modes() == frozenset()
    with pytest.raises(NotImplementedError, match="VLLM_SERVER_DEV_MODE=1"):
        policy.load_weights({"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="cannot take new weights.*refuses"):
        check_trainable(policy, lora=False)
    args = ["train", f"output_dir={tmp_path / 'run'}", f"model.name={smollm2_path()}", "sft.enabled=false",
            "rollout.backend=openai", f"rollout.servers=[{plain.url}]", "log.progress=false", "log.tensorboard=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error: rollout.backend=openai: the server(s) " + plain.url in err and "refuses" in err
    # it can still roll out for a run that trains the predictor only
    cfg = load_config(None, args[1:] + ["update_policy=false", "steps=1", "allocator=grpo", "budget.group_size=2", "budget.trajectories=2", "budget.prompts=1",
                                        "rollout.max_new_tokens=3"])
    trainer = RLTrainer(cfg)
    record = trainer.step()
    assert record["spent/trajectories"] == 2 and "update/loss" not in record
    assert [p for p, _ in plain.calls if p != "/v1/completions"] == []  # no sync attempted


# ----------------------------------------------------------------------------- weight pushes


class _Stub:
    name = "stub"

    def __init__(self, modes):
        self.modes, self.weights, self.adapters = frozenset(modes), [], []

    def sync_modes(self):
        return self.modes

    def load_weights(self, state):
        self.weights.append({k: v.clone() for k, v in state.items()})

    def load_adapter(self, path):
        self.adapters.append((path, sorted(p.name for p in Path(path).iterdir())))


def _lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model.eval()


def test_lora_pushes_merged_weights_or_the_adapter_and_leaves_the_trained_weights_alone(tmp_path):
    from transformers import LlamaForCausalLM

    model = _lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    version = param_version(model)
    plain = _Stub({"weights"})
    assert push_weights(plain, model, tmp_path, 1) == "merged"
    assert param_version(model) == version and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    merged = LlamaForCausalLM(model.get_base_model().config).eval()
    missing, unexpected = merged.load_state_dict(plain.weights[0], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, model(ids).logits, atol=1e-5)
        with model.disable_adapter():
            base_logits = model(ids).logits
        assert not torch.allclose(merged(ids).logits, base_logits, atol=1e-4)  # the adapter is in the merged weights
    assert set(merged_state(model)) == set(plain.weights[0])

    both = _Stub({"weights", "adapter"})
    assert push_weights(both, model, tmp_path, 1) == "adapter" and push_weights(both, model, tmp_path, 2) == "adapter"
    assert [p for p, _ in both.adapters] == [str(tmp_path / "adapter-1"), str(tmp_path / "adapter-0")]
    assert all("adapter_config.json" in files for _, files in both.adapters) and not both.weights
    with pytest.raises(ValueError, match="cannot take new weights"):
        push_weights(_Stub(set()), model, tmp_path, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the hf backend's bf16 copy exists on CUDA only")
def test_hf_backend_on_cuda_rolls_out_from_a_bf16_copy_synced_after_each_update(tmp_path):
    from vllm_checks import register_parity_env, train_config

    from trace_gym.trainers.rl import RLTrainer

    register_parity_env()
    trainer = RLTrainer(train_config(str(tmp_path / "run"), smollm2_path(), steps=2))
    gen = trainer.policy.model
    assert not trainer._shares_weights and gen.dtype == torch.bfloat16 and gen is not trainer.model
    assert next(trainer.model.parameters()).dtype == torch.float32
    trainer.train()
    assert trainer._syncs >= 1 and trainer._synced_version == param_version(trainer.model)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(gen.state_dict()[k], v.to(torch.bfloat16)), k


def test_a_training_track_trains_with_its_policy_backend(tmp_path):
    from trace_gym.leaderboard.spec import TrackSpec
    from trace_gym.trainers.leaderboard import trainer_config

    def track(policy, overrides=None):
        return TrackSpec.model_validate({
            "name": "t", "kind": "training", "envs": ["trace_gym/MathCalc-v0"], "allocators": ["grpo"], "policy": policy,
            "budget": {"trajectories": 8, "prompts": 4}, "steps": 1, "eval": {"tasks": 2},
            "trainer": {"overrides": overrides or {}}})

    def config(t):
        return trainer_config(t, t.envs[0], t.allocators[0], 0, tmp_path)

    cfg = config(track({"name": "openai", "model": "smollm2-135m",
                        "kwargs": {"base_url": "http://h:8000/v1", "timeout": 30, "tokenizer": "x"}}))
    assert cfg.rollout.backend == "openai" and cfg.rollout.servers == ["http://h:8000/v1"]
    assert cfg.rollout.policy_kwargs == {"timeout": 30} and cfg.loss.is_correction
    cfg = config(track({"name": "vllm", "model": "smollm2-135m", "kwargs": {"enforce_eager": True, "device": "cuda:1"}},
                       {"loss.is_correction": False}))
    assert cfg.rollout.backend == "vllm" and cfg.rollout.policy_kwargs == {"enforce_eager": True}
    assert cfg.model.device == "cuda:1" and not cfg.loss.is_correction  # the track's trainer config decides
    cfg = config(track({"name": "hf", "model": "smollm2-135m"}))
    assert cfg.rollout.backend == "hf" and not cfg.loss.is_correction
