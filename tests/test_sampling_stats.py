"""Plan diagnostics (dflash_lab.sampling.stats): known answers on hand-built plans."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_lab.sampling import Policy, StepPlan, TokenBudget
from dflash_lab.sampling.stats import plan_padding, plan_stats, smallest_k_for_efficiency

LENGTHS = np.array([10, 20, 30, 40, 50, 60])


class HandPolicy(Policy):
    """A policy whose epochs are given batch lists (the policy base, nothing computed)."""

    name = "hand"

    def setup(self, *, epochs, boundaries, packed):
        self.epochs, self.boundaries, self.packed = epochs, boundaries, packed

    def plan(self, epoch):
        return StepPlan([np.asarray(b, dtype=np.int64) for b in self.epochs[epoch]], self.world_size)


def hand_policy(epochs, world_size=1, boundaries=None, packed=False, lengths=LENGTHS):
    return HandPolicy(lengths, TokenBudget(100), seed=0, world_size=world_size, rank=0, drop_last=False,
                      overlong="error", epochs=epochs, boundaries=boundaries, packed=packed)


EPOCHS = {0: [[0, 1], [2, 3], [4, 5]], 1: [[1, 0], [2, 4], [3, 5]]}


def test_plan_padding_by_hand():
    pad = plan_padding([np.array([0, 1]), np.array([2])], np.array([3, 5, 4]), packed=False)
    assert (pad["real_tokens"], pad["padded_tokens"]) == (12, 14)  # rows x longest: 2 x 5 + 1 x 4
    assert pad["pad_eff"] == pytest.approx(12 / 14)
    assert pad["per_batch_attention"].tolist() == [50, 16]
    packed = plan_padding([np.array([0, 1]), np.array([2])], np.array([3, 5, 4]), packed=True)
    assert packed["pad_eff"] == 1.0 and packed["per_batch_attention"].tolist() == [34, 16]


def test_plan_stats_known_answers():
    stats = plan_stats(hand_policy(EPOCHS), bands=[0, 25, 45, 60])
    assert stats["real_tokens"] == 210 and stats["padded_tokens"] == 40 + 80 + 120
    assert stats["pad_eff"] == pytest.approx(210 / 240)
    assert stats["budget_fill"] == pytest.approx(210 / (3 * 100))
    assert stats["real_tokens_per_step"] == pytest.approx(70)
    assert (stats["batches_per_epoch"], stats["steps_per_epoch"]) == (3, 3)
    assert (stats["mean_samples_per_batch"], stats["max_samples_per_batch"]) == (2.0, 2)
    assert stats["composition_repeat"] == pytest.approx(1 / 3)  # only {0, 1} comes back in epoch 1
    assert stats["adjacent_length_corr"] == pytest.approx(1.0)  # batch means 15, 35, 55
    assert stats["bucket_run_length"] == 1.0  # longest rows 20, 40, 60 -> bands 0, 1, 2
    assert stats["within_batch_spread"] == pytest.approx((5 / 15 + 5 / 35 + 5 / 55) / 3)
    assert (stats["kept"], stats["dropped_overlong"], stats["repeated_remainder"]) == (6, 0, 0)


def test_plan_stats_bands_and_policy_boundaries():
    assert plan_stats(hand_policy(EPOCHS), bands=[0, 45, 60])["bucket_run_length"] == 1.5  # bands 0, 0, 1
    # Without bands, a policy's own boundaries are used.
    assert plan_stats(hand_policy(EPOCHS, boundaries=[0, 45, 60]))["bucket_run_length"] == 1.5


def test_plan_stats_reads_rank_zero_consumption_order():
    # W=2: steps ([0,1],[2,3]) and ([4,5],[0,1]); rank 0 consumes [0,1] then [4,5].
    epochs = {0: [[0, 1], [2, 3], [4, 5], [0, 1]], 1: [[0, 1], [2, 3], [4, 5], [0, 1]]}
    stats = plan_stats(hand_policy(epochs, world_size=2), bands=[0, 25, 45, 60])
    assert stats["steps_per_epoch"] == 2
    assert stats["bucket_run_length"] == 1.0  # bands of rank-0 batches: 0 (longest 20), 2 (longest 60)
    assert stats["composition_repeat"] == 1.0
    assert stats["real_tokens_per_step"] == pytest.approx((30 + 70 + 110 + 30) / 4)


def test_plan_stats_packed_counts_row_fill():
    stats = plan_stats(hand_policy(EPOCHS, packed=True), bands=[0, 60])
    assert stats["pad_eff"] == 1.0 and stats["budget_fill"] == pytest.approx(0.7)


def test_smallest_k_validates_its_target():
    with pytest.raises(ValueError, match=r"target_pad_eff=1\.5: must be <= 1"):
        smallest_k_for_efficiency(LENGTHS, 1.5, max_tokens=100)
    with pytest.raises(ValueError, match=r"target_pad_eff=0: must be a padding efficiency in \(0, 1\]"):
        smallest_k_for_efficiency(LENGTHS, 0, max_tokens=100)


def test_sampling_modules_import_without_cycles():
    """Every import between sampling modules (module level or inside functions) points one way."""
    import ast
    from pathlib import Path

    import dflash_lab.sampling as sampling

    root = Path(sampling.__file__).parent
    graph = {}
    for path in root.glob("*.py"):
        if path.stem == "__init__":
            continue
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets.add(node.module or "__init__")
        graph[path.stem] = targets
    assert "__init__" not in set().union(*graph.values()), "a sampling module imports the package itself"
    done, active = set(), []

    def visit(module):
        assert module not in active, f"import cycle: {' -> '.join(active + [module])}"
        if module in done:
            return
        active.append(module)
        for target in graph.get(module, ()):
            visit(target)
        active.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_full_random_at_bucketeds_real_tokens_is_resolved_from_the_bucketed_plan_of_the_same_data():
    """sampler.real_tokens_per_step=bucketed: T is the bucketed plan's mean real tokens per rank and step over the
    same lengths, budget, seed and world size (automatic boundaries), at least the longest sample; a number stays."""
    from dflash_lab.sampling import build_policy, resolve_auto_boundaries
    from dflash_lab.sampling.stats import plan_stats, resolve_matched_real_tokens

    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(8, 40, 300), rng.integers(200, 400, 60)])
    cfg = {"name": "full_random", "max_tokens": 1024, "overlong": "error", "real_tokens_per_step": "bucketed"}
    for builtin in (False, True):
        auto = resolve_auto_boundaries({"boundaries": "auto", "num_buckets": None}, builtin_corpus=builtin)
        bucketed = build_policy("bucketed", lengths, max_tokens=1024, seed=5, world_size=2,
                                boundaries=auto["boundaries"], num_buckets=auto["num_buckets"])
        expected = max(int(lengths.max()), round(plan_stats(bucketed)["real_tokens_per_step"]))
        got = resolve_matched_real_tokens(cfg, lengths, builtin_corpus=builtin, seed=5, world_size=2)
        assert got["real_tokens_per_step"] == expected and cfg["real_tokens_per_step"] == "bucketed"
        policy = build_policy("full_random", lengths, max_tokens=1024, seed=5, world_size=2,
                              real_tokens_per_step=got["real_tokens_per_step"])
        real = plan_stats(policy)["real_tokens_per_step"]
        assert abs(real - expected) / expected < 0.1   # full_random's steps then carry about bucketed's real tokens
    assert resolve_matched_real_tokens({**cfg, "real_tokens_per_step": 700}, lengths, builtin_corpus=False, seed=5,
                                       world_size=2)["real_tokens_per_step"] == 700
    with pytest.raises(ValueError, match="resolved where the data is known"):
        build_policy("full_random", lengths, max_tokens=1024, real_tokens_per_step="bucketed")
