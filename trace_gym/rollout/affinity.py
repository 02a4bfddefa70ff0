"""``PrefixAffinity``: which generation engine holds a prompt's prefix in its KV cache.

A router over several engines (:class:`~trace_gym.rollout.router.EngineRouter`) records, for
every prompt it sends, the engine that got it. A later prompt that extends a recorded one
(the next turn of a trajectory, a branch from a prefix, another rollout of the same opening
prompt) is looked up by its *longest recorded prefix*, and the engine that served that prefix
is where its KV is cached.

Prefixes are keyed by ``(length, hash)``, with one linear hash of all prefixes of a prompt
computed in a single vectorised pass (random 64-bit weights per position, sums wrapping
modulo 2**64), so a lookup costs one pass over the prompt plus one dict probe per recorded
length. Recorded prompts are grouped under the opening prompt they start with (its *root*),
so a lookup probes only the lengths recorded under its own root. The table is bounded:
the least recently used roots are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

__all__ = ["PrefixAffinity", "prefix_hashes"]

_WEIGHTS = np.zeros(0, dtype=np.uint64)


def _weights(n: int) -> np.ndarray:
    """Fixed random odd 64-bit weights for positions 0..n-1 (grown on demand; the same in every process)."""
    global _WEIGHTS
    if _WEIGHTS.size < n:
        size = max(n, 2 * _WEIGHTS.size, 4096)
        rng = np.random.default_rng(0x7A1CE)
        _WEIGHTS = rng.integers(0, 2**63, size=size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return _WEIGHTS[:n]


def prefix_hashes(ids: Sequence[int]) -> np.ndarray:
    """``h[k]`` = hash of ``ids[:k + 1]`` for every k (uint64)."""
    a = np.asarray(ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return np.cumsum(a * _weights(a.size), dtype=np.uint64)


class PrefixAffinity:
    """Prompt prefix -> engine index, by longest recorded prefix (see the module docstring).

    Args:
        max_roots: opening prompts remembered (least recently used forgotten first).
    """

    def __init__(self, max_roots: int = 65536):
        self.max_roots = int(max_roots)
        self._roots: OrderedDict[tuple[int, int], dict[tuple[int, int], int]] = OrderedDict()  # root key -> {prefix key: engine}
        self._root_lengths: dict[int, int] = {}  # length of an opening prompt -> how many roots have it

    def __len__(self) -> int:
        return len(self._roots)

    def clear(self) -> None:
        """Forget every recorded prefix (every engine's cache was dropped)."""
        self._roots.clear()
        self._root_lengths.clear()

    def forget(self, engine: int) -> None:
        """Drop every prefix recorded for ``engine`` (it lost its cache); opening prompts stay known."""
        for table in self._roots.values():
            for key in [k for k, e in table.items() if e == engine]:
                del table[key]

    def add_root(self, ids: Sequence[int], engine: int | None = None) -> bool:
        """Record an opening prompt (every later prompt of its task starts with it); True when
        it was not known yet, and then ``engine``, when given, is recorded as its server."""
        h = prefix_hashes(ids)
        key = (len(ids), int(h[-1])) if len(ids) else (0, 0)
        table = self._roots.get(key)
        new = table is None
        if table is None:
            table = self._roots[key] = {}
            self._root_lengths[key[0]] = self._root_lengths.get(key[0], 0) + 1
            while len(self._roots) > self.max_roots:
                (n, _), _ = self._roots.popitem(last=False)
                self._root_lengths[n] -= 1
                if not self._root_lengths[n]:
                    del self._root_lengths[n]
        else:
            self._roots.move_to_end(key)
        if engine is not None and new:
            table[key] = int(engine)
        return new

    def _root(self, h: np.ndarray) -> dict[tuple[int, int], int] | None:
        n = h.size
        for length in sorted((m for m in self._root_lengths if 0 < m <= n), reverse=True):
            table = self._roots.get((length, int(h[length - 1])))
            if table is not None:
                return table
        return None

    def lookup(self, ids: Sequence[int]) -> int | None:
        """The engine of the longest recorded prefix of ``ids``; None when none is recorded."""
        h = prefix_hashes(ids)
        table = self._root(h)
        if not table:
            return None
        n = h.size
        best, engine = -1, None
        for (length, value), e in table.items():
            if best < length <= n and int(h[length - 1]) == value:
                best, engine = length, e
        return engine

    def record(self, ids: Sequence[int], engine: int) -> bool:
        """Record that ``engine`` served prompt ``ids``; False when it starts with no known
        opening prompt (nothing is recorded then)."""
        h = prefix_hashes(ids)
        table = self._root(h)
        if table is None:
            return False
        table[(len(ids), int(h[-1]))] = int(engine)
        return True
