"""Provenance: what decides a result besides its config, recorded beside it.

A figure from this library holds for the code, the package versions and the CPU it was
measured with: math libraries choose their kernels and blockings by CPU, and a long float
computation (an SFT warm start) can come out differently on another CPU or with other
versions. Leaderboard records, SFT warm starts (``sft_summary.json``) and the training
benchmark all record these, from this one module.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

# Environment variables that override the kernels torch, MKL and oneDNN would pick for the CPU
# (an ISA cap or MKL's reproducibility branch); a run under any of them rounds as another CPU would.
KERNEL_ENV_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE",
                   "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")

_VERSION_PACKAGES = ("trace-gym", "numpy", "numba", "gymnasium", "pydantic", "torch", "transformers", "tokenizers", "vllm")


def package_versions() -> dict[str, str]:
    """Python and the versions of the packages that decide a result (installed ones only)."""
    out = {"python": platform.python_version()}
    for name in _VERSION_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def cpu_info() -> dict[str, str]:
    """The host CPU as far as it decides float results: its model name (key ``cpu``), family /
    model / stepping (``cpu_id``, from ``/proc/cpuinfo`` where there is one, else absent), the
    vector ISA torch dispatches to (``torch_cpu_capability``, where torch is installed) and
    ``kernel_env``: those of :data:`KERNEL_ENV_VARS` that are set, as ``NAME=value`` joined by
    spaces (absent when none is, so a record of the kernels the CPU picks for itself is unchanged)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if not sep:
                    if fields:
                        break  # the first processor's block is enough
                    continue
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    out = {"cpu": fields.get("model name") or platform.processor() or platform.machine()}
    if "cpu family" in fields:
        out["cpu_id"] = f"family {fields['cpu family']} model {fields.get('model', '?')} stepping {fields.get('stepping', '?')}"
    try:
        import torch

        out["torch_cpu_capability"] = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # torch absent or too old: the rest still identifies the host
        pass
    forced = [f"{name}={os.environ[name]}" for name in KERNEL_ENV_VARS if os.environ.get(name)]
    if forced:
        out["kernel_env"] = " ".join(forced)
    return out


def git_commit() -> str:
    """The commit of the trace-gym checkout (``+dirty`` with local changes), else ``unknown``."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict[str, Any]:
    """Everything above at once, keyed as a leaderboard record's fields: ``versions``,
    ``git_commit``, ``host`` (the host name) and ``cpu``."""
    return {"versions": package_versions(), "git_commit": git_commit(), "host": socket.gethostname(), "cpu": cpu_info()}


__all__ = ["cpu_info", "git_commit", "package_versions", "provenance"]
