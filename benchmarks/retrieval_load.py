"""Load on the retrieval server: N Search-R1 requests, C at a time (issue 12, item 7).

Starts ``trace-gym serve-retriever`` on a free loopback port over the MultiHopQA world
(``--world-seed``, ``--world-size``), or uses a running server (``--url``), and sends
``--requests`` ``POST /retrieve`` requests of one query each (``{"queries": [q], "topk": 3,
"return_scores": true}``, q a passage title of the world plus a word, so the answers are real
BM25 searches), ``--concurrency`` in flight at a time:

* ``--client httpx`` (default): one ``httpx.Client`` shared by ``--concurrency`` threads, no
  retries, so every dropped connection counts as an error (as in tests/test_retrieval_load.py);
* ``--client httpx-async``: one ``httpx.AsyncClient`` running ``--concurrency`` tasks, no
  retries (it spends 3-4x the CPU of the threaded client per request on this machine, so it
  measures the client as much as the server);
* ``--client retrieval``: the envs' :class:`RetrievalClient` (retries with backoff) with
  ``--concurrency`` workers.

An error is anything but a 200 whose ``result`` has one list per query.

    python benchmarks/retrieval_load.py [--requests 2000] [--concurrency 64] [--client httpx|httpx-async|retrieval] [--url URL]

Figures for 2,000 requests at 64, on this 2-core machine while other jobs kept its load
average at 7-13 (so they move from run to run by tens of percent), the old and the new server
run alternately (the old one from git history, pointed at with ``--url``):

=============  ==========================================  ===================================
client         stdlib ThreadingHTTPServer (before)         uvicorn + Starlette (now)
=============  ==========================================  ===================================
httpx          223-293 req/s, p99 0.6-1.3 s, 0-55 errors   176-208 req/s, p99 0.6-1.2 s, 0 errors
httpx-async    85-159 req/s, p99 1.8-2.6 s, 17-37 errors   46-105 req/s, p99 3.4-7.2 s, 0 errors
retrieval      213-342 req/s, p99 0.3-0.8 s, 0 errors      197-243 req/s, p99 0.8 s, 0 errors
=============  ==========================================  ===================================

The new server spends less CPU per request (1.7-1.9 ms against 2.4 ms, threaded client), but
on a loaded machine the scheduler shares CPU per thread, and the old server's 64 handler
threads out-draw its event loop and search threads (which waited ~5x longer to run than they
ran); its gain is that nothing is dropped. The issue's figure for the old server: 213
requests/s, p99 1.4 s, 19-35 errors.

Last line: ``requests=N concurrency=C client=K requests_per_s=X p50_ms=Y p99_ms=Z errors=E``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import selectors
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def _queries(world_seed: int, world_size: int | None, n: int) -> list[str]:
    from trace_gym.envs.multihop.world import DEFAULT_WORLD_SIZE
    from trace_gym.envs.multihop.worldindex import world

    titles = [p["title"] for p in world(world_seed, world_size or DEFAULT_WORLD_SIZE).passages()]
    words = ["born", "founded", "director", "capital", "spouse", "located"]
    return [f"{titles[(i * 7919) % len(titles)]} {words[i % len(words)]}" for i in range(n)]


def _start_server(world_seed: int, world_size: int | None) -> tuple[subprocess.Popen, str]:
    exe = Path(sys.executable).with_name("trace-gym")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "trace_gym.cli"]
    cmd += ["serve-retriever", "--host", "127.0.0.1", "--port", "0", "--world-seed", str(world_seed)]
    if world_size:
        cmd += ["--world-size", str(world_size)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=120):
        proc.kill()
        raise RuntimeError("serve-retriever printed nothing within 120 s")
    line = proc.stdout.readline()
    if " on " not in line:
        proc.kill()
        raise RuntimeError(f"serve-retriever did not start: {line!r}")
    return proc, line.split(" on ", 1)[1].split("/retrieve")[0]


def _ok(response: httpx.Response) -> bool:
    if response.status_code != 200:
        return False
    result = response.json().get("result")
    return isinstance(result, list) and len(result) == 1 and isinstance(result[0], list)


def _run_httpx_threads(url: str, queries: list[str], concurrency: int) -> tuple[list[float], collections.Counter]:
    latencies: list[float] = []
    errors: collections.Counter = collections.Counter()
    lock = threading.Lock()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(timeout=30.0, limits=limits, trust_env=False) as client:
        def one(q: str) -> None:
            start = time.perf_counter()
            try:
                r = client.post(url + "/retrieve", json={"queries": [q], "topk": 3, "return_scores": True})
                ok = _ok(r)
            except httpx.HTTPError as exc:
                with lock:
                    errors[type(exc).__name__] += 1
                return
            with lock:
                if ok:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors[f"HTTP {r.status_code}"] += 1

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, queries))
    return latencies, errors


async def _run_httpx_async(url: str, queries: list[str], concurrency: int) -> tuple[list[float], collections.Counter]:
    latencies: list[float] = []
    errors: collections.Counter = collections.Counter()
    todo = iter(queries)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30.0, limits=limits, trust_env=False) as client:
        async def worker() -> None:
            for q in todo:
                start = time.perf_counter()
                try:
                    r = await client.post(url + "/retrieve", json={"queries": [q], "topk": 3, "return_scores": True})
                    if not _ok(r):
                        errors[f"HTTP {r.status_code}"] += 1
                        continue
                except httpx.HTTPError as exc:
                    errors[type(exc).__name__] += 1
                    continue
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, errors


def _run_retrieval_client(url: str, queries: list[str], concurrency: int) -> tuple[list[float], collections.Counter]:
    from trace_gym.envs.retrieval import RetrievalClient, RetrievalError

    latencies: list[float] = []
    errors: collections.Counter = collections.Counter()
    lock = threading.Lock()
    with RetrievalClient(url, timeout=30.0, max_workers=concurrency) as client:
        def one(q: str) -> None:
            start = time.perf_counter()
            try:
                client.search(q, 3)
            except RetrievalError as exc:
                with lock:
                    errors[str(exc)[:80]] += 1
                return
            with lock:
                latencies.append(time.perf_counter() - start)

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, queries))
    return latencies, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests to send (default 2000)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at a time (default 64)")
    parser.add_argument("--client", choices=["httpx", "httpx-async", "retrieval"], default="httpx",
                        help="one httpx.Client on threads or one httpx.AsyncClient, without retries; or the envs' RetrievalClient")
    parser.add_argument("--url", help="a running retrieval server (default: start trace-gym serve-retriever)")
    parser.add_argument("--world-seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=None)
    args = parser.parse_args()

    queries = _queries(args.world_seed, args.world_size, args.requests)
    proc, url = (None, args.url.rstrip("/").removesuffix("/retrieve")) if args.url else _start_server(args.world_seed, args.world_size)
    try:
        httpx.post(url + "/retrieve", json={"queries": queries[:8], "topk": 3}, timeout=30.0, trust_env=False)  # warm-up
        start = time.perf_counter()
        if args.client == "httpx":
            latencies, errors = _run_httpx_threads(url, queries, args.concurrency)
        elif args.client == "httpx-async":
            latencies, errors = asyncio.run(_run_httpx_async(url, queries, args.concurrency))
        else:
            latencies, errors = _run_retrieval_client(url, queries, args.concurrency)
        elapsed = time.perf_counter() - start
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    n_errors = sum(errors.values())
    for kind, count in errors.most_common():
        print(f"error {count}x {kind}")
    cuts = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    print(f"requests={args.requests} concurrency={args.concurrency} client={args.client} "
          f"requests_per_s={args.requests / elapsed:.0f} p50_ms={cuts[49] * 1e3:.1f} p99_ms={cuts[98] * 1e3:.1f} "
          f"errors={n_errors}", flush=True)


if __name__ == "__main__":
    main()
