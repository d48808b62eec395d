"""Two-rank CPU DDP training (gloo) through train(): rank files, equal steps, identical weights, global metrics."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration   # trains, compiles or starts processes: scripts/test.sh

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, run_dir: str, results):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from test_train_e2e import compose_cfg  # same small configuration as the single-process tests

    import dflash_lab.components as components_module
    import dflash_lab.train as train_module

    built = {}
    original_build = components_module.build_model

    def build_and_keep(**kwargs):
        built["model"], tokenizer = original_build(**kwargs)
        return built["model"], tokenizer

    components_module.build_model = build_and_keep
    summary = train_module.train(compose_cfg(Path(run_dir), "trainer.max_steps=4", "trainer.measure_tau=false",
                                             "trainer.ckpt_every=0", "probes.every=2"))
    captured = {"state": {k: v.clone() for k, v in built["model"].draft_state_dict().items()}}
    results[rank] = (summary, captured["state"])


def test_two_rank_gloo_training(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    run_dir = tmp_path / "ddp"
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, _free_port(), str(run_dir), results), nprocs=2, join=True)

    summary0, weights0 = results[0]
    summary1, weights1 = results[1]
    assert summary0["status"] == "finished" and summary0["world_size"] == 2 and summary0["steps"] == 4
    assert summary1["steps"] == 4
    for name in weights0:  # DDP kept the replicas identical
        assert torch.equal(weights0[name], weights1[name]), name
    assert (run_dir / "train_rank0.log").is_file() and (run_dir / "train_rank1.log").is_file()
    assert (run_dir / "run.lock").read_text() == ""   # rank 0 alone held the run directory, released at the end
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # metrics are global: a step's documents are both ranks' batches (each rank's batch alone holds fewer)
    import pyarrow.parquet as pq

    table = pq.read_table(run_dir / "presentations.parquet").to_pandas()
    per_step = table.groupby("step").size()
    assert all(per_step[s] <= r["batch_size"] for s, r in zip(range(1, 5), rows))
    assert table["sample_index"].nunique() == len(table)  # ranks see disjoint samples within an epoch
