"""The retrieval server under the load of many env workers (issue 12, item 7).

The old stdlib server dropped 19-35 of 2,000 requests sent 64 at a time (connections reset).
Here the real ``trace-gym serve-retriever`` (a subprocess, on loopback) gets 2,000 Search-R1
requests, 64 in flight, from one httpx client with no retries, so any dropped connection is
an error; every answer is checked, and p50/p99 are printed.
"""

from __future__ import annotations

import os
import selectors
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from trace_gym.envs.multihop.world import DEFAULT_WORLD_SIZE
from trace_gym.envs.multihop.worldindex import world_index

REQUESTS = 2000
CONCURRENCY = 64


def _start_server() -> tuple[subprocess.Popen, str]:
    """``trace-gym serve-retriever`` over the default MultiHopQA world on a free loopback port."""
    exe = Path(sys.executable).with_name("trace-gym")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "trace_gym.cli"]
    proc = subprocess.Popen([*cmd, "serve-retriever", "--host", "127.0.0.1", "--port", "0", "--world-seed", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=120):
        proc.kill()
        raise AssertionError("serve-retriever printed nothing within 120 s")
    line = proc.stdout.readline()
    assert " on http://127.0.0.1:" in line, line + proc.stderr.read()
    return proc, line.split(" on ", 1)[1].split("/retrieve")[0]


@pytest.mark.timeout(240)
def test_server_holds_2000_requests_at_64_concurrent_without_errors(capsys):
    index = world_index(0, DEFAULT_WORLD_SIZE)  # what the server serves (cached; built once per process)
    titles = [p.title for p in index.passages]
    words = ["born", "founded", "director", "capital", "spouse", "located"]
    queries = [f"{titles[(i * 7919) % len(titles)]} {words[i % len(words)]}" for i in range(REQUESTS)]
    proc, url = _start_server()
    latencies: list[float] = []
    errors: list[str] = []
    answers: dict[int, list[str]] = {}
    lock = threading.Lock()
    # one client for all threads, as a rollout process has; no retries: a dropped connection is an error
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    client = httpx.Client(timeout=30.0, limits=limits, trust_env=False)

    def one(i: int) -> None:
        start = time.perf_counter()
        try:
            r = client.post(url + "/retrieve", json={"queries": [queries[i]], "topk": 3, "return_scores": True})
            ids = [hit["document"]["id"] for hit in r.json()["result"][0]] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")
            return
        elapsed = time.perf_counter() - start
        with lock:
            if ids is None:
                errors.append(f"HTTP {r.status_code}: {r.text[:100]}")
            else:
                latencies.append(elapsed)
                answers[i] = ids

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, range(REQUESTS)))
        wall = time.perf_counter() - start
    finally:
        client.close()
        proc.terminate()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    cuts = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [float("nan")] * 99
    with capsys.disabled():
        print(f"\nretrieval load: {REQUESTS} requests, {CONCURRENCY} concurrent: {REQUESTS / wall:.0f} requests/s, "
              f"p50 {cuts[49] * 1e3:.0f} ms, p99 {cuts[98] * 1e3:.0f} ms, {len(errors)} errors", flush=True)
    assert not errors, f"{len(errors)} of {REQUESTS} requests failed, e.g. {errors[:3]}"
    # the answers are the searches' own: check a spread of them against the local index
    for i in range(0, REQUESTS, 40):
        assert answers[i] == [p.id for p, _ in index.search(queries[i], 3)], queries[i]
