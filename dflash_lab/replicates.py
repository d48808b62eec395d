"""Seeds nested within targets: ``${dflash_target_seed:${seed},${target_seeds}}`` = seed mod target_seeds.

A sweep's seeds are its replicates. With one tiny target, every replicate shares one set of pretrained target
weights, so the seed-to-seed spread (and every confidence interval) leaves out how much the answer depends on the
target. ``target_seeds: k`` (conf/train.yaml) nests the run seeds within k target-pretraining seeds: the tiny
target of run seed s is pretrained with seed s mod k (conf/model/tiny.yaml ``pretrain_seed``). Runs of one seed still
share one target, so the paired differences stay paired; across seeds the target varies too.

k = 1 (the default) keeps the single target of seed 0 (the cache key, hence the cached target, is unchanged).
model=hf has one given target: target_seeds does not apply there.

Cost: none at run time; the first run of each new target seed pretrains its target once (part of the default run's first time, README.md).
"""

from __future__ import annotations

from omegaconf import OmegaConf


def target_seed(seed: int, target_seeds: int) -> int:
    """The tiny target's pretraining seed of run seed ``seed`` when seeds nest within ``target_seeds`` targets.

    Example:
        >>> [target_seed(s, 3) for s in range(6)]
        [0, 1, 2, 0, 1, 2]
        >>> target_seed(4, 0)
        Traceback (most recent call last):
        ...
        ValueError: target_seeds=0: give a whole number >= 1 (1: one target for every seed; 3: seeds nested within \
three target-pretraining seeds, pretrain seed = seed mod 3)
    """
    if isinstance(target_seeds, bool) or not isinstance(target_seeds, int) or target_seeds < 1:
        raise ValueError(f"target_seeds={target_seeds!r}: give a whole number >= 1 (1: one target for every seed; "
                         "3: seeds nested within three target-pretraining seeds, pretrain seed = seed mod 3)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: give a whole number >= 0")
    return seed % target_seeds


if not OmegaConf.has_resolver("dflash_target_seed"):
    OmegaConf.register_new_resolver("dflash_target_seed", target_seed)
