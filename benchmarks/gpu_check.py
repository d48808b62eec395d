"""GPU check of the training path: bf16 DFlash steps on a real-size target with random weights, Ktok/s per policy.

    python benchmarks/gpu_check.py                         # Qwen3-8B shape, 32,768-token budget, 12 steps/policy
    python benchmarks/gpu_check.py --shape tiny --device cpu --steps 2 --budget 2048   # the same path on a CPU

For a machine with a GPU (not CI). Builds a Qwen3 target from a ``transformers.Qwen3Config`` with random weights
(no download), wraps it with the project's DFlash draft (``dflash_lab.model.build.wrap_target``), draws batches
from the project's policies over the seed-scale length distribution, and times forward + backward + AdamW under
bf16 autocast. Prints one JSON line per policy (padding efficiency, step time, Ktok/s of real tokens, peak memory).
The tokens are random: the check measures speed and memory of the real shapes, not learning.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from dflash_lab.data import collate_packed, collate_padded
from dflash_lab.data.lengths import reference_lengths
from dflash_lab.metrics.throughput import ktok_per_s, padding_efficiency
from dflash_lab.model.build import wrap_target
from dflash_lab.sampling import build_policy

SHAPES = {
    # Qwen3-8B: 36 layers, hidden 4096, 32 query / 8 key-value heads of 128, MLP 12288, vocabulary 151,936.
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=192, vocab_size=264, max_position_embeddings=8192),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", type=int, default=32768, help="padded tokens per step (packed: row length)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per policy (after 2 warm-up steps)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--policies", default="bucketed,full_random,sorted_static,packed")
    args = parser.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    config = Qwen3Config(**shape, attn_implementation="sdpa")
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(torch.bfloat16 if on_gpu else torch.float32)
    target.eval()
    model = wrap_target(target, mask_token_id=shape["vocab_size"] - 1, block_size=args.block_size)
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=6e-4, fused=on_gpu)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    generator = torch.Generator().manual_seed(0)
    scale = 1 if args.shape != "tiny" else 8
    lengths = reference_lengths("seed", 20000, seed=0, scale=scale)
    lengths = np.minimum(lengths, args.budget)
    print(json.dumps({"shape": args.shape, "device": str(device), "budget": args.budget,
                      "target_params_b": sum(p.numel() for p in target.parameters()) / 1e9,
                      "draft_params_m": sum(p.numel() for p in model.trainable_parameters()) / 1e6}))
    for name in args.policies.split(","):
        params = {"boundaries": [0, 770, 1216, 1728, 2432, 3296, 8192] if scale == 1 else "cpu"} \
            if name.startswith("bucketed") else {}
        policy = build_policy(name, lengths, max_tokens=args.budget, seed=0, overlong="truncate", **params)
        batches = policy.batches(0)[: args.steps + 2]
        collate = collate_packed if policy.packed else collate_padded
        times, real, padded = [], 0, 0
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        for i, idx in enumerate(batches):
            samples = [
                {"input_ids": torch.randint(0, shape["vocab_size"] - 1, (int(policy.lengths[j]),), generator=generator),
                 "loss_mask": torch.ones(int(policy.lengths[j]), dtype=torch.bool)}
                for j in idx
            ]
            batch = collate(samples, idx.tolist(), policy.lengths[idx].tolist(), 0)
            batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with autocast:
                out = model(batch, generator)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if on_gpu:
                torch.cuda.synchronize()  # a sync point on purpose: the step time must include the GPU work
            if i >= 2:  # the first steps warm up kernels and the allocator
                times.append(time.perf_counter() - start)
                real += int(batch["real_tokens"])
                padded += int(batch["padded_tokens"])
        print(json.dumps({
            "policy": name, "steps": len(times), "pad_eff": padding_efficiency(real, padded),
            "step_time_s": float(np.mean(times)), "ktok_s_per_gpu": ktok_per_s(real, float(np.sum(times))),
            "loss": float(out.loss.detach()), "finite": bool(torch.isfinite(out.loss.detach())),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        }), flush=True)


if __name__ == "__main__":
    main()
