"""bucketed: length buckets, shuffled inside each bucket every epoch, batch order shuffled (optionally in runs).

Algorithm: boundaries ``[b0=0 < b1 < ... < bK]`` put a sample of length l in bucket k when ``b_k < l <= b_(k+1)``
(``boundaries.bucket_ids``). Boundaries are given (the seed's ``[0, 770, 1216, 1728, 2432, 3296, 8192]`` is a
preset) or fitted from the lengths (``num_buckets`` + ``fit_method``: quantile, equal_tokens, optimal; see
``boundaries.py``). Each epoch: shuffle the members of every bucket, pack each bucket greedily under the token
budget, then shuffle the order of steps. With W ranks, a step's W batches come from one bucket (neighbours by
longest row), except where a bucket's batch count is not a multiple of W and a step straddles two adjacent buckets.

``run_length: R`` (default 1) sets how steps are ordered: R=1 is one shuffle of all steps; R > 1 shuffles each
bucket's steps, cuts them into runs of R consecutive same-bucket steps and shuffles the runs (``core.
bucket_run_order``). R is the dose between random mixing (R=1) and full sequencing (``bucket_sequential``).

Properties: padding bounded by the bucket width (about 0.80 with the seed's 6 buckets on the seed workload);
composition changes every epoch, but each batch is length-homogeneous. With R=1 consecutive steps jump between
buckets (adjacent-length correlation ~ 0, bucket run length ~ 1 + 1/K); with R > 1 the bucket run length reads
about R and the adjacent-length correlation rises toward 1.

``bucket_by`` (``length`` | ``random``, default ``length``) says what decides bucket membership. ``length``: the
boundaries, as above. ``random``: the negative control of the forgetting ablation on natural data (where no skill
is planted per length band). The length buckets are computed exactly as above, then membership is reassigned: one
seeded permutation of all admitted samples is cut into consecutive groups of the length buckets' sizes, so group k
holds as many samples as length bucket k, but its members are a random draw independent of length. The groups
are fixed for the whole run (drawn once from the policy seed on their own stream, ``random_groups``), as length
buckets are; every epoch then shuffles, packs and orders them exactly as it does length buckets (same token and
block budgets, world-size rules and resumable state). So ``bucket_sequential`` with ``bucket_by: random`` visits
fixed random groups one after another, in the order and with the sizes of the length version: same curriculum
structure, no length curriculum. Random groups pack worse (a batch pads to its longest row, as in
``full_random``), so a group takes more steps than its length bucket. The per-step ``bucket`` metric
(``Policy.bucket_of``) is then the random group.

``real_tokens_per_step`` (``null`` | ``T`` | ``full_random``; bucketed and bucketed_megabatch) replaces the padded
budget inside each bucket, as full_random's key of the same name does: ``T`` closes a batch at the sample boundary
nearest to T real tokens (``core.pack_real_tokens``; ``max_tokens`` still decides admission, ``max_samples`` caps
rows, T is at least the longest admitted sample, ``quadratic_length`` is refused). ``full_random`` is full_random's
mean real tokens per rank and step over the same data, budget and seed, resolved where the data is known
(``sampling.stats.resolve_matched_real_tokens``): bucketed then makes as many optimizer updates per epoch as
full_random, so the two differ in batch composition alone (the converse of full_random at bucketed's real tokens).
Its batches pad to about T / 0.8 tokens, below ``max_tokens`` at full_random's T.

Cost: O(N) per epoch (one permutation per bucket + one packing pass) + O(B log B) step grouping and ordering;
``bucket_by: random`` adds one O(N) permutation at construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from ..config_check import as_choice, as_int
from .boundaries import FIT_METHODS, bucket_ids, fit_boundaries, validate_boundaries
from .core import StepPlan, Steps, bucket_run_order, epoch_rng, group_into_steps
from .policy import Policy

BUCKET_BY = ("length", "random")
# The random groups' seed stream: a spawn key, which no ``core.epoch_rng(seed, epoch, stream)`` generator can
# equal (a plain entropy list [seed, C] would: SeedSequence pads short entropy with zeros, so it is
# epoch_rng(seed, C, 0)). Drawing the groups there keeps them independent of every epoch's within-bucket shuffle.
RANDOM_GROUPS_STREAM = 0xB0C4E7

SEED_BOUNDARIES = [0, 770, 1216, 1728, 2432, 3296, 8192]
CPU_BOUNDARIES = [0, 96, 152, 216, 304, 412, 1024]  # the seed's boundaries / 8, for the CPU-scale workload
PRESETS = {"seed": SEED_BOUNDARIES, "cpu": CPU_BOUNDARIES}


def resolve_boundaries(
    lengths: np.ndarray, boundaries: Sequence[int] | str | None, num_buckets: int | None, fit_method: str
) -> list[int]:
    """Boundaries from an explicit list, a preset name (``seed``, ``cpu``) or a fit; validated against lengths.
    ``auto`` is a fit of ``num_buckets`` (default 6) to these lengths: the trainer and the planner first turn it into
    the ``cpu`` preset for the built-in corpus (:func:`resolve_auto_boundaries`)."""
    num_buckets = as_int("sampler.num_buckets", num_buckets, minimum=1, allow_none=True, example=6)
    as_choice("sampler.fit_method", fit_method, FIT_METHODS)
    if boundaries == "auto":
        boundaries, num_buckets = None, num_buckets or AUTO_NUM_BUCKETS
    if isinstance(boundaries, str):
        if boundaries not in PRESETS:
            raise ValueError(f"sampler.boundaries={boundaries!r}: unknown preset; use a list, auto or one of "
                             f"{list(PRESETS)}")
        boundaries = PRESETS[boundaries]
    if boundaries is None:
        if num_buckets is None:
            raise ValueError(
                "bucketed policies need sampler.boundaries (a list such as [0, 770, 1216, 1728, 2432, 3296, 8192]) "
                "or sampler.num_buckets (with sampler.fit_method) to fit them"
            )
        # Fewer buckets come back when there are fewer distinct lengths.
        return validate_boundaries(fit_boundaries(lengths, num_buckets, fit_method), int(lengths.max()))
    values = validate_boundaries(boundaries, int(lengths.max()))
    if num_buckets is not None and num_buckets != len(values) - 1:
        raise ValueError(
            f"sampler.num_buckets={num_buckets} conflicts with sampler.boundaries ({len(values) - 1} buckets); "
            f"set sampler.boundaries=null to fit boundaries, or num_buckets=null to use the list"
        )
    return values


AUTO_NUM_BUCKETS = 6


def resolve_auto_boundaries(sampler_cfg: Mapping[str, Any], *, builtin_corpus: bool) -> dict[str, Any]:
    """``sampler.boundaries: auto`` (the default of the bucketed policies), resolved where the data is known: the
    built-in corpus keeps its preset (``cpu``, so runs compare with the ablation); other data gets boundaries fitted
    to its own lengths (``sampler.num_buckets``, default 6, by ``sampler.fit_method``). Any other value is returned
    as given.

    Example:
        >>> resolve_auto_boundaries({"boundaries": "auto", "num_buckets": None}, builtin_corpus=True)["boundaries"]
        'cpu'
        >>> fitted = resolve_auto_boundaries({"boundaries": "auto", "num_buckets": None}, builtin_corpus=False)
        >>> fitted["boundaries"], fitted["num_buckets"]
        (None, 6)
    """
    cfg = dict(sampler_cfg)
    if cfg.get("boundaries") != "auto":
        return cfg
    if builtin_corpus:
        cfg["boundaries"] = "cpu"
        if cfg.get("num_buckets") == len(CPU_BOUNDARIES) - 1:
            cfg["num_buckets"] = None   # the preset's own count: no conflict to report
    else:
        cfg["boundaries"], cfg["num_buckets"] = None, cfg.get("num_buckets") or AUTO_NUM_BUCKETS
    return cfg


def random_groups(kept: np.ndarray, sizes: np.ndarray, seed: int) -> list[np.ndarray]:
    """``bucket_by: random``: the admitted samples cut, in a seeded random order, into groups of ``sizes``.

    A pure function of (kept samples, sizes, seed): the same groups for the whole run, whatever the epoch.

    Example:
        >>> [g.size for g in random_groups(np.arange(10), np.array([5, 0, 3, 2]), seed=0)]
        [5, 0, 3, 2]
    """
    rng = np.random.default_rng(np.random.SeedSequence(int(seed) & 0xFFFFFFFF, spawn_key=(RANDOM_GROUPS_STREAM,)))
    return np.split(kept[rng.permutation(kept.size)], np.cumsum(sizes)[:-1])


class Bucketed(Policy):
    name = "bucketed"

    def setup(self, *, boundaries: Sequence[int] | str | None, num_buckets: int | None, fit_method: str,
              bucket_by: str, run_length: int, real_tokens_per_step: int | None) -> None:
        self.use_real_tokens(real_tokens_per_step)
        self.run_length = as_int("sampler.run_length", run_length, minimum=1, example=8)
        self.make_buckets(boundaries, num_buckets, fit_method, bucket_by)

    def _config(self, overlong: str, own: Mapping[str, Any]) -> dict[str, Any]:
        config = super()._config(overlong, own)
        if "real_tokens_per_step" in config and config["real_tokens_per_step"] is None:
            # The padded budget is what every state written before this key existed used: leaving it out keeps
            # their fingerprints; a state of equal real tokens is refused by a padded-budget policy (and the reverse).
            del config["real_tokens_per_step"]
        return config

    def make_buckets(self, boundaries: Sequence[int] | str | None, num_buckets: int | None, fit_method: str,
                     bucket_by: str) -> None:
        """The buckets: boundaries resolved against the admitted lengths (:func:`resolve_boundaries`), and each
        bucket's members, by length or drawn at random (``bucket_by``)."""
        if bucket_by not in BUCKET_BY:
            raise ValueError(
                f"sampler.bucket_by={bucket_by!r}: choose length (buckets by the boundaries) or random (the negative "
                f"control: groups of the length buckets' sizes with members drawn independently of length), e.g. "
                f"sampler.bucket_by=random"
            )
        self.bucket_by = bucket_by
        admission = self.admission
        kept_lengths = admission.lengths[admission.kept]
        self.boundaries = resolve_boundaries(kept_lengths, boundaries, num_buckets, fit_method)
        bucket_of_kept = bucket_ids(kept_lengths, self.boundaries)
        # Members of each bucket in dataset order; the per-epoch shuffle starts from this fixed order.
        by_bucket = np.argsort(bucket_of_kept, kind="stable")
        counts = np.bincount(bucket_of_kept, minlength=len(self.boundaries) - 1)
        if bucket_by == "length":
            self.members = np.split(admission.kept[by_bucket], np.cumsum(counts)[:-1])
        else:
            self.members = random_groups(admission.kept, counts, self.seed)
        # The bucket each sample was packed from (-1: not admitted): what bucket_of reports for a batch.
        self.sample_bucket = np.full(admission.lengths.size, -1, dtype=np.int64)
        for bucket, members in enumerate(self.members):
            self.sample_bucket[members] = bucket

    def bucket_of(self, indices: Any) -> int:
        """Bucket id of a batch: the bucket its longest sample was packed from.

        ``bucket_by: length``: the length bucket of the longest sample (the boundaries rule). ``bucket_by: random``:
        the random group it was packed from, so "which bucket" keeps its meaning for the negative control.
        """
        if self.bucket_by == "length":
            return super().bucket_of(indices)
        indices = np.asarray(indices, dtype=np.int64)
        return int(self.sample_bucket[indices[np.argmax(self.admission.lengths[indices])]])

    def order_bucket(self, members: np.ndarray, bucket: int, rng: np.random.Generator) -> np.ndarray:
        """The consumption order of one bucket's samples this epoch: a plain shuffle."""
        return members[rng.permutation(members.size)]

    def bucket_steps(self, rng: np.random.Generator) -> tuple[list[np.ndarray], Steps, np.ndarray]:
        """This epoch's batches (every bucket shuffled and packed), grouped into steps in (bucket, width) order.

        Returns:
            ``(batches, steps, step_bucket)``: step_bucket is the bucket of each step's first batch.
        """
        batches: list[np.ndarray] = []
        keys = []
        for bucket, members in enumerate(self.members):
            packed, widest = self.pack(self.order_bucket(members, bucket, rng))
            batches += packed
            keys.append(np.stack([np.full(len(packed), bucket, dtype=np.float64), widest], axis=1))
        key = np.concatenate(keys) if keys else np.zeros((0, 2))
        steps = group_into_steps(batches, key, self.world_size, drop_last=self.drop_last)
        return batches, steps, key[steps.index[:, 0], 0].astype(np.int64)

    def plan(self, epoch: int) -> StepPlan:
        rng = epoch_rng(self.seed, epoch, stream=30)
        batches, steps, step_bucket = self.bucket_steps(rng)
        return steps.plan(batches, bucket_run_order(step_bucket, rng, run_length=self.run_length))
