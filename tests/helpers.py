"""Helpers shared by the tests (import them from here, never from another test module; tests/ is on sys.path).

- Run directories made by hand in the docs/CONTRACTS.md layout (``write_run``).
- Training: the small configuration of the end-to-end tests (``SMALL``, ``compose_small``), the trainer's command
  line as a subprocess (``run_cli``, ``train_cli``), a requested checkpoint-and-exit (``stop_at``) and a root-proof
  read-only check (``without_permission_override``).
- Chat data: the template fixtures (tests/fixtures/chat_templates/), a tiny fast byte-level tokenizer whose chat
  markers, <think> tags and Qwen3's tool tags are single tokens (nothing is downloaded), a local random Qwen3 saved
  with it (a ``model=hf`` target), and a JSONL writer.
- Models: a tiny DFlash model over a random target, random documents.
- Slurm (the local cluster of scripts/slurm_up.sh): whether it answers (``slurm_unreachable``, ``need_slurm``), the
  launcher settings of a CPU job (``SLURM_CPU``), the smallest real training (``TINY``), a job name to find a test's
  jobs by (``new_job_name``), the trainer's command line that cancels its jobs on a timeout (``slurm_cli``), and the
  run's records (``metric_steps``, ``metric_losses``, ``submitit_logs``, ``wait_for``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from hydra import compose, initialize_config_module

from dflash_lab.records import checkpoint as ckpt
from dflash_lab.train import TrainHooks

ROOT = Path(__file__).resolve().parents[1]

# A small run: a 2-layer target pretrained for a few steps (cached), 300 synthetic samples, a 1024-token budget.
SMALL = [
    "++model.hidden_size=64", "++model.num_layers=2", "++model.num_heads=4", "++model.num_kv_heads=2",
    "++model.intermediate_size=128", "++model.pretrain_steps=20", "++model.pretrain_tokens_per_step=2048",
    "++model.block_size=4", "++data.num_samples=300", "sampler.max_tokens=1024",
    "trainer.num_threads=1", "trainer.progress=false", "model.decode_num_prompts=2", "model.decode_max_new_tokens=8",
    "trainer.epochs=2", "probes.every=5", "probes.per_band=2",
]
# The command-line settings of a short CPU run.
SHORT_CLI = ["logger=none", "trainer.measure_tau=false", "trainer.progress=false", "trainer.max_steps=30",
             "probes.every=10", "trainer.ckpt_every=10", "trainer.num_threads=1"]


def compose_small(run_dir: Path, *overrides: str):
    """The SMALL training config for ``run_dir`` with ``overrides``."""
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        return compose(config_name="train", overrides=[f"run_dir={run_dir}", *SMALL, *overrides])


def stop_at(step: int) -> TrainHooks:
    """Hooks that request a checkpoint-and-exit during update ``step`` (what SIGUSR2 does on a cluster)."""
    def after_forward(at_step, micro, out):
        if at_step == step:
            ckpt.request_checkpoint("test")
        return out
    return TrainHooks(after_forward=after_forward)


def train_cli(*args: str, prefix: tuple[str, ...] = (), timeout: int = 300,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m dflash_lab.train ARGS`` from the repository root (``prefix``: a command to run it under)."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    environment.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([*prefix, sys.executable, "-m", "dflash_lab.train", *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def without_permission_override() -> tuple[str, ...] | None:
    """A command prefix under which file permissions hold (root drops the capabilities that bypass them), () for
    a user they hold for already, None when root cannot drop them here (``setpriv`` missing)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        return None
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner")


def run_cli(*arguments: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m dflash_lab.train ARGUMENTS`` in a subprocess that imports this checkout's code."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dflash_lab.train", *arguments], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


BANDS = [0, 96, 216, 1024]


def write_run(
    run_dir: Path,
    sampler: str,
    seed: int,
    *,
    steps: int = 120,
    summary: bool = True,
    probes: bool = True,
    presentations: bool = True,
    drop_fields: tuple[str, ...] = (),
    torn_tail: bool = False,
    settings: dict | None = None,
    analysis: dict | None = None,
    effects: dict | None = None,
    status: str = "finished",
    run_record: bool = False,
) -> Path:
    """A small run directory in the docs/CONTRACTS.md format (a test fixture, not a result).

    settings: dotted key -> value, recorded in .hydra/config.yaml and as Hydra task overrides (a swept key);
    analysis: the run's `analysis` config section; effects: column -> value added to every logged loss /
    probe loss / summary figure, to plant a difference between arms; status: summary.json's status; run_record:
    also write the run's own config record (run_config.json), as the trainer does since it keeps one.
    """
    rng = np.random.default_rng(seed + 100 * len(sampler))
    effects = effects or {}
    run_dir.mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    config = {"sampler": {"name": sampler, "max_tokens": 4096}, "seed": seed, "experiment": "test_ablation",
              "run_dir": "${hydra:runtime.output_dir}", "data": {"num_samples": 160}}
    for key, value in (settings or {}).items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    if analysis is not None:
        config["analysis"] = analysis
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    overrides = [f"sampler={sampler}", f"seed={seed}", "data.num_samples=160"]
    overrides += [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
                  for key, value in (settings or {}).items()]
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if run_record:
        (run_dir / "run_config.json").write_text(json.dumps({"config": config, "overrides": overrides}))
    rows = []
    for step in range(1, steps + 1):
        mean_len = float(rng.uniform(30, 600))
        row = {
            "step": step, "epoch": (step - 1) // (steps // 3), "loss": 3.0 * math.exp(-step / 20) + 1.0
            + 0.05 * rng.standard_normal() + effects.get("final_loss", 0.0), "acc": min(0.9, step / steps),
            "lr": 6e-4, "grad_norm": 1.0, "real_tokens": 3000, "padded_tokens": 4000, "pad_eff": 0.75,
            "batch_size": 8, "max_len": int(mean_len * 1.3), "mean_len": mean_len, "bucket": int(rng.integers(0, 3)),
            "attn_tokens": 10, "step_time_s": 0.1, "compute_time_s": 0.09, "ktok_s": 30.0 + rng.uniform(-1, 1),
            "eta_s": 0.1 * (steps - step),
        }
        rows.append({k: v for k, v in row.items() if k not in drop_fields})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if torn_tail:
        text += '{"step": 999, "loss": 1.'  # the line a crash cut off
    (run_dir / "metrics.jsonl").write_text(text)
    if probes:
        probe_rows = []
        for step in range(0, steps + 1, 5):
            for band in range(len(BANDS) - 1):
                probe_rows.append({
                    "step": step, "band": band, "band_lo": BANDS[band], "band_hi": BANDS[band + 1],
                    "loss": 3.0 - 0.01 * step + 0.05 * rng.standard_normal() + effects.get("probe_loss", 0.0),
                    "acc": min(1.0, 0.1 + 0.004 * step + 0.05 * rng.standard_normal()), "tokens": 64,
                })
        (run_dir / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in probe_rows))
    if presentations:
        records = []
        for epoch in range(3):
            for sample in range(40):
                length = int(rng.integers(20, 900))
                records.append({
                    "sample_index": sample, "epoch": epoch, "step": epoch * (steps // 3) + sample + 1,
                    "length": length, "band": int(np.searchsorted(BANDS, length, side="left") - 1),
                    "acc": float(rng.uniform(0, 1)),
                })
        pd.DataFrame(records).to_parquet(run_dir / "presentations.parquet")
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({
            "sampler": sampler, "seed": seed, "steps": steps, "epochs": 3,
            "ktok_s": 30.0 + effects.get("ktok_s", 0.0) + 0.1 * seed, "pad_eff": 0.75, "eta_s": 0.0,
            "full_run_eta_s": 12.0, "final_loss": rows[-1]["loss"], "final_acc": 0.9, "tau": 2.5,
            "tau_band_min": 2.1, "tau_band_mean": 2.4, "tau_baseline": 1.1, "tau_se": 0.05, "tau_prompts": 150,
            "overhead_frac": 0.03, "world_size": 1,
            "status": status,
        }))
    return run_dir


TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3, LLAMA3 = TEMPLATES / "qwen3_style.jinja", TEMPLATES / "llama3_style.jinja"
QWEN3_TOOLS = TEMPLATES / "qwen3_tools.jinja"   # Qwen3's own shape: tools, tool calls, reasoning_content
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def tiny_chat_tokenizer():
    """A fast byte-level tokenizer (no merges) whose chat markers and <think> tags are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(["<pad>", *alphabet])}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<|begin_of_text|>",
                                        eos_token="<|im_end|>", additional_special_tokens=SPECIAL)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


def tiny_tool_tokenizer():
    """tiny_chat_tokenizer plus Qwen3's tool tags as single (added, non-special) tokens."""
    hf = tiny_chat_tokenizer()
    hf.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return hf


def local_qwen3(directory: Path, tokenizer=None) -> Path:
    """A real transformers Qwen3 (random weights, 4 tiny layers) saved with ``tokenizer`` (default
    :func:`tiny_chat_tokenizer`): a local ``model=hf`` target for tests (nothing is downloaded)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tokenizer or tiny_chat_tokenizer()
    tokenizer.save_pretrained(directory)
    config = Qwen3Config(vocab_size=len(tokenizer) + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def write_jsonl(path: Path, records) -> Path:
    """One line per record: dicts as JSON, str and bytes as given (bad lines on purpose)."""
    lines = [r if isinstance(r, (str, bytes)) else json.dumps(r) for r in records]
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return path


# Conversations covering the chat shapes the templates must handle (system, multi-turn, <think>, empty replies).
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}],
    [{"role": "system", "content": "be brief"},
     {"role": "user", "content": "  naïve ✓ question  "},
     {"role": "assistant", "content": "<think>\nfirst thought\n</think>\n\nfirst answer "},
     {"role": "user", "content": "and then?"},
     {"role": "assistant", "content": "no think here"},
     {"role": "user", "content": "last one"},
     {"role": "assistant", "content": "<think>late reasoning</think>final answer"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>\nd\n</think>\n\ne"}],
]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def openai_tool_call(call_id, name, arguments):
    """An OpenAI-style call: arguments as a JSON string when given a str, else HF's dict form."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# (record, the calls' text as the template renders them, the tool responses): OpenAI string arguments, HF dict
# arguments, null and string content beside calls, two calls in one turn, consecutive tool turns.
TOOL_RECORDS = [
    ({"tools": [WEATHER_TOOL],
      "messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None,
                    "tool_calls": [openai_tool_call("c1", "get_weather", '{"city": "Paris"}')]},
                   {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18C, sunny"},
                   {"role": "assistant", "content": "It is 18C and sunny."}]},
     ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'],
     ["18C, sunny"]),
    ({"tools": [WEATHER_TOOL, TIME_TOOL],
      "messages": [{"role": "user", "content": "Weather and time in Oslo?"},
                   {"role": "assistant", "content": "Checking both.",
                    "tool_calls": [openai_tool_call("a", "get_weather", {"city": "Oslo"}),
                                   openai_tool_call("b", "get_time", {"city": "Oslo"})]},
                   {"role": "tool", "tool_call_id": "a", "content": "-3C, snow"},
                   {"role": "tool", "tool_call_id": "b", "content": "14:05"},
                   {"role": "assistant", "content": "Snowy, -3C, and it is 14:05."}]},
     ['Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
      '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'],
     ["-3C, snow", "14:05"]),
]


def tiny_dflash_model(block_size=4, anchors_per_doc=64, anchor_density=None, draft_seed=0, layers=4, fixed_anchors=0,
                      backend="auto", checkpointing=False):
    """A DFlashModel over a random 4-layer Qwen3 target and a 2-layer draft (no cache, no training)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from dflash_lab.data import ByteTokenizer
    from dflash_lab.model import DFlashDraft, DFlashModel, DraftConfig, default_target_layer_ids
    from dflash_lab.model.target import tiny_qwen3_config

    TOK = ByteTokenizer()
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(TOK.vocab_size, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2)
    target = Qwen3ForCausalLM(cfg).eval()
    ids = [1, layers - 2] if layers >= 4 else default_target_layer_ids(layers, 1)
    draft = DFlashDraft(DraftConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                    intermediate_size=64, target_layer_ids=ids), init_seed=draft_seed,
                        activation_checkpointing=checkpointing)
    model = DFlashModel(target, draft, mask_token_id=TOK.mask_token_id, block_size=block_size, loss_gamma=None,
                        anchors_per_doc=anchors_per_doc, anchor_density=anchor_density, draft_init_seed=draft_seed,
                        fixed_anchors=fixed_anchors, attention_backend=backend)
    model.stop_token_ids = TOK.stop_token_ids
    return model


def random_samples(lengths, seed=0):
    """Documents of the given lengths, random token ids, the first third unsupervised."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.bool)
        mask[: n // 3] = False
        out.append({"input_ids": torch.randint(8, 200, (n,), generator=g), "loss_mask": mask})
    return out


# ------------------------------------------------------------------------------------------------------- Slurm
@functools.cache
def slurm_unreachable() -> str | None:
    """Why the Slurm tests cannot run here (None when `sinfo` answers). Asked once, by the first test that runs, not
    at import: with no controller, sinfo retries for ~10 s, which every pytest worker would pay collecting a module
    even when the tier runs none of its tests."""
    if shutil.which("sinfo") is None:
        return "sinfo is not installed"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if out.returncode != 0 or not out.stdout.strip():
        return f"sinfo failed: {(out.stderr.strip().splitlines() or ['no partition'])[-1]}"
    return None


def need_slurm(nodes: int = 1) -> None:
    """Skip without a reachable Slurm of at least ``nodes`` nodes, or fail when CI says it must be there
    (DFLASH_LAB_REQUIRE_SLURM=1)."""
    import pytest

    reason = slurm_unreachable()
    if reason is None and nodes > 1:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30)
        have = len(set(out.stdout.split()))
        if have < nodes:
            reason = f"the cluster has {have} node(s), these tests need {nodes}"
    if reason is None:
        return
    message = (f"no reachable Slurm controller ({reason}); start one with `sudo scripts/slurm_up.sh"
               f"{f' --nodes {nodes}' if nodes > 1 else ''}`")
    if os.environ.get("DFLASH_LAB_REQUIRE_SLURM") == "1":
        pytest.fail(message + " (DFLASH_LAB_REQUIRE_SLURM=1)")
    pytest.skip(message)


# Two CPU ranks per job, sized for a 2-core machine.
SLURM_CPU = [
    "hydra/launcher=slurm",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.tasks_per_node=2",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=4",
    "hydra.launcher.timeout_min=20",
]
# The smallest real training: a few steps, no probes/tau, one thread per rank.
TINY = [
    "trainer.progress=false",
    "trainer.measure_tau=false",
    "trainer.num_threads=1",
    "probes.every=0",
    "probes.presentations=false",
    "sampler.max_tokens=1024",
]


def new_job_name() -> str:
    """A unique Slurm job name suffix (hydra.launcher.name=dflash_<it>), to find a test's jobs in squeue."""
    return f"t{uuid.uuid4().hex[:8]}"


def slurm_jobs(name: str) -> list[str]:
    """The ids of the queued or running jobs named ``dflash_<name>``."""
    out = subprocess.run(["squeue", "-h", "-n", f"dflash_{name}", "-o", "%A"], capture_output=True, text=True)
    return out.stdout.split()


def cancel_jobs(name: str) -> None:
    for job in slurm_jobs(name):
        subprocess.run(["scancel", job], check=False)


def slurm_cli(args, timeout, name, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real entry point; on a timeout cancel the test's jobs (the submitter would wait forever)."""
    try:
        return subprocess.run([sys.executable, "-m", "dflash_lab.train", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired as exc:
        cancel_jobs(name)
        raise AssertionError(f"timed out after {timeout}s:\n{(exc.stderr or b'')[-3000:]}") from exc


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def metric_losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def submitit_logs(sweep_dir: Path) -> str:
    texts = [p.read_text(errors="replace")[-4000:] for p in sorted((sweep_dir / ".submitit").rglob("*.*"))
             if p.suffix in (".out", ".err")]
    return "\n".join(texts)


def wait_for(predicate, timeout, what, proc=None, poll_s=1.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"submitter exited ({proc.returncode}) while waiting for {what}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def allocated_peak_bytes(run_step) -> int:
    """Peak bytes the CPU allocator holds during ``run_step()`` above what it held before (torch.profiler's memory
    events, ``Total Allocated``): every tensor allocation counts, small ones included, which the growth of resident
    memory misses when malloc serves them from heap pages already resident."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step()
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(f"{folder}/trace.json")
        with open(f"{folder}/trace.json") as handle:
            events = json.load(handle)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return int(max(totals) - min(totals))
