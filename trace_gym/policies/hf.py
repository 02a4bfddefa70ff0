"""``hf``: any transformers causal LM as a policy, on CPU or CUDA (bf16 there).

Generation is a small sampling loop over the model's forward pass rather than
``model.generate``, because the loop is where multi-turn rollouts and branching pay off.
A prompt's KV cache comes from the cheapest of three places:

1. **The prefix store** (:class:`PrefixKVStore`): the KV of every sequence this policy
   generated recently, found by longest common prefix (block hashing, as in vLLM's prefix
   cache). The next turn of a trajectory reuses its previous turn's KV and prefills only the
   observation tokens; a branch from node y reuses the KV of the turn that produced y.
2. **Shared prefixes within the call**: prompts that share a prefix (the k continuations of
   one branch point, the G rollouts of one prompt, the system + user turns of later waves)
   are grouped, and the shared part is prefilled once and repeated for every member.
3. Otherwise the prompt is prefilled in full.

``info["prefill_tokens"]`` and ``info["reused_prefix_tokens"]`` of each
:class:`~trace_gym.policies.base.Generation` say which tokens were computed and which reused. The
store is emptied whenever the weights change (:meth:`HFPolicy.load_weights`, or any in-place
update of the parameters, detected through their version counters).

Behaviour log-probs are ``log softmax(logits / T)`` of the sampled token (before top-p
truncation; at ``T = 0`` the untempered log-softmax of the greedy token): the same
quantity a trainer recomputes with the same temperature.
"""

from __future__ import annotations

import inspect
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from trace_gym.policies.chat import ChatPolicy, ChatTemplate
from trace_gym.policies.base import Generation, SamplingParams

#: how a seeded call's random stream reaches its rows (see :class:`HFPolicy`'s ``sampler``)
SAMPLERS = ("wave", "row")

# ----------------------------------------------------------------------------- grouping


@dataclass
class _Group:
    """Prompts that share their first ``shared`` tokens (always < every member's length)."""

    ref: list[int]
    members: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    shared: int = 0

    def cost(self, shared: int | None = None, extra: int | None = None) -> int:
        """Prefill tokens for this group (with a candidate ``shared`` length and member)."""
        s = self.shared if shared is None else shared
        lengths = self.lengths if extra is None else self.lengths + [extra]
        return s + sum(n - s for n in lengths)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def group_prompts(prompts: Sequence[Sequence[int]], indices: Sequence[int] | None = None, share: bool = True) -> list[_Group]:
    """Partition prompts (all, or those in ``indices``) into groups that prefill a common prefix once.

    Prompts are sorted, so equal and near-equal prompts are neighbours; a prompt joins the
    previous group when that lowers the total prefill (the group's shared prefix may shrink
    to the common part). A group's shared prefix always leaves at least one token per
    member, whose forward pass yields the first sampling distribution.
    """
    groups: list[_Group] = []
    order = range(len(prompts)) if indices is None else indices
    for i in sorted(order, key=lambda j: list(prompts[j])):
        p = prompts[i]
        n = len(p)
        if share and groups:
            g = groups[-1]
            s = min(g.shared, _common_prefix(g.ref, p), n - 1)
            if g.cost(s, n) < g.cost() + n:
                g.shared = s
                g.members.append(i)
                g.lengths.append(n)
                continue
        groups.append(_Group(ref=list(p), members=[i], lengths=[n], shared=n - 1 if share else 0))
    return groups


# ----------------------------------------------------------------------------- prefix store


@dataclass
class _Entry:
    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [heads, len, dim]


class PrefixKVStore:
    """KV caches of recent sequences, looked up by longest common prefix.

    Sequences are hashed in blocks of ``block`` tokens (each block's hash chains the previous
    one, as in vLLM's automatic prefix caching), so a lookup costs one pass over the prompt.
    An entry that is a prefix of a newer one is dropped (the newer one serves both).
    Entries are evicted least-recently-used first once they hold more than ``max_tokens``.
    Of several entries that match a lookup equally far, the newest serves it, so a lookup
    depends only on what was stored since the last :meth:`clear`.
    """

    def __init__(self, max_tokens: int, block: int = 16):
        self.max_tokens = int(max_tokens)
        self.block = int(block)
        self.tokens = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._blocks: dict[int, set[int]] = {}  # block-chain hash -> entries holding that prefix
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self._blocks.clear()
        self.tokens = 0

    def _hashes(self, ids: Sequence[int]) -> list[int]:
        out, h, b = [], 0, self.block
        for j in range(len(ids) // b):
            h = hash((h, tuple(ids[j * b:(j + 1) * b])))
            out.append(h)
        return out

    def match(self, ids: Sequence[int]) -> tuple[int, int]:
        """``(entry id, length)`` of the longest stored prefix of ``ids`` (``(-1, 0)``: none)."""
        candidates: set[int] | None = None
        n_blocks = 0
        for j, h in enumerate(self._hashes(ids)):
            found = self._blocks.get(h)
            if not found:
                break
            candidates, n_blocks = found, j + 1
        if not candidates:
            return -1, 0
        start = n_blocks * self.block
        best, best_len = -1, 0
        for e in candidates:
            entry = self._entries[e]
            length, limit = start, min(len(entry.ids), len(ids))
            while length < limit and entry.ids[length] == ids[length]:
                length += 1
            # among equal matches the newest entry: a set's order follows the ids' values,
            # which depend on how many entries the store held before (clear() keeps counting)
            if length > best_len or (length == best_len and e > best):
                best, best_len = e, length
        if self._entries[best].ids[:start] != list(ids[:start]):  # a hash collision: treat as a miss
            return -1, 0
        self._entries.move_to_end(best)
        return best, best_len

    def get(self, entry: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The per-layer ``(keys, values)`` of an entry, ``[heads, len, dim]`` each."""
        return self._entries[entry].kv

    def put(self, ids: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store the KV of sequence ``ids`` (``len(ids)`` positions per layer)."""
        if len(ids) < self.block or len(ids) > self.max_tokens:
            return
        old, length = self.match(ids)
        if old >= 0 and length == len(self._entries[old].ids):
            self._drop(old)  # the new sequence extends it
        elif old >= 0 and length == len(ids):
            return  # already covered by a longer entry
        e = self._next
        self._next += 1
        self._entries[e] = _Entry(list(ids), kv)
        for h in self._hashes(ids):
            self._blocks.setdefault(h, set()).add(e)
        self.tokens += len(ids)
        while self.tokens > self.max_tokens and self._entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, e: int) -> None:
        entry = self._entries.pop(e)
        self.tokens -= len(entry.ids)
        for h in self._hashes(entry.ids):
            found = self._blocks.get(h)
            if found is not None:
                found.discard(e)
                if not found:
                    del self._blocks[h]


# ----------------------------------------------------------------------------- the policy


@dataclass
class _Unit:
    """Rows of one chunk that share a prefix source: a stored entry or a group prefill."""

    members: list[int]
    shared: int  # prefix length served by the source
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # a store entry's KV (held, so eviction cannot drop it mid-call)


class HFPolicy(ChatPolicy):
    """A transformers causal LM with its tokenizer and chat template.

    Args:
        model: a model alias (``"smollm2-135m"``), a local HF directory, a hub id (offline:
            from the local cache), or an already built ``PreTrainedModel`` (then pass
            ``tokenizer`` too). The trainer's from-scratch presets are local directories.
        tokenizer: a tokenizer or a path; default: the model's.
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available.
        dtype: default bfloat16 on CUDA, float32 on CPU.
        max_batch_size: rows per forward pass; a larger wave is generated in chunks.
        max_batch_tokens: cap on rows x padded length per chunk (bounds activation memory).
            With ``sampler="wave"`` both are part of the run, not only of its speed: the
            chunks draw from one seeded random stream in turn, so a value that splits a wave
            differently samples different tokens from the same seed (a wave both leave in one
            chunk is unaffected).
        sampler: how a seeded call's random stream reaches its rows. ``"wave"`` (default):
            one stream, one uniform per live row per step in the order the rows sit in their
            chunks, so a row's draws depend on the chunking, on the prefix store's contents
            (they set the row order) and on when the other rows stop; one token that comes
            out differently (another CPU's rounding) changes every later draw of the call.
            ``"row"``: the call draws a ``(prompts, max_new_tokens)`` table of uniforms up
            front and prompt i's token t uses entry (i, t), so a row's tokens depend only on
            the seed, its index and its own logits: the same under any batch caps or store
            state up to floating-point rounding, as the vllm and openai backends' per-request
            seeds are. The default stays ``"wave"`` because the README's measured figures
            were sampled with it and reproduce bit for bit only with it.
        share_prefix: prefill prefixes shared within a call once per group.
        kv_cache_tokens: capacity of the :class:`PrefixKVStore` in tokens (0: no store).
            The default, 16384, is ~750 MB for SmolLM2-135M in fp32.
        chat_template, tools_in_template: see :class:`~trace_gym.policies.chat.ChatTemplate`.
        num_threads: torch CPU threads (default: leave torch's setting).

    ``share_prefix=False, kv_cache_tokens=0`` prefills every prompt in full: the baseline the
    rollout benchmark compares with.

    Attributes the trainer uses: ``model`` (the torch module, in eval mode), ``tokenizer``,
    ``chat`` (the :class:`ChatTemplate`), ``device``, and :meth:`load_weights`.
    """

    name = "hf"

    def __init__(
        self,
        model: Any = "smollm2-135m",
        *,
        tokenizer: Any = None,
        device: str | None = None,
        dtype: Any = None,
        max_batch_size: int = 64,
        max_batch_tokens: int = 16 * 1024,
        share_prefix: bool = True,
        kv_cache_tokens: int = 16384,
        chat_template: str | None = None,
        tools_in_template: bool | None = None,
        num_threads: int | None = None,
        sampler: str = "wave",
    ):
        from trace_gym.policies.models import load_model

        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(map(repr, SAMPLERS))}, got {sampler!r}")
        self.sampler = sampler

        if num_threads:
            torch.set_num_threads(int(num_threads))
        if isinstance(model, (str, os.PathLike)):
            self.model, tok = load_model(model, device=device, dtype=dtype)
            self.model_name = os.fspath(model)
        else:
            if tokenizer is None:
                raise ValueError("pass tokenizer= together with a model object")
            self.model, tok = model, None
            self.model_name = getattr(getattr(model, "config", None), "name_or_path", type(model).__name__)
            if device is not None:
                self.model.to(device)
            self.model.eval()
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        self.tokenizer = tokenizer if tokenizer is not None else tok
        self.chat = ChatTemplate(self.tokenizer, chat_template=chat_template, tools_in_template=tools_in_template)
        self.device = next(self.model.parameters()).device
        self.max_batch_size = int(max_batch_size)
        self.max_batch_tokens = int(max_batch_tokens)
        self.share_prefix = bool(share_prefix)
        self.store = PrefixKVStore(kv_cache_tokens)
        cfg = self.model.config
        self.max_context_tokens: int | None = getattr(cfg, "max_position_embeddings", None)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else self.chat.eot_id)
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        self.stop_ids = frozenset(self.chat.stop_ids | {int(e) for e in extra})
        # transformers >= 5.2x renamed the forward's `past_key_values` to `cache`
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._weights_version = self._version()

    # ------------------------------------------------------------------ weights

    def _version(self) -> int:
        # in-place updates (optimizer steps, load_state_dict) bump every tensor's version counter
        return sum(p._version for p in self.model.parameters())

    def load_weights(self, weights: Any) -> None:
        """Copy new weights into the model: a state dict, a module, or a directory of safetensors.
        Empties the prefix store (its KV belongs to the old weights)."""
        if isinstance(weights, torch.nn.Module):
            state = weights.state_dict()
        elif isinstance(weights, (str, os.PathLike)):
            from pathlib import Path

            from safetensors.torch import load_file

            files = sorted(Path(weights).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {os.fspath(weights)!r}")
            state = {}
            for f in files:
                state.update(load_file(str(f)))
        else:
            state = dict(weights)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = getattr(self.model, "_tied_weights_keys", None) or []
        tied = set(tied.keys() if isinstance(tied, dict) else tied)
        missing = [k for k in missing if k not in tied]
        self.store.clear()
        if missing or unexpected:
            raise ValueError(f"load_weights: missing keys {missing[:5]}, unexpected keys {list(unexpected)[:5]}")

    def reset_cache(self) -> None:
        """Empty the prefix store."""
        self.store.clear()

    # ------------------------------------------------------------------ generation

    def _units(self, prompts: list[list[int]]) -> list[_Unit]:
        """Assign every prompt a prefix source: a store entry (rows with the same entry and
        length together) or a group prefill."""
        by_entry: dict[tuple[int, int], list[int]] = {}
        held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        rest: list[int] = []
        if self.store.max_tokens > 0:
            for i, p in enumerate(prompts):
                e, n = self.store.match(p)
                n = min(n, len(p) - 1)
                if e >= 0 and n >= self.store.block:
                    by_entry.setdefault((e, n), []).append(i)
                    held.setdefault(e, self.store.get(e))
                else:
                    rest.append(i)
        else:
            rest = list(range(len(prompts)))
        units = [_Unit(m, n, held[e]) for (e, n), m in by_entry.items()]
        units += [_Unit(g.members, g.shared) for g in group_prompts(prompts, rest, self.share_prefix)]
        return units

    def _chunks(self, units: list[_Unit], prompts: list[list[int]]) -> list[list[_Unit]]:
        """Split units into forward-pass chunks that respect the batch limits."""
        chunks: list[list[_Unit]] = []
        cur: list[_Unit] = []
        rows = width = 0
        for u in units:
            members = list(u.members)
            longest = max(len(prompts[i]) for i in members)
            while members:
                w = max(width, longest)
                room = min(self.max_batch_size - rows, self.max_batch_tokens // max(1, w) - rows)
                if room <= 0 and not cur:
                    room = 1  # a row that alone exceeds max_batch_tokens still runs, by itself
                if room <= 0:
                    chunks.append(cur)
                    cur, rows, width = [], 0, 0
                    continue
                part, members = members[:room], members[room:]
                cur.append(_Unit(part, u.shared, u.kv))
                rows += len(part)
                width = w
        if cur:
            chunks.append(cur)
        return chunks

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        prompts = [[int(t) for t in p] for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        version = self._version()
        if version != self._weights_version:
            self.store.clear()
            self._weights_version = version
        out: list[Generation | None] = [None] * len(prompts)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(params.seed))
        table = None
        if self.sampler == "row" and params.temperature > 0:
            table = torch.rand((len(prompts), params.max_new_tokens), generator=gen, device=self.device)
        for chunk in self._chunks(self._units(prompts), prompts):
            self._generate_chunk(chunk, prompts, params, out, gen, table)
        return out  # type: ignore[return-value]

    def _forward(self, ids, mask, pos, cache):
        kw = {self._cache_arg: cache}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kw)

    def _prefix_cache(self, chunk: list[_Unit], prompts: list[list[int]], rows: list[int]):
        """The chunk's prefix block: a DynamicCache with each row's prefix KV, left-padded
        to a common width, and the matching attention mask."""
        from transformers import DynamicCache

        dev, n = self.device, len(rows)
        cache = DynamicCache(config=self.model.config)
        width = max(u.shared for u in chunk)
        mask = torch.zeros((n, width), dtype=torch.long, device=dev)
        if width == 0:
            return cache, mask
        # group prefills first: one row per group unit, left-padded
        groups = [u for u in chunk if u.kv is None and u.shared > 0]
        group_kv = None
        if groups:
            gw = max(u.shared for u in groups)
            ids = torch.full((len(groups), gw), self.pad_id, dtype=torch.long)
            gmask = torch.zeros((len(groups), gw), dtype=torch.long)
            for j, u in enumerate(groups):
                ids[j, gw - u.shared:] = torch.tensor(prompts[u.members[0]][: u.shared])
                gmask[j, gw - u.shared:] = 1
            gmask = gmask.to(dev)
            tmp = DynamicCache(config=self.model.config)
            self._forward(ids.to(dev), gmask, (gmask.cumsum(-1) - 1).clamp(min=0), tmp)
            group_kv = [(layer.keys, layer.values) for layer in tmp.layers]
        some_kv = group_kv or next(u.kv for u in chunk if u.kv is not None)
        ref = some_kv[0][0] if group_kv else some_kv[0][0].unsqueeze(0)
        n_layers = len(some_kv)
        heads, dim = ref.shape[1], ref.shape[-1]
        spans, r0, gi = [], 0, 0  # (first row, last row + 1, prefix length, source KV, row in the group prefill)
        for u in chunk:
            r1 = r0 + len(u.members)
            if u.shared > 0:
                mask[r0:r1, width - u.shared:] = 1
                spans.append((r0, r1, u.shared, u.kv, gi))
                gi += u.kv is None
            r0 = r1
        # one layer at a time, so the only transient copy is one layer's
        for layer in range(n_layers):
            keys = torch.zeros((n, heads, width, dim), dtype=ref.dtype, device=dev)
            values = torch.zeros_like(keys)
            for r0, r1, s, kv, g in spans:
                if kv is not None:
                    keys[r0:r1, :, width - s:] = kv[layer][0][:, :s]
                    values[r0:r1, :, width - s:] = kv[layer][1][:, :s]
                else:
                    gw = group_kv[layer][0].shape[2]
                    keys[r0:r1, :, width - s:] = group_kv[layer][0][g, :, gw - s:]
                    values[r0:r1, :, width - s:] = group_kv[layer][1][g, :, gw - s:]
            cache.update(keys, values, layer)
            del keys, values
        return cache, mask

    def _store_rows(self, cache, attn: torch.Tensor, seqs: list[list[int]]) -> None:
        """Save each row's real KV (positions where ``attn`` is 1) under its token ids."""
        for r, ids in enumerate(seqs):
            pos = attn[r].nonzero().squeeze(1)
            if pos.numel() != len(ids):  # defensive: never store KV that does not match its ids
                continue
            kv = [(layer.keys[r].index_select(1, pos), layer.values[r].index_select(1, pos)) for layer in cache.layers]
            self.store.put(ids, kv)

    def _generate_chunk(self, chunk: list[_Unit], prompts, params: SamplingParams, out, gen, table=None) -> None:
        dev = self.device
        rows = [i for u in chunk for i in u.members]
        # with sampler="row": each row's column of uniforms, in the chunk's row order
        own = None if table is None else table.index_select(0, torch.tensor(rows, device=dev))
        shared = [u.shared for u in chunk for _ in u.members]
        n = len(rows)
        cache, prefix_mask = self._prefix_cache(chunk, prompts, rows)

        # each row's own suffix, left-padded after the prefix block
        suffixes = [prompts[i][shared[r]:] for r, i in enumerate(rows)]
        smax = max(len(s) for s in suffixes)
        ids = torch.full((n, smax), self.pad_id, dtype=torch.long)
        smask = torch.zeros((n, smax), dtype=torch.long)
        for r, s in enumerate(suffixes):
            ids[r, smax - len(s):] = torch.tensor(s)
            smask[r, smax - len(s):] = 1
        attn = torch.cat([prefix_mask, smask.to(dev)], dim=1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -smax:]
        logits = self._forward(ids.to(dev), attn, pos, cache).logits[:, -1, :]
        next_pos = attn.sum(-1)

        # accounting: in a group, the first member pays for the shared prefix
        r = 0
        for u in chunk:
            for k, i in enumerate(u.members):
                computed = len(suffixes[r]) + (u.shared if (u.kv is None and k == 0) else 0)
                info = {"prefill_tokens": computed, "reused_prefix_tokens": len(prompts[i]) - computed}
                out[i] = Generation(token_ids=[], logprobs=[], text="", finish_reason="length", info=info)
                r += 1

        # sample one token per live row per step; finished rows leave the batch (their KV
        # goes to the prefix store first)
        live = torch.arange(n, device=dev)  # positions in `rows` of the rows still in the batch
        stop = torch.tensor(sorted(self.stop_ids), device=dev)
        store = self.store.max_tokens > 0
        for step in range(params.max_new_tokens):
            tok, lp = _sample(logits, params, gen, None if own is None else own[live, step:step + 1])
            tok_l, lp_l = tok.tolist(), lp.tolist()
            done = torch.isin(tok, stop)
            live_l, done_l = live.tolist(), done.tolist()
            for j, r in enumerate(live_l):
                g_ = out[rows[r]]
                g_.token_ids.append(tok_l[j])
                g_.logprobs.append(lp_l[j])
                if done_l[j]:
                    g_.finish_reason = "stop"
            last = step == params.max_new_tokens - 1
            if last or all(done_l):
                if store:
                    self._store_rows(cache, attn, [prompts[rows[r]] + out[rows[r]].token_ids[:-1] for r in live_l])
                break
            if any(done_l):
                if store:
                    gone = done.nonzero().squeeze(1)
                    sub = [live_l[j] for j in gone.tolist()]
                    self._store_rows(_Rows(cache, gone), attn.index_select(0, gone), [prompts[rows[r]] + out[rows[r]].token_ids[:-1] for r in sub])
                idx = (~done).nonzero().squeeze(1)
                cache.reorder_cache(idx)
                live, attn, next_pos, tok = live[idx], attn[idx], next_pos[idx], tok[idx]
            attn = torch.cat([attn, torch.ones((attn.shape[0], 1), dtype=attn.dtype, device=dev)], dim=1)
            logits = self._forward(tok[:, None], attn, next_pos[:, None], cache).logits[:, -1, :]
            next_pos = next_pos + 1
        for i in rows:
            g_ = out[i]
            g_.text = self.chat.decode(g_.token_ids)


class _Rows:
    """A view of some rows of a DynamicCache (for storing the rows that just finished)."""

    def __init__(self, cache, index: torch.Tensor):
        self.layers = [_RowsLayer(layer.keys.index_select(0, index), layer.values.index_select(0, index)) for layer in cache.layers]


@dataclass
class _RowsLayer:
    keys: torch.Tensor
    values: torch.Tensor


def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
            uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, their log-probs under softmax(logits / T)).
    ``uniforms`` (rows x 1, in [0, 1)) are the rows' draws; default: drawn here from ``gen``.

    Raises :class:`FloatingPointError` when a row's logits hold a NaN or +inf, or no finite
    value (-inf alone, a masked token, is fine): such a row has no distribution to sample."""
    logits = logits.float()
    # amax is NaN when any entry is, +inf when any is, -inf when all are: one reduction checks all three
    bad = ~torch.isfinite(logits.amax(dim=-1))
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(1).tolist()
        raise FloatingPointError(f"the model's logits are NaN or infinite in {len(rows)} of {logits.shape[0]} rows "
                                 f"(rows {rows[:8]}{' ...' if len(rows) > 8 else ''}): no token sampled")
    if params.temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cut = sorted_p.cumsum(-1) - sorted_p > params.top_p
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
    # inverse-CDF sampling: the same distribution as torch.multinomial, one cumsum and a binary
    # search per row (multinomial over a 49k vocabulary costs ~15 ms per row batch on a CPU);
    # right=True never lands on a zero-probability token (its CDF equals its predecessor's)
    cdf = probs.cumsum(dim=-1)
    if uniforms is None:
        uniforms = torch.rand((probs.shape[0], 1), generator=gen, device=probs.device, dtype=cdf.dtype)
    u = uniforms.to(cdf.dtype) * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
