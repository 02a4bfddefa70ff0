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
  back as ids with their log-probs (``return_tokens_as_token_ids``, ``stop_token_ids``;
  the stop token is kept in the output with its log-prob). No re-tokenisation anywhere.
  vLLM returns log-probs of the temperature-scaled distribution only when the server runs
  with ``--logprobs-mode processed_logprobs`` (its default is the raw logits'); a dev-mode
  server running with raw log-probs gets a warning when sampling at a temperature other
  than 1 (:meth:`OpenAIPolicy.logprobs_mode`).
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

Several servers. ``base_url`` may list several API roots (replicas serving the same model).
Every task's trajectories go to one server: :meth:`OpenAIPolicy.render_prompt` assigns each
opening prompt a server in turn, and a later prompt (a next turn, a branch) goes to the
server of the opening prompt it starts with, so it finds its prefix in that server's prefix
cache. A prompt that starts with no rendered opening prompt goes to a server chosen by a
hash of its tokens.

Weight sync (what vLLM's server offers; :meth:`OpenAIPolicy.sync_modes` probes each server's
``/openapi.json`` once):

* ``"weights"``: :meth:`OpenAIPolicy.load_weights` writes the weights as safetensors into
  ``sync_dir`` (or takes a directory as it is), then asks every server to reload them in
  place (``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}``) and to drop its prefix cache (``POST /reset_prefix_cache``).
  Both endpoints exist when the server runs with ``VLLM_SERVER_DEV_MODE=1``.
* ``"adapter"``: :meth:`OpenAIPolicy.load_adapter` registers a peft LoRA adapter directory
  on every server under a new name (``POST /v1/load_lora_adapter``; ``vllm serve
  --enable-lora --max-lora-rank R`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``),
  requests then name that adapter as their model, and the previous adapter is unloaded.
  A new name per load means no KV cached under an older adapter is reused.

``sync_dir`` must be readable by every server under the same path (a shared file system
when they run on other machines); by default it is a temporary directory on this machine.
A server with neither mode rolls out and evaluates with the weights it has; the trainer
refuses to train through it.

Failures. A request that still fails after its retries becomes a
:class:`~trace_gym.policies.base.Generation` with ``finish_reason="error"`` and the reason in
``info["error"]``; the rollout engine reports those trajectories and keeps the rest. Once
a request has failed to connect, the others of the same call to that server try only
once, so a dead server is reported in seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import tempfile
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Sequence

import httpx

from trace_gym.policies.base import Generation, SamplingParams
from trace_gym.policies.chat import ChatPolicy, ChatTemplate
from trace_gym.rollout.affinity import PrefixAffinity

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
DIALECTS = ("auto", "vllm", "transformers", "openai")


class OpenAIPolicy(ChatPolicy):
    """A policy behind an OpenAI-compatible HTTP server.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``, or a list of
            them (replicas of one model; see "Several servers" in the module docstring).
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
        weight_sync: ``"auto"`` (probe what the servers can take, see :meth:`sync_modes`)
            or ``"none"`` (treat them as unable to take weights).
        sync_dir: where :meth:`load_weights` writes weights and :meth:`load_adapter` copies
            adapters for the servers to read (default: a temporary directory, for servers on
            this machine).
        sync_timeout: seconds a server may take to reload weights or load an adapter.

    Attributes: ``dialect``, ``token_level`` (False in a text dialect), ``drift`` (text
    mode's re-tokenisation counts), ``requests`` and ``retries`` (totals), ``base_urls``,
    ``adapter`` (the served adapter's name after :meth:`load_adapter`, else None).
    """

    name = "openai"

    def __init__(
        self,
        base_url: str | Sequence[str] = "http://127.0.0.1:8000/v1",
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
        weight_sync: str = "auto",
        sync_dir: str | os.PathLike | None = None,
        sync_timeout: float = 600.0,
    ):
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        urls = [base_url] if isinstance(base_url, (str, os.PathLike)) else list(base_url)
        if not urls:
            raise ValueError("base_url: give at least one server")
        self.base_urls = [os.fspath(u).rstrip("/") for u in urls]
        self.base_url = self.base_urls[0]
        if weight_sync not in ("auto", "none"):
            raise ValueError(f"weight_sync must be 'auto' or 'none', got {weight_sync!r}")
        self.weight_sync = weight_sync
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self.sync_timeout = float(sync_timeout)
        self._modes: frozenset[str] | None = frozenset() if weight_sync == "none" else None
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.adapter: str | None = None
        self._adapter_count = 0
        self._roots = PrefixAffinity(max_roots=self.MAX_ROOTS)  # opening prompt -> its server
        self._next_server = 0
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
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else self.chat.eot_id)
        self.model = model if model is not None and not _is_local(model) else None
        self._model_resolved = self.model is not None
        self._mode_known = dialect != "auto"
        if self.dialect != "vllm":
            self._announce_text_mode(f"dialect {dialect!r}")
        self.drift = {"prompts": 0, "prompt_mismatch": 0, "prompt_token_diff": 0,
                      "completions": 0, "completion_mismatch": 0, "completion_token_diff": 0}
        self.requests = 0
        self.retries = 0
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._logprobs_checked = False

    # ------------------------------------------------------------------ routing

    MAX_ROOTS = 65536
    """Opening prompts remembered for routing (least recently rendered forgotten first)."""

    def render_prompt(self, messages, tools=None) -> list[int]:
        """The opening prompt's ids (see :class:`~trace_gym.policies.chat.ChatTemplate`); it
        is also assigned the next server in turn, which then serves every later prompt that
        starts with it."""
        ids = super().render_prompt(messages, tools)
        if len(self.base_urls) > 1:
            with self._lock:
                if self._roots.add_root(ids, self._next_server):
                    self._next_server = (self._next_server + 1) % len(self.base_urls)
        return ids

    def server_of(self, prompt: Sequence[int]) -> int:
        """Index into :attr:`base_urls` of the server that gets ``prompt``: that of the longest
        rendered opening prompt it starts with, else a hash of its tokens."""
        n = len(self.base_urls)
        if n == 1:
            return 0
        ids = [int(t) for t in prompt]
        with self._lock:
            server = self._roots.lookup(ids)
        if server is not None:
            return server
        return zlib.crc32(json.dumps(ids).encode()) % n

    # ------------------------------------------------------------------ weight sync

    def sync_modes(self) -> frozenset[str]:
        """``"weights"`` when every server offers ``/collective_rpc`` and
        ``/reset_prefix_cache`` (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``), ``"adapter"``
        when every server offers ``/v1/load_lora_adapter`` (runtime LoRA updating on); read
        from each server's ``/openapi.json`` on the first call. Empty with
        ``weight_sync="none"`` or when a server cannot be asked."""
        if self._modes is None:
            common: set[str] | None = None
            for url in self.base_urls:
                root = _server_root(url)
                try:
                    r = httpx.get(f"{root}/openapi.json", headers=self._headers(), timeout=self.timeout)
                    paths = set((r.json().get("paths") or {}) if r.status_code == 200 else ())
                except (httpx.HTTPError, ValueError, AttributeError):
                    paths = set()
                modes = set()
                if {"/collective_rpc", "/reset_prefix_cache"} <= paths:
                    modes.add("weights")
                if "/v1/load_lora_adapter" in paths:
                    modes.add("adapter")
                common = modes if common is None else common & modes
            self._modes = frozenset(common or ())
        return self._modes

    def sync_help(self) -> str:
        """Why these servers cannot take weights, and how to start ones that can."""
        return (f"the server(s) {', '.join(self.base_urls)} cannot take new weights"
                + (" (weight_sync='none')" if self.weight_sync == "none" else "")
                + ": full weights need vLLM's /collective_rpc and /reset_prefix_cache (start `vllm serve` with "
                "VLLM_SERVER_DEV_MODE=1), LoRA adapters need /v1/load_lora_adapter (`vllm serve --enable-lora "
                "--max-lora-rank R` with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")

    def _sync_path(self, name: str) -> Path:
        if self.sync_dir is not None:
            base = self.sync_dir
        else:
            if self._scratch is None:
                self._scratch = tempfile.TemporaryDirectory(prefix="trace-gym-openai-sync-")
            base = Path(self._scratch.name)
        path = base / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _control(self, root: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """POST a control request to a server's root; a failure raises naming the server."""
        try:
            r = httpx.post(f"{root}{path}", json=body, headers=self._headers(), timeout=self.sync_timeout)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"POST {root}{path} failed: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise RuntimeError(f"POST {root}{path} answered HTTP {r.status_code}: {r.text[:300]}")
        return r

    def load_weights(self, weights: Any) -> None:
        """Weight sync to every server: a state dict or module is written as safetensors
        into ``sync_dir`` (a directory is used as it is), each server reloads it in place
        and drops its prefix cache. Servers without the ``"weights"`` mode raise
        ``NotImplementedError`` saying how to start ones that have it."""
        from trace_gym.policies.vllm import save_safetensors, state_dict_of

        if "weights" not in self.sync_modes():
            raise NotImplementedError(self.sync_help())
        state = state_dict_of(weights)
        if state is None:
            path = os.path.abspath(os.fspath(weights))
            if not list(Path(path).glob("*.safetensors")):
                raise FileNotFoundError(f"no *.safetensors files in {path!r}")
        else:
            path = str(save_safetensors(state, self._sync_path("weights")))
        for url in self.base_urls:
            root = _server_root(url)
            self._control(root, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
            # KV cached under the old weights must not serve the new ones
            self._reset_prefix_cache(root)

    def load_adapter(self, path: str) -> None:
        """LoRA sync to every server: the adapter in directory ``path`` (copied into
        ``sync_dir`` first when one was given) is loaded under a new name, requests use it
        from now on, and the previous adapter is unloaded."""
        if "adapter" not in self.sync_modes():
            raise NotImplementedError(self.sync_help())
        src = Path(path).resolve()
        if not (src / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no adapter_config.json in {str(src)!r} (save the adapter with peft's save_pretrained)")
        self._adapter_count += 1
        name = f"trace-gym-adapter-{self._adapter_count}"
        if self.sync_dir is not None and self.sync_dir.resolve() not in src.parents:
            dst = self._sync_path(name)
            shutil.copytree(src, dst, dirs_exist_ok=True)
            src = dst
        for url in self.base_urls:
            self._control(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(src)})
        previous, self.adapter = self.adapter, name
        if previous is not None:
            for url in self.base_urls:
                try:
                    self._control(url, "/unload_lora_adapter", {"lora_name": previous})
                except RuntimeError:
                    pass  # an adapter left loaded costs memory only; requests name the new one
            if self.sync_dir is not None:
                shutil.rmtree(self.sync_dir / previous, ignore_errors=True)

    def reset_cache(self) -> None:
        """Drop every server's prefix cache where the server allows it (dev mode); else nothing.
        Raises ``RuntimeError`` naming a server that keeps refusing (:meth:`_reset_prefix_cache`)."""
        if "weights" in self.sync_modes():
            for url in self.base_urls:
                self._reset_prefix_cache(_server_root(url))

    RESET_RETRY_S = 30.0
    """How long a refused prefix-cache reset is retried (at most ``sync_timeout``)."""

    def _reset_prefix_cache(self, root: str) -> None:
        """``POST /reset_prefix_cache``. vLLM answers ``{"success": false}`` while blocks are
        held (requests still running, another client's too) and says to retry: retried for
        :attr:`RESET_RETRY_S`, then ``RuntimeError``, since KV left there would reach the next
        step or outlive a weight sync."""
        patience = min(self.RESET_RETRY_S, self.sync_timeout)
        deadline = time.monotonic() + patience
        wait = 0.05
        while True:
            r = self._control(root, "/reset_prefix_cache")
            refused = r.headers.get("content-type", "").startswith("application/json") and r.json().get("success") is False
            if not refused:
                return
            if time.monotonic() + wait > deadline:
                raise RuntimeError(f"{root} did not empty its prefix cache: it answered success=false for "
                                   f"{patience:.0f} s (requests still hold its blocks; "
                                   "are other clients generating on it?)")
            time.sleep(wait)
            wait = min(1.0, wait * 2)

    def close(self) -> None:
        """Remove the temporary sync directory."""
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

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
        if self.adapter or self.model:
            body["model"] = self.adapter or self.model
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

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any], url: str) -> httpx.Response:
        """POST to server ``url`` with retries; returns the last response (any status) or raises the last transport error."""
        attempts = 1 if url in self._down else self.max_retries + 1
        last_exc: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                with self._lock:
                    self.retries += 1
                await asyncio.sleep(self.backoff * (2 ** (attempt - 1)) * (0.75 + 0.5 * random.random()))
            try:
                with self._lock:
                    self.requests += 1
                r = await client.post(f"{url}/completions", json=body)
            except httpx.TransportError as exc:
                last_exc = exc
                continue
            if r.status_code in _RETRY_STATUS and attempt + 1 < attempts:
                continue
            self._down.discard(url)
            return r
        if isinstance(last_exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
            self._down.add(url)
        else:
            self._down.discard(url)
        assert last_exc is not None
        raise last_exc

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, prompt: list[int], params: SamplingParams,
                   seed: int | None) -> Generation:
        url = self.base_urls[self.server_of(prompt)]
        async with sem:
            try:
                return await self._request(client, prompt, params, seed, url)
            except httpx.HTTPError as exc:
                detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                return Generation([], [], "", "error", info={"error": f"POST {url}/completions failed after retries: {detail}"})

    async def _request(self, client: httpx.AsyncClient, prompt: list[int], params: SamplingParams, seed: int | None,
                       url: str) -> Generation:
        if self.token_level:
            r = await self._post(client, self._body(prompt, params, seed), url)
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
        r = await self._post(client, self._body(prompt, params, seed), url)
        if r.status_code != 200:
            return _http_error(r)
        return self._parse_text(r.json(), prompt)

    def _switch(self, dialect: str, reason: str) -> None:
        with self._lock:
            if not self._mode_known:
                self.dialect = dialect
                self._mode_known = True
                self._announce_text_mode(f"{', '.join(self.base_urls)} does not serve token-level completions ({reason}); using dialect {dialect!r}")

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

    def logprobs_mode(self) -> str | None:
        """The first server's vLLM ``logprobs_mode`` (``"processed_logprobs"``: log-probs of
        the temperature-scaled sampling distribution, what a trainer recomputes;
        ``"raw_logprobs"``, vLLM's default: of the untempered logits), read once from its
        ``/server_info`` (dev mode); None where the server does not say."""
        if not hasattr(self, "_logprobs_mode"):
            self._logprobs_mode: str | None = None
            try:
                r = httpx.get(f"{_server_root(self.base_url)}/server_info", params={"config_format": "json"},
                              headers=self._headers(), timeout=self.timeout)
                if r.status_code == 200:
                    cfg = (r.json().get("vllm_config") or {}).get("model_config") or {}
                    self._logprobs_mode = cfg.get("logprobs_mode") if isinstance(cfg, dict) else None
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
        return self._logprobs_mode

    def _check_logprobs_mode(self, params: SamplingParams) -> None:
        if self._logprobs_checked or not self.token_level or params.temperature <= 0 or params.temperature == 1.0:
            return
        self._logprobs_checked = True
        if self.logprobs_mode() == "raw_logprobs":
            warnings.warn(
                f"{self.base_url} returns raw log-probs (of the untempered logits), but sampling runs at temperature "
                f"{params.temperature}: behaviour log-probs then differ from the sampling distribution's; start "
                "`vllm serve` with --logprobs-mode processed_logprobs", RuntimeWarning, stacklevel=3)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        prompts = [[int(t) for t in p] for p in prompts]
        self._down = set()
        self._check_logprobs_mode(params)
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


def _server_root(url: str) -> str:
    """The server's root (where vLLM's control endpoints live) from its API root ``.../v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _http_error(r: httpx.Response) -> Generation:
    return Generation([], [], "", "error", info={"error": f"HTTP {r.status_code} from {r.request.url}: {r.text[:300]}"})


def _is_local(name: str) -> bool:
    from trace_gym.policies.models import MODEL_ALIASES

    return name in MODEL_ALIASES
