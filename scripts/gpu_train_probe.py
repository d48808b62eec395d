"""``python -m dflash_lab.train`` with a probe: what a run does not record about itself, read from inside its process.

    python scripts/gpu_train_probe.py PROBE.json [training overrides ...]
    TORCH_LOGS=recompiles python scripts/gpu_train_probe.py PROBE.json trainer=gpu model=hf model.target_path=...

Runs the training entry point as ``python -m dflash_lab.train <overrides>`` does (``runpy.run_module`` as
``__main__``, the same arguments, so Hydra composes the same config and the run is the same run), then writes
PROBE.json (rank r > 0 of a torchrun launch: PROBE.rank<r>.json), also when the run fails or is refused:

- ``compiled_graphs``: the graphs dynamo compiled in the process (``dflash_lab.model.attention.dynamo_graph_count``:
  flex_attention's, the draft's compiled layers, anything else), and ``flex_graphs``: flex_attention's alone;
- ``peak_mem_gb``: on CUDA ``torch.cuda.max_memory_allocated`` over the whole run (training, evaluation, tau);
  null on a CPU, where ``peak_rss_gb`` is the process's peak resident set (``VmHWM``: interpreter and libraries
  included);
- ``exit_code``: the entry point's (0: it returned).

Why each recompile happened is dynamo's own log (``TORCH_LOGS=recompiles``, which scripts/gpu_check_stages.py's
train stage sets): one ``Recompiling function <name> in <file>`` record per recompile.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
from pathlib import Path

GIB = 2**30


def probe_path(path: str) -> Path:
    """PROBE.json on rank 0 (or without torchrun), PROBE.rank<r>.json on rank r."""
    rank = int(os.environ.get("RANK", "0"))
    out = Path(path)
    return out if rank == 0 else out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def peak_rss_gb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+)", status, re.M).group(1)) * 1024 / GIB


def measurements(exit_code: int) -> dict:
    """The probe's figures at the end of the run (module docstring)."""
    import torch

    from dflash_lab.model.attention import dynamo_graph_count, flex_compile_count

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"exit_code": exit_code, "compiled_graphs": dynamo_graph_count(), "flex_graphs": flex_compile_count(),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / GIB if cuda else None, "peak_rss_gb": peak_rss_gb()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print("usage: python scripts/gpu_train_probe.py PROBE.json [training overrides ...]", file=sys.stderr)
        return 2
    out, overrides = probe_path(argv[0]), argv[1:]
    sys.argv = [sys.argv[0], *overrides]
    code = 1   # until the entry point returns or exits (an exception it lets out: 1, and it propagates)
    try:
        runpy.run_module("dflash_lab.train", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(measurements(code)) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
