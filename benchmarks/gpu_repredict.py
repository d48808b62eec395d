"""Re-predict a recorded GPU check: the memory model of today's code against the peaks a GPU measured.

    python benchmarks/gpu_check.py --repredict benchmarks/data/h200-2026-12-04/seed.jsonl
    python benchmarks/gpu_repredict.py [FILE.jsonl ...]     # default: the first H200 run's seed and plan files

For every ``gpu_check_step`` line of the file, the batch that step ran is rebuilt from the file's
``gpu_check_setup`` line, as the check built it: the seed workload's lengths (``num_samples``, the shape's length
scale), each policy's sampler config composed by Hydra with the recorded overrides and token budget, the recorded
memory plan (block budget, checkpointing; a ``ckpt`` step ran with checkpointing on), the policy's epoch-0 plan,
and the step's ``index`` in it. The rebuilt batch must have the recorded documents, real and padded tokens and
block tokens (else the plan code changed since the run, and the line says so instead of predicting another batch).
The memory model (``dflash_lab.model.footprint.step_memory``) then predicts its peak with the recorded precision,
attention path, LM head and compiled pieces (``compile_layers: auto`` compiles them on CUDA: the same rule the draft
uses, ``dflash_lab.model.draft.compiles_layers``).

Output: one JSON line per step, ``{"check": "repredict", "policy", "phase", "step", "peak_gb", "pred_peak_gb",
"ratio", "pred_reserved_gb", "oom", "mem_cap_gb", "activation_checkpointing", "clean"}`` (``ratio`` = predicted /
measured allocated peak; ``pred_reserved_gb``: the peak + the allocator's fragmentation margin; ``clean``:
a timed or checkpointing step that did not run out of memory; warm-up steps are not clean: the first one runs
before AdamW's moments exist), then ``{"check": "repredict_summary", ...}``: the clean steps' ratio range with and
without checkpointing, and whether every out-of-memory step is predicted above its memory cap.

Bounds (``BOUNDS``): a clean step within [0.97, 1.10] of its measured peak, [0.97, 1.15] with checkpointing (the
model keeps the larger of two moments where autograd's order can leave less alive; it must never under-predict by
more than 3%: a plan sized by it would run out of memory). A step that ran out of memory must be predicted above
what it had allocated when it failed, above the usable share of its cap (``USABLE_FRACTION``, what the memory
plan fits the peak against), and its reserved memory above the cap itself: the cap limits the memory the CUDA
allocator reserves, fragments included, so a step whose allocated peak stays just under the cap can still fail
(the H200 run: bucketed step 3 failed with 94.06 GiB allocated and 1.89 GiB reserved in fragments, asking for
512 MiB more under a 96 GiB cap; its predicted peak is 95.5 GiB, its reserved memory with the fragmentation
margin, ``footprint.FRAGMENTATION_FRACTION`` of the activations, 105.5). ``oom_peak_predicted_above_cap`` counts
the steps whose allocated peak alone is predicted above the cap.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dflash_lab.data.lengths import reference_lengths  # noqa: E402
from dflash_lab.model import footprint  # noqa: E402
from dflash_lab.sampling import policy_from_config  # noqa: E402

BOUNDS = {False: (0.97, 1.10), True: (0.97, 1.15)}   # predicted / measured, by activation checkpointing
CLEAN_PHASES = ("timed", "ckpt")


def recorded_head(setup: dict) -> str:
    """The LM head path a recorded check ran (``StepModel.head_ce``): its setup line's ``head_ce``; a line from
    before the one-pass head says ``fused_head_ce``: torch's fused op, else the reference's checkpointed chunks."""
    if "head_ce" in setup:
        return setup["head_ce"]
    return "fused" if setup["fused_head_ce"] else "reference"


@dataclass
class RecordedRun:
    """One ``gpu_check_setup`` line and what it implies: the step model, the settings and the lengths."""

    setup: dict
    model_name: str
    step_model: footprint.StepModel
    settings: footprint.Settings
    lengths: np.ndarray
    plans: dict

    @classmethod
    def from_setup(cls, setup: dict, model_name: str) -> "RecordedRun":
        from omegaconf import OmegaConf

        from gpu_check import SHAPES, compose_config

        shape = SHAPES[setup["shape"]]
        cfg = compose_config(model_name, list(setup.get("overrides", [])))
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        if shape["target"] is not None:
            model_cfg = {**model_cfg, "kind": "hf", "target_config": shape["target"], "target_path": None}
        device_type = "cpu" if setup["device"] == "cpu" else "cuda"
        step_model = replace(footprint.StepModel.from_model_config(model_cfg, device_type=device_type),
                             head_ce=recorded_head(setup))
        settings = footprint.Settings(precision=setup["precision"], attention=setup["attention"],
                                      world_size=int(setup["world_size"]), allocator=device_type)
        lengths = reference_lengths("seed", int(setup["num_samples"]), seed=0, scale=shape["length_scale"])
        return cls(setup, model_name, step_model, settings, lengths, {})

    def plan(self, policy: str) -> dict:
        """The policy's epoch-0 batches and their layout numbers, as the check built them (cached per policy)."""
        if policy not in self.plans:
            self.plans[policy] = self._build_plan(policy)
        return self.plans[policy]

    def _build_plan(self, policy: str) -> dict:
        from gpu_check import SHAPES, benchmark_block_tokens, sampler_config

        setup, step_model = self.setup, self.step_model
        budget = int(setup["budget"])
        memory = setup["memory_plan"][policy]
        cfg = sampler_config(policy, self.model_name, list(setup.get("overrides", [])), budget,
                             SHAPES[setup["shape"]]["length_scale"], int(np.max(self.lengths)))
        cfg["max_block_tokens"] = memory["max_block_tokens"]
        blocks = benchmark_block_tokens(self.lengths, budget, step_model)
        built = policy_from_config(cfg, self.lengths, seed=0, world_size=int(setup["world_size"]), rank=0,
                                   block_tokens=blocks if memory["max_block_tokens"] is not None else None)
        anchors = footprint.policy_anchors(built, step_model)
        if anchors is None:
            anchors = benchmark_block_tokens(built.lengths, budget, step_model) // step_model.block_size
        batches = built.global_plan(0).batches
        shapes = footprint.batch_shapes(batches, built.lengths, packed=built.packed, model=step_model, anchors=anchors)
        return {"batches": batches, "shapes": shapes, "anchors": anchors, "lengths": built.lengths,
                "packed": built.packed, "ckpt": bool(memory["activation_checkpointing"])}


def _mismatch(plan: dict, index: int, record: dict, block_size: int) -> str | None:
    """Why the rebuilt batch is not the recorded one (None when it is)."""
    from dflash_lab.metrics.throughput import batch_token_counts

    indices = plan["batches"][index]
    counts = batch_token_counts([indices], plan["lengths"], packed=plan["packed"])
    rebuilt = {"docs": len(indices), "real": int(counts.real[0]), "padded": int(counts.padded[0]),
               "block_tokens": float(plan["anchors"][indices].sum() * block_size)}
    wrong = {k: (record[k], v) for k, v in rebuilt.items() if k in record and float(record[k]) != float(v)}
    if not wrong:
        return None
    return "rebuilt batch differs from the recorded one (recorded, rebuilt): " + ", ".join(
        f"{k} {a} vs {b}" for k, (a, b) in wrong.items())


def repredict(lines: Iterable[dict], model_name: str = "qwen3_8b") -> list[dict]:
    """One ``repredict`` record per ``gpu_check_step`` line (each read against the setup line before it)."""
    run: RecordedRun | None = None
    out = []
    for line in lines:
        if line.get("check") == "gpu_check_setup":
            run = RecordedRun.from_setup(line, model_name)
            continue
        if line.get("check") != "gpu_check_step":
            continue
        if run is None:
            raise ValueError("a gpu_check_step line comes before any gpu_check_setup line: not a gpu_check file")
        out.append(_repredict_step(run, line))
    return out


def _repredict_step(run: RecordedRun, record: dict) -> dict:
    plan = run.plan(record["policy"])
    # the step's own checkpointing (the seed regime checkpoints only the steps that do not fit its cap); a line from
    # before per-step checkpointing ran with its memory plan's, or checkpointed as the ``ckpt`` step
    ckpt = record.get("activation_checkpointing", record["phase"] == "ckpt" or plan["ckpt"])
    index = int(record["index"])
    row = {"check": "repredict", "policy": record["policy"], "phase": record["phase"], "step": record["step"],
           "peak_gb": record["peak_gb"], "oom": record.get("oom"), "mem_cap_gb": run.setup.get("mem_cap_gb"),
           "activation_checkpointing": ckpt}
    why = _mismatch(plan, index, record, run.step_model.block_size)
    if why is not None:
        return {**row, "pred_peak_gb": None, "ratio": None, "clean": False, "error": why}
    shapes = {k: v[index:index + 1] for k, v in plan["shapes"].items()}
    settings = replace(run.settings, activation_checkpointing=ckpt)
    memory = footprint.step_memory(run.step_model, shapes, settings)
    predicted = float(memory["peak"][0]) / footprint.GIB
    clean = record["phase"] in CLEAN_PHASES and not record.get("oom")
    return {**row, "pred_peak_gb": round(predicted, 3), "ratio": round(predicted / record["peak_gb"], 4),
            "pred_reserved_gb": round(float(memory["reserved"][0]) / footprint.GIB, 3), "clean": clean}


def _ratio_range(rows: list[dict], ckpt: bool) -> dict:
    """The clean steps' predicted / measured range with or without checkpointing, against its bounds."""
    low, high = BOUNDS[ckpt]
    ratios = [r["ratio"] for r in rows if r["clean"] and r["activation_checkpointing"] == ckpt]
    return {"clean_steps": len(ratios), "bounds": [low, high], "ratio_min": min(ratios, default=None),
            "ratio_max": max(ratios, default=None), "ok": all(low <= r <= high for r in ratios)}


def _out_of_memory(rows: list[dict]) -> dict:
    """How the steps that ran out of memory are predicted: their reserved memory (peak + the allocator's
    fragmentation margin) above the cap, their peak above its usable share and above what they reached."""
    ooms = [r for r in rows if r["oom"] and r["pred_peak_gb"] is not None and r["mem_cap_gb"] is not None]
    return {"oom_steps": sum(bool(r["oom"]) for r in rows),
            "oom_predicted_above_cap": sum(r["pred_reserved_gb"] > r["mem_cap_gb"] for r in ooms),
            "oom_peak_predicted_above_cap": sum(r["pred_peak_gb"] > r["mem_cap_gb"] for r in ooms),
            "oom_predicted_above_usable_cap": sum(r["pred_peak_gb"] > footprint.USABLE_FRACTION * r["mem_cap_gb"]
                                                  for r in ooms),
            "oom_predicted_above_reached": sum(r["pred_peak_gb"] > r["peak_gb"] for r in ooms)}


def summary(rows: list[dict]) -> dict:
    """The clean steps' ratio range per checkpointing setting, the out-of-memory steps, and whether all hold.

    A step that ran out of memory must be one no plan would run: its peak predicted above the usable share of its
    cap (what the memory plan fits the peak against) and above what it had allocated when it failed, and its
    reserved memory (peak + fragmentation margin) above the cap: the allocator's cap counts the memory it
    reserved, fragments included, and its allocated peak can lie below the cap itself."""
    plain, ckpt, ooms = _ratio_range(rows, False), _ratio_range(rows, True), _out_of_memory(rows)
    errors = [r["error"] for r in rows if "error" in r]
    within = [plain.pop("ok"), ckpt.pop("ok")]
    ok = (not errors and all(within)
          and ooms["oom_predicted_above_usable_cap"] == ooms["oom_predicted_above_reached"] == ooms["oom_steps"]
          == ooms["oom_predicted_above_cap"])
    return {"check": "repredict_summary", "steps": len(rows), "plain": plain, "ckpt": ckpt, **ooms,
            "errors": errors, "ok": bool(ok)}


def main(path: str, model_name: str = "qwen3_8b") -> int:
    """Print the re-prediction of ``path``; exit status 0 when every step is within its bounds."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = repredict(lines, model_name)
    for row in rows:
        print(json.dumps(row), flush=True)
    result = summary(rows)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":   # python benchmarks/gpu_repredict.py [FILE.jsonl ...] (default: the first H200 run's)
    files = sys.argv[1:] or [str(ROOT / "benchmarks" / "data" / "h200-2026-12-04" / f"{name}.jsonl")
                             for name in ("seed", "plan")]
    raise SystemExit(max(main(path) for path in files))
