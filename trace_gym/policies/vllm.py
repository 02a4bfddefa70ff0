"""``vllm``: vLLM's offline engine (``vllm.LLM``) as a policy, on GPU.

Prompts go in as token ids (``TokensPrompt``), so nothing is re-tokenised; automatic prefix
caching is on, so the k continuations of a branch point and the later turns of a trajectory
reuse the KV blocks of their shared prefix (``RequestOutput.num_cached_tokens`` is reported
as ``reused_prefix_tokens``). Each turn stops at the chat template's end-of-turn token or
at ``max_new_tokens``; the sampled tokens' log-probs are returned (``logprobs=0``). vLLM
computes them from the processed (temperature-scaled) distribution when it supports
``logprobs_mode="processed_logprobs"``, else from the raw logits.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set), so
:meth:`VLLMPolicy.load_weights` can push a trainer's weights into it directly. Needs the
``vllm`` extra and a CUDA GPU; ``import trace_gym`` never imports vllm. (Tested only where
vLLM is installed: its test skips visibly elsewhere.)
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

from trace_gym.policies.chat import ChatPolicy, ChatTemplate
from trace_gym.policies.base import Generation, SamplingParams


class VLLMPolicy(ChatPolicy):
    """A vLLM offline engine.

    Args:
        model: a model alias, local directory or hub id (resolved with
            :func:`trace_gym.policies.models.resolve_model`).
        dtype: vLLM ``dtype`` (default ``"bfloat16"``).
        gpu_memory_utilization: share of GPU memory vLLM may take (default 0.5, so a trainer
            can share the GPU).
        max_model_len: context length (default: the model's).
        enable_prefix_caching: automatic prefix caching (default True).
        chat_template, tools_in_template: see :class:`~trace_gym.policies.chat.ChatTemplate`.
        **llm_kwargs: anything else for ``vllm.LLM``.
    """

    name = "vllm"

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        chat_template: str | None = None,
        tools_in_template: bool | None = None,
        **llm_kwargs: Any,
    ):
        try:
            import vllm
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("the vllm policy needs vLLM and a CUDA GPU: pip install 'trace-gym[vllm]'") from exc
        from trace_gym.policies.models import resolve_model

        # keep the engine in this process: weight sync (apply_model) then calls into the model
        # directly instead of pickling weights across processes
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.model_path = resolve_model(model)
        kwargs: dict[str, Any] = dict(model=self.model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                      enable_prefix_caching=enable_prefix_caching, **llm_kwargs)
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        try:
            self.llm = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs)
            self.logprobs_mode = "processed_logprobs"
        except TypeError:  # older vLLM: no logprobs_mode (raw log-probs)
            self.llm = vllm.LLM(**kwargs)
            self.logprobs_mode = "raw_logprobs"
        self._vllm = vllm
        self.tokenizer = self.llm.get_tokenizer()
        self.chat = ChatTemplate(self.tokenizer, chat_template=chat_template, tools_in_template=tools_in_template)
        self.stop_ids = self.chat.stop_ids
        engine = self.llm.llm_engine
        cfg = getattr(engine, "model_config", None) or getattr(getattr(engine, "vllm_config", None), "model_config", None)
        self.max_context_tokens: int | None = getattr(cfg, "max_model_len", None)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        sampling = []
        for i in range(len(prompts)):
            seed = None if params.seed is None else (int(params.seed) * 7919 + i) % (2**31)
            sampling.append(self._vllm.SamplingParams(
                n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p, seed=seed,
                logprobs=0, stop_token_ids=sorted(self.stop_ids), skip_special_tokens=True, detokenize=True,
            ))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], sampling, use_tqdm=False)
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
                ids.append(self.chat.eot_id)  # the turn ended without its stop token in the output: close it
                lps.append(math.nan)
            result.append(Generation(ids, lps, self.chat.decode(ids), finish,
                                     info={"prefill_tokens": len(p) - cached, "reused_prefix_tokens": cached}))
        return result

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Any) -> None:
        """Weight sync: load a state dict (or a directory of safetensors, or a module's state
        dict) into the engine's model and reset the prefix cache (its KV is stale)."""
        import torch

        if isinstance(weights, torch.nn.Module):
            state = weights.state_dict()
        elif isinstance(weights, (str, os.PathLike)):
            from pathlib import Path

            from safetensors.torch import load_file

            state = {}
            for f in sorted(Path(weights).glob("*.safetensors")):
                state.update(load_file(str(f)))
            if not state:
                raise FileNotFoundError(f"no *.safetensors files in {os.fspath(weights)!r}")
        else:
            state = dict(weights)
        items = list(state.items())
        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(lambda model: model.load_weights(items))
        else:  # pragma: no cover - older vLLM (V0 engine)
            self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(items)
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and free its GPU memory."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            del llm
            import gc

            import torch

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
