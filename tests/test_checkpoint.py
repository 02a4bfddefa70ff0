"""Checkpoints: atomic, pruned (never the newest good one), every RNG restored, corrupt ones
reported and skipped, and all of them unreadable refused by name."""

import random
import resource
import signal
import warnings

import numpy as np
import pytest
import torch

from trace_gym.trainers.checkpoint import (CheckpointError, CheckpointManager, CheckpointWriteError, CorruptCheckpointWarning, capture_rng,
                                          restore_rng)


def _state(step: int) -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": {"step": step, "cursor": 10 * step, "rng": capture_rng(),
                                                                                     "predictor": {"w": np.arange(4.0) * step}}}


def test_round_trip_and_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    saved = {s: _state(s) for s in range(1, 5)}
    for s, st in saved.items():
        mgr.save(s, st)
    assert mgr.steps() == [3, 4]
    step, state = mgr.load_latest()
    assert step == 4 and state["trainer"]["cursor"] == 40
    np.testing.assert_array_equal(state["trainer"]["predictor"]["w"], np.arange(4.0) * 4)
    for k, v in saved[4]["model"].items():
        torch.testing.assert_close(state["model"][k], v)
    assert state["optimizer"]["state"][0]["exp_avg"].shape == (2, 3)


def test_rng_states_round_trip():
    state = capture_rng()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_corrupt_latest_is_reported_and_previous_used(tmp_path, damage):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    _damage(mgr.path(2), damage)
    with pytest.warns(CorruptCheckpointWarning, match="step 2"):
        step, state = mgr.load_latest()
    assert step == 1 and state["trainer"]["cursor"] == 10
    # Saving step 2 again (the resumed run repeating it) replaces the corrupt copy.
    mgr.save(2, _state(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.load_latest()[0] == 2


def test_interrupted_save_leaves_previous_checkpoint_usable(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, _state(1))
    # What a SIGKILL during save leaves behind: a half-written temporary directory.
    tmp = tmp_path / ".tmp-step-00000002-999"
    tmp.mkdir()
    (tmp / "model.pt").write_bytes(b"\x00" * 10)
    assert mgr.steps() == [1] and mgr.load_latest()[0] == 1
    mgr.save(2, _state(2))
    assert not tmp.exists() and mgr.steps() == [1, 2]


def test_a_write_that_fails_removes_its_partial_files_and_says_so(tmp_path):
    # A real failing write, as on a full disk: the process may not write files past 64 KiB
    # (RLIMIT_FSIZE; the kernel then fails the write with EFBIG instead of killing us).
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, _state(1))
    big = {"model": {"w": torch.zeros(256, 1024)}, "trainer": {"step": 2}}  # 1 MiB
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(CheckpointWriteError) as info:
            mgr.save(2, big)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    msg = str(info.value)
    assert "checkpoint of step 2" in msg and "MiB are free there now" in msg and "[1] are intact" in msg
    assert isinstance(info.value, OSError)
    assert not list(tmp_path.glob(".tmp-*")), "the partial checkpoint must not be left to fill the disk further"
    assert mgr.steps() == [1] and mgr.load_latest()[1]["trainer"]["cursor"] == 10
    mgr.save(2, big)  # with room again, the same save goes through
    assert mgr.steps() == [1, 2]


def test_no_checkpoint_gives_none(tmp_path):
    assert CheckpointManager(tmp_path / "nothing").load_latest() is None
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)


def _damage(path, how: str) -> None:
    target = path / ("manifest.json" if how == "manifest" else "trainer.pt")
    data = bytearray(target.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))


def test_every_checkpoint_unreadable_is_refused_naming_each(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for s in (1, 2, 3):
        mgr.save(s, _state(s))
    _damage(mgr.path(1), "truncate")
    _damage(mgr.path(2), "flip")
    _damage(mgr.path(3), "manifest")
    with pytest.raises(CheckpointError) as info:
        mgr.load_latest()
    msg = str(info.value)
    assert "none of the 3 checkpoints" in msg
    for s in (1, 2, 3):
        assert str(mgr.path(s)) in msg
    assert "unreadable manifest" in msg and "corrupt" in msg
    assert mgr.steps() == [1, 2, 3]  # refusing removes nothing


def test_pruning_never_removes_the_newest_good_checkpoint(tmp_path):
    # Corrupt checkpoints of later steps (a run resumed from before them): the checkpoints the
    # resumed run writes sort older than them, and must survive pruning all the same.
    for s in (1, 7, 8):
        CheckpointManager(tmp_path, keep_last=3).save(s, _state(s))
    mgr = CheckpointManager(tmp_path, keep_last=2)
    _damage(mgr.path(7), "flip")
    _damage(mgr.path(8), "truncate")
    with pytest.warns(CorruptCheckpointWarning):
        assert mgr.load_latest()[0] == 1
    mgr.save(2, _state(2))
    assert mgr.steps() == [1, 2, 7, 8]
    mgr.save(3, _state(3))
    assert mgr.steps() == [2, 3, 7, 8]  # keep_last among the older ones; the later ones are left alone
    with pytest.warns(CorruptCheckpointWarning) as caught:
        step, state = mgr.load_latest()
    assert sorted(str(w.message).split(" is corrupt")[0] for w in caught) == ["checkpoint of step 7", "checkpoint of step 8"]
    assert step == 3 and state["trainer"]["cursor"] == 30
    # the resumed run reaches step 7: its checkpoint replaces the corrupt one
    mgr.save(7, _state(7))
    assert mgr.steps() == [3, 7, 8]
    with pytest.warns(CorruptCheckpointWarning, match="step 8"):
        assert mgr.load_latest()[0] == 7
