"""Where one training step's time goes (benchmarks/gpu_check.py's ``gpu_check_profile`` line): ``torch.profiler`` on
one step, its kernels' time by kernel class and by range of the step.

Ranges (``RANGES``): the target's forward (``target``: ``DFlashModel.target_features``), the draft's forward
(``draft_forward``: the context projection ``draft.project_context`` and the draft layers over the training blocks,
``DFlashModel._draft_blocks``), the LM head and cross-entropy (``head``: ``DFlashModel._head_ce``), the fixed-anchor
pass (``fixed_anchors``: ``DFlashModel._fixed_output``, its own draft layers and head inside it), the rest of the
forward (``forward_other``: anchors, blocks, embeddings), ``backward`` and ``optimizer`` (gradient scaling,
clipping, AdamW), and ``unattributed`` (kernels no range launched). The model's ranges come from
``model_ranges``, which wraps those methods on the model instance for the profiled step only (the model's code is
not changed; a method that is gone is an error naming it); the step's own ranges are ``record_function`` calls in
gpu_check.py's ``train_step``. A kernel belongs to the innermost range open when it was launched (on a GPU: its
launching operator's start; kernels run later than they are launched, so device time is attributed by launch,
not by when it ran).

Time: on CUDA each kernel's device time (the profiler's CUDA activity: kernels, memcpy, memset); on a CPU each
operator's self CPU time (the time in its own code, its child operators' left out, so nothing counts twice). The
step's ``wall_ms`` beside it shows what is neither (idle device, Python and launch overhead on a CPU).

Kernel classes (``kernel_class``, the first pattern of ``CLASS_PATTERNS`` that matches the kernel's or operator's
name, case-insensitive): ``flex_attention`` (the compiled flex_attention kernels, forward and backward),
``sdpa_attention`` (scaled-dot-product attention: flash / memory-efficient / cuDNN kernels; on a GPU the target's
attention, the draft runs flex; on a CPU also the draft's per-document attention), ``gemm`` (cuBLAS / CUTLASS /
nvjet matrix multiplies and their split-K reductions, inductor's matmul templates; aten::mm/addmm/bmm on CPU),
``softmax_ce`` (softmax, log-softmax, NLL, cross-entropy), ``optimizer`` (multi-tensor ``_foreach`` / fused AdamW
kernels: AdamW, gradient scaling and clipping; on a CPU also ``Optimizer.step``'s own Python, while AdamW's
per-parameter aten operators there are elementwise), ``collective`` (NCCL / gloo), ``memcpy`` (copies, casts,
fills, concatenation, host-device transfers), ``inductor_fused`` (other inductor-generated kernels: Triton
``triton_poi`` pointwise, ``triton_red`` / ``triton_per`` reductions, C++ ``cpp_fused`` on a CPU: the compiled
RMSNorm, rope and MLP), ``elementwise`` (eager pointwise and reduction kernels, indexing, embedding; every other
aten operator on a CPU) and ``other`` (autograd's bookkeeping, views and allocations, and what matches nothing:
a GPU kernel here is a name to add).

Cost: the profiled step runs slower than an unprofiled one (its kernels are timed, not the step); reading the
events is O(events) in Python (tens of thousands for a Qwen3-8B step: seconds).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

RANGE_PREFIX = "gpu_check."
RANGES = ("target", "draft_forward", "head", "fixed_anchors", "forward_other", "backward", "optimizer",
          "unattributed")
KERNEL_CLASSES = ("flex_attention", "sdpa_attention", "gemm", "softmax_ce", "optimizer", "collective", "memcpy",
                  "inductor_fused", "elementwise", "other")
CLASS_PATTERNS = (
    # autograd's own bookkeeping (its work runs in the aten operators under it); views and allocations (no kernel)
    ("other", r"^(torch::)?autograd::|backward\d+$|^aten::(empty\w*|new_empty\w*|view|_unsafe_view|reshape"
              r"|_reshape_alias|expand|expand_as|as_strided|slice|select|narrow|transpose|t|permute|unsqueeze|squeeze"
              r"|flatten|split\w*|unbind|alias|detach|lift_fresh|resolve_conj|resolve_neg|result_type|item"
              r"|_local_scalar_dense)$"),
    ("flex_attention", r"flex_attention|flexattention"),
    ("gemm", r"^triton_tem_fused_(add)?b?mm"),   # inductor's matmul templates
    # inductor's kernels are named after the operators they fuse (a softmax, a copy, an attention's prologue)
    ("inductor_fused", r"^triton_|^cpp_fused|compiledfxgraph|compiledfunction"),
    ("sdpa_attention", r"flash_(fwd|bwd)|flash_attention|fmha|efficient_attention|scaled_dot_product|cudnn.*attn"
                       r"|sdpa"),
    ("gemm", r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitkreduce|^aten::(mm|addmm|bmm|baddbmm|matmul|linear"
             r"|_addmm_activation|dot|mv)$"),
    ("softmax_ce", r"softmax|nll_loss|cross_entropy|logsumexp"),
    ("optimizer", r"multi_tensor_apply|foreach|adam|^optimizer\."),
    ("collective", r"nccl|gloo|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter"),
    ("memcpy", r"memcpy|memset|copy|catarray|^aten::(cat|stack|clone|contiguous|to|fill_|zero_|zeros|ones|full"
               r"|zeros_like|ones_like|full_like|new_zeros|new_ones)$"),
    ("elementwise", r"elementwise|reduce_kernel|index|gather|scatter|embedding|^aten::"),
)
_COMPILED_PATTERNS = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CLASS_PATTERNS)


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel or CPU operator name (module docstring).

    Example:
        >>> kernel_class("nvjet_tst_128x256_64x6_2x1_2cta_v_bz_TNT"), kernel_class("triton_poi_fused_mul_silu_0")
        ('gemm', 'inductor_fused')
    """
    return next((cls for cls, pattern in _COMPILED_PATTERNS if pattern.search(name)), "other")


@dataclass(frozen=True)
class Kernel:
    """One kernel (or CPU operator's own time): its name, when it was launched (None: not known), how long it ran
    (microseconds)."""

    name: str
    launch_us: float | None
    duration_us: float


@dataclass(frozen=True)
class Range:
    """One open-close interval of a named range (microseconds, the profiler's clock)."""

    name: str
    start_us: float
    end_us: float


def range_of(launch_us: float | None, ranges: list[Range]) -> str:
    """The innermost (shortest) range open at ``launch_us``; ``unattributed`` when none is (or it is not known)."""
    if launch_us is None:
        return "unattributed"
    open_ranges = [r for r in ranges if r.start_us <= launch_us <= r.end_us]
    return min(open_ranges, key=lambda r: r.end_us - r.start_us).name if open_ranges else "unattributed"


def summarize_kernels(kernels: Iterable[Kernel], ranges: list[Range], top: int = 12) -> dict:
    """Time by kernel class, by range and the top kernels by time, in milliseconds and shares of the total."""
    by_class = dict.fromkeys(KERNEL_CLASSES, 0.0)
    by_range = dict.fromkeys(RANGES, 0.0)
    by_name: dict[str, list] = {}
    for kernel in kernels:
        cls = kernel_class(kernel.name)
        by_class[cls] += kernel.duration_us
        by_range[range_of(kernel.launch_us, ranges)] += kernel.duration_us
        entry = by_name.setdefault(kernel.name, [cls, 0.0, 0])
        entry[1] += kernel.duration_us
        entry[2] += 1
    total = sum(by_class.values())

    def table(times: dict) -> dict:
        return {name: {"ms": round(us / 1e3, 3), "share": round(us / total, 4) if total else None}
                for name, us in sorted(times.items(), key=lambda kv: -kv[1]) if us > 0}

    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"total_ms": round(total / 1e3, 3), "classes": table(by_class), "ranges": table(by_range),
            "top": [{"name": name[:160], "class": cls, "ms": round(us / 1e3, 3), "calls": calls,
                     "share": round(us / total, 4) if total else None} for name, (cls, us, calls) in heaviest]}


# -------------------------------------------------------------------------------------------- the profiler's events


def _is_range(event) -> bool:
    return event.name.startswith(RANGE_PREFIX)


def profile_ranges(events) -> list[Range]:
    """The step's ranges (``record_function`` events named ``gpu_check.<range>``) on the host clock."""
    return [Range(e.name[len(RANGE_PREFIX):], e.time_range.start, e.time_range.end) for e in events
            if _is_range(e) and e.device_type == torch.autograd.DeviceType.CPU]


def _annotation(event) -> bool:
    """A ``record_function`` range (its CPU event, or the span kineto draws for it on the GPU's timeline)."""
    return bool(getattr(event, "is_user_annotation", False))


def device_kernels(events) -> list[Kernel]:
    """CUDA kernels (memcpy and memset included; the ranges' GPU-timeline spans left out, as torch's own tables
    do): those an operator launched at that operator's start (the profiler links them, ``FunctionEvent.kernels``),
    the others (no operator launched them) with no launch time, so they count in their class and as
    ``unattributed``."""
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not _annotation(e)]
    unmatched = Counter(e.name for e in device)
    launched = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:   # (an annotation launches what runs in it
            continue                                             # directly, e.g. a compiled graph's Triton kernels)
        for kernel in event.kernels:
            if unmatched[kernel.name] > 0:
                unmatched[kernel.name] -= 1
                launched.append(Kernel(kernel.name, event.time_range.start, kernel.duration))
    unlinked = []
    for event in device:
        if unmatched[event.name] > 0:
            unmatched[event.name] -= 1
            unlinked.append(Kernel(event.name, None, event.time_range.end - event.time_range.start))
    return launched + unlinked


def cpu_operators(events) -> list[Kernel]:
    """Every CPU operator's self time (the step's ranges left out: their own time is Python; other annotations
    stay: a compiled graph's own time is its C++ kernel)."""
    return [Kernel(e.name, e.time_range.start, e.self_cpu_time_total) for e in events
            if e.device_type == torch.autograd.DeviceType.CPU and not _is_range(e) and e.self_cpu_time_total > 0]


# -------------------------------------------------------------------------------------------- ranges in the model

MODEL_RANGES = (("target", None, "target_features"), ("draft_forward", "draft", "project_context"),
                ("draft_forward", None, "_draft_blocks"), ("head", None, "_head_ce"),
                ("fixed_anchors", None, "_fixed_output"))


@contextlib.contextmanager
def model_ranges(model):
    """Within the block, the model's parts (``MODEL_RANGES``: range, sub-module, method) run inside
    ``record_function("gpu_check.<range>")``; inside the fixed-anchor pass the draft and head open no range of
    their own (its time is the pass's). The wrappers are instance attributes, removed on exit.

    Raises:
        AttributeError: the model has no such method (renamed?): the message names it.
    """
    inside_fixed = [False]
    wrapped = []

    def wrap(owner, method: str, range_name: str) -> None:
        original = getattr(owner, method, None)
        if original is None:
            raise AttributeError(f"gpu_profile.model_ranges: {type(owner).__name__} has no method {method!r} for "
                                 f"the {range_name!r} range: update MODEL_RANGES")

        @functools.wraps(original)
        def ranged(*args, **kwargs):
            if inside_fixed[0]:
                return original(*args, **kwargs)
            with torch.autograd.profiler.record_function(RANGE_PREFIX + range_name):
                inside_fixed[0] = range_name == "fixed_anchors"
                try:
                    return original(*args, **kwargs)
                finally:
                    inside_fixed[0] = False

        object.__setattr__(owner, method, ranged)   # an instance attribute: shadows the class's method
        wrapped.append((owner, method))

    try:
        for range_name, child, method in MODEL_RANGES:
            wrap(getattr(model, child) if child else model, method, range_name)
        yield
    finally:
        for owner, method in wrapped:
            owner.__dict__.pop(method, None)


def profile_step(run_step: Callable[[], None], model, device: torch.device, trace_path: str | None = None) -> dict:
    """Run ``run_step`` once under ``torch.profiler`` with the model's ranges; its time by class, range and kernel
    (``summarize_kernels``), ``time_basis`` saying which time, and the step's wall time. ``trace_path``: also a
    Chrome trace there."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof, model_ranges(model):
        start = time.perf_counter()
        run_step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    if trace_path:   # torch logs a failed write and goes on: make the folder, and check the file is there
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace_path)
        if not Path(trace_path).is_file():
            raise OSError(f"the profiled step's Chrome trace was not written to {trace_path}")
    events = prof.events()
    kernels = device_kernels(events) if cuda else cpu_operators(events)
    summary = summarize_kernels(kernels, profile_ranges(events))
    basis = "CUDA kernel time" if cuda else "CPU operator self time"
    return {"time_basis": basis, "wall_ms": round(wall * 1e3, 3), **summary,
            **({"trace": str(trace_path)} if trace_path else {})}
