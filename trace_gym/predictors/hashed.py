"""``hashed``: one shared online logistic model of V(H) over hashed n-gram features.

A single model serves every prompt and every prefix (PAPER.md sec. 3, "shared predictor").
The features of a history H (prompt + turns so far), each hashed into ``2**bits`` weights:

* the prompt's word unigrams and bigrams, and a bias;
* the prefix depth, the turns remaining (``max_turns - depth`` where ``max_turns`` is
  known) and their pair;
* the words of every earlier turn (bag of words, each turn counted once per word);
* the unigrams and bigrams of the *last* turn (action and observation), alone and crossed
  with the turns remaining.

Words are lower-cased runs of ``[a-z0-9_]``. With ``shapes=True`` every other non-space
character (an operator, a bracket, a currency sign) is a word too, and a number (a run of
digits) stands as its shape ``#<digits>`` in the word sequence, its literal value added as a
unigram: so "What is 1188 ÷ 18?" gives the unigrams ``what is #4 ÷ #2 ? 1188 18`` and the
bigrams ``what is``, ``is #4``, ``#4 ÷``, ``÷ #2``, ``#2 ?``, which carry over to prompts
whose numbers the predictor has never seen. Feature lists are cached per prompt and per
turn text. Training is weighted logistic regression on (H, V_hat) pairs with AdaGrad,
``epochs`` shuffled passes per :meth:`~HashedPredictor.update` (online: each call continues
from the current weights); sample weights are normalised to mean 1 within a call.
Prediction and training run in numba over a CSR matrix of feature ids.

Empirical-Bayes root counts (``counts=True``; off by default)
------------------------------------------------------------

The predictor keeps, per prompt (``History.task_id``), the outcome counts of its roots. An
update holding a root history of backed-up value ``V_hat`` adds ``S += K V_hat`` successes
out of ``N += K``, where ``K`` is the number of independent draws behind it: the root's
depth-1 children in the same update (one per rollout that started at the root), or, when
the update holds none, the root's weight (the caller's leaf count). ``count_decay`` < 1
multiplies every prompt's counts by that factor per update. The root prediction is the
posterior mean of the hierarchical (beta-binomial) model

    p_i ~ Beta(s m_i, s (1 - m_i)),    outcomes of prompt i ~ Bernoulli(p_i),
    E[p_i | counts] = (s m_i + S_i) / (s + N_i),

whose prior mean ``m_i`` is the shared logistic model's prediction for the prompt. The prior
strength ``s`` (pseudo-outcomes) is ``prior_strength`` when given; otherwise it is learned:
every update first scores the incoming root counts under the posterior predictive of each
``s`` on the log grid ``STRENGTH_GRID`` (the beta-binomial log-likelihood of each prompt's
new outcomes together, computed *before* the counts and the model are updated, i.e.
prequentially), and the grid point with the largest accumulated log-likelihood is used
(``s = 2`` until a root outcome has been seen). Inner nodes get the shared model's
prediction unchanged.

:meth:`HashedPredictor.predict_beta` exposes the whole predictive distribution: the mean
and the concentration ``s + N_i`` of the root's Beta posterior (``inf`` for inner nodes:
a point estimate). TRACE's stage 1 uses it (:mod:`trace_gym.allocators.trace`).

Why the features, the counts and their prior are chosen this way, and the caveats: the
README's "Design notes".
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any, Sequence

import numba as nb
import numpy as np

from trace_gym.forest.forest import History
from trace_gym.predictors.base import Predictor
from trace_gym.predictors import register

_WORD = re.compile(r"[a-z0-9_]+")
_TOKEN = re.compile(r"[a-z0-9_]+|[^\sa-z0-9_]")  # with shapes: words, and every other non-space character


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


@nb.njit(cache=True, nogil=True)
def _beta_binomial_loglik_kernel(grid, m, s0, n0, succ, fail, out):
    """out[g] += sum_i log B(a + succ_i, b + fail_i) - log B(a, b) with a = grid[g] m_i + s0_i,
    b = grid[g] (1 - m_i) + (n0_i - s0_i): the log-likelihood of the new counts under each
    prior strength (the binomial coefficient does not depend on it and is left out)."""
    for g in range(grid.shape[0]):
        total = 0.0
        for i in range(m.shape[0]):
            a = grid[g] * m[i] + s0[i]
            b = grid[g] * (1.0 - m[i]) + (n0[i] - s0[i])
            c, d = succ[i], fail[i]
            total += (math.lgamma(a + c) + math.lgamma(b + d) - math.lgamma(a + b + c + d)
                      - math.lgamma(a) - math.lgamma(b) + math.lgamma(a + b))
        out[g] += total


# prior strengths s the root counts' likelihood chooses from (pseudo-outcomes)
STRENGTH_GRID = np.geomspace(1.0 / 16.0, 1024.0, 29)
_UNSEEN_STRENGTH = 2.0


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
        counts: combine each prompt's own root outcomes with the shared model's prediction
            (empirical Bayes, see the module docstring); False (the default) gives the plain
            shared model. The counts assume a fixed policy: they sharpen the prediction of a
            frozen policy's prompts, but in training their outcomes go stale as the policy
            improves, and every measured training run learned faster without them (the
            README's "Design notes").
        prior_strength: fixes the prior strength ``s`` of the root counts (None: learned
            by the counts' prequential likelihood).
        count_decay: factor in (0, 1] applied to every prompt's counts per update (1: keep
            all; below 1 forgets old outcomes of a changing policy).
        shapes: symbols as words and numbers by their digit count (see the module
            docstring); False (the default) reads words of ``[a-z0-9_]`` only.
    """

    name = "hashed"

    def __init__(self, bits: int = 18, lr: float = 0.1, l2: float = 1e-6, epochs: int = 2, seed: int = 0,
                 max_cache: int = 200_000, counts: bool = False, prior_strength: float | None = None,
                 count_decay: float = 1.0, shapes: bool = False):
        if not 8 <= bits <= 26:
            raise ValueError(f"bits must be in [8, 26], got {bits}")
        if lr <= 0 or l2 < 0 or epochs < 1:
            raise ValueError("need lr > 0, l2 >= 0 and epochs >= 1")
        if prior_strength is not None and not prior_strength > 0:
            raise ValueError(f"prior_strength must be positive (or None: learned), got {prior_strength}")
        if not 0.0 < count_decay <= 1.0:
            raise ValueError(f"count_decay must be in (0, 1], got {count_decay}")
        self.counts = bool(counts)
        self.shapes = bool(shapes)
        self.prior_strength = None if prior_strength is None else float(prior_strength)
        self.count_decay = float(count_decay)
        # per prompt: [successes, outcomes, update index of the last change] (decay is lazy)
        self.root_counts: dict[str, list[float]] = {}
        self.strength_loglik = np.zeros(STRENGTH_GRID.size)
        self.n_root_updates = 0
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

    def _words(self, text: str) -> tuple[list[str], list[str]]:
        """``(sequence, extra unigrams)`` of ``text``: its words in order (bigrams are read
        from these), and with ``shapes`` the literal numbers the sequence shows as shapes."""
        if not self.shapes:
            return _WORD.findall(text.lower()), []
        tokens = _TOKEN.findall(text.lower())
        return [f"#{len(t)}" if t.isdigit() else t for t in tokens], [t for t in tokens if t.isdigit()]

    def _prompt_ids(self, prompt: str) -> np.ndarray:
        ids = self._prompt.get(prompt)
        if ids is None:
            words, extra = self._words(prompt)
            ids = self._ids(["bias"] + ["p:" + x for x in words + extra] + [f"p2:{a} {b}" for a, b in zip(words, words[1:])])
            self._prompt[prompt] = ids
        return ids

    def _step_ids(self, text: str) -> np.ndarray:
        ids = self._step.get(text)
        if ids is None:
            words, extra = self._words(text)
            ids = self._ids(["s:" + x for x in sorted(set(words + extra))])
            self._step[text] = ids
        return ids

    def _last_ids(self, text: str, left: int) -> np.ndarray:
        key = (text, left)
        ids = self._last.get(key)
        if ids is None:
            words, extra = self._words(text)
            uni = sorted(set(words + extra))
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

    def predict_shared(self, histories: Sequence[History]) -> np.ndarray:
        """The shared logistic model's prediction alone (no per-prompt counts)."""
        indptr, idx = self.features(histories)
        out = np.empty(len(histories))
        _predict_kernel(indptr, idx, self.w, out)
        return out

    def strength(self) -> float:
        """The prior strength ``s`` in use: fixed, learned, or 2 before any root outcome."""
        if self.prior_strength is not None:
            return self.prior_strength
        if self.n_root_updates == 0:
            return _UNSEEN_STRENGTH
        return float(STRENGTH_GRID[int(np.argmax(self.strength_loglik))])

    def _counts_of(self, histories: Sequence[History]) -> tuple[np.ndarray, np.ndarray]:
        """Decayed (successes, outcomes) of each history's prompt."""
        succ, total = np.zeros(len(histories)), np.zeros(len(histories))
        now, decay = self.n_updates, self.count_decay
        for k, h in enumerate(histories):
            c = self.root_counts.get(h.task_id)
            if c is not None:
                f = decay ** (now - c[2]) if decay < 1.0 else 1.0
                succ[k], total[k] = f * c[0], f * c[1]
        return succ, total

    def predict_beta(self, histories: Sequence[History]) -> tuple[np.ndarray, np.ndarray]:
        """The predictive distribution of each history's success probability as a Beta:
        ``(mean, concentration)``. Roots (with ``counts``): the posterior of the module
        docstring, concentration ``s + N_i``. Inner nodes, and roots without ``counts``:
        the shared model's prediction with concentration ``inf`` (a point estimate)."""
        m = self.predict_shared(histories)
        conc = np.full(m.size, np.inf)
        if not self.counts:
            return m, conc
        roots = np.fromiter((len(h.steps) == 0 for h in histories), dtype=bool, count=len(histories))
        if roots.any():
            rh = [h for h, r in zip(histories, roots) if r]
            s = self.strength()
            succ, total = self._counts_of(rh)
            prior = np.clip(m[roots], 1e-6, 1.0 - 1e-6)
            m[roots] = (s * prior + succ) / (s + total)
            conc[roots] = s + total
        return m, conc

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        """Predicted V(H): the posterior mean of :meth:`predict_beta`."""
        return self.predict_beta(histories)[0]

    def _observe_roots(self, histories: Sequence[History], y: np.ndarray, sw: np.ndarray) -> None:
        """Score the incoming root counts under every prior strength (before anything is
        updated), then add them to the per-prompt counts (see the module docstring: mean
        ``V_hat`` of the root, evidence = the root's depth-1 children in the batch, else
        its weight). Several roots of one prompt in a batch pool their counts."""
        first: dict[str, int] = {}
        rh: list[History] = []
        mean_num: list[float] = []
        mean_den: list[float] = []
        children: dict[str, int] = {}
        for h, t, w in zip(histories, y.tolist(), sw.tolist()):
            depth = len(h.steps)
            if depth == 1:
                children[h.task_id] = children.get(h.task_id, 0) + 1
            if depth != 0:
                continue
            k = first.get(h.task_id)
            if k is None:
                first[h.task_id] = k = len(rh)
                rh.append(h)
                mean_num.append(0.0)
                mean_den.append(0.0)
            mean_num[k] += w * t
            mean_den[k] += w
        if not rh:
            return
        value = np.array(mean_num) / np.array(mean_den)
        evidence = np.array([float(children.get(h.task_id, 0)) or d for h, d in zip(rh, mean_den)])
        succ, fail = evidence * value, evidence * (1.0 - value)
        s0, n0 = self._counts_of(rh)
        m = np.clip(self.predict_shared(rh), 1e-6, 1.0 - 1e-6)
        _beta_binomial_loglik_kernel(STRENGTH_GRID, m, s0, n0, succ, fail, self.strength_loglik)
        now, decay = self.n_updates + 1, self.count_decay  # the index this update will have
        for h, a, b, c0, t0 in zip(rh, succ.tolist(), fail.tolist(), s0.tolist(), n0.tolist()):
            self.root_counts[h.task_id] = [decay * c0 + a, decay * t0 + a + b, now]
        self.n_root_updates += 1

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
        if self.counts:
            self._observe_roots(histories, y, sw)  # with the caller's weights: n = leaves
        sw = sw / sw.mean()
        indptr, idx = self.features(histories)
        loss = float("nan")
        for _ in range(self.epochs):
            order = self.rng.permutation(y.size)
            loss = float(_adagrad_kernel(indptr, idx, y, sw, order, self.w, self.g2, self.lr, self.l2))
        self.n_updates += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy(), "g2": self.g2.copy(), "bits": self.bits, "shapes": self.shapes, "n_updates": self.n_updates,
                "rng": self.rng.bit_generator.state,
                "root_counts": {k: list(v) for k, v in self.root_counts.items()},
                "strength_loglik": self.strength_loglik.copy(), "n_root_updates": self.n_root_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["bits"]) != self.bits:
            raise ValueError(f"checkpoint has bits={state['bits']}, this predictor bits={self.bits}")
        if bool(state.get("shapes", False)) != self.shapes:  # its weights belong to other features
            raise ValueError(f"checkpoint has shapes={bool(state.get('shapes', False))}, this predictor shapes={self.shapes}")
        self.w = np.array(state["w"], dtype=np.float64)
        self.g2 = np.array(state["g2"], dtype=np.float64)
        self.n_updates = int(state["n_updates"])
        self.rng.bit_generator.state = state["rng"]
        # checkpoints written before the root counts existed load with none
        self.root_counts = {k: [float(x) for x in v] for k, v in state.get("root_counts", {}).items()}
        self.strength_loglik = np.array(state.get("strength_loglik", np.zeros(STRENGTH_GRID.size)), dtype=np.float64)
        self.n_root_updates = int(state.get("n_root_updates", 0))
