"""The memory model against the first GPU run (one H200, benchmarks/data/h200-2026-12-04/): every recorded step's
batch rebuilt from the file's setup line, its peak re-predicted by today's model (benchmarks/gpu_repredict.py)."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "h200-2026-12-04"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_repredict  # noqa: E402
from dflash_lab.model import footprint  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    out = {}
    for name in ("seed", "plan"):
        lines = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        out[name] = gpu_repredict.repredict(lines)
    return out


def test_every_recorded_batch_is_rebuilt_exactly(rows):
    """Documents, real and padded tokens and block tokens of each rebuilt batch equal the recorded ones."""
    for name, found in rows.items():
        assert found and not [r["error"] for r in found if "error" in r], name


def test_clean_steps_are_predicted_within_bounds_with_and_without_checkpointing(rows):
    clean = [r for found in rows.values() for r in found if r["clean"]]
    plain = [r["ratio"] for r in clean if not r["activation_checkpointing"]]
    ckpt = [r["ratio"] for r in clean if r["activation_checkpointing"]]
    assert len(plain) == 12 and len(ckpt) == 7   # the seed regime's timed steps; the plan regime's and one more
    assert all(0.97 <= r <= 1.10 for r in plain), plain
    assert all(0.97 <= r <= 1.15 for r in ckpt), ckpt
    for name, found in rows.items():
        assert gpu_repredict.summary(found)["ok"], name


def test_steps_that_ran_out_of_memory_are_predicted_not_to_fit(rows):
    ooms = [r for r in rows["seed"] if r["oom"]]
    assert len(ooms) == 6
    for r in ooms:
        assert r["pred_peak_gb"] > r["peak_gb"]                     # above what it held when it failed
        assert r["pred_peak_gb"] > 0.9 * r["mem_cap_gb"]            # no plan against the 96 GiB cap would run it
        assert r["pred_reserved_gb"] > r["mem_cap_gb"]              # peak + fragments: the allocator's cap breaks
    assert gpu_repredict.summary(rows["seed"])["oom_predicted_above_cap"] == 6


OOM_LINE = re.compile(r"this process has ([\d.]+) GiB memory in use.*?([\d.]+) GiB is allocated by PyTorch, and "
                      r"([\d.]+) GiB is reserved by PyTorch but unallocated")


def test_fragmentation_margin_and_cuda_context_are_the_recorded_out_of_memory_lines():
    """The margin the memory plan reserves is the largest fragments / activations ratio of the six recorded
    failures (activations: what was allocated less the weights and optimizer state); the CUDA context is what the
    process held beyond PyTorch's reservation."""
    lines = [json.loads(line) for line in (DATA / "seed.jsonl").read_text().splitlines() if line.strip()]
    setup = next(line for line in lines if line.get("check") == "gpu_check_setup")
    run = gpu_repredict.RecordedRun.from_setup(setup, "qwen3_8b")
    one = footprint.batch_shapes([np.arange(1)], np.array([2]), packed=True, model=run.step_model)
    static = float(footprint.step_memory(run.step_model, one, run.settings)["static"][0]) / footprint.GIB
    failures = [tuple(map(float, OOM_LINE.search(line["oom"]).groups()))
                for line in lines if line.get("check") == "gpu_check_step" and line.get("oom")]
    assert len(failures) == 6
    ratios = [fragments / (allocated - static) for _, allocated, fragments in failures]
    assert max(ratios) <= footprint.FRAGMENTATION_FRACTION < max(ratios) + 0.001, ratios
    contexts = [in_use - allocated - fragments for in_use, allocated, fragments in failures]
    assert all(abs(c - footprint.CUDA_CONTEXT_GIB) <= 0.011 for c in contexts), contexts


def test_a_step_is_repredicted_with_its_own_checkpointing():
    """The seed regime checkpoints only the steps that do not fit its cap, and says so on each step line: a step
    that ran checkpointed is predicted checkpointed, whatever its memory plan (no checkpointing in that regime)."""
    lines = [json.loads(line) for line in (DATA / "seed.jsonl").read_text().splitlines() if line.strip()]
    setup = next(line for line in lines if line["check"] == "gpu_check_setup")
    step = next(line for line in lines if line["check"] == "gpu_check_step" and line["phase"] == "timed"
                and not line["oom"] and not line.get("activation_checkpointing"))
    plain, checkpointed = (gpu_repredict.repredict([setup, {**step, "activation_checkpointing": flag}])[0]
                           for flag in (False, True))
    assert (plain["activation_checkpointing"], checkpointed["activation_checkpointing"]) == (False, True)
    assert checkpointed["pred_peak_gb"] < 0.9 * plain["pred_peak_gb"]
