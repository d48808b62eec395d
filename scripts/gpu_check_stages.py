"""The stages of scripts/gpu_check.sh: each a subprocess with a timeout, each ending in JSON lines of OUT.jsonl.

    python scripts/gpu_check_stages.py [--cpu] OUT.jsonl [--work-dir DIR] [--only attention_tests,gpu_check,train]

Stages, in order (GPU; ``--cpu``: the same path at CPU size):

1. ``attention_tests``: pytest on tests/test_model_attention.py and every other test file that checks
   ``torch.cuda.is_available()`` (the CUDA-only tests, e.g. the flex_attention backward against the dense oracle);
   one line with passed / failed / skipped / error counts and the names of the failed and skipped tests. On a CPU
   the CUDA tests are skipped and recorded as skipped.
2. ``gpu_check``: ``benchmarks/gpu_check.py`` for bucketed and packed: GPU at the Qwen3-8B shape (random weights,
   32,768-token budget, the memory plan's block budget and checkpointing, every visible GPU); CPU at the tiny
   shape. One line for its setup (``check: gpu_check_setup``) and one per policy (``check: gpu_check``).
3. ``train``: ``scripts/make_random_qwen3.py`` builds a random-weight Qwen3 (GPU: hidden 1024, 8 layers; CPU: hidden
   64) with a local tokenizer, then ``python -m dflash_lab.train trainer=gpu model=hf model.target_path=<it>
   data=synthetic trainer.max_steps=100`` (torchrun over 2 ranks when 2 GPUs exist; CPU: trainer=cpu, 10 steps);
   one line from its summary.json (status, ktok_s, tau, loss, ...).

Each stage has a timeout; a stage that fails or times out records ``ok: false`` and its error, and the next stage
runs. Exit code 1 when any stage failed.
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
STAGES = ("attention_tests", "gpu_check", "train")
# seconds per stage: GPU (<= 8 minutes in all on one H200), CPU
TIMEOUTS = {"gpu": {"attention_tests": 80, "gpu_check": 200, "train": 190},
            "cpu": {"attention_tests": 120, "gpu_check": 150, "train": 240}}
TRAIN_STEPS = {"gpu": 100, "cpu": 10}
SUMMARY_KEYS = ("status", "steps", "ktok_s", "tau", "tau_baseline", "final_loss", "final_acc", "pad_eff",
                "world_size", "eta_s", "overhead_frac", "eval_frac", "wall_time_s", "anchor_rule", "max_block_tokens",
                "activation_checkpointing")


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


def stage_attention_tests(mode: str, work: Path) -> list[dict]:
    timeout = TIMEOUTS[mode]["attention_tests"]
    files = cuda_test_files()
    junit = work / "attention_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra", "-m", "",
           f"--junitxml={junit}", *files]
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


def stage_gpu_check(mode: str, work: Path) -> list[dict]:
    timeout = TIMEOUTS[mode]["gpu_check"]
    if mode == "gpu":
        args = ["--device", "cuda", "--shape", "qwen3-8b", "--num-samples", "8000", "--warmup", "2", "--steps", "4"]
    else:
        args = ["--device", "cpu", "--shape", "tiny", "--warmup", "1", "--steps", "1"]
    cmd = [sys.executable, "benchmarks/gpu_check.py", *args, "--policies", "bucketed,packed"]
    env = {**os.environ, **({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")} if mode == "cpu" else {})}
    code, seconds, tail = run(cmd, timeout, work / "gpu_check.log", env)
    rows = []
    for line in tail.splitlines():
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            rows.append({"check": "gpu_check_setup", **obj["setup"]} if "setup" in obj else {"check": "gpu_check", **obj})
    policies = [r for r in rows if r["check"] == "gpu_check"]
    problems = [f"{r.get('policy')}: {r.get('error') or r.get('skipped')}" for r in policies
                if r.get("error") or r.get("skipped") or not r.get("finite", False)]
    ok = code == 0 and len(policies) == 2 and not problems
    for r in rows:
        r["ok"] = ok if r["check"] == "gpu_check_setup" else not (r.get("error") or r.get("skipped")
                                                                   or not r.get("finite", False))
    summary = {"check": "gpu_check_status", "ok": ok, "seconds": round(seconds, 1), "command": " ".join(cmd[1:])}
    if not ok:
        summary["error"] = "; ".join(problems) or _error(code, timeout, tail)
    return rows + [summary]


def stage_train(mode: str, work: Path) -> list[dict]:
    timeout = TIMEOUTS[mode]["train"]
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
        overrides += ["model.decode_num_prompts=16", "model.decode_max_new_tokens=128"]
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the CPU path at the tiny shape")
    parser.add_argument("out", help="JSON lines output")
    parser.add_argument("--work-dir", default=None, help="logs, the random model, the run (default: a temp dir)")
    parser.add_argument("--only", default=",".join(STAGES))
    args = parser.parse_args(argv)
    mode = "cpu" if args.cpu else "gpu"
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    stages = {"attention_tests": stage_attention_tests, "gpu_check": stage_gpu_check, "train": stage_train}
    failed = []
    with open(out, "a") as sink:
        sink.write(json.dumps({"check": "start", "mode": mode, "work_dir": str(work), "ok": True}) + "\n")
        for name in args.only.split(","):
            try:
                rows = stages[name](mode, work)
            except Exception as exc:   # a broken stage is recorded, the next one runs
                rows = [{"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}]
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
