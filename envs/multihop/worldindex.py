"""The generated world and its bm25s index, built once per ``(seed, size)`` per process."""

from __future__ import annotations

from functools import lru_cache

from trace_gym.envs.multihop.world import World, generate_world
from trace_gym.envs.retrieval import BM25Index, Passage


@lru_cache(maxsize=4)
def world(seed: int, size: int) -> World:
    """The world of ``(seed, size)`` (cached)."""
    return generate_world(seed, size)


@lru_cache(maxsize=4)
def world_index(seed: int, size: int) -> BM25Index:
    """A bm25s index over the passages of ``world(seed, size)`` (cached); passage ``i`` of the
    index is entity ``i`` of the world."""
    w = world(seed, size)
    return BM25Index(Passage(p["id"], p["title"], p["text"]) for p in w.passages())
