"""Length bands: the one mapping from a length to its bucket or probe band, shared by the policies (buckets), the
probes and tau (bands) and the forgetting metrics (a step's band). It lives with the metrics so that both the
sampling package and the metrics read it without importing each other."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bucket_ids(lengths: np.ndarray | Sequence[int], boundaries: Sequence[int]) -> np.ndarray:
    """The one length -> bucket (or probe band) mapping: k with ``b_k < l <= b_(k+1)``; -1 outside ``(b_0, b_K]``.

    Policies validate that their boundaries cover every sample, so -1 never occurs there; probe bands are checked
    against the data at start-up, so a length outside every band is an error reported there, never clipped.

    Example:
        >>> bucket_ids(np.array([1, 96, 97, 1024, 2000, np.nan]), [0, 96, 152, 1024]).tolist()
        [0, 0, 1, 2, -1, -1]
    """
    edges = np.asarray(boundaries)
    values = np.asarray(lengths)
    ids = np.searchsorted(edges, values, side="left").astype(np.int64) - 1
    ids[~((values > edges[0]) & (values <= edges[-1]))] = -1  # written so that NaN lands outside too
    return ids
