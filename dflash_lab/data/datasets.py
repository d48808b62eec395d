"""Tokenized datasets behind one class, built once per (data config, tokenizer, code) and memory-mapped after.

Storage (one cache directory per key ``<kind>-<hash>`` under ``<cache_dir>/data/``; the token store's files are
written by ``dflash_lab/data/store.py``):
    tokens.npy  int32[total]   all samples' ids, concatenated
    loss_mask.npy bool[total]  supervised tokens
    offsets.npy int64[N + 1]   sample i is tokens[offsets[i]:offsets[i+1]]
    lengths.npy int64[N]       one length per sample: what the samplers read, without touching the samples
    meta.json                  config, counts (``stats``: e.g. skipped JSONL lines per reason)
    skipped_lines.jsonl        data=jsonl: every skipped line's number, reason and message (the run copies it)
The key hashes the data config, the tokenizer fingerprint and the source of the corpus code, so changing any of
them rebuilds; a JSONL file enters the key by its content's digest (not its modification time: an edit in place
whose mtime was restored rebuilds too); ``data.num_proc`` does not enter it (the store is the same for any
value). Arrays are opened with ``mmap_mode="r"`` (DDP ranks on one node share their pages); every load streams
them once through BLAKE2b (``content_digest``: the run's ``data_digest``, computed from the bytes trained on) and
checks the digest recorded at build time, so a damaged or edited cache is refused before step 1 (the planner,
which trains on nothing, leaves that pass to the first use of ``content_digest``: ``check_digest=False``).

Building: the samples are written to the store chunk by chunk as they are made (``store.StoreWriter``), so the
builder's memory does not grow with the corpus; ``data=jsonl`` is tokenized in ``data.num_proc`` processes
(``jsonl.encode_jsonl``), logging a progress line at least every 10 s and the time and size at the end. The
build runs under the cache entry's lock (``cache.build_once``): other processes wanting the same entry (the other
DDP ranks) wait for it, saying so, and then load what it wrote.

``TokenizedDataset.split()`` holds out ``probe_fraction`` of the samples for probes and decoding prompts,
stratified by length (one pick per run of ``1/probe_fraction`` samples in length order) so every length band
has held-out samples; training uses the other view, so it never sees them. Given the probe bands and a count
per band, it tops up any band holding fewer held-out samples than that count (extra picks from the band's other
samples, at most half of them, so training keeps the band): the stratified share alone can leave a band short
(3000 synthetic samples: 19 held out in (304, 412] for 24 probes).

Cost: building = the corpus generator's cost (synthetic: ~1 s per 10K samples; chat JSONL: docs/data.md, "Preparing
a large file"), then one read of the store for its digest; loading = a few ``np.load`` and one read of the arrays
for the digest (about 1-4 s per GiB on 2 slow cores, as busy as they are); a JSONL source is read once more for
its digest at every build call.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash_lab.config_check import refuse_unknown_keys
from dflash_lab.data import code as code_module
from dflash_lab.data import jsonl as jsonl_module
from dflash_lab.data import store as store_module
from dflash_lab.data import synthetic as synthetic_module
from dflash_lab.data import tokenizer as tokenizer_module
from dflash_lab.data.cache import build_once, config_hash, default_cache_dir, source_hash
from dflash_lab.data.parallel import resolve_num_proc
from dflash_lab.data.progress import PROGRESS_EVERY_S, ItemProgress, format_bytes
from dflash_lab.data.store import StoreWriter, chunked
from dflash_lab.data.tokenizer import ByteTokenizer, load_chat_template
from dflash_lab.metrics.throughput import format_eta
from dflash_lab.refusal import DamagedCache
from dflash_lab.sampling.boundaries import bucket_ids

KINDS = ("synthetic", "code", "jsonl")
log = logging.getLogger("dflash_lab.data")
__all__ = ["KINDS", "TokenizedDataset", "build_dataset", "default_cache_dir"]


class TokenizedDataset:
    """Samples as ``{"input_ids": Long[L], "loss_mask": Bool[L], "index": i}`` over memory-mapped arrays.

    Args:
        tokens, loss_mask, offsets, lengths: the cached arrays (see module docstring).
        meta: the cache metadata (config, counts).
        indices: optional view: sample i of this dataset is sample ``indices[i]`` of the arrays.
        probe_fraction, split_seed: defaults for :meth:`split`.
    """

    def __init__(self, tokens, loss_mask, offsets, lengths, meta: dict, indices: np.ndarray | None = None,
                 probe_fraction: float = 0.05, split_seed: int = 0):
        self._tokens = tokens
        self._loss_mask = loss_mask
        self._offsets = offsets
        self._all_lengths = lengths
        self.meta = meta
        self.source_indices = (np.arange(len(lengths), dtype=np.int64) if indices is None
                               else np.asarray(indices, dtype=np.int64))
        self.lengths = np.ascontiguousarray(lengths[self.source_indices], dtype=np.int64)
        self.probe_fraction = probe_fraction
        self.split_seed = split_seed

    def __len__(self) -> int:
        return len(self.source_indices)

    def __getstate__(self) -> dict:
        # DataLoader workers receive a pickled dataset: send the cache directory, not the (memory-mapped)
        # token arrays, which pickle would copy in full into every worker.
        state = dict(self.__dict__)
        if self.meta.get("directory"):
            state["_tokens"] = state["_loss_mask"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._tokens is None:
            directory = Path(self.meta["directory"])
            self._tokens = np.load(directory / "tokens.npy", mmap_mode="r")
            self._loss_mask = np.load(directory / "loss_mask.npy", mmap_mode="r")

    def __getitem__(self, i: int) -> dict:
        source = int(self.source_indices[i])
        start, end = int(self._offsets[source]), int(self._offsets[source + 1])
        return {
            "input_ids": torch.from_numpy(np.asarray(self._tokens[start:end], dtype=np.int64)),
            "loss_mask": torch.from_numpy(np.array(self._loss_mask[start:end], dtype=bool)),
            "index": int(i),
        }

    @property
    def stats(self) -> dict:
        """Counts recorded when the cache was built; ``stats["skipped"]``: skipped lines per reason (every kind
        has the key; ``jsonl`` lists every reason of ``data.jsonl.SKIP_REASONS``, zeros included)."""
        return {"skipped": {}, **self.meta.get("stats", {})}

    def skipped_lines(self) -> list[dict] | None:
        """Every line the data=jsonl loader skipped (``{"line", "reason", "message"}``, file order; [] when none);
        None for other kinds and for datasets not read from a cache entry that lists them."""
        directory = self.meta.get("directory")
        if self.meta.get("kind") != "jsonl" or not directory or not (Path(directory) / SKIPPED_LINES_FILE).is_file():
            return None
        text = (Path(directory) / SKIPPED_LINES_FILE).read_text(encoding="utf-8")
        return [json.loads(row) for row in text.splitlines() if row.strip()]

    @property
    def content_digest(self) -> str | None:
        """The digest of the bytes this dataset trains on (``content_digest`` of the cached arrays, computed when
        the cache was loaded and checked there against the one recorded at build time); None for a dataset that
        is not cached."""
        digest = self.meta.get("content_digest")
        if digest is None and self.meta.get("directory"):   # loaded with check_digest=False: streamed and checked now
            digest = self.meta["content_digest"] = checked_digest(Path(self.meta["directory"]),
                                                                  self.meta.get("recorded_content_digest"))
        return digest

    def anchor_positions(self, chunk_tokens: int = 1 << 24) -> np.ndarray:
        """Valid anchor positions of each sample (``t`` and ``t + 1`` both supervised, inside the sample): what
        the anchor rule (``sampling.anchors``) reads to count a sample's blocks. One pass over the loss mask, in
        chunks of about ``chunk_tokens`` so a memory-mapped mask is never loaded whole.

        Example:
            >>> ds = TokenizedDataset(np.zeros(7, np.int32), np.array([1, 1, 1, 0, 1, 1, 1], bool),
            ...                       np.array([0, 3, 7]), np.array([3, 4]), {})
            >>> ds.anchor_positions().tolist()
            [2, 2]
        """
        counts = np.zeros(len(self._all_lengths), dtype=np.int64)
        offsets = np.asarray(self._offsets, dtype=np.int64)
        first = 0
        while first < counts.size:  # whole samples per chunk
            last = int(np.searchsorted(offsets, offsets[first] + chunk_tokens, side="right")) - 1
            last = min(max(last, first + 1), counts.size)
            lo, hi = int(offsets[first]), int(offsets[last])
            mask = np.asarray(self._loss_mask[lo:hi], dtype=bool)
            pair = np.zeros(hi - lo, dtype=np.int64)
            pair[:-1] = mask[:-1] & mask[1:]
            pair[offsets[first + 1:last + 1] - lo - 1] = 0  # a sample's last token pairs with the next sample
            sums = np.add.reduceat(pair, offsets[first:last] - lo) if hi > lo else np.zeros(last - first, np.int64)
            counts[first:last] = np.where(np.diff(offsets[first:last + 1]) > 0, sums, 0)
            first = last
        return counts[self.source_indices]

    def subset(self, indices) -> TokenizedDataset:
        """A view holding samples ``indices`` of this dataset (renumbered 0..len-1)."""
        return TokenizedDataset(self._tokens, self._loss_mask, self._offsets, self._all_lengths, self.meta,
                                self.source_indices[np.asarray(indices, dtype=np.int64)],
                                self.probe_fraction, self.split_seed)

    def heldout_indices(self, probe_fraction: float | None = None, seed: int | None = None,
                        bands=None, per_band: int = 0) -> np.ndarray:
        """Sorted indices of the held-out samples (length-stratified, deterministic).

        ``bands`` (boundaries, band b = lengths in (lo, hi]) and ``per_band``: a band with fewer held-out samples
        gets extra picks from its other samples (at most half of them), drawn with (seed, band): the stratified
        picks are kept, so without a short band the split is unchanged. The extra picks of all bands together are
        capped at ``probe_fraction`` of the data (held out: at most twice ``probe_fraction``), handed out one per
        band in turn, so a small file is not drained into probes.
        """
        fraction = self.probe_fraction if probe_fraction is None else probe_fraction
        seed = self.split_seed if seed is None else seed
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"data.probe_fraction={fraction}: choose a held-out share in [0, 1)")
        n = len(self)
        if fraction == 0.0 or n < 2:
            return np.zeros(0, dtype=np.int64)
        stride = max(2, int(round(1.0 / fraction)))
        order = np.argsort(self.lengths, kind="stable")
        rng = np.random.default_rng(seed)
        picks = [order[start + rng.integers(min(stride, n - start))] for start in range(0, n, stride)]
        held = np.zeros(n, dtype=bool)
        held[np.asarray(picks, dtype=np.int64)] = True
        if bands is not None and per_band > 0:
            band_of = bucket_ids(self.lengths, bands)
            wanted = []   # per band: its extra picks in draw order
            for band in range(len(bands) - 1):
                in_band = band_of == band
                short = per_band - int(held[in_band].sum())
                free = np.flatnonzero(in_band & ~held)
                extra = min(short, len(free) // 2)
                band_rng = np.random.default_rng([seed, band])
                wanted.append(list(band_rng.choice(free, size=extra, replace=False)) if extra > 0 else [])
            budget = int(fraction * n)
            for turn in range(max(map(len, wanted), default=0)):   # one pick per band in turn, up to the budget
                for picks in wanted:
                    if turn < len(picks) and budget > 0:
                        held[picks[turn]] = True
                        budget -= 1
        return np.flatnonzero(held).astype(np.int64)

    def train_indices(self, probe_fraction: float | None = None, seed: int | None = None,
                      bands=None, per_band: int = 0) -> np.ndarray:
        """Sorted indices of the training samples: everything not held out."""
        keep = np.ones(len(self), dtype=bool)
        keep[self.heldout_indices(probe_fraction, seed, bands, per_band)] = False
        return np.flatnonzero(keep).astype(np.int64)

    def split(self, probe_fraction: float | None = None, seed: int | None = None,
              bands=None, per_band: int = 0) -> tuple[TokenizedDataset, TokenizedDataset]:
        """(train view, held-out view); defaults from the data config's probe_fraction and seed; ``bands`` and
        ``per_band``: at least that many held-out samples per band where the band allows (see heldout_indices).

        Example:
            >>> train, heldout = ds.split()            # doctest: +SKIP
            >>> len(train) + len(heldout) == len(ds)   # doctest: +SKIP
            True
        """
        return (self.subset(self.train_indices(probe_fraction, seed, bands, per_band)),
                self.subset(self.heldout_indices(probe_fraction, seed, bands, per_band)))


def _write_store(directory: Path, chunks, kind: str) -> StoreWriter:
    """Consume chunks ``(tokens, loss_mask, lengths)`` into the store's files as they come (``store.StoreWriter``:
    memory holds one chunk, not the corpus)."""
    with StoreWriter(directory) as writer:
        for tokens, loss_mask, lengths in chunks:
            writer.add(tokens, loss_mask, lengths)
    if not writer.num_samples:
        raise ValueError(f"the {kind} dataset produced no samples: check the data config (data.*)")
    return writer


def store_size(directory: Path) -> int:
    """Bytes of a cache entry's files."""
    return sum(path.stat().st_size for path in Path(directory).iterdir() if path.is_file())


CONTENT_FILES = ("tokens.npy", "loss_mask.npy", "offsets.npy")
SKIPPED_LINES_FILE = "skipped_lines.jsonl"   # data=jsonl: one row per skipped line (cache entry and run directory)


def write_skipped_lines(path: Path, rows) -> None:
    """One JSON object per skipped line, in file order: ``{"line": 1-based number, "reason": one of
    data.jsonl.SKIP_REASONS, "message": what was wrong and the fix}``."""
    text = "".join(json.dumps({"line": int(line), "reason": reason, "message": message}) + "\n"
                   for line, reason, message in rows)
    Path(path).write_text(text, encoding="utf-8")


def content_digest(directory: Path, log_every_s: float | None = None) -> str:
    """A digest of what a dataset holds (its tokens, loss mask and sample boundaries, as cached): two datasets with
    the same digest train on the same text. BLAKE2b over the cached files, 1 MiB at a time; ``log_every_s``: a line
    (bytes read so far) at least this often while it reads (a store of several GB takes seconds per GB).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> for name in CONTENT_FILES:
        ...     np.save(d / name, np.arange(3))
        >>> len(content_digest(d))
        32
    """
    digest = hashlib.blake2b(digest_size=16)
    files = [Path(directory) / name for name in CONTENT_FILES]
    total = sum(file.stat().st_size for file in files) if log_every_s is not None else 0
    done, started = 0, time.monotonic()
    last = started
    for file in files:
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
                done += len(chunk)
                if log_every_s is not None and time.monotonic() - last >= log_every_s:
                    last = time.monotonic()
                    log.info(f"data: hashing {Path(directory).name}: {format_bytes(done)} of {format_bytes(total)} "
                             f"in {format_eta(last - started)}")
    return digest.hexdigest()


def _fix(directory: Path) -> str:
    return f"delete it (rm -rf '{directory}') and run again to rebuild it from the source data"


def checked_digest(directory: Path, recorded: str | None) -> str:
    """The entry's ``content_digest`` streamed from its files now, refused when it is not the one ``recorded`` at
    build time (``refusal.DamagedCache``, naming the entry to delete)."""
    try:
        digest = content_digest(directory, log_every_s=PROGRESS_EVERY_S)
    except OSError as error:
        raise DamagedCache(f"the cached dataset {directory} cannot be read ({type(error).__name__}: {error}): "
                           f"{_fix(directory)}") from None
    if recorded is not None and recorded != digest:
        raise DamagedCache(f"the cached dataset {directory} has content digest {digest}, but its meta.json records "
                           f"{recorded} (its token files were damaged or edited after it was built): {_fix(directory)}")
    return digest


def _load(directory: Path, probe_fraction: float, split_seed: int, digest: str = "check") -> TokenizedDataset:
    """Open a built cache entry, checked: the digest of its arrays as they are now must be the one recorded when it
    was built, and the sample lengths must match the sample boundaries. A damaged or edited file is refused
    before anything trains on it (``refusal.DamagedCache``, naming the entry to delete).

    ``digest``: ``check`` streams it now; ``just_built``: this process has just written the entry and streamed its
    digest from the written files (not read twice); ``defer``: streamed and checked when ``content_digest`` is
    first asked for (what a run records and resumes by), never by a reader that does not ask (the planner)."""
    fix = _fix(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text())
        arrays = [np.load(directory / "tokens.npy", mmap_mode="r"), np.load(directory / "loss_mask.npy", mmap_mode="r"),
                  np.load(directory / "offsets.npy"), np.load(directory / "lengths.npy")]
    except (OSError, ValueError) as error:
        raise DamagedCache(f"the cached dataset {directory} cannot be read ({type(error).__name__}: {error}): "
                           f"{fix}") from None
    recorded = meta.pop("content_digest", None)
    # streamed from the bytes trained on, never copied from meta.json (but by the process that just wrote them)
    if digest == "check":
        meta["content_digest"] = checked_digest(directory, recorded)
    elif digest == "just_built":
        meta["content_digest"] = recorded
    else:
        meta["recorded_content_digest"] = recorded
    tokens, loss_mask, offsets, lengths = arrays
    offsets = np.asarray(offsets, dtype=np.int64)
    if (offsets.ndim != 1 or offsets.size != lengths.size + 1 or offsets[0] != 0 or offsets[-1] != tokens.size
            or offsets[-1] != loss_mask.size or not np.array_equal(np.diff(offsets), lengths)):
        raise DamagedCache(f"the cached dataset {directory} has sample lengths that do not match its sample "
                           f"boundaries (lengths.npy or offsets.npy damaged): {fix}")
    meta["directory"] = str(directory)
    return TokenizedDataset(tokens, loss_mask, offsets, lengths, meta, probe_fraction=probe_fraction,
                            split_seed=split_seed)


def file_digest(path: Path) -> str:
    """BLAKE2b of a file's bytes, read 1 MiB at a time: a source file's identity in a cache key (an edit that
    keeps the size and the modification time still changes it)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def build_dataset(kind: str = "synthetic", *, tokenizer=None, cache_dir: str | None = None,
                  probe_fraction: float = 0.05, seed: int = 0, num_samples: int | None = 3000,
                  min_length: int = 32, max_length: int = 1024, path: str | None = None,
                  max_bad_fraction: float = 0.01, max_truncated_fraction: float = 0.05,
                  stdlib_dir: str | None = None, chat_template: str | None = None,
                  band_skills: str = "none", skill_bands=None, num_proc: int | None = None,
                  check_digest: bool = True, **unknown) -> TokenizedDataset:
    """Build (first call) or load (later calls) a tokenized dataset.

    Args:
        kind: ``synthetic`` (embedded default), ``code`` (stdlib functions/classes) or ``jsonl`` (chat file).
        tokenizer: the target's tokenizer (``build_model`` returns it); default ByteTokenizer.
        cache_dir: cache root (default ``$DFLASH_LAB_CACHE`` or ``~/.cache/dflash_lab``).
        probe_fraction: held-out share used by ``split()``.
        seed: corpus seed (synthetic) and held-out split seed.
        num_samples: synthetic: corpus size; code: cap (None = all); jsonl: ignored.
        min_length: synthetic: smallest sample; code: skip shorter samples.
        max_length: code/jsonl: cap on tokens per sample (synthetic lengths are capped at 1024 by their shape).
        path: jsonl: the file.
        max_bad_fraction: jsonl: largest tolerated share of unusable lines.
        max_truncated_fraction: jsonl: largest tolerated share of kept samples cut to ``max_length`` (a cut
            conversation loses its ending, often the assistant's answer); above it the dataset is refused.
        stdlib_dir: code: override the standard-library directory.
        chat_template: jsonl with an HF tokenizer: a Jinja file or template text replacing the tokenizer's own.
        band_skills: synthetic: ``none`` (the length-styled corpus), ``aligned`` or ``independent`` (the skills
            corpus, see data.synthetic); ``none`` leaves the cache key of the default corpus as it was.
        skill_bands: synthetic: skill band boundaries (None: ``synthetic.DEFAULT_SKILL_BANDS``).
        num_proc: jsonl: processes that tokenize the file when it is not cached yet (None: the CPUs this process
            may use, ``parallel.available_cpus``); the store is the same for any value, so it is not in the key.
        check_digest: stream a cached store through its digest and check it at load (every run does); False
            (the planner, which trains on nothing) defers it to the first use of ``content_digest``. Not a data
            key.
        **unknown: refused (ValueError listing the valid keys): a misspelt key must never keep a default.

    Returns:
        A TokenizedDataset whose ``lengths`` come from the cached lengths array.

    Example:
        >>> ds = build_dataset("synthetic", num_samples=100)   # doctest: +SKIP
        >>> ds.lengths.dtype                                   # doctest: +SKIP
        dtype('int64')
    """
    refuse_unknown_keys("data", unknown, DATA_KEYS)
    tokenizer = tokenizer or ByteTokenizer()
    if chat_template is not None and kind != "jsonl":
        raise ValueError(f"data.chat_template applies to data=jsonl, not data={kind}: drop data.chat_template")
    if chat_template is not None and isinstance(tokenizer, ByteTokenizer):
        raise ValueError("data.chat_template needs model=hf (a Hugging Face tokenizer); the tiny model's byte "
                         "tokenizer has its own chat format: drop data.chat_template")
    if kind != "synthetic" and (band_skills != "none" or skill_bands is not None):
        raise ValueError(f"data.band_skills / data.skill_bands apply to data=synthetic, not data={kind}: drop them")
    if num_proc is not None and kind != "jsonl":
        raise ValueError(f"data.num_proc applies to data=jsonl, not data={kind}: drop data.num_proc")
    started = time.monotonic()
    facts = {"processes": 1}   # what the build used, for its last log line
    if kind == "synthetic":
        if not num_samples or num_samples <= 0:
            raise ValueError(f"data.num_samples={num_samples}: the synthetic corpus needs a positive size")
        config = {"num_samples": int(num_samples), "seed": int(seed), "min_length": int(min_length)}
        longest = int(synthetic_module.synthetic_lengths(int(num_samples), int(seed), int(min_length)).max())
        band_skills, bands = synthetic_module.check_band_skills(band_skills, skill_bands, longest)
        if band_skills != "none":  # the default corpus keeps its key (and its cache entry) without the new keys
            config.update(band_skills=band_skills, skill_bands=bands)
        module = synthetic_module

        def produce(report, tmp):
            return chunked(synthetic_module.iter_synthetic(tokenizer, **config))
    elif kind == "code":
        config = {"num_samples": num_samples, "max_length": int(max_length), "min_length": int(min_length),
                  "stdlib_dir": stdlib_dir or code_module.sysconfig.get_paths()["stdlib"]}
        module = code_module

        def produce(report, tmp):
            return chunked(code_module.iter_code(tokenizer, **config, report=report))
    elif kind == "jsonl":
        if not path:
            raise ValueError("data.path is not set: data=jsonl needs data.path=/path/to/chat.jsonl")
        file = jsonl_module.check_data_path(path).resolve()
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"data.max_bad_fraction={max_bad_fraction}: choose a share in [0, 1]")
        template = load_chat_template(chat_template)
        config = {"path": str(file), "size": file.stat().st_size, "content": file_digest(file),
                  "max_length": int(max_length), "max_bad_fraction": float(max_bad_fraction),
                  "chat_template": template}
        module = jsonl_module

        requested = resolve_num_proc(num_proc)

        def produce(report, tmp):
            processes = min(requested, len(jsonl_module.line_chunks(file)))   # no more than there are chunks
            facts["processes"] = processes
            log.info(f"data: tokenizing {file} ({format_bytes(config['size'])}) in {processes} process"
                     f"{'es' if processes > 1 else ''} into {directory}")
            return jsonl_module.encode_jsonl(tokenizer, path=str(file), max_length=int(max_length),
                                             max_bad_fraction=float(max_bad_fraction), report=report,
                                             chat_template=template, num_proc=processes, spill_dir=tmp,
                                             progress=ItemProgress(file.name, config["size"]))
    else:
        raise ValueError(f"data.kind={kind!r}: choose one of {', '.join(KINDS)}")

    key = {"kind": kind, "config": config, "tokenizer": tokenizer.fingerprint,
           "code": source_hash(module, sys.modules[__name__], tokenizer_module, store_module)}
    directory = default_cache_dir(cache_dir) / "data" / f"{kind}-{config_hash(key)}"

    def build(tmp: Path) -> None:
        report = jsonl_module.JsonlReport()
        meta = {"kind": kind, "config": config, "tokenizer": tokenizer.fingerprint}
        # encode_jsonl raises after its pass when too many lines are bad: the cache is then never written.
        writer = _write_store(tmp, produce(report, tmp), kind)
        # jsonl: every count; code: samples kept and cut to max_length (summary.json data_truncated)
        meta["stats"] = (report.as_dict() if kind == "jsonl" else
                         {"kept": report.kept, "truncated": report.truncated} if kind == "code" else {})
        if kind == "jsonl":
            write_skipped_lines(tmp / SKIPPED_LINES_FILE, report.skipped_lines)
        if kind == "jsonl":   # between the last progress line and the end: seconds per GB
            log.info(f"data: {writer.num_samples:,} samples written in {format_eta(time.monotonic() - started)}; "
                     f"hashing the store ({format_bytes(store_size(tmp))}) for its content digest")
        meta["content_digest"] = content_digest(tmp, log_every_s=PROGRESS_EVERY_S)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        seconds = time.monotonic() - started
        processes = facts["processes"]
        rate = (f" ({report.total_lines / seconds:,.0f} conversations/s in {processes} process"
                f"{'es' if processes > 1 else ''})" if kind == "jsonl" else "")
        log.info(f"data: built in {format_eta(seconds)}{rate}: {writer.num_samples:,} samples, "
                 f"{writer.num_tokens:,} tokens, {format_bytes(store_size(tmp))} on disk in {directory}")

    _path, built = build_once(directory, build)
    dataset = _load(directory, probe_fraction, seed, digest="just_built" if built else
                    "check" if check_digest else "defer")
    if not built:
        log.info(f"data: cached store {directory}: {len(dataset):,} samples, {int(dataset._offsets[-1]):,} tokens, "
                 f"{format_bytes(store_size(directory))}; opened{' and checked' if check_digest else ''} in "
                 f"{time.monotonic() - started:.1f} s")
    if kind == "jsonl":
        check_truncated_share(dataset.stats, max_length=int(max_length), max_fraction=float(max_truncated_fraction))
    return dataset


def check_truncated_share(stats: dict, *, max_length: int, max_fraction: float) -> None:
    """Refuse a dataset whose share of samples cut to ``max_length`` exceeds ``max_fraction`` (a check, not part
    of the cache key: the cached tokens are the same whatever the threshold).

    Example:
        >>> check_truncated_share({"kept": 100, "truncated": 5}, max_length=1024, max_fraction=0.05)
        >>> check_truncated_share({"kept": 100, "truncated": 52}, max_length=1024, max_fraction=0.05)
        Traceback (most recent call last):
        ...
        ValueError: data: 52 of 100 samples (52%) are longer than data.max_length=1024 tokens and were cut, more than data.max_truncated_fraction=0.05: raise data.max_length, or accept the cut with data.max_truncated_fraction=1.0
    """
    if not 0.0 <= max_fraction <= 1.0:
        raise ValueError(f"data.max_truncated_fraction={max_fraction}: choose a share in [0, 1]")
    kept, truncated = int(stats.get("kept") or 0), int(stats.get("truncated") or 0)
    keeping = stats.get("length_keeping_99pct")   # data=jsonl records the length that keeps 99% of lines whole
    advice = (f" (data.max_length={keeping} keeps 99% of the lines whole)"
              if isinstance(keeping, int) and keeping > max_length else "")
    if kept and truncated / kept > max_fraction:
        raise ValueError(f"data: {truncated} of {kept} samples ({truncated / kept:.0%}) are longer than "
                         f"data.max_length={max_length} tokens and were cut, more than "
                         f"data.max_truncated_fraction={max_fraction}: raise data.max_length{advice}, or accept the "
                         f"cut with data.max_truncated_fraction=1.0")


# Valid data.* keys: build_dataset's own parameters (``kind`` and every key of conf/data/*.yaml).
DATA_KEYS = tuple(name for name in inspect.signature(build_dataset).parameters
                  if name not in ("tokenizer", "unknown", "check_digest"))
