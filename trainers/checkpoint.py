"""Checkpoints that survive being killed at any instant, and every RNG a run depends on.

A checkpoint is a directory ``step-00000012/`` under the run's checkpoint folder holding
one ``torch.save`` file per top-level entry of the state (``model.pt``, ``optimizer.pt``,
``trainer.pt`` ...) and a ``manifest.json`` with each file's size and SHA-256, written
last. It is written into a temporary sibling directory, every file and the directory are
fsync'ed, and only then is it renamed into place (an atomic rename on POSIX), so a run
killed mid-write leaves the previous checkpoints intact and at worst a ``.tmp-*`` folder
that the next save removes; a write that fails (a full disk) removes its partial files at
once and raises a :class:`CheckpointWriteError` saying how much space is free. On load, a
checkpoint whose manifest is missing or whose files do not match it is reported (a
:class:`CorruptCheckpointWarning`) and the previous one is used; when none of them reads
back, :meth:`CheckpointManager.load_latest` refuses with a :class:`CheckpointError` naming
every one (a run must not silently start over next to them).
Pruning after a save keeps that checkpoint and the ``keep_last - 1`` newest older ones; it
never touches checkpoints of later steps (left by a run that was resumed from an earlier
one, e.g. because they are corrupt: a resumed run overwrites them as it reaches their steps),
so the newest good checkpoint is never the one removed.

Checkpoints are pickles written by this process: load only checkpoints you trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint could not be read and an older one was used instead."""


class CheckpointError(ValueError):
    """Checkpoints exist but none of them can be read; the message names each and why."""


def capture_rng() -> dict[str, Any]:
    """The state of every global RNG a training step touches: Python's ``random``,
    numpy's legacy global generator, torch's CPU generator and, where present, CUDA's."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount); its partial files were
    removed and the earlier checkpoints are intact. The message says how much was written and
    how much space is free."""


class CheckpointManager:
    """Saves and loads a run's checkpoints in ``directory`` (see the module docstring).

    ``save(step, state)`` takes a dict of picklable entries (tensors, state dicts, numpy
    arrays, plain Python); ``load_latest()`` returns ``(step, state)`` of the newest readable
    checkpoint, or None when there is none.
    """

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = int(keep_last)

    def steps(self) -> list[int]:
        """Steps of the complete (renamed-into-place) checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [int(m.group(1)) for p in self.directory.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
        return sorted(found)

    def path(self, step: int) -> Path:
        """The directory of the checkpoint of ``step``."""
        return self.directory / f"step-{step:08d}"

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step`` atomically; prune old ones."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".tmp-*"):  # left by a run killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        final = self.path(step)
        for name in state:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"checkpoint entry name {name!r} must be a plain file name")
        tmp = self.directory / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            self._write(tmp, step, state)
        except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as RuntimeError
            written = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self.directory).free
            raise CheckpointWriteError(
                f"could not write the checkpoint of step {step} to {self.directory} ({exc}); "
                f"{written / 2**20:.0f} MiB were written before it failed and {free / 2**20:.0f} MiB are free there now. "
                f"The partial checkpoint was removed and the earlier ones {self.steps()} are intact: "
                f"if the disk is full, free some space (or set checkpoint.keep_last lower) and resume the run"
            ) from exc
        if final.exists():  # re-saving a step (a resumed run repeating it): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        older = [s for s in self.steps() if s < step]
        for old in older[: max(0, len(older) - (self.keep_last - 1))]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    @staticmethod
    def _write(tmp: Path, step: int, state: dict[str, Any]) -> None:
        files: dict[str, dict[str, Any]] = {}
        for name, value in state.items():
            fpath = tmp / f"{name}.pt"
            with open(fpath, "wb") as f:
                torch.save(value, f)
                f.flush()
                os.fsync(f.fileno())
            files[name] = {"file": fpath.name, "bytes": fpath.stat().st_size, "sha256": _sha256(fpath)}
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"step": int(step), "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)

    def load(self, step: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """Read the checkpoint of ``step``; raises ``ValueError`` naming the problem when it
        is incomplete or does not match its manifest."""
        path = self.path(step)
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{manifest_path}: unreadable manifest ({exc})") from exc
        state: dict[str, Any] = {}
        for name, entry in manifest["files"].items():
            fpath = path / entry["file"]
            if not fpath.is_file():
                raise ValueError(f"{fpath}: missing")
            if fpath.stat().st_size != entry["bytes"] or _sha256(fpath) != entry["sha256"]:
                raise ValueError(f"{fpath}: contents do not match the manifest (corrupt)")
            with open(fpath, "rb") as f:
                state[name] = torch.load(f, map_location=map_location, weights_only=False)
        return state

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[int, dict[str, Any]] | None:
        """``(step, state)`` of the newest checkpoint that reads back intact; each newer
        corrupt one is reported with a :class:`CorruptCheckpointWarning`. None if there is no
        checkpoint; a :class:`CheckpointError` naming each one when none reads back."""
        problems: list[tuple[int, str]] = []
        for step in reversed(self.steps()):
            try:
                state = self.load(step, map_location)
            except Exception as exc:  # any failure to read it back means: fall back
                problems.append((step, f"{self.path(step)}: {exc}"))
                continue
            for bad, why in problems:
                warnings.warn(f"checkpoint of step {bad} is corrupt, using an older one: {why}", CorruptCheckpointWarning, stacklevel=2)
            return step, state
        if problems:
            listing = "\n  ".join(why for _, why in problems)
            raise CheckpointError(f"none of the {len(problems)} checkpoints in {self.directory} can be read:\n  {listing}\n"
                                  f"move them away to start the run again, or restore a good copy")
        return None
