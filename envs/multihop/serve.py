"""``trace-gym serve-retriever``: serve a passage index (a JSONL file, or a MultiHopQA world) over the Search-R1 retrieval API."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any
import sys
import time

from trace_gym.envs.retrieval import BM25Index, RetrievalServer


def configure_serve_retriever(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``trace-gym serve-retriever``."""
    parser.add_argument("--passages", metavar="FILE.jsonl", help="serve this JSONL corpus instead of a generated world")
    parser.add_argument("--world-seed", type=int, default=0, help="seed of the MultiHopQA world to serve (default 0)")
    parser.add_argument("--world-size", type=int, default=None, help="passages in the world (default: the env's default)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--topk", type=int, default=3, help="passages per query when a request gives no topk")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.set_defaults(func=serve_retriever)


def serve_retriever(args: argparse.Namespace) -> int:
    """Build the index, print the URL (one line, flushed) and serve until interrupted."""
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
        server = RetrievalServer((args.host, args.port), index, topk=args.topk, verbose=args.verbose)
    except (OSError, ValueError) as exc:
        print(f"serve-retriever: {exc}", file=sys.stderr)
        return 1
    print(f"serving {len(index)} passages ({what}) on {server.url}/retrieve "
          f"(index built in {time.perf_counter() - started:.1f} s)", flush=True)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
