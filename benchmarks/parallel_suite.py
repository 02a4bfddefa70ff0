"""Run a leaderboard suite's rows as parallel processes on one machine (a GPU machine with
many cores), then merge them into one leaderboard.

    python benchmarks/parallel_suite.py smollm2-m128 --out results/m128 --jobs 8
    python benchmarks/parallel_suite.py smollm2-m128 --out results/m128 --deadline 540

``trace-gym leaderboard run`` runs a suite's rows one after another in one process. A small
model on a large GPU leaves the device mostly idle in one process (generation is bound by
Python and kernel-launch latency), so this script gives every (track, allocator) pair of the
suite its own ``trace-gym leaderboard run`` process on a one-track, one-allocator copy of the
suite (``OUT/parts/NN.yaml``, results in ``OUT/parts/NN/``, log in ``OUT/parts/NN.log``),
``--jobs`` at a time, each with ``--threads`` torch threads. Each track's SFT warm start is
built first, once, in this process (the trainer caches it; the rows find it cached).
Then ``trace-gym leaderboard merge`` writes ``OUT/records.jsonl`` and the leaderboard.

The records are the ones a sequential ``trace-gym leaderboard run SUITE`` writes (same rows,
same budgets, same seeds); only wall-clock times differ, since the rows share the device.
At ``--deadline`` seconds the rows still running are stopped (their records are lost, the
finished ones are merged) and the script says which.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml


def split_suite(spec, parts_dir: Path) -> list[tuple[str, Path]]:
    """Write one suite file per (track, allocator) of the suite ``spec``: ``[(label, path)]``."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for track in spec.tracks:
        data = track.model_dump(mode="json", exclude_unset=True)
        data["seeds"] = spec.track_seeds(track)
        for alloc in track.allocators:
            part = dict(data, allocators=[alloc.model_dump(mode="json", exclude_unset=True)])
            path = parts_dir / f"{len(out):02d}.yaml"
            path.write_text(yaml.safe_dump({"suite": spec.suite, "description": spec.description,
                                            "seeds": spec.seeds, "tracks": [part]}, sort_keys=False))
            out.append((f"{track.name}/{alloc.key}", path))
    return out


def build_warm_starts(spec) -> None:
    """Build (or find cached) every SFT warm start of the suite ``spec``'s tracks, once each."""
    from trace_gym.leaderboard.runner import preflight
    from trace_gym.trainers.leaderboard import warm_start

    preflight(spec, servers=False)
    done: set[str] = set()
    for track in spec.tracks:
        if track.policy.warm_start is None:
            continue
        t0 = time.perf_counter()
        path = warm_start(track, [e.id for e in track.envs], {})
        if path not in done:
            print(f"warm start of track {track.name}: {path} ({time.perf_counter() - t0:.1f} s)", flush=True)
        done.add(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", help="a preset suite name or a YAML file")
    ap.add_argument("--out", required=True, help="results folder (parts/ and the merged records.jsonl)")
    ap.add_argument("--tracks", default=None, metavar="A,B", help="only these tracks")
    ap.add_argument("--jobs", type=int, default=8, help="rows at a time (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per row process (default: %(default)s)")
    ap.add_argument("--deadline", type=float, default=None, help="stop the rows still running after this many seconds")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = Path(args.out)
    from trace_gym.leaderboard.spec import load_suite

    spec = load_suite(args.suite).select([t for t in args.tracks.split(",") if t] if args.tracks else None)
    parts = split_suite(spec, out / "parts")
    print(f"{len(parts)} rows of suite {args.suite}, {args.jobs} at a time", flush=True)
    build_warm_starts(spec)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-P", "-m", "trace_gym.cli"]  # -P: a checkout in the working directory never shadows the install
    waiting, running, finished = list(parts), {}, []
    while waiting or running:
        while waiting and len(running) < args.jobs:
            label, path = waiting.pop(0)
            log = open(path.with_suffix(".log"), "w")
            proc = subprocess.Popen(cmd + ["leaderboard", "run", str(path), "--out", str(path.with_suffix("")), "--no-progress"],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
            running[proc] = (label, path, time.perf_counter(), log)
            print(f"[{time.perf_counter() - t0:6.0f} s] started {label}", flush=True)
        time.sleep(2)
        for proc in [p for p in running if p.poll() is not None]:
            label, path, start, log = running.pop(proc)
            log.close()
            finished.append((label, proc.returncode))
            print(f"[{time.perf_counter() - t0:6.0f} s] {label}: exit {proc.returncode} after "
                  f"{time.perf_counter() - start:.0f} s (log {path.with_suffix('.log')})", flush=True)
        if args.deadline is not None and time.perf_counter() - t0 > args.deadline:
            for proc, (label, path, start, log) in running.items():
                proc.terminate()
                print(f"[{time.perf_counter() - t0:6.0f} s] deadline: stopped {label} after {time.perf_counter() - start:.0f} s",
                      flush=True)
            for proc, (_, _, _, log) in running.items():
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                log.close()
            for label, _ in waiting:
                print(f"deadline: not started {label}", flush=True)
            running, waiting = {}, []
    done = [str(p.with_suffix("")) for _, p in parts if (p.with_suffix("") / "records.jsonl").is_file()]
    ok = sum(1 for _, rc in finished if rc == 0)
    print(f"{ok} of {len(parts)} rows finished in {time.perf_counter() - t0:.0f} s", flush=True)
    if not done:
        return 1
    merged = subprocess.run(cmd + ["leaderboard", "merge", *done, "--out", str(out), "--title",
                                   f"trace-gym leaderboard: {args.suite} (rows run in parallel)"], env=env)
    return merged.returncode if ok == len(parts) else 1


if __name__ == "__main__":
    sys.exit(main())
