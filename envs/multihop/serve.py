"""``trace-gym serve-retriever``: serve a passage index (a JSONL file, or a MultiHopQA world) over the Search-R1 retrieval API."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import Any

from trace_gym.envs.retrieval import BM25Index, RetrievalServer


def configure_serve_retriever(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym serve-retriever``."""
    parser.add_argument("--passages", metavar="FILE.jsonl", help="serve this JSONL corpus instead of a generated world")
    parser.add_argument("--world-seed", type=int, default=0, help="seed of the MultiHopQA world to serve (default 0)")
    parser.add_argument("--world-size", type=int, default=None, help="passages in the world (default: the env's default)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--topk", type=int, default=3, help="passages per query when a request gives no topk")
    parser.add_argument("--search-threads", type=int, default=None,
                        help="threads that run the (batched) searches (default: the CPU count, at most 4)")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.set_defaults(func=serve_retriever)


def serve_retriever(args: argparse.Namespace) -> int:
    """Build the index, bind, print the URL (one line on stdout, flushed: ``serving N passages
    (WHAT) on URL/retrieve (...)``) and serve with uvicorn until SIGINT or SIGTERM, which stop
    it gracefully with exit status 0. An unreadable corpus or a port in use prints the reason
    on stderr and returns 1."""
    started = time.perf_counter()
    try:
        if args.passages:
            index = BM25Index.from_jsonl(args.passages)
            what = f"{args.passages}"
        else:
            from trace_gym.envs.multihop.world import DEFAULT_WORLD_SIZE
            from trace_gym.envs.multihop.worldindex import world_index

            size = args.world_size or DEFAULT_WORLD_SIZE
            index = world_index(args.world_seed, size)
            what = f"MultiHopQA world seed={args.world_seed} size={size}"
        server = RetrievalServer((args.host, args.port), index, topk=args.topk, search_threads=args.search_threads,
                                 verbose=args.verbose)
    except (OSError, ValueError) as exc:
        print(f"serve-retriever: {exc}", file=sys.stderr)
        return 1
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    def stop(signum: int, frame: Any) -> None:
        server.request_shutdown()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        print(f"serving {len(index)} passages ({what}) on {server.url}/retrieve "
              f"(index built in {time.perf_counter() - started:.1f} s)", flush=True)
        server.serve_forever(poll_interval=0.2)
    finally:
        server.shutdown()
        server.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
