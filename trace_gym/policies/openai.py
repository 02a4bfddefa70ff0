"""``openai``: a policy served by any OpenAI-compatible server (``vllm serve``, SGLang,
llama.cpp's server, ``transformers serve``), over httpx.

Requests go to ``POST {base_url}/completions`` (the legacy Completions API, which takes a
raw prompt, so the engine's token prefix is sent as it is, not through the server's chat
template). All prompts of one :meth:`OpenAIPolicy.generate` call are in flight together,
up to ``concurrency`` at a time; each request has a timeout and is retried with exponential
backoff on connection errors, timeouts, 429 and 5xx.

Token level where the server allows it. Servers differ in what they accept beyond the
OpenAI fields; the ``dialect`` says which extensions to use:

* ``"vllm"`` (vLLM, SGLang): the prompt goes as token ids, and the sampled tokens come
  back as ids with their log-probs (``return_tokens_as_token_ids``, ``stop_token_ids``).
  No re-tokenisation anywhere.
* ``"transformers"`` (``transformers serve``): text prompts only, and sampling is switched
  on through its ``generation_config`` field (its default config decodes greedily).
* ``"openai"``: plain text prompts and OpenAI fields only.
* ``"auto"`` (default): try ``vllm``; a server that rejects it (HTTP 400/422) is switched
  to ``transformers`` when its error names the fields or the prompt type as
  ``transformers serve`` does, else to ``openai``.

Text dialects are announced with a warning and ``policy.token_level == False``: the prompt
is decoded to text, the completion text is tokenised again here, behaviour log-probs are
unavailable (NaN), and :attr:`OpenAIPolicy.drift` measures the re-tokenisation drift
against the server's own token counts (``usage``): prompts the server tokenised to a
different length than the engine's ids, and completions whose re-tokenised length differs
from what the server generated.

Failures. A request that still fails after its retries becomes a
:class:`~trace_gym.policies.base.Generation` with ``finish_reason="error"`` and the reason in
``info["error"]``; the rollout engine reports those trajectories and keeps the rest. Once
a request has failed to connect, the others of the same call try only once, so a dead
server is reported in seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import threading
import warnings
from typing import Any, Sequence

import httpx

from trace_gym.policies.chat import ChatPolicy, ChatTemplate
from trace_gym.policies.base import Generation, SamplingParams

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
DIALECTS = ("auto", "vllm", "transformers", "openai")


class OpenAIPolicy(ChatPolicy):
    """A policy behind an OpenAI-compatible HTTP server.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name to send (``None``: the first id of ``GET /models``, or none).
        tokenizer: the tokenizer the engine renders chats with (a model alias, directory,
            hub id, or a tokenizer object); default: ``model``. It must be the served
            model's tokenizer.
        api_key: bearer token (default ``$OPENAI_API_KEY``; most local servers need none).
        dialect: ``"auto"``, ``"vllm"`` (token level), ``"transformers"`` or ``"openai"``
            (see the module docstring).
        concurrency: requests in flight at once.
        timeout: seconds per request (connect, read and write).
        max_retries: retries per request after the first attempt.
        backoff: first retry delay in seconds; doubled each retry (with jitter).
        chat_template, tools_in_template: see :class:`~trace_gym.policies.chat.ChatTemplate`.
        extra_body: more JSON fields for every request (server-specific options).

    Attributes: ``dialect``, ``token_level`` (False in a text dialect), ``drift`` (text
    mode's re-tokenisation counts), ``requests`` and ``retries`` (totals).
    """

    name = "openai"

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str | None = None,
        *,
        tokenizer: Any = None,
        api_key: str | None = None,
        dialect: str = "auto",
        concurrency: int = 8,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        chat_template: str | None = None,
        tools_in_template: bool | None = None,
        extra_body: dict[str, Any] | None = None,
    ):
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.dialect = "vllm" if dialect == "auto" else dialect
        self.concurrency = int(concurrency)
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.extra_body = dict(extra_body or {})
        tok_source = tokenizer if tokenizer is not None else model
        if tok_source is None:
            raise ValueError("pass tokenizer= (or model=) so prompts can be rendered to the served model's tokens")
        if isinstance(tok_source, (str, os.PathLike)):
            from transformers import AutoTokenizer

            from trace_gym.policies.models import resolve_model

            tok_source = AutoTokenizer.from_pretrained(resolve_model(tok_source))
        self.tokenizer = tok_source
        self.chat = ChatTemplate(self.tokenizer, chat_template=chat_template, tools_in_template=tools_in_template)
        self.stop_ids = self.chat.stop_ids
        self.model = model if model is not None and not _is_local(model) else None
        self._model_resolved = self.model is not None
        self._mode_known = dialect != "auto"
        if self.dialect != "vllm":
            self._announce_text_mode(f"dialect {dialect!r}")
        self.drift = {"prompts": 0, "prompt_mismatch": 0, "prompt_token_diff": 0,
                      "completions": 0, "completion_mismatch": 0, "completion_token_diff": 0}
        self.requests = 0
        self.retries = 0
        self._down = False
        self._lock = threading.Lock()

    def load_weights(self, weights: Any) -> None:
        raise NotImplementedError(
            "the openai backend cannot push weights to a server; reload the server with the new checkpoint "
            "(e.g. vLLM's /v1/load_lora_adapter or a restart) and build a new policy"
        )

    # ------------------------------------------------------------------ requests

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _resolve_model(self, client: httpx.AsyncClient) -> None:
        if self._model_resolved:
            return
        self._model_resolved = True
        try:
            r = await client.get(f"{self.base_url}/models")
            data = r.json().get("data") or []
            if r.status_code == 200 and data:
                self.model = data[0].get("id")
        except (httpx.HTTPError, ValueError):
            pass  # requests then go without a model name; servers serving one model accept that

    @property
    def token_level(self) -> bool:
        """Whether prompts and completions travel as token ids (the ``vllm`` dialect)."""
        return self.dialect == "vllm"

    def _body(self, prompt: list[int], params: SamplingParams, seed: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p}
        if self.model:
            body["model"] = self.model
        if seed is not None:
            body["seed"] = seed
        if self.dialect == "vllm":
            body.update(prompt=prompt, logprobs=0, return_tokens_as_token_ids=True, skip_special_tokens=False,
                        stop_token_ids=sorted(self.stop_ids), include_stop_str_in_output=True)
        else:
            body["prompt"] = self.tokenizer.decode(prompt, skip_special_tokens=False)
        if self.dialect == "transformers":
            # its generation_config replaces the model's default one (which decodes greedily),
            # so it must also carry the stop tokens
            pad = getattr(self.tokenizer, "pad_token_id", None)
            cfg = {"do_sample": params.temperature > 0, "max_new_tokens": params.max_new_tokens,
                   "eos_token_id": sorted(self.stop_ids), "pad_token_id": pad if pad is not None else self.chat.eot_id}
            if params.temperature > 0:
                cfg.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
            body["generation_config"] = json.dumps(cfg)
        body.update(self.extra_body)
        return body

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
        """POST with retries; returns the last response (any status) or raises the last transport error."""
        attempts = 1 if self._down else self.max_retries + 1
        last_exc: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                with self._lock:
                    self.retries += 1
                await asyncio.sleep(self.backoff * (2 ** (attempt - 1)) * (0.75 + 0.5 * random.random()))
            try:
                with self._lock:
                    self.requests += 1
                r = await client.post(f"{self.base_url}/completions", json=body)
            except httpx.TransportError as exc:
                last_exc = exc
                continue
            if r.status_code in _RETRY_STATUS and attempt + 1 < attempts:
                continue
            self._down = False
            return r
        self._down = isinstance(last_exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError))
        assert last_exc is not None
        raise last_exc

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, prompt: list[int], params: SamplingParams,
                   seed: int | None) -> Generation:
        async with sem:
            try:
                return await self._request(client, prompt, params, seed)
            except httpx.HTTPError as exc:
                detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                return Generation([], [], "", "error", info={"error": f"POST {self.base_url}/completions failed after retries: {detail}"})

    async def _request(self, client: httpx.AsyncClient, prompt: list[int], params: SamplingParams, seed: int | None) -> Generation:
        if self.token_level:
            r = await self._post(client, self._body(prompt, params, seed))
            if r.status_code in (400, 422) and not self._mode_known:
                detail = r.text[:300]
                transformers = "Unexpected fields" in detail or "prompt must be a string" in detail
                self._switch("transformers" if transformers else "openai", f"HTTP {r.status_code}: {detail}")
            elif r.status_code != 200:
                return _http_error(r)
            else:
                g = self._parse_tokens(r.json(), prompt)
                if g is not None:
                    self._mode_known = True
                    return g
                if self._mode_known:
                    return Generation([], [], "", "error", info={"error": "the server returned no token ids (dialect 'vllm')"})
                self._switch("openai", "the server accepted token ids but returned text only")
        r = await self._post(client, self._body(prompt, params, seed))
        if r.status_code != 200:
            return _http_error(r)
        return self._parse_text(r.json(), prompt)

    def _switch(self, dialect: str, reason: str) -> None:
        with self._lock:
            if not self._mode_known:
                self.dialect = dialect
                self._mode_known = True
                self._announce_text_mode(f"{self.base_url} does not serve token-level completions ({reason}); using dialect {dialect!r}")

    def _announce_text_mode(self, reason: str) -> None:
        warnings.warn(
            f"{reason}: prompts are sent as text and completions re-tokenised here, behaviour log-probs are "
            "unavailable (NaN), and the re-tokenisation drift is counted in policy.drift",
            RuntimeWarning, stacklevel=3,
        )

    def _parse_tokens(self, data: dict[str, Any], prompt: list[int]) -> Generation | None:
        choice = (data.get("choices") or [{}])[0]
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        logprobs = lp.get("token_logprobs")
        if ids is None:
            toks = lp.get("tokens")
            if not toks or not all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
                return None
            ids = [int(t.split(":", 1)[1]) for t in toks]
        ids = [int(t) for t in ids]
        if logprobs is None or len(logprobs) != len(ids):
            logprobs = [math.nan] * len(ids)
        logprobs = [math.nan if x is None else float(x) for x in logprobs]
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        if finish == "stop" and (not ids or ids[-1] not in self.stop_ids):
            # a server that leaves the stop token out: the turn still ended, so close it with
            # the end-of-turn token (no log-prob known for it)
            ids.append(self.chat.eot_id)
            logprobs.append(math.nan)
        usage = data.get("usage") or {}
        return Generation(ids, logprobs, self.chat.decode(ids), finish,
                          info={"prefill_tokens": len(prompt) - _cached(usage), "reused_prefix_tokens": _cached(usage)})

    def _parse_text(self, data: dict[str, Any], prompt: list[int]) -> Generation:
        choice = (data.get("choices") or [{}])[0]
        text = choice.get("text") or ""
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        ids = self.chat.encode(text)
        if finish == "stop":
            ids.append(self.chat.eot_id)  # the server stopped at end of turn but returned no token for it
        usage = data.get("usage") or {}
        info: dict[str, Any] = {"retokenized": True, "prefill_tokens": len(prompt) - _cached(usage), "reused_prefix_tokens": _cached(usage)}
        with self._lock:
            d = self.drift
            for kind, ours in (("prompt", len(prompt)), ("completion", len(ids))):
                if f"{kind}_tokens" in usage:
                    diff = abs(int(usage[f"{kind}_tokens"]) - ours)
                    d[f"{kind}s"] += 1
                    d[f"{kind}_mismatch"] += int(diff > 0)
                    d[f"{kind}_token_diff"] += diff
                    info[f"{kind}_drift_tokens"] = diff
        return Generation(ids, [math.nan] * len(ids), self.chat.decode(ids), finish, info=info)

    async def _agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout), limits=limits, headers=self._headers()) as client:
            await self._resolve_model(client)
            sem = asyncio.Semaphore(self.concurrency)
            seeds = [None if params.seed is None else (int(params.seed) * 7919 + i) % (2**31) for i in range(len(prompts))]
            if not self._mode_known and prompts:
                # settle token vs text mode on one request before fanning out
                first = await self._one(client, sem, prompts[0], params, seeds[0])
                rest = await asyncio.gather(*(self._one(client, sem, p, params, s) for p, s in zip(prompts[1:], seeds[1:])))
                return [first, *rest]
            return list(await asyncio.gather(*(self._one(client, sem, p, params, s) for p, s in zip(prompts, seeds))))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        prompts = [[int(t) for t in p] for p in prompts]
        self._down = False
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._agenerate(prompts, params))
        # called from inside an event loop (a notebook): run ours on a helper thread
        out: list[list[Generation]] = []
        t = threading.Thread(target=lambda: out.append(asyncio.run(self._agenerate(prompts, params))))
        t.start()
        t.join()
        return out[0]


def _cached(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _http_error(r: httpx.Response) -> Generation:
    return Generation([], [], "", "error", info={"error": f"HTTP {r.status_code} from {r.request.url}: {r.text[:300]}"})


def _is_local(name: str) -> bool:
    from trace_gym.policies.models import MODEL_ALIASES

    return name in MODEL_ALIASES
