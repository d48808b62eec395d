"""Batching policies: how samples are grouped into batches and in what order, one policy per module.

``build_policy(name, lengths, *, max_tokens, seed=0, world_size=1, rank=0, **params)`` returns a ``Policy``:
``batches(epoch)`` (this rank's batches in consumption order), the torch ``batch_sampler`` protocol
(``set_epoch``, ``__iter__``, ``__len__``) and ``state_dict()``/``load_state_dict()`` for exact resume.

| policy             | module                | padding      | composition across epochs | step order            |
|--------------------|-----------------------|--------------|---------------------------|-----------------------|
| sorted_static      | sorted_static.py      | least        | never changes             | shuffled              |
| full_random        | full_random.py        | most         | fully random              | shuffled              |
| bucketed           | bucketed.py           | bucket width | random inside buckets     | shuffled (runs of R)  |
| bucketed_megabatch | bucketed_megabatch.py | near sorted  | random inside buckets     | shuffled (runs of R)  |
| packed             | packed.py             | none (rows)  | random chunks             | shuffled              |
| bucket_sequential  | bucket_sequential.py  | bucket width | random inside buckets     | bucket by bucket      |

``bucket_sequential`` is a positive control for the forgetting ablation, never a production order. The bucketed
policies take ``bucket_by: length | random``; ``random`` keeps the length buckets' sizes and visiting order but
draws each bucket's members once, independently of length: the negative control on natural data.

Modules: ``core`` (lengths check, token budget, packing passes, steps), ``boundaries`` (the one length -> bucket
rule, boundary fitting), ``policy`` (the base every policy subclasses: its shared arguments, the step budget,
sharding, the ``batch_sampler`` protocol and resumable state), ``build`` (registry, key checks, the presets'
defaults), ``stats`` (plan diagnostics).
"""

from __future__ import annotations

from .boundaries import FIT_METHODS, bucket_ids, fit_boundaries, validate_boundaries
from .bucketed import CPU_BOUNDARIES, SEED_BOUNDARIES, resolve_auto_boundaries
from .build import POLICIES, build_policy, policy_from_config, policy_keys
from .core import StepPlan, TokenBudget, validate_lengths
from .policy import Policy
from .stats import smallest_k_for_efficiency

__all__ = [
    "POLICIES", "FIT_METHODS", "CPU_BOUNDARIES", "SEED_BOUNDARIES", "resolve_auto_boundaries", "Policy", "StepPlan",
    "TokenBudget",
    "build_policy", "policy_from_config", "policy_keys", "fit_boundaries", "smallest_k_for_efficiency",
    "validate_boundaries", "validate_lengths", "bucket_ids",
]
