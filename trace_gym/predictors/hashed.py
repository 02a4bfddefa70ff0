"""``hashed``: one shared online logistic model of V(H) over hashed n-gram features.

A single model serves every prompt and every prefix (PAPER.md sec. 3, "shared predictor"),
so what it learns on one prompt transfers to others with similar words. The features of a
history H (prompt + turns so far), each hashed into ``2**bits`` weights:

* the prompt's word unigrams and bigrams (so it learns difficulty cues and, for prompts
  that recur, the prompt itself), and a bias;
* the prefix depth, the turns remaining (``max_turns - depth`` where ``max_turns`` is
  known) and their pair;
* the words of every earlier turn (bag of words, each turn counted once per word);
* the unigrams and bigrams of the *last* turn (action and observation), alone and crossed
  with the turns remaining: the latest observation says most about the current state, and
  how much it matters depends on how many turns are left.

Words are lower-cased runs of ``[a-z0-9_]``. Feature lists are cached per prompt and per
turn text, so a history costs a few dictionary look-ups. Training is weighted logistic
regression on (H, V_hat) pairs with AdaGrad, ``epochs`` shuffled passes per
:meth:`~HashedPredictor.update` (online: each call continues from the current weights);
sample weights are normalised to mean 1 within a call. Prediction and training run in
numba over a CSR matrix of feature ids.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, Sequence

import numba as nb
import numpy as np

from trace_gym.forest import History
from trace_gym.predictor import Predictor
from trace_gym.predictors import register

_WORD = re.compile(r"[a-z0-9_]+")


@nb.njit(cache=True, nogil=True)
def _predict_kernel(indptr, idx, w, out):
    for i in range(indptr.shape[0] - 1):
        z = 0.0
        for j in range(indptr[i], indptr[i + 1]):
            z += w[idx[j]]
        if z >= 0:
            out[i] = 1.0 / (1.0 + np.exp(-z))
        else:
            e = np.exp(z)
            out[i] = e / (1.0 + e)


@nb.njit(cache=True, nogil=True)
def _adagrad_kernel(indptr, idx, y, sw, order, w, g2, lr, l2):
    """One pass of weighted logistic AdaGrad over rows in ``order``; returns the mean log-loss."""
    loss = 0.0
    for i in order:
        z = 0.0
        for j in range(indptr[i], indptr[i + 1]):
            z += w[idx[j]]
        if z >= 0:
            p = 1.0 / (1.0 + np.exp(-z))
        else:
            e = np.exp(z)
            p = e / (1.0 + e)
        pc = min(max(p, 1e-12), 1.0 - 1e-12)
        loss += sw[i] * -(y[i] * np.log(pc) + (1.0 - y[i]) * np.log(1.0 - pc))
        g = sw[i] * (p - y[i])
        for j in range(indptr[i], indptr[i + 1]):
            k = idx[j]
            grad = g + l2 * w[k]
            g2[k] += grad * grad
            w[k] -= lr * grad / np.sqrt(g2[k] + 1e-8)
    return loss / max(order.shape[0], 1)


def _hash(text: str, mask: int) -> int:
    return zlib.crc32(text.encode()) & mask


@register("hashed")
class HashedPredictor(Predictor):
    """Shared online logistic model over hashed features of (prompt, prefix); see the
    module docstring.

    Args:
        bits: log2 of the number of weights.
        lr: AdaGrad learning rate.
        l2: L2 penalty per feature update.
        epochs: shuffled passes over each update's batch.
        seed: seeds the shuffling.
        max_cache: feature-cache entries kept before the cache is cleared.
    """

    name = "hashed"

    def __init__(self, bits: int = 18, lr: float = 0.1, l2: float = 1e-6, epochs: int = 2, seed: int = 0,
                 max_cache: int = 200_000):
        if not 8 <= bits <= 26:
            raise ValueError(f"bits must be in [8, 26], got {bits}")
        if lr <= 0 or l2 < 0 or epochs < 1:
            raise ValueError("need lr > 0, l2 >= 0 and epochs >= 1")
        self.bits, self.lr, self.l2, self.epochs = int(bits), float(lr), float(l2), int(epochs)
        self.mask = (1 << self.bits) - 1
        self.w = np.zeros(1 << self.bits)
        self.g2 = np.zeros(1 << self.bits)
        self.rng = np.random.default_rng(seed)
        self.max_cache = int(max_cache)
        self._prompt: dict[str, np.ndarray] = {}
        self._step: dict[str, np.ndarray] = {}
        self._last: dict[tuple[str, int], np.ndarray] = {}
        self._scalar: dict[tuple[int, int], np.ndarray] = {}
        self.n_updates = 0

    # ------------------------------------------------------------------ features

    def _ids(self, names: list[str]) -> np.ndarray:
        m = self.mask
        return np.array([_hash(n, m) for n in names], dtype=np.int64)

    def _prompt_ids(self, prompt: str) -> np.ndarray:
        ids = self._prompt.get(prompt)
        if ids is None:
            words = _WORD.findall(prompt.lower())
            ids = self._ids(["bias"] + ["p:" + x for x in words] + [f"p2:{a} {b}" for a, b in zip(words, words[1:])])
            self._prompt[prompt] = ids
        return ids

    def _step_ids(self, text: str) -> np.ndarray:
        ids = self._step.get(text)
        if ids is None:
            ids = self._ids(["s:" + x for x in sorted(set(_WORD.findall(text.lower())))])
            self._step[text] = ids
        return ids

    def _last_ids(self, text: str, left: int) -> np.ndarray:
        key = (text, left)
        ids = self._last.get(key)
        if ids is None:
            words = _WORD.findall(text.lower())
            uni = sorted(set(words))
            bi = sorted({f"{a} {b}" for a, b in zip(words, words[1:])})
            ids = self._ids(["l:" + x for x in uni] + ["l2:" + x for x in bi] + [f"lr{left}:{x}" for x in uni])
            self._last[key] = ids
        return ids

    def _scalar_ids(self, depth: int, left: int) -> np.ndarray:
        key = (depth, left)
        ids = self._scalar.get(key)
        if ids is None:
            ids = self._ids([f"d:{depth}", f"r:{left}", f"dr:{depth},{left}"])
            self._scalar[key] = ids
        return ids

    def features(self, histories: Sequence[History]) -> tuple[np.ndarray, np.ndarray]:
        """CSR ``(indptr, feature ids)`` of ``histories`` (a row may repeat an id: a count)."""
        if len(self._step) + len(self._last) + len(self._prompt) > self.max_cache:
            self._prompt.clear(), self._step.clear(), self._last.clear()
        # histories of one forest share prefixes: the prompt-plus-earlier-turns part of a row
        # is built once per distinct prefix within this call
        base: dict[tuple[str, tuple[str, ...]], np.ndarray] = {}
        parts: list[np.ndarray] = []
        lengths = np.zeros(len(histories) + 1, dtype=np.int64)
        for k, h in enumerate(histories):
            depth = len(h.steps)
            left = h.max_turns - depth if h.max_turns > 0 else -1
            earlier = h.steps[:-1]
            key = (h.prompt, earlier)
            head = base.get(key)
            if head is None:
                head = self._prompt_ids(h.prompt)
                if earlier:
                    head = np.concatenate([head] + [self._step_ids(s) for s in earlier])
                base[key] = head
            scalar = self._scalar_ids(depth, left)
            parts.append(head)
            parts.append(scalar)
            n = head.size + scalar.size
            if depth:
                last = self._last_ids(h.steps[-1], left)
                parts.append(last)
                n += last.size
            lengths[k + 1] = n
        indptr = np.cumsum(lengths)
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return indptr, idx

    # ------------------------------------------------------------------ Predictor API

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        indptr, idx = self.features(histories)
        out = np.empty(len(histories))
        _predict_kernel(indptr, idx, self.w, out)
        return out

    def update(self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None = None) -> float:
        """Train on ``(histories, targets)``; returns the last pass's mean weighted log-loss."""
        y = np.asarray(targets, dtype=np.float64)
        sw = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
        if y.shape != (len(histories),) or sw.shape != y.shape:
            raise ValueError("targets and weights need one value per history")
        keep = np.isfinite(y) & (sw > 0)
        if not keep.any():
            return float("nan")
        if not np.all((y[keep] >= 0) & (y[keep] <= 1)):
            raise ValueError("targets must lie in [0, 1]")
        if not keep.all():
            histories = [h for h, k in zip(histories, keep) if k]
            y, sw = y[keep], sw[keep]
        sw = sw / sw.mean()
        indptr, idx = self.features(histories)
        loss = float("nan")
        for _ in range(self.epochs):
            order = self.rng.permutation(y.size)
            loss = float(_adagrad_kernel(indptr, idx, y, sw, order, self.w, self.g2, self.lr, self.l2))
        self.n_updates += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy(), "g2": self.g2.copy(), "bits": self.bits, "n_updates": self.n_updates,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["bits"]) != self.bits:
            raise ValueError(f"checkpoint has bits={state['bits']}, this predictor bits={self.bits}")
        self.w = np.array(state["w"], dtype=np.float64)
        self.g2 = np.array(state["g2"], dtype=np.float64)
        self.n_updates = int(state["n_updates"])
        self.rng.bit_generator.state = state["rng"]
