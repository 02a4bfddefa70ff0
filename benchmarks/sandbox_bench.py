"""Start-up cost of one sandboxed Python call, per isolation level this machine has (issue 15).

For each available level (``bubblewrap``, ``namespaces``, ``audit-hook``) it times
``PythonSandbox.run`` on a program that prints one number (the cost of starting the sandbox
and the interpreter), and on one that imports numpy with ``allow_packages=("numpy",)``.
Each figure is the median of ``--calls`` runs after one warm-up run.

    python benchmarks/sandbox_bench.py [--calls N]

One line per level: ``level=L plain_s=X numpy_s=Y``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import trace_gym.envs.sandbox as sandbox_module
from trace_gym.envs.sandbox import PythonSandbox


def _median_s(sb: PythonSandbox, code: str, calls: int) -> float:
    first = sb.run(code)
    if not first.ok:
        raise RuntimeError(f"the benchmark program failed under {sb.isolation}: {first.output}")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sb.run(code)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="timed calls per figure")
    args = parser.parse_args()
    levels = ["audit-hook"]
    if sandbox_module._namespaces_work():
        levels.insert(0, "namespaces")
    if sandbox_module.isolation_level() == "bubblewrap":
        levels.insert(0, "bubblewrap")
    real = sandbox_module.isolation_level
    try:
        for level in levels:
            sandbox_module.isolation_level = lambda level=level: level
            plain = _median_s(PythonSandbox(timeout_s=10), "print(1)", args.calls)
            numpy = _median_s(PythonSandbox(timeout_s=10, allow_packages=("numpy",)), "import numpy\nprint(1)", args.calls)
            print(f"level={level} plain_s={plain:.3f} numpy_s={numpy:.3f}", flush=True)
    finally:
        sandbox_module.isolation_level = real


if __name__ == "__main__":
    main()
