"""Every policy's plans and resume fingerprints equal a recorded reference.

A plan is a pure function of (lengths, policy config, seed, epoch, world size), and a checkpoint's sampler state
names its policy by a fingerprint: a change of code that moves one batch, or one fingerprint, would replay or skip
data on resume, or refuse the checkpoints of earlier runs. The digests below were recorded with the code of
4554964 (before the policies shared a base class); a change that moves them on purpose records them anew and says
why in its commit.

Policies are built directly (``build_policy`` with the keys a library caller gives: the plans) and as training
builds them (the composed ``conf/sampler/<name>.yaml``, ``policy_from_config``: the plans, and the fingerprint and
config a checkpoint's sampler state holds), over several world sizes, ranks, epochs and the budget's options (block
budget, truncation, drop_last, equal real tokens, runs of same-bucket steps).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dflash_lab.data.lengths import reference_lengths
from dflash_lab.sampling import build_policy, policy_from_config

BOUNDARIES = [0, 96, 152, 216, 304, 412, 1024]
# (policy, keys given to build_policy besides max_tokens and seed)
DIRECT = {
    "sorted_static": ("sorted_static", {}),
    "sorted_static+quadratic": ("sorted_static", {"quadratic_length": 512, "max_samples": 12, "overlong": "drop"}),
    "full_random": ("full_random", {}),
    "full_random+real_tokens": ("full_random", {"real_tokens_per_step": 1500}),
    "bucketed": ("bucketed", {"boundaries": BOUNDARIES}),
    "bucketed+fit": ("bucketed", {"boundaries": None, "num_buckets": 4, "fit_method": "quantile"}),
    "bucketed+runs": ("bucketed", {"boundaries": "cpu", "run_length": 3, "bucket_by": "random"}),
    "bucketed_megabatch": ("bucketed_megabatch", {"boundaries": BOUNDARIES, "megabatch_batches": 4}),
    "packed": ("packed", {"chunk_rows": 8}),
    "packed+truncate": ("packed", {"chunk_rows": 8, "overlong": "truncate", "drop_last": True}),
    "bucket_sequential": ("bucket_sequential", {"boundaries": BOUNDARIES, "bucket_by": "random"}),
}


def lengths_and_blocks() -> tuple[np.ndarray, np.ndarray]:
    lengths = reference_lengths("cpu", 1500, seed=5)
    blocks = (np.minimum(lengths // 16, 24) * 8).astype(np.int64)   # a block budget's per-sample block tokens
    return lengths, blocks


def plan_digest(policies, with_state: bool) -> str:
    """One digest of every rank's batches (in order) over epochs 0 and 1 and the boundaries; ``with_state`` adds
    the resume fingerprint and the config the sampler state records."""
    digest = hashlib.sha256()
    for policy in policies:
        digest.update(f"{policy.boundaries}|".encode())
        if with_state:
            digest.update(f"{policy.fingerprint}|{sorted(policy.state_dict()['config'].items())}|".encode())
        for epoch in (0, 1):
            for batch in policy.batches(epoch):
                digest.update(np.asarray(batch, dtype=np.int64).tobytes() + b"|")
    return digest.hexdigest()[:16]


def direct_digest(variant: str, world_size: int, block_budget: bool) -> str:
    name, params = DIRECT[variant]
    lengths, blocks = lengths_and_blocks()
    budget = {"block_tokens": blocks, "max_block_tokens": 600} if block_budget else {}
    max_tokens = 900 if "truncate" in variant else 2048
    return plan_digest((build_policy(name, lengths, max_tokens=max_tokens, seed=3, world_size=world_size, rank=rank,
                                     **params, **budget) for rank in range(world_size)), with_state=False)


RECORDED_DIRECT = {
    ("sorted_static", 1, False): "fc7f1ffcc9429f6d", ("sorted_static", 3, True): "e85540696a90678e",
    ("sorted_static+quadratic", 2, False): "3c526bbe2f0f7e67",
    ("full_random", 1, False): "b74d210818670c80", ("full_random", 3, True): "295852a2b9fc0945",
    ("full_random+real_tokens", 2, False): "2e54888049a896ec", ("full_random+real_tokens", 3, True): "b3883d52c0488178",
    ("bucketed", 1, False): "a1dc6f4ca53c6344", ("bucketed", 3, True): "471560635e745b95",
    ("bucketed+fit", 2, False): "c2045bc769b8f882",
    ("bucketed+runs", 3, False): "c226184d1e723cb7",
    ("bucketed_megabatch", 1, False): "8dff80f1ef94fe21", ("bucketed_megabatch", 3, True): "38728a4c1bdb2192",
    ("packed", 1, False): "ff4ce910b762d7d5", ("packed", 3, True): "e0d62f18aa89ca83",
    ("packed+truncate", 2, False): "d1756d4e351e7110",
    ("bucket_sequential", 2, False): "4659639bdb803b0f", ("bucket_sequential", 3, True): "69eb8ba01f0cce28",
}


@pytest.mark.parametrize("case", sorted(RECORDED_DIRECT), ids=lambda c: f"{c[0]}-w{c[1]}{'-blocks' if c[2] else ''}")
def test_direct_plans_equal_the_recorded_reference(case):
    assert direct_digest(*case) == RECORDED_DIRECT[case]


def composed_sampler(name: str, overrides: list[str]) -> dict:
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["run_dir=/tmp/unused", f"sampler={name}", *overrides])
    return OmegaConf.to_container(cfg.sampler, resolve=True)


RECORDED_COMPOSED = {
    ("sorted_static", ()): "7e29d13414a73ef7",
    ("full_random", ()): "40e6978aeb1005d8",
    ("full_random", ("sampler.real_tokens_per_step=1800",)): "63aae627064002ce",
    ("bucketed", ("sampler.boundaries=cpu",)): "9d839aaf5d4d3f24",
    ("bucketed", ("sampler.boundaries=null", "sampler.num_buckets=5")): "b49590181f263d81",
    ("bucketed_megabatch", ("sampler.boundaries=cpu", "sampler.bucket_by=random")): "cde1d9bc303dfb2d",
    ("packed", ()): "dcec0e1d3ec2994a",
    ("bucket_sequential", ("sampler.boundaries=cpu", "sampler.drop_last=true")): "d38130fdc1a5587f",
}


@pytest.mark.parametrize("case", sorted(RECORDED_COMPOSED), ids=lambda c: "-".join([c[0], *c[1]]))
def test_composed_plans_equal_the_recorded_reference(case):
    """As training builds them: the composed sampler section, ``policy_from_config``, two ranks."""
    name, overrides = case
    sampler_cfg = composed_sampler(name, list(overrides))
    lengths, _ = lengths_and_blocks()
    policies = [policy_from_config(sampler_cfg, lengths, seed=1, world_size=2, rank=rank) for rank in (0, 1)]
    assert plan_digest(policies, with_state=True) == RECORDED_COMPOSED[case]
