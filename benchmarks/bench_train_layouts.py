"""Training throughput of packed rows against length-sorted padded batches, same run, same budget.

    python benchmarks/bench_train_layouts.py                        # 80 steps each, default data and model
    python benchmarks/bench_train_layouts.py --steps 120 --repeats 2 --rss-tokens 32768
    python benchmarks/bench_train_layouts.py --attention --max-tokens 4096 --doc-len 256   # attention paths only
    git archive <commit> --prefix=old/ | tar -x -C /tmp                                  # the same step, older code:
    python benchmarks/bench_train_layouts.py --steps 0 --rss-tokens 32768 --code /tmp/old

Each policy trains through ``dflash_lab.train.train`` (the real loop: data loader, target, draft, optimizer) on the
default synthetic data and the tiny model, with the same ``sampler.max_tokens`` budget and ``trainer.max_steps``,
tau and probes off. Ktok/s is the run's steady-state value (``summary.json``: median over steps after the warm-up
steps, real tokens only; ``dflash_lab.metrics.throughput``). With ``--repeats`` > 1 the policies alternate
(packed, sorted_static, packed, ...) and the median per policy is reported, so a load change on a shared machine
hits both. The acceptance line checks packed >= 0.8 x sorted_static.

``--rss-tokens N`` also runs one packed step with ``sampler.max_tokens=N`` in a fresh process (address space capped
at ``--rss-cap-gb``) and reports its peak resident memory (``ru_maxrss``), beside the size of one N x N boolean
mask. ``--code DIR`` runs that step with the dflash_lab package found in DIR (e.g. ``git archive`` of another
commit) for a before/after comparison.

Compile: flex_attention compiles in the first steps of the first run (a few seconds with a warm
``TORCHINDUCTOR_CACHE_DIR``); the warm-up steps keep it out of the steady state. The number of compiled graphs is
printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("packed", "sorted_static")


def train_once(policy: str, steps: int, max_tokens: int, run_dir: Path, threads: int, extra: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    from dflash_lab.train import train

    overrides = [f"run_dir={run_dir}", f"sampler={policy}", f"sampler.max_tokens={max_tokens}",
                 f"trainer.max_steps={steps}", "trainer.measure_tau=false", "probes.every=0",
                 "probes.presentations=false", "trainer.progress=false", f"trainer.num_threads={threads}",
                 "trainer.ckpt_every=0", *extra]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    start = time.perf_counter()
    summary = train(cfg)
    summary["run_wall_s"] = time.perf_counter() - start
    return summary


def peak_rss_of_one_packed_step(tokens: int, code: Path, threads: int, cap_gb: float) -> dict:
    """Peak RSS (MiB) of a fresh ``python -m dflash_lab.train`` process running one packed step.

    The child's address space is capped at ``cap_gb`` (a dense-mask step at 32K tokens would otherwise take the
    memory of a shared machine); past the cap it fails, and the result says so.
    """
    def cap() -> None:
        limit = int(cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "dflash_lab.train", "sampler=packed", f"sampler.max_tokens={tokens}",
                   "trainer.max_steps=1", "trainer.measure_tau=false", "probes.every=0", "trainer.progress=false",
                   f"trainer.num_threads={threads}", f"hydra.run.dir={tmp}/run"]
        env = dict(os.environ, PYTHONPATH=str(code))
        start = time.perf_counter()
        with open(Path(tmp) / "stderr.txt", "w") as stderr:
            child = subprocess.Popen(command, cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                     preexec_fn=cap)
            _, status, usage = os.wait4(child.pid, 0)   # usage of this child alone (ru_maxrss: KiB on Linux)
        failed = os.waitstatus_to_exitcode(status) != 0
        error = (Path(tmp) / "stderr.txt").read_text()[-300:] if failed else None
    return {"max_tokens": tokens, "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "one_bool_mask_mib": round(tokens * tokens / 2**20, 1), "seconds": round(time.perf_counter() - start, 1),
            "code": str(code), "failed": failed, "cap_gb": cap_gb, "error": error}


def attention_micro(tokens: int, doc_len: int, repeats: int) -> list[dict]:
    """Seconds per attention call on one packed row of ``doc_len``-token documents (best of ``repeats``).

    Target: per-document causal attention (dense SDPA on the T x T mask, flex at 128- and 32-token tiles, exact
    per-document SDPA, and SDPA causal on the same documents padded one per row as the sorted_static reference).
    Draft: block queries at density 1/16, block size 8 (dense, flex, per-document). 4 heads on 2 kv heads, d 16.
    """
    import torch
    import torch.nn.functional as F

    from dflash_lab.model import attention
    from dflash_lab.model.objective import build_blocks, draft_key_intervals, sample_anchors

    torch.set_num_threads(1)
    lengths = [doc_len] * (tokens // doc_len) + ([tokens % doc_len] if tokens % doc_len else [])
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    g = torch.Generator().manual_seed(0)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return round(min(times), 4)

    def flex_at(tile: int, make):
        def run():
            attention.CPU_TILE = tile
            return attention.flex_attend(q, k, v, make().block_mask(), 0.25)
        return run

    rows = []
    with torch.no_grad():
        target = lambda: attention.causal_document_intervals(doc_ids)   # noqa: E731
        q, k, v = torch.randn(1, 4, tokens, 16, generator=g), *torch.randn(2, 1, 2, tokens, 16, generator=g)
        padded = [torch.randn(len(lengths), h, doc_len, 16, generator=g) for h in (4, 2, 2)]
        rows.append({"attention": "target", "tokens": tokens, "doc_len": doc_len,
                     "dense_mask_s": best(lambda: attention.dense_attend(q, k, v, target().dense(), 0.25)),
                     "flex_tile128_s": best(flex_at(128, target)), "flex_tile32_s": best(flex_at(32, target)),
                     "per_document_s": best(lambda: attention.segments_attend(q, k, v, target(), 0.25)),
                     "padded_causal_sdpa_s": best(lambda: F.scaled_dot_product_attention(*padded, is_causal=True,
                                                                                          enable_gqa=True))})
        loss_mask = torch.ones_like(doc_ids, dtype=torch.bool)
        anchors = sample_anchors(loss_mask, doc_ids, g, 64, 1 / 16, len(lengths))
        blocks = build_blocks(doc_ids, loss_mask, doc_ids * 0, doc_ids, *anchors, block_size=8, mask_token_id=0,
                              gamma=None)
        draft = lambda: draft_key_intervals(blocks, tokens)   # noqa: E731
        queries = draft().q_len
        q, k, v = (torch.randn(1, 4, queries, 16, generator=g),
                   *torch.randn(2, 1, 2, tokens + queries, 16, generator=g))
        rows.append({"attention": "draft", "tokens": tokens, "doc_len": doc_len, "queries": queries,
                     "dense_mask_s": best(lambda: attention.dense_attend(q, k, v, draft().dense(), 0.25)),
                     "flex_tile128_s": best(flex_at(128, draft)), "flex_tile32_s": best(flex_at(32, draft)),
                     "per_document_s": best(lambda: attention.segments_attend(q, k, v, draft(), 0.25))})
    attention.CPU_TILE = 32
    return rows


def throughput(args) -> None:
    """Train each policy ``args.repeats`` times (alternating) and print Ktok/s per run, medians and the ratio."""
    from dflash_lab.model.attention import flex_compile_count

    results: dict[str, list[dict]] = {p: [] for p in args.policies}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for policy in args.policies:
                summary = train_once(policy, args.steps, args.max_tokens, Path(tmp) / f"{policy}_{repeat}",
                                     args.threads, args.override)
                results[policy].append(summary)
                row = {"policy": policy, "repeat": repeat, "ktok_s": round(summary["ktok_s"], 3),
                       "pad_eff": round(summary["pad_eff"], 4), "step_time_s": round(summary["step_time_s"], 4),
                       "steps": summary["steps"], "run_wall_s": round(summary["run_wall_s"], 1)}
                print(json.dumps(row), flush=True)
    ktok = {p: statistics.median(s["ktok_s"] for s in runs) for p, runs in results.items()}
    report = {f"{p}_ktok_s": round(k, 3) for p, k in ktok.items()}
    if set(POLICIES) <= set(ktok):
        ratio = ktok["packed"] / ktok["sorted_static"]
        report.update(ratio_packed_over_sorted_static=round(ratio, 3), accept_ratio_ge_0_8=ratio >= 0.8)
    print(json.dumps({**report, "compiled_graphs": flex_compile_count(), "steps": args.steps,
                      "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": args.threads,
                      "overrides": args.override}))



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run (0: no throughput runs)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rss-tokens", type=int, default=0, help="also measure one packed step's peak RSS (0: no)")
    parser.add_argument("--code", type=Path, default=ROOT, help="dflash_lab checkout used for the RSS step")
    parser.add_argument("--rss-cap-gb", type=float, default=8.0, help="address-space cap of the RSS step's process")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--attention", action="store_true", help="only time the attention paths on one packed row")
    parser.add_argument("--doc-len", type=int, default=256, help="--attention: document length")
    parser.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides for every run, e.g. "
                        "model.fixed_anchors=0")
    args = parser.parse_args()

    if args.attention:
        for row in attention_micro(args.max_tokens, args.doc_len, max(args.repeats, 5)):
            print(json.dumps(row))
        return
    if args.steps > 0:
        throughput(args)
    if args.rss_tokens:
        print(json.dumps(peak_rss_of_one_packed_step(args.rss_tokens, args.code.resolve(), args.threads,
                                                     args.rss_cap_gb)))


if __name__ == "__main__":
    main()
