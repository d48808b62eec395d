"""Tau by chain replay: the accepted lists of real speculative decoding, from cached target continuations; the
prompt-bootstrap SE of tau."""

import math

import pytest
import torch

from dflash_lab.metrics.draft_quality import tau_bootstrap_se
from dflash_lab.model.decoding import (
    TargetContinuations, greedy_generate, measure_acceptance, replay_acceptance, replay_chain, speculative_generate,
)
from helpers import tiny_dflash_model

torch.set_num_threads(1)
BUDGET = 21   # with block size 4, chains whose last verify step is cut by the budget


def _prompts(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g)
            for _ in range(count)]


def _varied_model():
    """The tiny DFlash model with its random target's matrices redrawn at std 0.3: at the default 0.02 a random
    target repeats one token forever, which would test neither the stop tokens nor the features of varied text."""
    model = tiny_dflash_model(block_size=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.target.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3, generator=g)
    return model


def _half_right_draft(model):
    """Wrap the model's draft so that it accepts some blocks: slot j proposes the target's greedy token unless the
    real draft's own argmax there is divisible by 3. A random draft accepts nothing, which would not exercise the
    chain; this one still runs the real draft on the context features, so its proposals depend on them. Returns
    (set_reference(tokens), calls) where ``calls`` records (anchor position, context, proposals) of every call."""
    real = model.draft_block_logits
    state: dict = {"reference": None}
    calls: list[tuple[int, torch.Tensor, list[int]]] = []

    def draft_block_logits(context_features, anchor_token, anchor_position, block_size=None):
        logits = real(context_features, anchor_token, anchor_position, block_size)
        reference = state["reference"]
        for slot in range(logits.shape[0]):
            position = anchor_position + 1 + slot
            if int(logits[slot].argmax()) % 3 and position < len(reference):
                logits[slot, reference[position]] = logits[slot].max() + 1.0
        calls.append((anchor_position, context_features.clone(), logits.argmax(dim=-1).tolist()))
        return logits

    model.draft_block_logits = draft_block_logits
    return (lambda tokens: state.update(reference=tokens)), calls


@pytest.mark.parametrize("stops", ["none", "common_token"])
def test_replay_gives_the_accepted_lists_of_speculative_decoding(stops):
    """24 prompts, budget 21 at block size 4 (cut last steps), and a stop token most continuations hold: replay and
    speculative decoding record the same accepted list for every prompt, and see the same contexts."""
    model = _varied_model()
    prompts = _prompts(24)
    greedy = [greedy_generate(model, p, BUDGET, stop_token_ids=[]) for p in prompts]
    stop_ids = []
    if stops == "common_token":   # the token most continuations hold after their first one: many stop early
        counts: dict[int, int] = {}
        for tokens in greedy:
            for token in set(tokens[1:]):
                counts[token] = counts.get(token, 0) + 1
        stop_ids = [max(counts, key=counts.get)]
    set_reference, calls = _half_right_draft(model)
    continuations = TargetContinuations.build(model, prompts, BUDGET, stop_token_ids=stop_ids)
    cut, stopped, accepted_some = 0, 0, 0
    for prompt, tokens, length, features in zip(prompts, continuations.tokens, continuations.prompt_lengths,
                                                continuations.features):
        reference = prompt.tolist() + tokens
        set_reference(reference)
        calls.clear()
        generated, expected = speculative_generate(model, prompt, BUDGET, stop_token_ids=stop_ids)
        generate_calls = list(calls)
        calls.clear()
        assert replay_chain(model, features, length, tokens) == expected
        assert generated == tokens
        for (position, seen, proposed), (replay_position, replayed, replay_proposed) in zip(generate_calls, calls,
                                                                                          strict=True):
            assert (position, proposed) == (replay_position, replay_proposed)
            torch.testing.assert_close(replayed, seen, rtol=1e-4, atol=1e-4)   # last bits only
        stopped += tokens[-1] in stop_ids
        if calls:   # the last step is cut when its drafts match every remaining token (the bonus would pass g_L)
            position, _, proposed = calls[-1]
            remaining = reference[position + 1:]
            cut += len(remaining) < len(proposed) and proposed[:len(remaining)] == remaining
        accepted_some += any(expected)
    assert accepted_some >= 12 and cut >= 1
    assert stopped >= 5 if stop_ids else stopped == 0


def test_replay_acceptance_matches_measure_acceptance_over_prompts():
    """The per-prompt runner: same dict as measure_acceptance (the untrained random draft: accepts nothing)."""
    model = tiny_dflash_model(block_size=4)
    prompts = _prompts(6)
    replayed = replay_acceptance(model, TargetContinuations.build(model, prompts, BUDGET))
    measured = measure_acceptance(model, prompts, BUDGET)
    assert replayed == measured and replayed["prompts"] == 6 and replayed["complete"]
    stopped = replay_acceptance(model, TargetContinuations.build(model, prompts, BUDGET), should_stop=lambda: True)
    assert stopped["prompts"] == 0 and not stopped["complete"] and math.isnan(stopped["tau"])


def test_an_oracle_draft_is_fully_accepted_in_replay():
    """A draft that proposes the continuation is accepted in full: 1 prefill token + 6 steps x 4 tokens = 25."""
    model = tiny_dflash_model(block_size=4)
    prompt = torch.tensor([1, 5, 60, 61])
    continuations = TargetContinuations.build(model, [prompt], 25, stop_token_ids=[])
    reference = prompt.tolist() + continuations.tokens[0]
    assert continuations.tokens[0] == greedy_generate(model, prompt, 25, stop_token_ids=[])
    assert continuations.features[0].shape[1] == 4 + 25 - 1

    def oracle(context_features, anchor_token, anchor_position, block_size=None):
        assert reference[anchor_position] == anchor_token and context_features.shape[1] == anchor_position
        logits = torch.zeros(3, model.target.config.vocab_size)
        logits[torch.arange(3), torch.tensor((reference + [0, 0, 0])[anchor_position + 1: anchor_position + 4])] = 1
        return logits

    model.draft_block_logits = oracle
    assert replay_acceptance(model, continuations)["accepted_per_prompt"] == [[3] * 6]


def test_bootstrap_se_of_tau_shrinks_with_more_prompts():
    """Same per-prompt distribution, 16 x the prompts: the SE falls about 4x (1/sqrt(n)); deterministic by seed."""
    g = torch.Generator().manual_seed(0)

    def prompts(count):
        return [torch.randint(0, 4, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
                for _ in range(count)]

    few, many = prompts(10), prompts(160)
    assert tau_bootstrap_se(few) == tau_bootstrap_se(few)
    ratio = tau_bootstrap_se(few) / tau_bootstrap_se(many)
    assert 2.5 < ratio < 6.5
    assert tau_bootstrap_se([[3, 3], [3]]) == 0.0   # every resample has the same tau


class _HeldOut:
    """A held-out split: ``lengths`` and samples whose first third is the prompt; every fifth has no supervision."""

    def __init__(self, lengths):
        g = torch.Generator().manual_seed(3)
        self.lengths = list(lengths)
        self.samples = []
        for i, length in enumerate(self.lengths):
            mask = torch.zeros(length, dtype=torch.bool)
            if i % 5:
                mask[length // 3:] = True
            self.samples.append({"input_ids": torch.randint(3, 200, (length,), generator=g), "loss_mask": mask})

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def _evaluation(model, heldout, method, num_prompts):
    import contextlib
    import logging

    from dflash_lab.records.record import RunTotals, TimeLedger
    from dflash_lab.training.evaluation import Evaluation
    from dflash_lab.training.settings import ProbeSettings

    probes = ProbeSettings(every=0, warmup_evals=0, bands=[0, 12, 24, 48], per_band=1, seed=0, max_tokens=512,
                           presentations=False)
    model_cfg = {"decode_num_prompts": num_prompts, "decode_max_new_tokens": 9, "decode_max_prompt_tokens": 64,
                 "tau_method": method}
    rows = []
    evaluation = Evaluation(model=model, heldout_ds=heldout, pad_id=0, device=torch.device("cpu"),
                            autocast=contextlib.nullcontext, probes=probes, tau_every=0, model_cfg=model_cfg,
                            log_probes=lambda rows: None, log_tau=rows.append,
                            ledger=TimeLedger(RunTotals(), start=0.0), is_main=True, log=logging.getLogger("test"),
                            warmup_steps=0)
    return evaluation, rows


def test_evaluation_replays_every_held_out_prompt_and_takes_each_bands_minimum_over_all_of_them():
    """decode_num_prompts null: every held-out sample with supervision is a tau prompt (24 of 30 here), grouped by
    its probe band; replay and generate give the same figures; tau_band_min is the minimum over the bands of tau
    pooled over all the band's prompts; tau_se and tau_prompts are reported."""
    model = tiny_dflash_model(block_size=4)

    def copy_draft(context_features, anchor_token, anchor_position, block_size=None):
        # the random target mostly repeats a token: copying the anchor is accepted there, not at a change
        logits = torch.zeros(3, model.target.config.vocab_size)
        logits[:, anchor_token] = 1.0
        return logits

    model.draft_block_logits = copy_draft
    heldout = _HeldOut([8 + (13 * i) % 40 for i in range(30)])   # lengths 8..47 over the 3 bands
    supervised = [i for i in range(30) if i % 5]
    replayed, rows = _evaluation(model, heldout, "replay", None)
    assert len(replayed.prompts) == len(supervised) == 24
    assert sorted(len(p) for p in replayed.prompts) == sorted(max(1, heldout.lengths[i] // 3) for i in supervised)
    result = replayed.final_tau(5, should_stop=lambda: False)
    generated = _evaluation(model, heldout, "generate", None)[0].final_tau(5, should_stop=lambda: False)
    assert {k: v for k, v in result.items() if "baseline" not in k} == {
        k: v for k, v in generated.items() if "baseline" not in k}
    measured = replayed.measure(model)
    per_band = {band: [] for band in range(3)}
    for band, steps in zip(replayed.prompt_bands, measured["accepted_per_prompt"]):
        per_band[band].extend(steps)
    expected = [sum(a + 1 for a in steps) / len(steps) for steps in per_band.values()]
    assert result["tau_by_band"] == pytest.approx(expected) and len(set(expected)) == 3
    assert result["tau_band_min"] == min(expected) and result["tau_prompts"] == 24
    assert 0 < result["tau_se"] < 1 and rows[0]["tau_se"] == result["tau_se"] and rows[0]["tau_prompts"] == 24
    capped, _ = _evaluation(model, heldout, "replay", 6)
    assert len(capped.prompts) == 6 and set(capped.prompt_bands) == {0, 1, 2}   # a number caps the count
