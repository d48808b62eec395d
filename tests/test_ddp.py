"""DDP correctness of the real training loop: 2 gloo ranks (torchrun) against 1 rank with the same global batches.

Each run executes ``dflash_lab.train.train(cfg)`` unchanged, under a small harness (this file run as a script:
``torchrun --nproc_per_node=2 tests/test_ddp.py OUT overrides...``) that observes it without altering it:

* it records the ``sample_index`` of every batch the training DataLoader collates on that rank (a subclass of
  the real ``Collator`` that calls it and keeps the indices, put in place of ``Collator`` in dflash_lab.training.components),
* it keeps a handle on the model ``build_model`` returns (the real function, wrapped the same way),
* after ``train`` returns, each rank saves its batches, trained draft parameters and summary to
  ``OUT/harness_rank<r>.pt``; the tests compare the files.

Checks: ranks see disjoint batches and the same number of steps; draft parameters are identical on every rank
after training; and a 2-rank run's loss curve matches a 1-rank run fed the same global batches. A plan depends on
the world size (a step groups W cost-neighbour batches), so the 1-rank reference walks the 2-rank *global* plan
(its policy is built for world_size=2 and yields every rank's batches in order) with ``grad_accum=2``: step s then
trains on global batches 2s and 2s+1 in both layouts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration   # trains, compiles or starts processes: scripts/test.sh

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
# Small and fast: a handful of steps on the tiny model, no probes/tau, one thread per rank.
TINY = [
    f"trainer.max_steps={STEPS}",
    "trainer.progress=false",
    "trainer.measure_tau=false",
    "trainer.num_threads=1",
    "trainer.ckpt_every=0",
    "probes.every=0",
    "probes.presentations=false",
    "sampler.max_tokens=1024",
    "seed=3",
]


# ------------------------------------------------------------------------------------------ the harness


def _harness_main(out_dir: str, overrides: list[str]) -> None:
    """Run train(cfg) on this rank, observing batches and parameters (see the module docstring)."""
    import torch
    from hydra import compose, initialize_config_module

    import dflash_lab.data as data_module
    import dflash_lab.model as model_module
    import dflash_lab.training.components as components_module
    import dflash_lab.train as train_module

    out = Path(out_dir)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    seen: list[list[int]] = []
    captured = {}

    class RecordingCollator(data_module.Collator):
        def __call__(self, samples):
            batch = super().__call__(samples)
            seen.append([int(i) for i in batch["sample_index"].tolist()])
            return batch

    real_build_model = model_module.build_model

    def build_and_keep(*args, **kwargs):
        model, tokenizer = real_build_model(*args, **kwargs)
        captured["model"] = model
        return model, tokenizer

    # Reference run on one rank: consume the global plan of a `plan_world_size`-rank run in order, so with
    # grad_accum = plan_world_size each optimizer step trains on exactly the batches the ranks trained on together.
    # (A policy's plan depends on the world size: steps group W cost-neighbour batches.)
    plan_world_size = int(os.environ.get("DDP_HARNESS_PLAN_WORLD_SIZE", "0"))
    if plan_world_size:
        from dflash_lab.sampling import policy_from_config as real_policy_from_config

        def all_ranks_policy(sampler_cfg, lengths, seed, world_size, rank, block_tokens=None):
            assert world_size == 1, "the reference run is a single process"
            policy = real_policy_from_config(sampler_cfg, lengths, seed=seed, world_size=plan_world_size, rank=0,
                                             block_tokens=block_tokens)
            base = type(policy)
            policy.__class__ = type(f"AllRanks{base.__name__}", (base,), {
                "batches": lambda self, epoch: self.global_plan(epoch).batches,
                "__len__": lambda self: len(self.global_plan(self.epoch).batches),
            })
            return policy

        components_module.policy_from_config = all_ranks_policy

    # Replace the names wherever train() may look them up (its module globals, or the packages at call time).
    for module in (components_module, data_module):
        module.Collator = RecordingCollator
    for module in (components_module, model_module):
        module.build_model = build_and_keep

    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"run_dir={out / 'run'}"])
    summary = train_module.train(cfg)

    params = torch.cat([p.detach().reshape(-1).double() for p in captured["model"].trainable_parameters()])
    # One file per rank; the test compares them (no second process group needed).
    torch.save(
        {"rank": rank, "world_size": world, "batches": seen, "params": params, "summary": summary},
        out / f"harness_rank{rank}.pt",
    )


# ------------------------------------------------------------------------------------------ the tests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(out: Path, overrides: list[str], nproc: int, timeout: int = 300, plan_world_size: int = 0) -> dict:
    """Run the harness on `nproc` ranks; return the per-rank records and rank 0's metrics rows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "DDP_HARNESS_"))}
    env["OMP_NUM_THREADS"] = "1"
    if plan_world_size:
        env["DDP_HARNESS_PLAN_WORLD_SIZE"] = str(plan_world_size)
    script = [str(Path(__file__).resolve()), str(out), *overrides]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *script]
    # Own session, so a hung run can be killed with all of its rank processes.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"harness timed out after {timeout}s: {stderr[-3000:]}") from None
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    import torch

    ranks = [torch.load(out / f"harness_rank{r}.pt", weights_only=False) for r in range(nproc)]
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"ranks": ranks, "metrics": metrics, "summary": json.loads((out / "run" / "summary.json").read_text()),
            "run_dir": out / "run"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ddp2"), TINY, nproc=2)


@pytest.fixture(scope="module")
def one_rank_same_global_batches(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ddp1"), [*TINY, "trainer.grad_accum=2"], nproc=1, plan_world_size=2)


def test_ranks_see_disjoint_batches_and_the_same_number_of_steps(two_ranks):
    assert two_ranks["summary"]["world_size"] == 2 and two_ranks["summary"]["steps"] == STEPS
    assert [r["summary"]["steps"] for r in two_ranks["ranks"]] == [STEPS, STEPS]
    for rank in (0, 1):   # every rank logs to its own text log; rank 0 alone writes the run files
        assert (two_ranks["run_dir"] / f"train_rank{rank}.log").is_file()
    rank0, rank1 = (r["batches"] for r in two_ranks["ranks"])
    assert len(rank0) == len(rank1) == STEPS  # grad_accum=1: one batch per rank per step
    for step, (b0, b1) in enumerate(zip(rank0, rank1), start=1):
        assert b0 and b1, f"step {step}: an empty batch"
        assert not set(b0) & set(b1), f"step {step}: ranks share samples {set(b0) & set(b1)}"
    # within the first epoch no sample is trained twice, on either rank
    everything = [i for batch in rank0 + rank1 for i in batch]
    assert len(everything) == len(set(everything))
    # the logged batch is the union of both ranks' batches (metrics count all ranks)
    for row, b0, b1 in zip(two_ranks["metrics"], rank0, rank1):
        assert row["batch_size"] == len(b0) + len(b1)


def test_parameters_identical_across_ranks_after_training(two_ranks):
    p0, p1 = (r["params"] for r in two_ranks["ranks"])
    assert p0.numel() > 0 and p0.shape == p1.shape
    assert torch_equal(p0, p1), f"max |diff| {float((p0 - p1).abs().max())}"


def test_two_rank_loss_curve_matches_one_rank_with_the_same_global_batches(two_ranks, one_rank_same_global_batches):
    one = one_rank_same_global_batches
    assert one["summary"]["world_size"] == 1 and one["summary"]["steps"] == STEPS
    single = one["ranks"][0]["batches"]
    rank0, rank1 = (r["batches"] for r in two_ranks["ranks"])
    assert len(single) == 2 * STEPS
    for step in range(STEPS):  # the same samples enter each optimizer step
        assert sorted(single[2 * step] + single[2 * step + 1]) == sorted(rank0[step] + rank1[step]), step
    two_rows, one_rows = two_ranks["metrics"], one["metrics"]
    assert [r["step"] for r in two_rows] == [r["step"] for r in one_rows] == list(range(1, STEPS + 1))
    for a, b in zip(two_rows, one_rows):
        assert a["real_tokens"] == b["real_tokens"] and a["padded_tokens"] == b["padded_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3, abs=1e-6), a["step"]
    # and the trained weights agree too
    p1, p2 = one["ranks"][0]["params"], two_ranks["ranks"][0]["params"]
    assert float((p1 - p2).abs().max()) <= 1e-4 * max(1.0, float(p1.abs().max()))


def test_each_ranks_exit_line_states_only_what_that_rank_knows(two_ranks):
    """Rank 0 ends its log with the loss; rank 1, which keeps no metric history, names rank 0 instead of a NaN."""
    def exit_line(rank: int) -> str:
        lines = (two_ranks["run_dir"] / f"train_rank{rank}.log").read_text().splitlines()
        return [line for line in lines if "] finished: " in line][-1]

    assert f"finished: step {STEPS}/" in exit_line(0) and ", loss " in exit_line(0)
    rank_1 = exit_line(1)
    assert "nan" not in rank_1.lower() and "on rank 1 of 2" in rank_1 and "rank 0's log line" in rank_1


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


if __name__ == "__main__":
    _harness_main(sys.argv[1], sys.argv[2:])
