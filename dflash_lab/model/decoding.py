"""Greedy speculative decoding with the DFlash draft, and the real acceptance length tau.

Loop (the DFlash inference loop, greedy):
    prefill: target on the prompt (KV cache) -> features of the prompt, first token = argmax (the first anchor)
    repeat:  draft proposes bs-1 tokens from [context features ; anchor, MASK...]   (draft_block_logits)
             target verifies [anchor, d_1..d_{bs-1}] in one forward on its cache
             accepted = longest prefix of drafts equal to the target's greedy tokens; bonus = target's next token
             keep accepted + 1 tokens, extend the context with the target features of the kept block tokens,
             crop the target cache to the kept length; the bonus token is the next anchor
tau = mean over verify steps of (accepted + 1) (dflash_lab.metrics.draft_quality.acceptance_length_tau).
Greedy verification makes the output identical to the target's own greedy decoding, whatever the draft does.

Cost: per verify step one draft forward over the context (the context is re-projected each step; fine at our
scales) and one target forward over bs tokens with a KV cache.

Replay (``TargetContinuations`` + ``replay_acceptance``): the same accepted lists without a target forward per
verify step. The target is frozen and greedy verification emits the target's own greedy tokens, so the target's
greedy continuation g_1..g_L of each prompt and its features are computed once per run and each draft's decoding
chain is replayed on them (``replay_acceptance`` states the algorithm and the equivalence argument).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from dflash_lab.metrics.draft_quality import acceptance_length_tau
from dflash_lab.model.dflash import capture_target_features


def heldout_prompts(dataset, num_prompts: int = 16, max_prompt_tokens: int = 128) -> list[torch.Tensor]:
    """Prompts (the unsupervised prefix of each sample) of the first ``num_prompts`` usable held-out samples.

    Samples are taken evenly over the dataset's length order so short and long samples both appear.

    Args:
        dataset: usually the held-out view from ``dataset.split()``.
        num_prompts: how many prompts.
        max_prompt_tokens: longer prefixes keep their last ``max_prompt_tokens`` tokens.

    Returns:
        Long[P_i] tensors.
    """
    order = sorted(range(len(dataset)), key=lambda i: int(dataset.lengths[i]))
    if not order:
        return []
    step = max(1, len(order) // max(1, num_prompts))
    prompts = []
    for i in order[::step]:
        prompt = _prompt_of(dataset[i], max_prompt_tokens)
        if prompt is None:
            continue
        prompts.append(prompt)
        if len(prompts) >= num_prompts:
            break
    return prompts


def _prompt_of(sample: dict, max_prompt_tokens: int) -> torch.Tensor | None:
    """The unsupervised prefix of a sample (its last ``max_prompt_tokens`` tokens); None without supervision."""
    supervised = torch.as_tensor(sample["loss_mask"]).nonzero()
    if supervised.numel() == 0:
        return None
    cut = max(1, int(supervised[0]))   # at least one prompt token so the target has context
    return torch.as_tensor(sample["input_ids"][:cut], dtype=torch.long)[-max_prompt_tokens:]


def banded_prompts(dataset, bands, num_prompts: int = 16,
                   max_prompt_tokens: int = 128) -> tuple[list[torch.Tensor], list[int]]:
    """Prompts spread over length bands (the probe bands: band b = documents of length in (lo, hi]), and the band of
    each: one prompt per band in turn, each band's taken evenly over its length order, until ``num_prompts``; a
    band with no usable sample gets none. Tau per band then comes from the same measurement at no extra cost.

    Returns:
        (prompts, band of each prompt).
    """
    from dflash_lab.sampling.boundaries import bucket_ids

    band_of = bucket_ids(np.asarray(dataset.lengths), list(bands))
    share = max(1, -(-num_prompts // max(1, len(bands) - 1)))   # ceil: a band's fair share of the prompts
    queues = []   # per band: its samples, evenly spaced picks first, the rest after (for prompts that lack one)
    for band in range(len(bands) - 1):
        members = [int(i) for i in sorted(np.flatnonzero(band_of == band), key=lambda i: int(dataset.lengths[i]))]
        spaced = members[::max(1, len(members) // share)]
        queues.append(spaced + sorted(set(members) - set(spaced), key=members.index))
    prompts, prompt_bands = [], []
    while len(prompts) < num_prompts and any(queues):
        for band, queue in enumerate(queues):
            while queue and len(prompts) < num_prompts:
                prompt = _prompt_of(dataset[queue.pop(0)], max_prompt_tokens)
                if prompt is not None:
                    prompts.append(prompt)
                    prompt_bands.append(band)
                    break
    return prompts, prompt_bands


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of the cache (transformers 5 crops by a negative count to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _cache_kwarg(target) -> str:
    # transformers >= 5.x names the KV cache argument `cache` (past_key_values is deprecated); 4.x has only the latter.
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _target_step(model, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache):
    features, out = capture_target_features(model.target, model.target_layer_ids, stop_early=False, input_ids=ids,
                                            position_ids=positions, use_cache=True,
                                            **{_cache_kwarg(model.target): cache})
    return out.logits.float(), features


@torch.no_grad()
def speculative_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int = 64,
                         stop_token_ids: list[int] | None = None, block_size: int | None = None):
    """Greedy speculative decoding of one prompt.

    Args:
        model: a DFlashModel.
        prompt_ids: Long[P] prompt.
        max_new_tokens: generation budget.
        stop_token_ids: stop after emitting any of these (None: ``model.stop_token_ids``).
        block_size: verify block size (default: the model's training block size).

    Returns:
        (new_tokens list[int], accepted list[int] per verify step).
    """
    bs = block_size or model.block_size
    device = model.target.get_input_embeddings().weight.device
    prompt = prompt_ids.to(device).view(1, -1)
    stops = set(getattr(model, "stop_token_ids", []) if stop_token_ids is None else stop_token_ids)
    cache = DynamicCache()
    logits, context = _target_step(model, prompt, torch.arange(prompt.shape[1], device=device)[None], cache)
    anchor = int(logits[0, -1].argmax())
    generated = [anchor]
    accepted_per_step: list[int] = []
    while len(generated) < max_new_tokens and anchor not in stops:
        start = context.shape[1]                         # position of the anchor
        draft_tokens = model.draft_block_logits(context, anchor, start, bs).argmax(dim=-1)
        block = torch.cat([torch.tensor([anchor], device=device), draft_tokens])[None]
        logits, features = _target_step(model, block, start + torch.arange(bs, device=device)[None], cache)
        greedy = logits[0].argmax(dim=-1)                # greedy[j]: target's token after block[:j+1]
        matches = (block[0, 1:] == greedy[:-1]).long().cumprod(dim=0)
        accepted = int(matches.sum())
        new = block[0, 1:accepted + 1].tolist() + [int(greedy[accepted])]
        new = new[: max_new_tokens - len(generated)]
        hit = [i for i, token in enumerate(new) if token in stops]
        if hit:
            new = new[: hit[0] + 1]  # the target itself would stop at the first stop token
        generated.extend(new)
        # Tokens produced by this verify step = accepted drafts + 1 (fewer only when the budget/stop cuts).
        accepted_per_step.append(len(new) - 1)
        if len(new) < accepted + 1 or hit:
            break
        # Keep the target state of the anchor and the accepted drafts; the bonus token is the next anchor.
        context = torch.cat([context, features[:, : accepted + 1]], dim=1)
        _crop(cache, start + accepted + 1)
        anchor = generated[-1]
    return generated, accepted_per_step


@torch.no_grad()
def greedy_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int = 64,
                    stop_token_ids: list[int] | None = None) -> list[int]:
    """The target's own greedy decoding (no draft, full recompute each token): the reference for tests."""
    device = model.target.get_input_embeddings().weight.device
    ids = prompt_ids.to(device).view(1, -1)
    stops = set(stop_token_ids or [])
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(model.target(input_ids=ids, use_cache=False).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        if token in stops:
            break
    return out


@torch.no_grad()
def measure_acceptance(model, prompts: list[torch.Tensor], max_new_tokens: int = 64,
                       stop_token_ids: list[int] | None = None, block_size: int | None = None,
                       should_stop=None, on_prompt=None) -> dict:
    """Real acceptance length tau over held-out prompts.

    Args:
        should_stop: optional ``() -> bool`` polled before each prompt (a preemption request): when it turns
            True the measurement ends early and reports the prompts done so far (``complete`` False).
        on_prompt: optional ``(done, total, tau_so_far) -> None`` called after each prompt (progress reports).

    Returns:
        {"tau", "verify_steps", "new_tokens", "prompts", "complete", "accepted_per_prompt"} (the accepted
        tokens of each verify step, per measured prompt); tau is NaN when no verify step ran.

    Example:
        >>> res = measure_acceptance(model, heldout_prompts(heldout, 8), max_new_tokens=32)   # doctest: +SKIP
    """
    def decode(prompt):
        tokens, steps = speculative_generate(model, prompt, max_new_tokens, stop_token_ids, block_size)
        return len(tokens), list(steps)

    return _tally_chains(model, [functools.partial(decode, prompt) for prompt in prompts], should_stop, on_prompt)


def _tally_chains(model, chains, should_stop, on_prompt) -> dict:
    """Run each prompt's decoding chain (a ``() -> (new tokens, accepted per verify step)``) with the draft in eval
    mode, polling ``should_stop`` before each and reporting to ``on_prompt`` after each: the measurement dict of
    ``measure_acceptance`` (generation) and ``replay_acceptance`` (replay) alike."""
    was_training = model.draft.training
    model.draft.eval()
    accepted: list[int] = []
    per_prompt: list[list[int]] = []
    new_tokens = 0
    try:
        for chain in chains:
            if should_stop is not None and should_stop():
                break
            produced, steps = chain()
            per_prompt.append(steps)
            accepted.extend(steps)
            new_tokens += produced
            if on_prompt is not None:
                on_prompt(len(per_prompt), len(chains), acceptance_length_tau(accepted))
    finally:
        model.draft.train(was_training)
    return {"tau": acceptance_length_tau(accepted), "verify_steps": len(accepted), "new_tokens": new_tokens,
            "prompts": len(per_prompt), "complete": len(per_prompt) == len(chains),
            "accepted_per_prompt": per_prompt}


@dataclass
class TargetContinuations:
    """The target's greedy continuation of each prompt and its features: what a replay of decoding reads.

    Attributes:
        prompt_lengths: P_i, tokens of each prompt.
        tokens: g_1..g_L of each prompt, the target's greedy tokens after it: L = ``max_new_tokens``, or fewer when
            g_L is the first stop token (speculative decoding emits exactly these tokens).
        features: Float[1, P_i + L_i - 1, n*H] per prompt, on the CPU: the target features (the concatenated
            ``model.target_layer_ids`` outputs) of the prompt and of g_1..g_(L-1), the longest context a verify
            step reads (g_L is never an anchor).
        max_new_tokens, stop_token_ids: the budget and stop tokens they were built for.

    Build with :meth:`build` once per run: the target is frozen, so every draft (trained at any step, untrained)
    replays on the same continuations.
    """

    prompt_lengths: list[int]
    tokens: list[list[int]]
    features: list[torch.Tensor]
    max_new_tokens: int
    stop_token_ids: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    @torch.no_grad()
    def build(cls, model, prompts: list[torch.Tensor], max_new_tokens: int,
              stop_token_ids: list[int] | None = None, should_stop=None) -> TargetContinuations:
        """Greedy-decode each prompt with the target (KV cache), keeping the features of every position.

        Per prompt: a prefill over the prompt (its features and g_1), then one single-token forward per further
        token, g_k in -> features of g_k and g_(k+1) out, until ``max_new_tokens`` tokens or a stop token. The
        features come from the same incremental, KV-cached forwards as speculative decoding's (not from one full
        forward), so they match its context to the last bits in practice (tests/test_decoding_replay.py).

        Args:
            model: a DFlashModel (only its target is run).
            prompts: Long[P_i] prompts.
            max_new_tokens: generation budget (as ``speculative_generate``'s).
            stop_token_ids: None: ``model.stop_token_ids``.
            should_stop: optional ``() -> bool`` polled before each prompt (a preemption request): when it turns
                True the build ends early, holding the prompts done so far (fewer than ``prompts``).

        Cost: P_i + L_i - 1 target token-forwards per prompt with a KV cache (one greedy decoding), once per run;
        memory: (P_i + L_i - 1) x n*H feature values per prompt, kept on the CPU.
        """
        stops = list(getattr(model, "stop_token_ids", []) if stop_token_ids is None else stop_token_ids)
        stop_set = set(stops)
        device = model.target.get_input_embeddings().weight.device
        lengths, all_tokens, all_features = [], [], []
        for prompt_ids in prompts:
            if should_stop is not None and should_stop():
                break
            prompt = prompt_ids.to(device).view(1, -1)
            cache = DynamicCache()
            logits, features = _target_step(model, prompt, torch.arange(prompt.shape[1], device=device)[None], cache)
            parts = [features]
            tokens = [int(logits[0, -1].argmax())]
            while len(tokens) < max_new_tokens and tokens[-1] not in stop_set:
                position = prompt.shape[1] + len(tokens) - 1
                logits, features = _target_step(model, torch.tensor([[tokens[-1]]], device=device),
                                                torch.tensor([[position]], device=device), cache)
                parts.append(features)
                tokens.append(int(logits[0, -1].argmax()))
            lengths.append(prompt.shape[1])
            all_tokens.append(tokens)
            all_features.append(torch.cat(parts, dim=1).cpu())
        return cls(lengths, all_tokens, all_features, int(max_new_tokens), stops)


def replay_chain(model, features: torch.Tensor, prompt_length: int, tokens: list[int],
                 block_size: int | None = None) -> list[int]:
    """Accepted draft tokens per verify step of one prompt, replayed on its cached greedy continuation.

    Algorithm: n = 1 (g_1 comes from the prefill); while n < L: the anchor is g_n at position P + n - 1, the
    context the features of positions 0..P+n-2 (prompt and g_1..g_(n-1)); the draft proposes d_1..d_(bs-1)
    (argmax of ``draft_block_logits``); a = the longest prefix of the d_j equal to g_(n+1).., compared up to g_L;
    the step keeps k = min(a + 1, L - n) tokens (the a drafts and the target's bonus token, cut at the budget or
    the stop token g_L) and records k - 1; n += k.

    Equivalence with ``speculative_generate``: greedy verification keeps exactly the target's greedy tokens, so at
    every step its anchor, its position and its context are g_n, P + n - 1 and the features of prompt and
    g_1..g_(n-1); the verify forward's greedy tokens are g_(n+1)..; its accepted count is this a; it keeps
    a + 1 tokens cut to the remaining budget (L - n when the budget ends the continuation) or at the first stop
    token (g_L, again L - n), records the kept count - 1 and advances by it. The lists are therefore equal, the
    last, cut step included, up to the floating-point difference between the features and greedy tokens of its
    verify forwards (a bs-token block on the cache) and of the single-token forwards of
    ``TargetContinuations.build``: equal on every prompt tested.

    Args:
        model: a DFlashModel (its draft is run).
        features: Float[1, >= P + L - 1, n*H] target features (``TargetContinuations.features``).
        prompt_length: P.
        tokens: g_1..g_L.
        block_size: verify block size (default: the model's training block size).

    Returns:
        The accepted draft tokens of each verify step (as ``speculative_generate``'s second result).

    Cost: one draft forward per verify step (over the context, as in ``speculative_generate``); no target forward.
    """
    bs = block_size or model.block_size
    device = model.target.get_input_embeddings().weight.device
    features = features.to(device)
    total = len(tokens)
    accepted_per_step: list[int] = []
    done = 1
    while done < total:
        start = prompt_length + done - 1                 # position of the anchor g_done
        drafts = model.draft_block_logits(features[:, :start], tokens[done - 1], start, bs).argmax(dim=-1).tolist()
        truth = tokens[done: done + bs - 1]              # g_(done+1).., at most up to g_L
        accepted = 0
        while accepted < len(truth) and drafts[accepted] == truth[accepted]:
            accepted += 1
        kept = min(accepted + 1, total - done)           # the drafts and the bonus token, cut at g_L
        accepted_per_step.append(kept - 1)
        done += kept
    return accepted_per_step


@torch.no_grad()
def replay_acceptance(model, continuations: TargetContinuations, block_size: int | None = None,
                      should_stop=None, on_prompt=None) -> dict:
    """Acceptance length tau by replaying the decoding chain on cached target continuations (``replay_chain``).

    Gives the accepted lists of ``measure_acceptance`` (same prompts, budget and stop tokens) with only the draft's
    forwards: the target runs once per run, in ``TargetContinuations.build``.

    Args:
        model: a DFlashModel whose target built ``continuations``.
        continuations: the prompts' greedy continuations and features.
        block_size, should_stop, on_prompt: as ``measure_acceptance``'s.

    Returns:
        The dict of ``measure_acceptance``.

    Example:
        >>> cont = TargetContinuations.build(model, prompts, max_new_tokens=32)    # doctest: +SKIP
        >>> replay_acceptance(model, cont)["tau"]                                  # doctest: +SKIP
    """
    def replay(length, tokens, features):
        return len(tokens), replay_chain(model, features, length, tokens, block_size)

    chains = [functools.partial(replay, *prompt) for prompt in
              zip(continuations.prompt_lengths, continuations.tokens, continuations.features)]
    return _tally_chains(model, chains, should_stop, on_prompt)
