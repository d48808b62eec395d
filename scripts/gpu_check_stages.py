"""The stages of scripts/gpu_check.sh: each a subprocess with its own time limit, each ending in JSON lines of OUT.jsonl.

    python scripts/gpu_check_stages.py [--cpu] [--quick] OUT.jsonl [--work-dir DIR]
                                [--only attention_tests,gpu_check,train,gpu_check_seed,gpu_check_plan]

Modes: the full one, the one command a GPU session runs (<= 7 min 15 s on one H200 by its stage limits, 45 s
inside the 8 minutes of machine time it is given: attention_tests, gpu_check with both regimes, the training entry
point at the Qwen3-8B shape) and ``--quick`` (<= 4 minutes: attention_tests, gpu_check_seed on 8,000 documents).
``--cpu``: the same stages at CPU size (the tiny shape).
Stages, in order:

1. ``attention_tests``: pytest ``-m cuda`` on the test files with tests marked ``cuda``: the tests that need a
   CUDA device (the compiled flex_attention forward and backward against the dense oracle at the draft's shape
   class, head dim 128, bf16, 32 query / 8 key-value heads; the one-pass LM head at Qwen3-8B's head against the
   float32 reference, and its memory against the memory model's head terms). The other tests run on a CPU in CI on
   every commit. One line with passed / failed / skipped / error counts and the names of the failed and skipped
   tests. On a CPU the CUDA tests are skipped and recorded as skipped.
2. ``gpu_check`` (full mode): ``benchmarks/gpu_check.py --regime seed,plan`` in one process on one model (the start
   and the compiled graphs paid once):
   - the seed run's regime (one GPU capped at 96 GiB, 32,768-token steps at the Qwen3-8B shape, no block budget,
     recipe anchors, checkpointing only on the steps the memory model says do not fit) for full_random, bucketed
     and packed; then
   - the memory plan's regime (the device's whole memory, each policy's block budget and checkpointing from the
     memory plan: where the MFU goal is set) for bucketed and packed;
   each policy timed on one step per cost stratum of its epoch plan (5 on a GPU) of 20,000 documents; CPU: the tiny
   shape. The seed regime starts no step that would leave the plan regime less than ``PLAN_RESERVE_S``. Lines, each
   with its ``regime``: ``gpu_check_setup``, ``gpu_check_step`` (one per step), ``gpu_check`` (one per policy),
   ``gpu_check_epoch`` (the step-time fit and the epoch's full_random / bucketed ratio next to the planner's),
   ``gpu_check_ckpt`` (seed: one step again with checkpointing), ``gpu_check_profile`` (one bucketed step under
   torch.profiler: time by kernel class and range), then ``gpu_check_status``.
   ``gpu_check_seed`` (quick mode) and ``gpu_check_plan`` (``--only``): one regime alone.
3. ``train`` (full mode): the real entry point at the real shape: ``scripts/make_random_qwen3.py --shape qwen3_8b
   --random-init`` writes a Qwen3-8B config (36 layers) with a local tokenizer and no weights (the run builds random
   bf16 weights on the GPU: dflash_lab/model/random_target.py), then ``python -m dflash_lab.train trainer=gpu
   model=hf model.target_path=<it> data=synthetic`` through ``scripts/gpu_train_probe.py`` (compiled graphs and
   peak memory from inside the run) with the automatic memory plan, ``TRAIN_STEPS`` steps, 2 tau prompts and
   ``TORCH_LOGS=recompiles`` (torchrun over 2 ranks when 2 GPUs exist; CPU: trainer=cpu at the tiny shape, the
   memory plan against ``trainer.gpu_mem_gb=1``). One line: status, Ktok/s, tau, the preflight's predicted peak
   against the measured one, the compiled graphs and the recompiles dynamo logged.

Each stage has a time limit (``TIMEOUTS``, each one's source in ``LIMIT_SOURCES``; gpu_check stops starting steps
``DEADLINE_MARGIN_S`` before its own and still reports); a stage that fails or times out records ``ok: false`` and
its error (with what it had written), and the next stage runs. Exit code 1 when any stage failed. Compiled kernels
are cached in ``TORCHINDUCTOR_CACHE_DIR`` (default ~/.cache/dflash_lab/torchinductor, as the tests use), so a second
run on the same machine compiles less; the limits hold for a cold cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"quick": ("attention_tests", "gpu_check_seed"), "full": ("attention_tests", "gpu_check", "train")}
# The gpu_check stages: the regimes of benchmarks/gpu_check.py each runs, in that order, in one process.
REGIMES = {"gpu_check": ("seed", "plan"), "gpu_check_seed": ("seed",), "gpu_check_plan": ("plan",)}
SEED_POLICIES = ("full_random", "bucketed", "packed")   # the seed's three (its ratio: full_random / bucketed)
PLAN_POLICIES = ("bucketed", "packed")                  # where the plan regime's MFU goal is set
# Seconds per stage, by device and mode. GPU: from the first H200 run (one H200, torch 2.11, cold kernel cache;
# docs/gpu.md "Stage limits"), each about 1.2x what that run measured or what its parts add up to; the gpu_check
# stages' steps priced by benchmarks/gpu_stage_budget.py (the stage's own plans on a CPU, each step's executed
# FLOPs at that run's measured rate): quick sums to 235 s, full to 435 s (7 min 15 s: 45 s inside the 8 minutes of
# machine time). gpu_check_seed and gpu_check_plan alone are for --only.
TIMEOUTS = {("gpu", "quick"): {"attention_tests": 45, "gpu_check_seed": 190, "gpu_check": 265, "train": 125,
                               "gpu_check_plan": 145},
            ("gpu", "full"): {"attention_tests": 45, "gpu_check_seed": 190, "gpu_check": 265, "train": 125,
                              "gpu_check_plan": 145},
            # a CPU is not lent by the minute, and a shared one can be 10x slower than when idle (a packed step's
            # compile alone: 30-100 s)
            ("cpu", "quick"): {"attention_tests": 300, "gpu_check_seed": 900, "gpu_check": 1200, "train": 400,
                               "gpu_check_plan": 600},
            ("cpu", "full"): {"attention_tests": 300, "gpu_check_seed": 1200, "gpu_check": 1500, "train": 400,
                              "gpu_check_plan": 600}}
# In the gpu_check stage the seed regime starts no step that would leave the plan regime less than this (its
# priced share: benchmarks/gpu_stage_budget.py --regime seed,plan, the plan part 48 s, at 1.2x; CPU: the tiny
# shape's plan part took 30 s here, at 10x). The seed regime's own deadline, 265 - 30 - 58 = 177 s, is 1.1x its
# 160 s price.
PLAN_RESERVE_S = {"gpu": 58, "cpu": 300}
LIMIT_SOURCES = {
    "attention_tests": "the tests that need CUDA (marked cuda; the others run in CI on every commit): in the first "
                       "run the CUDA flex test took 12.7 s on a cold kernel cache (compiling its kernels), + ~16 s "
                       "of pytest start; the one-pass head's CUDA test adds a few bf16 matmuls at the Qwen3-8B "
                       "head (~2.5 TFLOP each: milliseconds) and the generation of its 1.2 GB head: ~35 s",
    "gpu_check_seed": "the first run's seed stage took 137 s: 42 s outside the steps (start, model, plans), 57 s of "
                      "warm-up (the first step compiles for 38 s); its timed steps ran at executed FLOPs / 459-469 "
                      "TFLOP/s + 0.12-0.18 s. Now 5 strata x 3 policies (full: of 20,000 documents; quick: 8,000), "
                      "priced from the stage's own plans (benchmarks/gpu_stage_budget.py --regime seed: 15 steps of "
                      "706-2,894 executed TFLOP, 8 with checkpointing, + the checkpointing step + the profiled step "
                      "at 3 steps: 61 s): 160 s; 8 strata would be 187 s",
    "gpu_check": "the seed regime as gpu_check_seed (160 s), then the plan regime in the same process on the same "
                 "model (benchmarks/gpu_stage_budget.py --regime seed,plan): no start and no first compile, 5 "
                 "strata x bucketed and packed of 20,000 documents (10 steps of 767-1,412 executed TFLOP, "
                 "checkpointing off), its warm-up by the fit + 3.5 s per policy, its profiled step, its plans' "
                 "CPU time: 48 s; 208 s in all",
    "train": "the run at hidden 1024 took 112-121 s (60 steps, 8 tau prompts x 64 tokens: 21.5 s of evaluation); "
             "at Qwen3-8B: ~40 s first-step compile + 7 steps of ~2 s (4,096 tokens, ~60K block tokens), 2 tau "
             "prompts x 32 tokens (~20 s with the draft's compile), ~25 s of start (imports, random 8B weights "
             "on the GPU, data, memory plan): ~100 s",
    "gpu_check_plan": "the first run's plan stage took 90 s (2 + 3 steps x 2 policies, checkpointing on); now "
                      "checkpointing off at a ~120K block budget: benchmarks/gpu_stage_budget.py --regime plan "
                      "--steps 3 --policies bucketed,packed: 6 steps of 799-1,373 executed TFLOP and the profiled "
                      "step (23 s) + 42 s outside + 57 s of warm-up: 122 s"}
DEADLINE_MARGIN_S = 30   # gpu_check.py stops starting steps this long before its stage's limit
CUDA_MARKER = "cuda"     # pytest marker of the tests that need a CUDA device (pyproject.toml)
TRAIN_STEPS = {"gpu": 8, "cpu": 6}
SEED_STRATA = {"gpu": 5}   # timed steps per policy (and regime) on a GPU, both modes (TIMEOUTS)
SUMMARY_KEYS = ("status", "steps", "ktok_s", "tau", "tau_baseline", "final_loss", "final_acc", "pad_eff",
                "world_size", "eta_s", "overhead_frac", "eval_frac", "wall_time_s", "anchor_rule", "max_block_tokens",
                "activation_checkpointing", "target_digest")
LINE_CHECKS = {"setup": "gpu_check_setup", "step": "gpu_check_step", "ckpt_step": "gpu_check_ckpt",
               "epoch": "gpu_check_epoch", "profile": "gpu_check_profile"}
TINY_TARGET = ["--hidden", "64", "--layers", "8", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
               "--intermediate", "192"]   # benchmarks/gpu_check.py's tiny shape
TRAIN_OVERRIDES = {
    "gpu": ["model.decode_num_prompts=2", "model.decode_max_new_tokens=32", "trainer.steady_warmup_steps=3"],
    "cpu": ["sampler.max_tokens=1024", "data.num_samples=400", "model.draft_layers=2", "model.decode_num_prompts=2",
            "model.decode_max_new_tokens=16", "trainer.progress=false", "trainer.steady_warmup_steps=2",
            "trainer.gpu_mem_gb=1"]}   # (the memory plan runs where a memory figure is given; 1 GiB is the least)


def run(cmd: list[str], timeout: float, log: Path, env: dict | None = None) -> tuple[int | None, float, str]:
    """Run ``cmd`` from the repository root with stdout+stderr to ``log``; (exit code or None on timeout, seconds,
    the output's tail)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ.copy(),
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)   # the whole stage: ranks and compile workers too
            proc.wait()
            code = None
    return code, time.perf_counter() - start, log.read_text(errors="replace")


def _error(code: int | None, timeout: float, tail: str) -> str:
    head = f"timed out after {timeout:g} s" if code is None else f"exit code {code}"
    return f"{head}: {tail[-2000:]}"


# -------------------------------------------------------------------------------------------- attention_tests


def cuda_test_files() -> list[str]:
    """The test files with tests marked ``cuda`` (collecting only them keeps pytest's start short)."""
    marker = f"pytest.mark.{CUDA_MARKER}"
    return sorted(str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").glob("test_*.py"))
                  if marker in path.read_text(errors="replace"))


def junit_counts(junit: Path) -> dict:
    """passed / failed / skipped / errors and the failed (with errors) and skipped tests' names of a JUnit XML."""
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    failed, skipped, errors = [], [], []
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name')}"
        if case.find("failure") is not None:
            failed.append(name)
        elif case.find("error") is not None:
            errors.append(name)
        elif case.find("skipped") is not None:
            skipped.append(f"{name}: {case.find('skipped').get('message', '')}")
    return {"passed": len(cases) - len(failed) - len(skipped) - len(errors), "failed": len(failed),
            "skipped": len(skipped), "errors": len(errors), "failed_tests": failed + errors, "skipped_tests": skipped}


def stage_attention_tests(mode: str, run_mode: str, work: Path) -> list[dict]:
    timeout = TIMEOUTS[(mode, run_mode)]["attention_tests"]
    files = cuda_test_files()
    junit = work / "attention_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra", "-m", CUDA_MARKER,
           f"--junitxml={junit}", *files]
    code, seconds, tail = run(cmd, timeout, work / "attention_tests.log")
    row = {"check": "attention_tests", "files": files, "seconds": round(seconds, 1), "timeout_s": timeout}
    if not junit.exists():
        return [{**row, "ok": False, "error": _error(code, timeout, tail)}]
    row.update(junit_counts(junit))
    row["ok"] = code == 0 and not row["failed"] and not row["errors"]
    if not row["ok"]:
        row["error"] = _error(code, timeout, tail)
    return [row]


# -------------------------------------------------------------------------------------------- gpu_check


def gpu_check_command(stage: str, mode: str, run_mode: str, timeout: float, work: Path) -> list[str]:
    """benchmarks/gpu_check.py for a stage (``REGIMES``: the seed regime, the plan regime, or both in one process),
    at the Qwen3-8B shape on a GPU and the tiny one on a CPU. No step starts that could not end DEADLINE_MARGIN_S
    before the stage's limit; with both regimes the seed one also leaves the plan's share (``PLAN_RESERVE_S``)."""
    device = ["--device", "cuda", "--shape", "qwen3-8b"] if mode == "gpu" else ["--device", "cpu", "--shape", "tiny"]
    regimes = REGIMES[stage]
    args = ["--regime", ",".join(regimes), *(["--quick"] if run_mode == "quick" else []),
            "--profile-trace", str(work / "profile_trace.json")]
    if "seed" in regimes:
        args += ["--steps", str(SEED_STRATA[mode])] if mode in SEED_STRATA else []
        args += ["--policies", ",".join(SEED_POLICIES)]
    if "plan" in regimes:
        args += ["--policies", ",".join(PLAN_POLICIES)]
    if regimes == ("plan",):   # alone, the sample its limit was priced for
        args += ["--num-samples", "8000", "--steps", "3"] if mode == "gpu" else ["--warmup", "1", "--steps", "2"]
    deadline = max(10, timeout - DEADLINE_MARGIN_S)
    if len(regimes) > 1:   # the seed regime's deadline leaves the plan regime its share of the stage
        args += ["--deadline-s", str(max(10, deadline - PLAN_RESERVE_S[mode]))]
    return [sys.executable, "benchmarks/gpu_check.py", *device, *args, "--deadline-s", str(deadline)]


def parse_gpu_check_lines(text: str) -> list[dict]:
    """gpu_check.py's JSON lines as OUT.jsonl rows, each with its ``check``."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        key = next((k for k in LINE_CHECKS if k in obj and len(obj) == 1), None)
        rows.append({"check": LINE_CHECKS[key], **obj[key]} if key else {"check": "gpu_check", **obj})
    return rows


def policy_ok(row: dict) -> bool:
    """A policy row with measured steps and a finite loss (steps that ran out of memory in the seed regime are
    measurements, not failures)."""
    return not (row.get("error") or row.get("skipped")) and bool(row.get("finite", False)) and row.get("steps", 0) > 0


def gpu_check_problems(regimes: tuple[str, ...], rows: list[dict]) -> list[str]:
    """What a gpu_check stage's lines lack, per regime: a policy without a good row, the epoch and profile lines
    (each without an error)."""
    problems = []
    for regime in regimes:
        own = [r for r in rows if r.get("regime") == regime]
        expected = SEED_POLICIES if regime == "seed" else PLAN_POLICIES
        policies = [r for r in own if r["check"] == "gpu_check"]
        problems += [f"{regime} {r.get('policy')}: {r.get('error') or r.get('skipped') or 'no finite step'}"
                     for r in policies if not policy_ok(r)]
        missing = [p for p in expected if p not in [r.get("policy") for r in policies]]
        if missing:
            problems.append(f"{regime}: no row for {', '.join(missing)}")
        for check in ("gpu_check_epoch", "gpu_check_profile"):
            line = next((r for r in own if r["check"] == check), None)
            if line is None or line.get("error"):
                problems.append(f"{regime} {check}: {line['error'] if line else 'no line'}")
    return problems


def mark_rows(rows: list[dict], ok: bool) -> None:
    """Each row's ``ok``: a policy row by its own steps, the setup line by the stage, the others by their error."""
    for r in rows:
        if r["check"] == "gpu_check":
            r["ok"] = policy_ok(r)
        else:
            r["ok"] = ok if r["check"] == "gpu_check_setup" else not r.get("error")


def stage_gpu_check(stage: str, mode: str, run_mode: str, work: Path) -> list[dict]:
    timeout = TIMEOUTS[(mode, run_mode)][stage]
    cmd = gpu_check_command(stage, mode, run_mode, timeout, work)
    env = {**os.environ, **({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")} if mode == "cpu" else {})}
    code, seconds, tail = run(cmd, timeout, work / f"{stage}.log", env)
    rows = parse_gpu_check_lines(tail)
    problems = gpu_check_problems(REGIMES[stage], rows)
    ok = code == 0 and not problems
    mark_rows(rows, ok)
    summary = {"check": f"{stage}_status", "regimes": list(REGIMES[stage]), "ok": ok, "seconds": round(seconds, 1),
               "timeout_s": timeout, "command": " ".join(cmd[1:])}
    if not ok:
        summary["error"] = "; ".join(problems) + ("; " if problems else "") + _error(code, timeout, tail)
    return rows + [summary]


# -------------------------------------------------------------------------------------------- train


def train_command(mode: str, target: Path, work: Path) -> tuple[list[str], int]:
    """The training command (through scripts/gpu_train_probe.py) and its number of ranks."""
    gpus = 0
    if mode == "gpu":
        import torch

        gpus = torch.cuda.device_count()
    nproc = 2 if gpus >= 2 else 1
    run_dir = work / "train_run"
    overrides = [f"trainer={mode}", "model=hf", f"model.target_path={target}", "data=synthetic",
                 f"trainer.max_steps={TRAIN_STEPS[mode]}", f"hydra.run.dir={run_dir}", "probes.every=0",
                 f"model.cache_dir={work / 'cache'}", f"data.cache_dir={work / 'cache'}", *TRAIN_OVERRIDES[mode]]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    return [*launcher, "scripts/gpu_train_probe.py", str(work / "train_probe.json"), *overrides], nproc


def train_figures(log: str, summary: dict, probe: dict) -> dict:
    """The train line's figures: the summary's, the preflight's predicted peak (the worst step of the epoch plan;
    GPU only) against the probe's measured one (the whole run), compiled graphs, and the recompiles in the log."""
    row = {k: summary.get(k) for k in SUMMARY_KEYS if k in summary}
    # the trainer's line: "preflight: " + footprint.gpu_use (worst step X GiB of the GPU's Y ...)
    preflight = re.search(r"preflight: worst step ([\d.]+) GiB of the GPU's ([\d.]+)", log)
    row["memory_log"] = re.findall(r"(memory plan: .*|preflight: .*)", log)[:2]
    row["pred_peak_mem_gb"] = float(preflight.group(1)) if preflight else None
    row["pred_peak_scope"] = ("the preflight: the worst step of the epoch plan" if preflight else
                              "no preflight (it runs on CUDA only)")
    row.update({k: probe.get(k) for k in ("peak_mem_gb", "peak_rss_gb", "compiled_graphs", "flex_graphs")})
    if row["pred_peak_mem_gb"] and row.get("peak_mem_gb"):
        row["mem_ratio"] = row["pred_peak_mem_gb"] / row["peak_mem_gb"]
    recompiled = re.findall(r"Recompiling function (\S+) in (\S+)", log)
    row["recompiles"] = len(recompiled)
    row["recompiled_functions"] = sorted({f"{name} ({Path(file).name})" for name, file in recompiled})[:10]
    return row


def stage_train(mode: str, run_mode: str, work: Path) -> list[dict]:
    timeout = TIMEOUTS[(mode, run_mode)]["train"]
    start = time.perf_counter()
    target = work / "qwen3_random"
    shape = ["--shape", "qwen3_8b"] if mode == "gpu" else TINY_TARGET
    code, _, tail = run([sys.executable, "scripts/make_random_qwen3.py", str(target), *shape, "--random-init"], 120,
                        work / "make_random_qwen3.log")
    row = {"check": "train", "target_path": str(target), "shape": "qwen3_8b" if mode == "gpu" else "tiny",
           "timeout_s": timeout}
    if code != 0:
        return [{**row, "ok": False, "error": "make_random_qwen3: " + _error(code, 120, tail)}]
    cmd, nproc = train_command(mode, target, work)
    remaining = max(10.0, timeout - (time.perf_counter() - start))
    code, _, tail = run(cmd, remaining, work / "train.log", {**os.environ, "TORCH_LOGS": "recompiles"})
    row.update({"command": " ".join(cmd[1:]), "nproc": nproc, "seconds": round(time.perf_counter() - start, 1)})
    summary_file, probe_file = work / "train_run" / "summary.json", work / "train_probe.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    probe = json.loads(probe_file.read_text()) if probe_file.exists() else {}
    row.update(train_figures(tail, summary, probe))
    row["ok"] = code == 0 and row.get("status") == "finished"
    if not row["ok"]:
        row["error"] = _error(code, remaining, tail)
    return [row]


# -------------------------------------------------------------------------------------------- the script


def run_stage(name: str, mode: str, run_mode: str, work: Path) -> list[dict]:
    """One stage's rows; a stage that raises is recorded as failed."""
    stages = {"attention_tests": stage_attention_tests, "train": stage_train,
              **{stage: partial(stage_gpu_check, stage) for stage in REGIMES}}
    try:
        return stages[name](mode, run_mode, work)
    except Exception as exc:   # a broken stage is recorded, the next one runs
        return [{"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the CPU path at the tiny shape")
    parser.add_argument("--quick", action="store_true", help="the quick mode (<= 4 min on one H200)")
    parser.add_argument("out", help="JSON lines output")
    parser.add_argument("--work-dir", default=None, help="logs, the random model, the run (default: a temp dir)")
    parser.add_argument("--only", default=None, help="comma-separated stages (default: the mode's: "
                        + "; ".join(f"{m}: {','.join(s)}" for m, s in STAGES.items())
                        + "; also gpu_check_seed, gpu_check_plan: one regime alone)")
    args = parser.parse_args(argv)
    args.mode, args.run_mode = "cpu" if args.cpu else "gpu", "quick" if args.quick else "full"
    args.stages = args.only.split(",") if args.only else list(STAGES[args.run_mode])
    limits = TIMEOUTS[(args.mode, args.run_mode)]
    unknown = [n for n in args.stages if n not in limits]
    if unknown:
        parser.error(f"--only: unknown stages {unknown}; choose from {', '.join(limits)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "dflash_lab" / "torchinductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    limits = TIMEOUTS[(args.mode, args.run_mode)]
    failed = []
    with open(out, "w") as sink:
        def write(row: dict) -> None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

        write({"check": "start", "mode": args.mode, "run_mode": args.run_mode, "stages": args.stages,
               "limits_s": {n: limits[n] for n in args.stages}, "limit_total_s": sum(limits[n] for n in args.stages),
               "work_dir": str(work), "ok": True})
        for name in args.stages:
            rows = run_stage(name, args.mode, args.run_mode, work)
            for row in rows:
                write(row)
            if not all(r.get("ok", True) for r in rows):
                failed.append(name)
            print(f"gpu_check.sh: {name}: {'FAILED' if name in failed else 'ok'}", file=sys.stderr, flush=True)
        write({"check": "done", "ok": not failed, "failed_stages": failed})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
