"""The token store on disk, written as it is built: a dataset's arrays grow chunk by chunk, never whole in memory.

Files (one cache entry; ``dflash_lab/data/datasets.py`` reads them memory-mapped):
    tokens.npy    int32[T]    every sample's ids, concatenated
    loss_mask.npy bool[T]     supervised tokens
    offsets.npy   int64[N+1]  sample i is tokens[offsets[i]:offsets[i+1]]
    lengths.npy   int64[N]    one length per sample

Algorithm: :class:`StoreWriter` opens ``tokens.npy`` and ``loss_mask.npy`` with a ``.npy`` header for an empty
array, appends each chunk of samples (``add``) to both files as it comes, and at ``close`` rewrites both headers in
place with the final length and writes the small ``offsets.npy`` and ``lengths.npy``. numpy pads a 1-D header so
that its length never changes with the shape's digits (``numpy.lib.format.GROWTH_AXIS_MAX_DIGITS``): the files
are byte for byte what ``np.save`` writes for the whole arrays, so a store's ``content_digest`` does not depend on
how it was written. :func:`chunked` turns a generator of single samples (the synthetic and code corpora) into
such chunks.

Properties: the writer holds one chunk and the per-sample lengths (8 bytes a sample), whatever the number of
tokens; the bytes of a store depend only on the samples and their order.

Cost: one write of the token bytes (5 bytes a token); the header rewrites and the two small arrays are negligible.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

TOKEN_DTYPE, MASK_DTYPE = np.dtype(np.int32), np.dtype(np.bool_)
CHUNK_TOKENS = 1 << 20   # :func:`chunked`: samples gathered into chunks of about this many tokens (5 MB)


def _write_header(handle, dtype: np.dtype, length: int) -> int:
    """Write a 1-D ``.npy`` header for ``length`` items of ``dtype`` at the start of ``handle``; its size."""
    handle.seek(0)
    np.lib.format.write_array_header_1_0(handle, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                   "fortran_order": False, "shape": (int(length),)})
    return handle.tell()


class StoreWriter:
    """Appends chunks of samples to a store directory's ``tokens.npy`` and ``loss_mask.npy``; ``close`` finishes
    the files (module docstring).

    Args:
        directory: an existing, empty directory.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> with StoreWriter(folder) as writer:
        ...     writer.add(np.array([5, 6, 7], np.int32), np.array([0, 1, 1], bool), np.array([1, 2]))
        >>> np.load(folder / "tokens.npy").tolist(), np.load(folder / "offsets.npy").tolist()
        ([5, 6, 7], [0, 1, 3])
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.num_tokens = 0
        self._lengths = array("q")
        self._files = {}
        for name, dtype in (("tokens.npy", TOKEN_DTYPE), ("loss_mask.npy", MASK_DTYPE)):
            handle = open(self.directory / name, "wb")
            self._files[name] = (handle, dtype, _write_header(handle, dtype, 0))

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    def add(self, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray) -> None:
        """Append samples: their ids and mask concatenated, and one length per sample (summing to the ids)."""
        tokens = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
        loss_mask = np.ascontiguousarray(loss_mask, dtype=MASK_DTYPE)
        lengths = np.asarray(lengths, dtype=np.int64)
        if tokens.ndim != 1 or tokens.shape != loss_mask.shape or int(lengths.sum()) != tokens.size:
            raise ValueError(f"a chunk of {tokens.size} ids, {loss_mask.size} mask entries and lengths summing to "
                             f"{int(lengths.sum())}: they must agree")
        self._files["tokens.npy"][0].write(memoryview(tokens))
        self._files["loss_mask.npy"][0].write(memoryview(loss_mask))
        self._lengths.frombytes(lengths.tobytes())
        self.num_tokens += tokens.size

    def close(self) -> None:
        """Give both token files their final length and write ``offsets.npy`` and ``lengths.npy``."""
        for name, (handle, dtype, header_size) in self._files.items():
            if handle.closed:
                continue
            if _write_header(handle, dtype, self.num_tokens) != header_size:   # numpy keeps room for the digits
                raise RuntimeError(f"{name}: the .npy header changed size when its length was written")
            handle.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(self.directory / "offsets.npy", offsets)
        np.save(self.directory / "lengths.npy", lengths)

    def abandon(self) -> None:
        """Close the files without finishing them (the caller removes the directory)."""
        for handle, _dtype, _size in self._files.values():
            handle.close()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()


def chunked(samples: Iterable[tuple], chunk_tokens: int = CHUNK_TOKENS
            ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Gather single samples ``(ids, loss_mask)`` into chunks ``(tokens, loss_mask, lengths)`` of about
    ``chunk_tokens`` tokens (a sample is never split).

    Example:
        >>> [lengths.tolist() for _, _, lengths in chunked([([1, 2], [0, 1]), ([3], [1]), ([4], [1])], 2)]
        [[2], [1, 1]]
    """
    ids_parts, mask_parts, lengths, held = [], [], [], 0
    for ids, mask in samples:
        ids_parts.append(np.asarray(ids, dtype=TOKEN_DTYPE))
        mask_parts.append(np.asarray(mask, dtype=MASK_DTYPE))
        lengths.append(len(ids_parts[-1]))
        held += lengths[-1]
        if held >= chunk_tokens:
            yield np.concatenate(ids_parts), np.concatenate(mask_parts), np.asarray(lengths, dtype=np.int64)
            ids_parts, mask_parts, lengths, held = [], [], [], 0
    if lengths:
        yield np.concatenate(ids_parts), np.concatenate(mask_parts), np.asarray(lengths, dtype=np.int64)
