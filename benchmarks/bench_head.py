"""Time and peak memory of one LM head + CE forward/backward: chunked reference, torch's fused op, one pass.

    python benchmarks/bench_head.py --slots 4096 --vocab 32768 --hidden 512 --repeats 5

Each variant runs in its own process (peak RSS is per process): ``reference`` (``head_ce_chunked`` with
DFlashModel.CE_CHUNK_ELEMENTS: whole logits up to 2^27 elements), ``reference_chunked`` (forced chunks of
``--chunk-rows`` rows under checkpointing), ``fused`` (``head_ce_fused`` with CE_CHUNK_ELEMENTS) and
``fused_small`` (fused, ``--chunk-rows`` rows), ``one_pass`` (``head_ce_one_pass`` with CE_CHUNK_ELEMENTS, the
default with gradients) and ``one_pass_small`` (``--chunk-rows`` rows). One step = per-slot CE and argmax, weighted sum, backward to the
hidden slots (the head is frozen). Reports the median of ``--repeats`` timed steps after one warm-up step, and the
peak RSS growth over the process's state before the first step (inputs allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("reference", "reference_chunked", "fused", "fused_small", "one_pass", "one_pass_small")


def run_variant(args) -> dict:
    import torch

    from dflash_lab.model.dflash import DFlashModel
    from dflash_lab.model.head import head_ce_chunked, head_ce_fused, head_ce_one_pass

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5
    hidden = torch.randn(args.slots, args.hidden, generator=g)
    labels = torch.randint(0, args.vocab, (args.slots,), generator=g)
    slot_weights = torch.rand(args.slots, generator=g)
    budget = DFlashModel.CE_CHUNK_ELEMENTS
    small = args.chunk_rows * args.vocab
    fn, chunk_elements = {"reference": (head_ce_chunked, budget), "reference_chunked": (head_ce_chunked, small),
                          "fused": (head_ce_fused, budget), "fused_small": (head_ce_fused, small),
                          "one_pass": (head_ce_one_pass, budget),
                          "one_pass_small": (head_ce_one_pass, small)}[args.variant]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats + 1):
        x = hidden.clone().requires_grad_()
        start = time.perf_counter()
        ce, predicted = fn(x, weight, None, labels, chunk_elements)
        (ce * slot_weights).sum().backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": args.variant, "median_s": statistics.median(times[1:]), "times_s": times[1:],
            "peak_rss_growth_mib": (peak - base) / 1024, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-rows", type=int, default=1024)
    parser.add_argument("--variant", choices=VARIANTS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    print(f"S={args.slots} V={args.vocab} H={args.hidden}, median of {args.repeats}")
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--variant", variant] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "variant"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT,
                                           env=env).stdout.splitlines()[-1])
        print(f"{variant:18s} {result['median_s']:7.2f} s  peak RSS +{result['peak_rss_growth_mib']:7.0f} MiB  "
              f"(threads {result['threads']}; {', '.join(f'{t:.2f}' for t in result['times_s'])})", flush=True)


if __name__ == "__main__":
    main()
