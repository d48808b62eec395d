"""Learning probes recorded during training: per-band probe sets and per-example presentation records.

Two instruments feed the forgetting metrics of docs/metrics.md (``dflash_lab.metrics.forgetting`` computes them; this
module only records):

* **Probe bands** (:class:`ProbeSets`): a fixed held-out probe set per length band. Bands are a fixed list of
  boundaries (default the CPU-scale ``[0, 96, 152, 216, 304, 412, 1024]``, ``probes.bands``), the same for every
  policy so runs compare; band b holds lengths in ``(bands[b], bands[b+1]]`` (the one length -> bucket rule,
  ``sampling.bucket_ids``). ``probes.per_band`` samples per band are drawn from the held-out split with a seed of their
  own (``probes.seed``), so every run of a sweep evaluates the very same examples. Every ``probes.every`` steps each
  band is evaluated with the model's ``evaluate`` (no grad) on each example's fixed anchors (positions drawn once
  from the example id, ``model.fixed_anchors`` per document), so a change in a band's loss is a change of the
  model, not of anchor sampling. Rows go to ``probes.jsonl``:
  ``record.PROBE_FIELDS`` (tokens = supervised block positions scored).
* **Presentations** (:class:`PresentationRecorder`): for every training example each time it is presented, its
  block accuracy on its fixed anchors, scored with the weights of that step before its update (a no-grad pass
  right after the training forward): ``sample_index, epoch, step, length, band, acc`` from
  ``StepOutput.doc_correct / doc_count``. Examples with no valid anchor position (``doc_count == 0``) have no
  accuracy and are not recorded. Rows are buffered and
  written to ``presentations.parquet`` at checkpoints and at the end; a resumed run keeps the rows of steps up to
  its checkpoint (the step rule of ``dflash_lab.records.record``).

Cost: one forward per band (a few short sequences) every ``probes.every`` steps; the records are a few numpy
appends per step. Both are counted in the trainer's overhead figure.

Example:
    >>> import numpy as np
    >>> validate_bands([0, 96, 152])
    [0, 96, 152]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dflash_lab.config_check import as_int
from dflash_lab.records.record import PRESENTATION_COLUMNS
from dflash_lab.sampling.boundaries import bucket_ids

DEFAULT_BANDS = (0, 96, 152, 216, 304, 412, 1024)


def validate_bands(bands: list[int] | tuple[int, ...]) -> list[int]:
    """Check a band boundary list: at least two strictly increasing integers starting at 0.

    Raises:
        ValueError: naming ``probes.bands`` and the fix.
    """
    if isinstance(bands, (str, bytes)) or not hasattr(bands, "__iter__"):
        raise ValueError(f"probes.bands={bands!r}: give a list of boundaries, e.g. {list(DEFAULT_BANDS)}, or auto "
                         f"(the data's length quantiles)")
    values = [as_int("probes.bands", b, minimum=0) for b in bands]
    if len(values) < 2 or values[0] != 0 or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"probes.bands={list(bands)}: give strictly increasing boundaries starting at 0, "
            f"e.g. {list(DEFAULT_BANDS)}"
        )
    return values


def fitted_bands(lengths: np.ndarray, num_bands: int = 6, multiple: int = 16) -> list[int]:
    """Probe bands at the data's length quantiles (the buckets' own ``quantile`` fit, ``sampling.fit_boundaries``):
    ``num_bands`` bands of about equal sample counts, inner boundaries rounded up to a multiple of ``multiple``
    tokens, the last at the longest sample (band b = (lo, hi]).

    Example:
        >>> fitted_bands(np.arange(1, 601), num_bands=3)
        [0, 208, 400, 600]
    """
    from dflash_lab.sampling.boundaries import fit_boundaries

    fitted = fit_boundaries(np.asarray(lengths), num_bands, "quantile")
    longest = fitted[-1]
    inner = sorted({min(longest, -(-b // multiple) * multiple) for b in fitted[1:-1]} - {longest})
    return [0, *inner, longest]


def resolve_bands(bands: list[int] | str, lengths: np.ndarray, *, builtin_corpus: bool) -> list[int]:
    """``probes.bands``: a list as given; ``auto``: the built-in corpus's bands (:data:`DEFAULT_BANDS`, so runs
    compare with the ablation) for the built-in corpus, else bands at the data's length quantiles
    (:func:`fitted_bands`)."""
    if bands != "auto":
        return list(bands)
    return list(DEFAULT_BANDS) if builtin_corpus else fitted_bands(lengths)


@dataclass(frozen=True)
class ProbeSet:
    """The probe examples of one band: held-out dataset indices and the band's bounds."""

    band: int
    lo: int
    hi: int
    indices: np.ndarray


class ProbeSets:
    """Fixed probe sets per length band, drawn once from the held-out split.

    Args:
        heldout_lengths: lengths of the held-out dataset (``heldout_ds.lengths``).
        bands: band boundaries (``probes.bands``, as ``ProbeSettings`` checked them and ``resolve_bands`` resolved
            ``auto``).
        per_band: examples per band (``probes.per_band``); a band with fewer held-out examples takes them all, and
            a band with none is left out (logged by the trainer).
        seed: the probe seed (``probes.seed``), independent of the run seed so all runs share the same probes.
        max_tokens: cap on the tokens of one probe batch (longest x rows); a band's examples are split into several
            forward passes when they exceed it.
    """

    def __init__(self, heldout_lengths: np.ndarray, bands: list[int], per_band: int, seed: int, max_tokens: int):
        self.bands = list(bands)
        self.max_tokens = int(max_tokens)
        lengths = np.asarray(heldout_lengths, dtype=np.int64)
        band_ids = bucket_ids(lengths, self.bands)
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x70B3]))
        self.sets: list[ProbeSet] = []
        self.empty_bands: list[int] = []
        for band in range(len(self.bands) - 1):
            members = np.flatnonzero(band_ids == band)
            if members.size == 0:
                self.empty_bands.append(band)
                continue
            chosen = np.sort(rng.choice(members, size=min(per_band, members.size), replace=False))
            self.sets.append(ProbeSet(band, self.bands[band], self.bands[band + 1], chosen.astype(np.int64)))
        self._lengths = lengths

    def chunks(self, probe: ProbeSet) -> list[np.ndarray]:
        """Split a band's examples into forward passes of at most ``max_tokens`` padded tokens."""
        out, current, longest = [], [], 0
        for index in probe.indices.tolist():
            length = int(self._lengths[index])
            wider = max(longest, length)
            if current and wider * (len(current) + 1) > self.max_tokens:
                out.append(np.asarray(current, dtype=np.int64))
                current, wider = [], length
            current.append(index)
            longest = wider
        if current:
            out.append(np.asarray(current, dtype=np.int64))
        return out

    def evaluate(
        self,
        evaluate_batch: Callable[[np.ndarray, torch.Generator], Any],
        step: int,
        seed: int,
    ) -> list[dict[str, Any]]:
        """Evaluate every band; returns ``probes.jsonl`` rows.

        Args:
            evaluate_batch: ``(heldout indices, generator) -> StepOutput-like`` with ``weighted_ce_sum``,
                ``weight_sum``, ``correct`` and ``count`` (the trainer collates and calls ``model.evaluate``).
            step: training step the rows are tagged with.
            seed: the anchor generator is reset to this seed for every band, so each evaluation scores the same
                blocks.

        Returns:
            One row per band: ``{step, band, band_lo, band_hi, loss, acc, tokens}``; loss and acc are NaN for a
            band where no block could be scored.
        """
        rows = []
        for probe in self.sets:
            generator = torch.Generator().manual_seed(int(seed) * 1000 + probe.band)
            ce = weight = correct = count = 0.0
            for chunk in self.chunks(probe):
                out = evaluate_batch(chunk, generator)
                ce += float(out.weighted_ce_sum)
                weight += float(out.weight_sum)
                correct += float(out.correct)
                count += float(out.count)
            rows.append(
                {
                    "step": int(step),
                    "band": probe.band,
                    "band_lo": probe.lo,
                    "band_hi": probe.hi,
                    "loss": ce / weight if weight > 0 else math.nan,
                    "acc": correct / count if count > 0 else math.nan,
                    "tokens": int(count),
                }
            )
        return rows


def heldout_evaluator(model, heldout_ds, pad_id: int, device: torch.device, autocast) -> Callable:
    """The ``evaluate_batch`` of :meth:`ProbeSets.evaluate`: collate held-out examples (padded) and evaluate them.

    Args:
        model: the DFlashModel (``model.evaluate(batch, generator)``, no gradients).
        heldout_ds: the held-out dataset view the probe indices point into.
        pad_id: the tokenizer's padding id.
        device: where the model runs.
        autocast: the training step's autocast context (bf16 on GPU), so probes see the same numerics.
    """
    from dflash_lab.data import collate_padded

    def evaluate_batch(indices: np.ndarray, generator: torch.Generator):
        lengths = heldout_ds.lengths[indices]
        batch = collate_padded([heldout_ds[int(i)] for i in indices], indices, lengths, pad_id)
        if device.type != "cpu":
            batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        with autocast:
            return model.evaluate(batch, generator)

    return evaluate_batch


class PresentationRecorder:
    """Buffers one row per (training example, presentation) and writes ``presentations.parquet``.

    Args:
        path: ``<run_dir>/presentations.parquet``.
        bands: band boundaries for the ``band`` column (the probe bands, so both views line up).
    """

    def __init__(self, path: Path | str, bands: list[int]):
        self.path = Path(path)
        self.bands = list(bands)
        self._chunks: list[dict[str, np.ndarray]] = []
        self._previous: Any = None  # a pyarrow table loaded on resume

    def warm_up(self) -> None:
        """Write an empty table to memory once: pyarrow's first parquet write initialises lazily (~0.4 s), which
        would otherwise land inside the training loop's first checkpoint (setup is the place for it)."""
        import io

        empty = pa.table({name: pa.array([], type=pa.int64()) for name in PRESENTATION_COLUMNS[:-1]}
                         | {"acc": pa.array([], type=pa.float32())})
        pq.write_table(empty, io.BytesIO())

    def record(
        self,
        sample_index: np.ndarray,
        lengths: np.ndarray,
        correct: np.ndarray,
        count: np.ndarray,
        *,
        epoch: int,
        step: int,
    ) -> None:
        """Add the documents of one batch (``StepOutput.doc_correct / doc_count``, already on the CPU)."""
        count = np.asarray(count, dtype=np.float64)
        scored = count > 0
        if not scored.any():
            return
        lengths = np.asarray(lengths, dtype=np.int64)[scored]
        self._chunks.append(
            {
                "sample_index": np.asarray(sample_index, dtype=np.int64)[scored],
                "epoch": np.full(int(scored.sum()), epoch, dtype=np.int64),
                "step": np.full(int(scored.sum()), step, dtype=np.int64),
                "length": lengths,
                "band": bucket_ids(lengths, self.bands),
                "acc": (np.asarray(correct, dtype=np.float64)[scored] / count[scored]).astype(np.float32),
            }
        )

    def __len__(self) -> int:
        previous = 0 if self._previous is None else self._previous.num_rows
        return previous + sum(c["step"].size for c in self._chunks)

    def resume(self, last_step: int | None) -> int:
        """Apply the record's resume rule: keep the rows of steps <= ``last_step`` (None: a fresh start keeps none).

        Returns the number of rows dropped (they are run again). An unreadable file (damaged by hand or by the file
        system; the atomic write cannot tear it) is left as it is and named in ``resume_problem``: the trainer
        refuses to continue on incomplete records.
        """
        self._chunks.clear()
        self._previous = None
        self.resume_problem = None
        if not self.path.is_file():
            return 0
        if last_step is None:
            self.path.unlink()
            return 0
        try:
            table = pq.read_table(self.path)
        except Exception as exc:  # noqa: BLE001 - a damaged file holds nothing we can trust
            self.resume_problem = f"{self.path.name} is unreadable ({type(exc).__name__})"
            return 0
        self._previous = table.filter(pc.less_equal(table["step"], int(last_step)))
        return table.num_rows - self._previous.num_rows

    def covered_step(self) -> int | None:
        """The last step whose presentations the resumed file holds (None: none)."""
        if self._previous is None or self._previous.num_rows == 0:
            return None
        return int(pc.max(self._previous["step"]).as_py())

    def missing_steps(self, last_step: int, shown: int = 10) -> str:
        """The steps 1..``last_step`` without a row in the resumed table (the first ``shown``, and how many more):
        what an older copy of the file lacks."""
        present = set() if self._previous is None else set(pc.unique(self._previous["step"]).to_pylist())
        missing = [step for step in range(1, int(last_step) + 1) if step not in present]
        return str(missing) if len(missing) <= shown else f"{missing[:shown]} and {len(missing) - shown} more"

    def gather(self, gather_objects: Callable[[Any], list[Any]]) -> None:
        """Collect every rank's buffered rows onto each rank (``dist.all_gather_objects``); collective."""
        merged = self._concat(self._chunks)
        parts = gather_objects(merged)
        self._chunks = [p for p in parts if p is not None and p["step"].size]

    @staticmethod
    def _concat(chunks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray] | None:
        if not chunks:
            return None
        return {name: np.concatenate([c[name] for c in chunks]) for name in PRESENTATION_COLUMNS}

    def write(self) -> None:
        """Write all rows (loaded + buffered) to the parquet file atomically; buffered rows move to the table."""
        merged = self._concat(self._chunks)
        tables = [] if self._previous is None else [self._previous]
        if merged is not None:
            tables.append(pa.table({name: merged[name] for name in PRESENTATION_COLUMNS}))
        if not tables:
            return
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        tmp = self.path.with_name(self.path.name + ".tmp")
        pq.write_table(table, tmp)
        tmp.replace(self.path)
        self._previous, self._chunks = table, []
