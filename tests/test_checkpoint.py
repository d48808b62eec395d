"""dflash_lab.records.checkpoint: atomic files, keep-last pruning, fallbacks, RNG round trip, the preemption hook."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch

from dflash_lab.records import checkpoint as ckpt


def test_save_prunes_and_points_at_the_newest(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path / "checkpoints", keep=2)
    for step in (10, 20, 30):
        manager.save({"step": step, "model": {"w": torch.full((2,), float(step))}}, step=step)
    names = sorted(p.name for p in manager.directory.iterdir())
    assert names == ["last.json", "step_20.pt", "step_30.pt"]
    assert manager.pointer() == {"file": "step_30.pt", "step": 30}
    latest = manager.load_latest()
    assert latest["step"] == 30 and torch.equal(latest["model"]["w"], torch.full((2,), 30.0))
    assert latest["format_version"] == ckpt.CHECKPOINT_FORMAT_VERSION
    assert not list(manager.directory.glob("*.tmp"))
    # independent files: no hard link between the pointer's target and anything else
    assert os.stat(manager.directory / "step_30.pt").st_nlink == 1


def test_empty_directory_has_no_checkpoint(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path / "none")
    assert manager.latest_path() is None and manager.load_latest() is None


def test_truncated_newest_falls_back_to_the_previous_and_says_so(tmp_path, caplog):
    manager = ckpt.CheckpointManager(tmp_path, keep=2)
    manager.save({"step": 1}, step=1)
    manager.save({"step": 2}, step=2)
    newest = tmp_path / "step_2.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with caplog.at_level("INFO", logger="dflash_lab"):
        assert manager.load_latest()["step"] == 1
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "step_1.pt" in message and "step_2.pt" in message


def test_kill_between_save_and_pointer_update_resumes_the_newer_file(tmp_path, caplog):
    manager = ckpt.CheckpointManager(tmp_path, keep=3)
    manager.save({"step": 1}, step=1)
    pointer = manager.pointer_path.read_bytes()
    manager.save({"step": 2}, step=2)
    manager.pointer_path.write_bytes(pointer)  # the pointer still names step_1.pt
    with caplog.at_level("INFO", logger="dflash_lab"):
        assert manager.load_latest()["step"] == 2
    assert "names step_1.pt" in caplog.text


def test_stale_tmp_files_are_removed(tmp_path):
    (tmp_path / "step_5.pt.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "last.json.tmp").write_text("{")
    ckpt.CheckpointManager(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))


def test_nothing_intact_says_how_to_restart(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path)
    (tmp_path / "step_3.pt").write_bytes(b"junk")
    with pytest.raises(ckpt.NoIntactCheckpoint, match=r"step_3\.pt.*fresh run directory"):
        manager.load_latest()


def test_resume_config_changes_take_effect_or_are_refused():
    old = {"seed": 0, "trainer": {"lr": 1e-3, "progress": True, "max_steps": 5}, "sampler": {"name": "bucketed"}}
    assert ckpt.check_resume_config(old, old) == []
    new = {**old, "trainer": {"lr": 2e-3, "progress": False, "max_steps": 9}}
    assert ckpt.check_resume_config(old, new) == ["trainer.lr", "trainer.max_steps"]
    with pytest.raises(ValueError, match=r"sampler\.name \('bucketed' -> 'packed'\).*fresh run directory"):
        ckpt.check_resume_config(old, {**old, "sampler": {"name": "packed"}})


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_checkpoints"):
        ckpt.CheckpointManager(tmp_path, keep=0)


def test_rng_round_trip():
    generator = torch.Generator().manual_seed(7)
    state = ckpt.capture_rng_state(generator)
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item())
    random.random(), np.random.rand(), torch.rand(3), torch.rand(3, generator=generator)  # move every stream on
    ckpt.restore_rng_state(state, generator)
    again = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item())
    assert again == expected


def test_request_flag_and_signal_handler():
    ckpt.clear_checkpoint_request()
    assert not ckpt.checkpoint_requested()
    installed = ckpt.install_preemption_handler(["SIGUSR2"])
    try:
        assert installed == ["SIGUSR2"]
        os.kill(os.getpid(), signal.SIGUSR2)
        assert ckpt.checkpoint_requested() and ckpt.request_reason() == "SIGUSR2"
    finally:
        ckpt.uninstall_preemption_handler()
        ckpt.clear_checkpoint_request()
    assert signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None) or callable(signal.getsignal(signal.SIGUSR2))


def test_previous_handler_is_chained():
    calls = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        ckpt.install_preemption_handler(["SIGUSR2"])
        os.kill(os.getpid(), signal.SIGUSR2)
        assert ckpt.checkpoint_requested() and not calls  # ours only sets the flag...
        ckpt.run_previous_handler()  # ...the trainer calls the replaced one after its checkpoint
        assert calls == [signal.SIGUSR2]
    finally:
        ckpt.uninstall_preemption_handler()
        ckpt.clear_checkpoint_request()
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_bad_signal_name():
    with pytest.raises(ValueError, match="preempt_signals"):
        ckpt.install_preemption_handler(["SIGNOPE"])


def test_preempted_exit_code():
    exc = ckpt.Preempted(5, None)
    assert isinstance(exc, SystemExit) and exc.code == ckpt.PREEMPTED_EXIT_CODE == 75


def test_a_checkpoint_of_another_format_version_is_refused_naming_both(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path, keep=2)
    path = manager.save({"step": 3}, step=3)
    assert manager.load_latest()["format_version"] == ckpt.CHECKPOINT_FORMAT_VERSION
    state = torch.load(path, weights_only=False)
    state["format_version"] = ckpt.CHECKPOINT_FORMAT_VERSION + 7
    torch.save(state, path)
    with pytest.raises(ValueError, match=rf"format_version {ckpt.CHECKPOINT_FORMAT_VERSION + 7}; this version of "
                                         rf"dflash_lab reads format {ckpt.CHECKPOINT_FORMAT_VERSION}"):
        manager.load_latest()
