"""Checkpoints: atomic, pruned, every RNG restored, corrupt ones reported and skipped."""

import random
import warnings

import numpy as np
import pytest
import torch

from trace_gym.trainers.checkpoint import CheckpointManager, CorruptCheckpointWarning, capture_rng, restore_rng


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
    target = mgr.path(2) / ("manifest.json" if damage == "manifest" else "trainer.pt")
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))
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


def test_no_checkpoint_gives_none(tmp_path):
    assert CheckpointManager(tmp_path / "nothing").load_latest() is None
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)
