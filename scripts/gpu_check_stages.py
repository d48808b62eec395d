"""The stages of scripts/gpu_check.sh: each a subprocess with its own time limit, each ending in JSON lines of OUT.jsonl.

    python scripts/gpu_check_stages.py [--cpu] [--quick] OUT.jsonl [--work-dir DIR]
                                       [--only attention_tests,gpu_check_seed,train,gpu_check_plan]

Modes: ``--quick`` (<= 4 minutes on one H200: attention_tests on the CUDA and flex tests only, gpu_check_seed in
its quick mode) and the full one (<= 8 minutes: every attention test, gpu_check_seed with more timed steps, a short
training). ``--cpu``: the same path at CPU size (the tiny shape). Stages, in order:

1. ``attention_tests``: pytest on tests/test_model_attention.py and every other test file that checks
   ``torch.cuda.is_available()`` (the CUDA-only tests: the flex_attention backward against the dense oracle at
   head dim 128, bf16, 32 query / 8 key-value heads); quick: only the tests named ``cuda``, ``flex_operator`` or
   ``counts_flex``. One line with passed / failed / skipped / error counts and the names of the failed and skipped
   tests. On a CPU the CUDA tests are skipped and recorded as skipped.
2. ``gpu_check_seed``: ``benchmarks/gpu_check.py --regime seed``: the seed run's regime (one GPU capped at 96 GiB,
   no checkpointing, no block budget, 32,768-token steps at the Qwen3-8B shape, recipe anchors) for full_random,
   bucketed and packed, one checkpointing-on step, and the measured full_random / bucketed ratio next to the
   planner's; CPU: the tiny shape. Lines: ``gpu_check_setup``, ``gpu_check_step`` (one per step),
   ``gpu_check`` (one per policy), ``gpu_check_ckpt``, ``gpu_check_comparison``, ``gpu_check_status``.
3. ``train`` (full mode): ``scripts/make_random_qwen3.py`` builds a random-weight Qwen3 (GPU: hidden 1024,
   8 layers; CPU: hidden 64) with a local tokenizer, then ``python -m dflash_lab.train trainer=gpu model=hf
   model.target_path=<it> data=synthetic trainer.max_steps=60`` (torchrun over 2 ranks when 2 GPUs exist; CPU:
   trainer=cpu, 10 steps); one line from its summary.json (status, ktok_s, tau, loss, ...).
4. ``gpu_check_plan`` (only with ``--only``): ``benchmarks/gpu_check.py`` in the memory plan's regime (bucketed and
   packed, the device's memory, the plan's block budget and checkpointing) with the same lines.

Each stage has a time limit (``TIMEOUTS``; gpu_check stops starting steps 30 s before its own and still reports);
a stage that fails or times out records ``ok: false`` and its error (with what it had written), and the next stage
runs. Exit code 1 when any stage failed. Compiled kernels are cached in ``TORCHINDUCTOR_CACHE_DIR`` (default
~/.cache/dflash_lab/torchinductor, as the tests use), so a second run on the same machine compiles nothing.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"quick": ("attention_tests", "gpu_check_seed"), "full": ("attention_tests", "gpu_check_seed", "train")}
# seconds per stage, by device and mode: GPU quick <= 4 min, full <= 8 min in all on one H200 (+ seconds of setup)
TIMEOUTS = {("gpu", "quick"): {"attention_tests": 55, "gpu_check_seed": 180, "train": 150, "gpu_check_plan": 200},
            ("gpu", "full"): {"attention_tests": 90, "gpu_check_seed": 230, "train": 150, "gpu_check_plan": 200},
            # a CPU is not lent by the minute, and a shared one can be 10x slower than when idle (a packed step's
            # compile alone: 30-100 s)
            ("cpu", "quick"): {"attention_tests": 300, "gpu_check_seed": 600, "train": 300, "gpu_check_plan": 600},
            ("cpu", "full"): {"attention_tests": 420, "gpu_check_seed": 900, "train": 400, "gpu_check_plan": 600}}
DEADLINE_MARGIN_S = 30   # gpu_check.py stops starting steps this long before its stage's limit
QUICK_TESTS = "cuda or flex_operator or counts_flex"
TRAIN_STEPS = {"gpu": 60, "cpu": 10}
SUMMARY_KEYS = ("status", "steps", "ktok_s", "tau", "tau_baseline", "final_loss", "final_acc", "pad_eff",
                "world_size", "eta_s", "overhead_frac", "eval_frac", "wall_time_s", "anchor_rule", "max_block_tokens",
                "activation_checkpointing")
LINE_CHECKS = {"setup": "gpu_check_setup", "step": "gpu_check_step", "ckpt_step": "gpu_check_ckpt",
               "comparison": "gpu_check_comparison"}


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


def cuda_test_files() -> list[str]:
    files = {"tests/test_model_attention.py"}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if "cuda.is_available()" in path.read_text(errors="replace"):
            files.add(str(path.relative_to(ROOT)))
    return sorted(files)


def stage_attention_tests(mode: str, run_mode: str, work: Path) -> list[dict]:
    timeout = TIMEOUTS[(mode, run_mode)]["attention_tests"]
    files = cuda_test_files()
    junit = work / "attention_tests.xml"
    select = ["-k", QUICK_TESTS] if run_mode == "quick" else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra", "-m", "",
           f"--junitxml={junit}", *select, *files]
    code, seconds, tail = run(cmd, timeout, work / "attention_tests.log")
    row = {"check": "attention_tests", "files": files, "seconds": round(seconds, 1)}
    if not junit.exists():
        return [{**row, "ok": False, "error": _error(code, timeout, tail)}]
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
    passed = len(cases) - len(failed) - len(skipped) - len(errors)
    ok = code == 0 and not failed and not errors
    row.update({"passed": passed, "failed": len(failed), "skipped": len(skipped), "errors": len(errors),
                "failed_tests": failed + errors, "skipped_tests": skipped, "ok": ok})
    if not ok:
        row["error"] = _error(code, timeout, tail)
    return [row]


def gpu_check_command(regime: str, mode: str, run_mode: str, timeout: float) -> list[str]:
    """benchmarks/gpu_check.py for a stage: the seed or the plan regime, at the Qwen3-8B shape on a GPU and the
    tiny one on a CPU, stopping new steps DEADLINE_MARGIN_S before the stage's limit."""
    device = ["--device", "cuda", "--shape", "qwen3-8b"] if mode == "gpu" else ["--device", "cpu", "--shape", "tiny"]
    if regime == "seed":
        args = ["--regime", "seed", *(["--quick"] if run_mode == "quick" else [])]
    elif mode == "gpu":
        args = ["--policies", "bucketed,packed", "--num-samples", "8000", "--warmup", "2", "--steps", "3"]
    else:
        args = ["--policies", "bucketed,packed", "--warmup", "1", "--steps", "1"]
    return [sys.executable, "benchmarks/gpu_check.py", *device, *args,
            "--deadline-s", str(max(10, timeout - DEADLINE_MARGIN_S))]


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


def stage_gpu_check(regime: str, mode: str, run_mode: str, work: Path) -> list[dict]:
    stage = f"gpu_check_{regime}"
    timeout = TIMEOUTS[(mode, run_mode)][stage]
    cmd = gpu_check_command(regime, mode, run_mode, timeout)
    env = {**os.environ, **({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")} if mode == "cpu" else {})}
    code, seconds, tail = run(cmd, timeout, work / f"{stage}.log", env)
    rows = parse_gpu_check_lines(tail)
    expected = ["full_random", "bucketed", "packed"] if regime == "seed" else ["bucketed", "packed"]
    policies = [r for r in rows if r["check"] == "gpu_check"]
    problems = [f"{r.get('policy')}: {r.get('error') or r.get('skipped') or 'no finite step'}" for r in policies
                if not policy_ok(r)]
    missing = [p for p in expected if p not in [r.get("policy") for r in policies]]
    if missing:
        problems.append(f"no row for {', '.join(missing)}")
    if regime == "seed" and not any(r["check"] == "gpu_check_comparison" for r in rows):
        problems.append("no comparison line")
    ok = code == 0 and not problems
    for r in rows:
        r["ok"] = policy_ok(r) if r["check"] == "gpu_check" else (ok if r["check"] == "gpu_check_setup" else
                                                                   not r.get("error"))
    summary = {"check": f"{stage}_status", "ok": ok, "seconds": round(seconds, 1), "timeout_s": timeout,
               "command": " ".join(cmd[1:])}
    if not ok:
        summary["error"] = "; ".join(problems) + ("; " if problems else "") + _error(code, timeout, tail)
    return rows + [summary]


def stage_train(mode: str, run_mode: str, work: Path) -> list[dict]:
    timeout = TIMEOUTS[(mode, run_mode)]["train"]
    start = time.perf_counter()
    target = work / "qwen3_random"
    size = [] if mode == "gpu" else ["--hidden", "64", "--layers", "8", "--heads", "4", "--kv-heads", "2",
                                     "--head-dim", "16", "--intermediate", "192"]
    code, seconds, tail = run([sys.executable, "scripts/make_random_qwen3.py", str(target), *size], 120,
                              work / "make_random_qwen3.log")
    row = {"check": "train", "target_path": str(target)}
    if code != 0:
        return [{**row, "ok": False, "error": "make_random_qwen3: " + _error(code, 120, tail)}]
    gpus = 0
    if mode == "gpu":
        import torch

        gpus = torch.cuda.device_count()
    nproc = 2 if gpus >= 2 else 1
    run_dir = work / "train_run"
    overrides = [f"trainer={mode}", "model=hf", f"model.target_path={target}", "data=synthetic",
                 f"trainer.max_steps={TRAIN_STEPS[mode]}", f"hydra.run.dir={run_dir}", "probes.every=0",
                 f"model.cache_dir={work / 'cache'}", f"data.cache_dir={work / 'cache'}"]
    if mode == "gpu":
        overrides += ["model.decode_num_prompts=8", "model.decode_max_new_tokens=64"]
    else:
        overrides += ["sampler.max_tokens=1024", "data.num_samples=400", "model.draft_layers=2",
                      "model.decode_num_prompts=2", "model.decode_max_new_tokens=16", "trainer.progress=false"]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "dflash_lab.train", *overrides]
    remaining = max(10.0, timeout - (time.perf_counter() - start))
    code, seconds, tail = run(cmd, remaining, work / "train.log")
    row.update({"command": " ".join(cmd[1:]), "nproc": nproc, "seconds": round(time.perf_counter() - start, 1)})
    summary_file = run_dir / "summary.json"
    if summary_file.exists():
        summary = json.loads(summary_file.read_text())
        row.update({k: summary.get(k) for k in SUMMARY_KEYS if k in summary})
        row.update({k: v for k, v in summary.items() if "mem" in k})
    memory = re.findall(r"(memory plan: .*|preflight: .*)", tail)
    if memory:
        row["memory_log"] = memory[:2]
    ok = code == 0 and row.get("status") == "finished"
    row["ok"] = ok
    if not ok:
        row["error"] = _error(code, remaining, tail)
    return [row]


def run_stage(name: str, mode: str, run_mode: str, work: Path) -> list[dict]:
    """One stage's rows; a stage that raises is recorded as failed."""
    stages = {"attention_tests": stage_attention_tests, "train": stage_train,
              "gpu_check_seed": lambda *a: stage_gpu_check("seed", *a),
              "gpu_check_plan": lambda *a: stage_gpu_check("plan", *a)}
    try:
        return stages[name](mode, run_mode, work)
    except Exception as exc:   # a broken stage is recorded, the next one runs
        return [{"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the CPU path at the tiny shape")
    parser.add_argument("--quick", action="store_true", help="the quick mode (<= 4 min on one H200)")
    parser.add_argument("out", help="JSON lines output")
    parser.add_argument("--work-dir", default=None, help="logs, the random model, the run (default: a temp dir)")
    parser.add_argument("--only", default=None, help="comma-separated stages (default: the mode's: "
                        + "; ".join(f"{m}: {','.join(s)}" for m, s in STAGES.items()) + "; also gpu_check_plan)")
    args = parser.parse_args(argv)
    mode, run_mode = "cpu" if args.cpu else "gpu", "quick" if args.quick else "full"
    names = args.only.split(",") if args.only else list(STAGES[run_mode])
    unknown = [n for n in names if n not in TIMEOUTS[(mode, run_mode)]]
    if unknown:
        parser.error(f"--only: unknown stages {unknown}; choose from {', '.join(TIMEOUTS[(mode, run_mode)])}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "dflash_lab" / "torchinductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    failed = []
    with open(out, "a") as sink:
        sink.write(json.dumps({"check": "start", "mode": mode, "run_mode": run_mode, "stages": names,
                               "limits_s": {n: TIMEOUTS[(mode, run_mode)][n] for n in names},
                               "work_dir": str(work), "ok": True}) + "\n")
        sink.flush()
        for name in names:
            rows = run_stage(name, mode, run_mode, work)
            for row in rows:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            if not all(r.get("ok", True) for r in rows):
                failed.append(name)
            print(f"gpu_check.sh: {name}: {'FAILED' if name in failed else 'ok'}", file=sys.stderr, flush=True)
        sink.write(json.dumps({"check": "done", "ok": not failed, "failed_stages": failed}) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
