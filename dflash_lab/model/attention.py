"""Attention without T x T masks: per-query key intervals -> flex_attention BlockMasks (or exact per-document SDPA).

Every attention of a DFlash training step has the same shape: query i may see the keys of at most two intervals.

    target, packed row:  [start of i's document, i]            causal, same document (padding: itself only)
    draft token of block n (anchor a, document start s, T context keys):
                         [s, a)                                 context strictly before the anchor, same document
                       + [T + n bs, T + (n + 1) bs)             its own block (bidirectional), no other block

``KeyIntervals`` holds these bounds per query (Long[R, Q] tensors, a few bytes per query); everything else is
derived from them, so the mask never exists as a [Q, KV] tensor for a packed row:

* ``flex``: ``flex_block_mask`` lays the R rows end to end as one sequence (batch 1), pads it to whole tiles (128
  tokens on GPU, 32 on CPU; at least two), and builds the BlockMask's tile lists directly from the intervals with
  difference arrays: O(Q + tiles^2) work and memory (a 32K-token GPU row has 256 x 512 tiles). Tiles that every
  query of the tile sees entirely are "full" (no mask evaluation), tiles some query touches are "partial" (the
  mask_mod decides per element). ``flex_attend`` runs the compiled ``torch.nn.attention.flex_attention`` with
  native GQA (``enable_gqa``).
* ``segments``: exact SDPA per (row, document) on that document's keys only; document-sized masks. PyTorch has no
  flex_attention backward on CPU, so this is the CPU path whenever gradients are needed.
* ``dense``: SDPA on the whole Bool[R, 1, Q, KV] mask (``KeyIntervals.dense``): the oracle of the tests, and the
  path for rows that hold a single document (their mask is document-sized anyway).

``attend`` picks the backend (``auto``): flex on CUDA. On CPU, flex only for intervals marked ``cpu_flex`` (the
target's packed rows: no gradient, every token a query, where the alternative is a loop over documents) and the
draft runs per-document SDPA (segments; dense for single-document rows) with or without gradients: the same kernels
in training and in the fixed-anchor and probe passes, and measured about as fast as CPU flex for the draft's few
queries per document (docs/attention.md). A CPU process that trains on padded batches therefore compiles nothing.

Compilation: flex_attention runs through two ``torch.compile`` wrappers, one for calls with gradients (the draft's
training forward) and one without (the target, fixed anchors, probes), each shared by the target and the draft (one
mask_mod for both, so they share compiled graphs). Each compiles one static graph, then one graph with dynamic
lengths at the second distinct shape, and no more, because every call looks the same to the compiler: batch 1,
whole tiles (at least two), contiguous inputs (strides are guarded), four distinct [1, Q] bound tensors (aliasing is
guarded). Batch > 1 and 1-D bound indexing both break torch 2.13's CPU code generation for dynamic shapes.
``flex_compile_count()`` reports the graphs dynamo compiled for flex_attention in this process (other compiled code,
e.g. the draft's compiled layers, is not counted; ``dynamo_graph_count()`` counts every graph).
``TORCHINDUCTOR_CACHE_DIR`` shares compiled kernels across processes (the tests set it).

Cost: flex and segments do the work of the allowed (query, key) pairs rounded up to tiles / documents; dense does
R x Q x KV.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

GPU_TILE = 128    # BlockMask tile (queries and keys): flex_attention's default, what its GPU kernels are built for
CPU_TILE = 32     # the CPU kernel computes whole tiles: smaller ones waste less on short documents (docs/attention.md:
                  # a packed 4K row of 270-token documents, target 27 ms at 128 vs 14 ms at 32, draft 24 vs 11 ms)
BACKENDS = ("auto", "flex", "segments", "dense")
TRANSFORMERS_NAME = "dflash_flex"   # attention implementation name registered with transformers


@dataclass
class KeyIntervals:
    """Keys visible to each query: ``[lo, hi)`` plus, optionally, ``[own_lo, own_hi)``; empty when lo >= hi.

    Args:
        lo, hi: Long[R, Q] first visible key and one past the last of the first interval.
        own_lo, own_hi: Long[R, Q] second interval (a draft token's own block), or None.
        kv_len: number of keys per row (KV).
        backend: ``auto`` | ``flex`` | ``segments`` | ``dense`` (see the module docstring).
        single_document_rows: every row holds one document (dense is then document-sized); None: unknown.
        cpu_flex: ``auto`` uses flex on CPU too (when no gradient is needed).

    Example:
        >>> iv = causal_document_intervals(torch.tensor([[0, 0, 1, 1, 1]]))
        >>> iv.dense()[0, 0].int().tolist()
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    """

    lo: torch.Tensor
    hi: torch.Tensor
    own_lo: torch.Tensor | None
    own_hi: torch.Tensor | None
    kv_len: int
    backend: str = "auto"
    single_document_rows: bool | None = None
    cpu_flex: bool = False
    _block_mask: BlockMask | None = field(default=None, repr=False)
    _row_plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")

    @property
    def rows(self) -> int:
        return self.lo.shape[0]

    @property
    def q_len(self) -> int:
        return self.lo.shape[1]

    def _pairs(self):
        pairs = [(self.lo, self.hi)]
        if self.own_lo is not None:
            pairs.append((self.own_lo, self.own_hi))
        return pairs

    def allowed(self, query_slice: slice, key_index: torch.Tensor, row: slice = slice(None)) -> torch.Tensor:
        """Bool[rows, 1, q, k]: may query ``query_slice`` see key ``key_index`` (absolute key positions [k])."""
        keys = key_index[None, None, :]
        out = None
        for lo, hi in self._pairs():
            part = (keys >= lo[row, query_slice, None]) & (keys < hi[row, query_slice, None])
            out = part if out is None else out | part
        return out[:, None]

    def dense(self) -> torch.Tensor:
        """Bool[R, 1, Q, KV] mask (True = may attend). The oracle; document-sized only for single-document rows."""
        return self.allowed(slice(None), torch.arange(self.kv_len, device=self.lo.device))

    def block_mask(self) -> BlockMask:
        """The flex BlockMask of the rows laid end to end (built once, shared by every layer)."""
        if self._block_mask is None:
            self._block_mask = flex_block_mask(self)
        return self._block_mask

    def row_plan(self, row: int) -> _RowPlan:
        """Row ``row`` cut into per-document problems for ``segments_attend`` (built once, shared by every layer)."""
        if row not in self._row_plans:
            self._row_plans[row] = _row_plan(self, row)
        return self._row_plans[row]


def causal_document_intervals(doc_ids: torch.Tensor, backend: str = "auto") -> KeyIntervals:
    """Key intervals of the target's per-document causal attention: [document start, i]; padding sees itself.

    Documents must be contiguous runs of a row (both collators produce them; see ``document_starts``).
    """
    starts = document_starts(doc_ids)
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    return KeyIntervals(starts, index + 1, None, None, kv_len=doc_ids.shape[1], backend=backend, cpu_flex=True)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """Long[R, T]: index of the first token of each token's document run (a padding token: its own index).

    Example:
        >>> document_starts(torch.tensor([[0, 0, 1, 1, 1, -1]])).tolist()
        [[0, 0, 2, 2, 2, 5]]
    """
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    new_run = torch.ones_like(doc_ids, dtype=torch.bool)
    new_run[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = torch.where(new_run, index, torch.zeros_like(index)).cummax(dim=1).values
    return torch.where(doc_ids >= 0, starts, index)


# ------------------------------------------------------------------------------------------------- flex BlockMask


def tile_size(device: torch.device) -> int:
    """BlockMask tile for ``device``."""
    return GPU_TILE if device.type == "cuda" else CPU_TILE


def _padded_length(n: int, tile: int) -> int:
    """Whole tiles, at least two (a one-tile dimension is specialised by the compiler: an extra graph)."""
    return max(2, math.ceil(n / tile)) * tile


def _flat(values: torch.Tensor, offsets: torch.Tensor, empty: torch.Tensor, length: int) -> torch.Tensor:
    """Row-local bounds [R, Q] -> bounds on the rows laid end to end, padded to ``length`` queries (empty)."""
    flat = torch.where(empty, torch.zeros_like(values), values + offsets).flatten()
    return F.pad(flat, (0, length - flat.numel())).to(torch.int32)


def _coverage(lo: torch.Tensor, hi: torch.Tensor, q_tiles: int, kv_tiles: int, tile: int):
    """Per (query tile, key tile): does some query touch it, and how many queries cover it entirely."""
    device = lo.device
    tile_of_query = torch.arange(lo.numel(), device=device) // tile
    width = kv_tiles + 1

    def counts(first: torch.Tensor, last_excl: torch.Tensor) -> torch.Tensor:
        # difference array: +1 at the first tile, -1 after the last, prefix sums give per-tile counts
        # (weights instead of a boolean filter: no host sync on the GPU)
        weight = (last_excl > first).to(torch.int32)
        base = tile_of_query * width
        diff = torch.zeros(q_tiles * width, dtype=torch.int32, device=device)
        diff.index_add_(0, base + first.clamp(0, kv_tiles), weight)
        diff.index_add_(0, base + last_excl.clamp(0, kv_tiles), -weight)
        return diff.view(q_tiles, width).cumsum(dim=1, dtype=torch.int32)[:, :kv_tiles]

    lo64, hi64 = lo.long(), hi.long()
    touched = counts(lo64 // tile, (hi64 - 1) // tile + 1) > 0
    covered = counts((lo64 + tile - 1) // tile, hi64 // tile)
    return touched, covered


def _ordered(tiles: torch.Tensor):
    """Dense Bool[nQ, nKV] tile grid -> (num Int32[1, 1, nQ], indices Int32[1, 1, nQ, nKV]) in key order."""
    num = tiles.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None], indices[None, None]


def flex_block_mask(intervals: KeyIntervals) -> BlockMask:
    """BlockMask for ``intervals`` with the rows laid end to end (batch 1), padded to whole tiles.

    Row r's queries are flat queries [r Q, (r + 1) Q) and its keys flat keys [r KV, (r + 1) KV). Padding queries
    see nothing; padding keys are seen by nobody. Tiles are "full" only when every real query of the tile sees
    every key of the tile (padding queries of the tile do not count), else "partial" when any query touches them.
    """
    rows, q_len, kv_len = intervals.rows, intervals.q_len, intervals.kv_len
    device = intervals.lo.device
    tile = tile_size(device)
    q_pad, kv_pad = _padded_length(rows * q_len, tile), _padded_length(rows * kv_len, tile)
    offsets = (torch.arange(rows, device=device) * kv_len)[:, None]
    flat_pairs = []
    for lo, hi in intervals._pairs():
        empty = hi <= lo
        flat_pairs.append((_flat(lo, offsets, empty, q_pad), _flat(hi, offsets, empty, q_pad)))
    q_tiles, kv_tiles = q_pad // tile, kv_pad // tile
    touched = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool, device=device)
    covered = torch.zeros(q_tiles, kv_tiles, dtype=torch.int32, device=device)
    for lo, hi in flat_pairs:
        t, c = _coverage(lo, hi, q_tiles, kv_tiles, tile)
        touched |= t
        covered += c   # the two intervals are disjoint: a tile is covered by at most one of them
    real = torch.arange(q_pad, device=device) < rows * q_len
    real_per_tile = real.view(q_tiles, tile).sum(dim=1, dtype=torch.int32)[:, None]
    full = (covered == real_per_tile) & (real_per_tile > 0)
    partial = touched & ~full
    if len(flat_pairs) == 1:   # one mask_mod for every caller: an empty second interval
        # (two tensors: one tensor in both places would be an aliasing guard, i.e. another compiled graph)
        flat_pairs.append(tuple(torch.zeros(q_pad, dtype=torch.int32, device=device) for _ in range(2)))
    # [1, Q] tensors indexed [b, q]: torch 2.13's CPU code generation fails on this mask with 1-D [q] indexing
    (lo_a, hi_a), (lo_b, hi_b) = ((lo[None], hi[None]) for lo, hi in flat_pairs)

    def mask_mod(b, h, q, kv):
        return ((kv >= lo_a[b, q]) & (kv < hi_a[b, q])) | ((kv >= lo_b[b, q]) & (kv < hi_b[b, q]))

    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(q_pad, kv_pad))


# -------------------------------------------------------------------------------------------------- attention


def _flex_with_grad(q, k, v, block_mask, scale, enable_gqa):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _flex_no_grad(q, k, v, block_mask, scale, enable_gqa):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


@functools.cache
def _compiled_flex(with_grad: bool):
    # Two functions, two code objects: dynamo counts graphs against its recompile limit per code object, and the
    # training forward (grad) and the no-grad passes (fixed anchors, probes, the target) each need their own
    # static and dynamic graphs; apart they stay at two to four each.
    return torch.compile(_flex_with_grad if with_grad else _flex_no_grad)


_FLEX_GRAPHS = [0]   # graphs dynamo compiled during flex_attend's compiled calls (this process)


def dynamo_graph_count() -> int:
    """Every graph dynamo compiled in this process (flex_attention's, the draft's compiled layers, anything else)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def flex_compile_count() -> int:
    """Graphs dynamo compiled for flex_attention in this process: the graphs that appeared during
    ``flex_attend``'s compiled calls (compilation is synchronous, so those are flex's own), and nothing else."""
    return _FLEX_GRAPHS[0]


def flex_supported(*tensors: torch.Tensor) -> bool:
    """flex_attention runs here: CUDA always; CPU only without gradients (PyTorch has no CPU flex backward)."""
    device = tensors[0].device.type
    if device == "cuda":
        return True
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return device == "cpu" and not needs_grad


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                scale: float | None = None) -> torch.Tensor:
    """Compiled flex_attention of [R, H, Q, d] queries on [R, Hkv, KV, d] keys under a ``flex_block_mask``."""
    rows, heads, q_len, dim = q.shape
    q_pad, kv_pad = block_mask.seq_lengths

    def flat(x: torch.Tensor, length: int) -> torch.Tensor:
        # contiguous: the compiled graph guards on strides, so one layout for every caller means no recompiles
        x = x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[-1])
        return F.pad(x, (0, 0, 0, length - x.shape[2])).contiguous()

    if torch._C._len_torch_dispatch_stack():
        # Under a Python dispatch mode (torch's FlopCounterMode, a memory tracker) flex_attention fails in torch
        # 2.13 and leaves dynamo broken for the rest of the process: the same mask as one dense SDPA instead.
        allowed = create_mask(block_mask.mask_mod, 1, 1, q_pad, kv_pad, device=q.device)
        out = dense_attend(flat(q, q_pad), flat(k, kv_pad), flat(v, kv_pad), allowed, scale)
    else:
        counting = not torch.compiler.is_compiling()   # (inside a caller's compiled graph nothing compiles here)
        graphs_before = dynamo_graph_count() if counting else 0
        out = _compiled_flex(torch.is_grad_enabled())(flat(q, q_pad), flat(k, kv_pad), flat(v, kv_pad), block_mask,
                                                      scale, heads != k.shape[1])
        if counting:
            _FLEX_GRAPHS[0] += dynamo_graph_count() - graphs_before
    return out[:, :, : rows * q_len].reshape(heads, rows, q_len, dim).transpose(0, 1)


def dense_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                 scale: float | None = None) -> torch.Tensor:
    """SDPA with a boolean mask (None: everything visible); GQA native."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@dataclass(frozen=True)
class _RowPlan:
    """How one row splits into per-document attention problems (computed once, shared by all layers)."""

    query_sizes: list[int]            # consecutive query runs
    key_sizes: list[int]              # the row's keys cut at every run's range ends
    key_pieces: list[list[int]]       # per run: the key pieces it attends to
    allowed: list[torch.Tensor]       # per run: Bool[1, 1, queries, keys] exact mask on those keys


def _row_plan(intervals: KeyIntervals, row: int) -> _RowPlan:
    """Runs of queries sharing their first visible key (one document's blocks), each with the key ranges it needs."""
    lo, hi = intervals.lo[row], intervals.hi[row]
    run_key = torch.where(hi > lo, lo, -1)
    change = torch.ones_like(run_key, dtype=torch.bool)
    change[1:] = run_key[1:] != run_key[:-1]
    run_of = change.long().cumsum(0) - 1
    runs = int(run_of[-1]) + 1
    bounds = []
    for first, last in intervals._pairs():
        first, last = first[row], last[row]
        nonempty = last > first
        big = torch.full((runs,), intervals.kv_len, dtype=first.dtype, device=first.device)
        low = big.scatter_reduce(0, run_of, torch.where(nonempty, first, intervals.kv_len), "amin")
        high = torch.zeros_like(big).scatter_reduce(0, run_of, torch.where(nonempty, last, 0), "amax")
        bounds += [low, high]
    sizes = torch.bincount(run_of, minlength=runs)
    table = torch.stack([sizes] + bounds, dim=1).tolist()   # one host transfer per row
    ranges = [[(a, b) for a, b in zip(entry[1::2], entry[2::2]) if b > a] for entry in table]
    cuts = sorted({0, intervals.kv_len} | {x for run in ranges for pair in run for x in pair})
    piece_at = {cut: i for i, cut in enumerate(cuts)}
    key_pieces, allowed, start = [], [], 0
    for entry, run in zip(table, ranges):
        key_pieces.append([i for a, b in run for i in range(piece_at[a], piece_at[b])])
        key_index = torch.cat([torch.arange(a, b, device=lo.device) for a, b in run]) if run else \
            torch.zeros(0, dtype=torch.long, device=lo.device)
        allowed.append(intervals.allowed(slice(start, start + entry[0]), key_index, slice(row, row + 1)))
        start += entry[0]
    return _RowPlan([entry[0] for entry in table], [b - a for a, b in zip(cuts, cuts[1:])], key_pieces, allowed)


def segments_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, intervals: KeyIntervals,
                    scale: float | None = None) -> torch.Tensor:
    """Exact attention, one SDPA per run of queries that share a first visible key (a document's blocks).

    Each run attends to the union of its queries' intervals only, under the exact mask restricted to those keys:
    document-sized work and memory, never a [Q, KV] mask of a packed row. Rows, query runs and key ranges are
    taken with ``split`` (whose backward is one concatenation), not with indexing (a full-size gradient per run).
    """
    outputs = []
    for row, (q_row, k_row, v_row) in enumerate(zip(q.split(1), k.split(1), v.split(1))):
        plan = intervals.row_plan(row)
        k_pieces, v_pieces = k_row.split(plan.key_sizes, dim=2), v_row.split(plan.key_sizes, dim=2)
        pieces = []
        for q_run, used, allowed in zip(q_row.split(plan.query_sizes, dim=2), plan.key_pieces, plan.allowed):
            if not used:   # nothing visible: zeros, like flex's empty rows
                pieces.append(torch.zeros_like(q_run))
                continue
            k_run = torch.cat([k_pieces[i] for i in used], dim=2) if len(used) > 1 else k_pieces[used[0]]
            v_run = torch.cat([v_pieces[i] for i in used], dim=2) if len(used) > 1 else v_pieces[used[0]]
            pieces.append(dense_attend(q_run, k_run, v_run, allowed, scale))
        outputs.append(torch.cat(pieces, dim=2))
    return torch.cat(outputs, dim=0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, intervals: KeyIntervals | None,
           scale: float | None = None) -> torch.Tensor:
    """Attention of [R, H, Q, d] queries on [R, Hkv, KV, d] keys/values under ``intervals`` (None: no mask).

    Backend ``auto``: see the module docstring.
    """
    if intervals is None:
        return dense_attend(q, k, v, None, scale)
    backend = intervals.backend
    if backend == "auto":
        on_cpu_too = intervals.cpu_flex or q.device.type == "cuda"
        if on_cpu_too and flex_supported(q, k, v):
            backend = "flex"
        else:
            backend = "dense" if intervals.single_document_rows else "segments"
    if backend == "flex":
        return flex_attend(q, k, v, intervals.block_mask(), scale)
    if backend == "segments":
        return segments_attend(q, k, v, intervals, scale)
    return dense_attend(q, k, v, intervals.dense(), scale)


def _transformers_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: flex_attention under a ``flex_block_mask`` (the target's packed rows)."""
    if not isinstance(attention_mask, BlockMask):
        raise TypeError(f"attention implementation {TRANSFORMERS_NAME!r} needs a flex BlockMask, got "
                        f"{type(attention_mask).__name__}")
    if dropout:
        raise ValueError("the target runs without attention dropout (it is frozen, in eval mode)")
    out = flex_attend(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def register_with_transformers() -> None:
    """Make ``TRANSFORMERS_NAME`` a valid ``config._attn_implementation`` for HF models (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TRANSFORMERS_NAME, _transformers_attention)
