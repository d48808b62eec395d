"""A comparison cell is never silently empty: a metric left NaN by its documented minimum is named, with the reason,
in the run's notes (analysis.summarize.analyse_run). Built in memory: no training, no files."""

import numpy as np
import pandas as pd

from dflash_lab.analysis.schema import (
    COMPARISON_COLUMNS,
    PRESENTATION_COLUMNS,
    PROBE_COLUMNS,
    STEP_COLUMNS,
    RunRecord,
    conform,
)
from dflash_lab.analysis.summarize import analyse_run, explains
from dflash_lab.metrics import forgetting

BANDS = [0, 96, 152, 216, 304, 412, 1024]  # the 6 default probe bands
STEPS = 100


def _record(probe_every: int) -> RunRecord:
    """A finished 100-step run with 6 probe bands evaluated every `probe_every` steps.

    The loss never descends, so the steady state starts at the 10% floor (step 11): probes every 10 steps leave 9
    evals in the window (steps 20..100), enough for A and beta (8), too few for the cross effect with 6 bands (11).
    """
    rng = np.random.default_rng(0)
    step = np.arange(1, STEPS + 1)
    steps = pd.DataFrame({"step": step, "epoch": (step - 1) // 25, "loss": 2.0 + 0.001 * step,
                          "acc": 0.3, "real_tokens": 3000, "padded_tokens": 4000, "ktok_s": 30.0})
    probe_rows = [{"step": s, "band": b, "band_lo": BANDS[b], "band_hi": BANDS[b + 1],
                   "loss": 3.0 - 0.002 * s + 0.05 * rng.standard_normal(), "acc": 0.2 + 0.002 * s, "tokens": 64}
                  for s in range(0, STEPS + 1, probe_every) for b in range(len(BANDS) - 1)]
    shown = [{"sample_index": i, "epoch": epoch, "step": epoch * 25 + i % 25 + 1, "band": band,
              "length": int(rng.integers(BANDS[band] + 1, BANDS[band + 1] + 1)), "acc": float(rng.uniform())}
             for epoch in range(4) for i, band in enumerate(rng.integers(0, len(BANDS) - 1, 100))]
    summary = {"sampler": "bucketed", "seed": 0, "steps": STEPS, "ktok_s": 30.0, "pad_eff": 0.75,
               "final_loss": 2.1, "final_acc": 0.3, "tau": 2.0, "status": "finished"}
    return RunRecord(run_id="r", source="local", location="/r", summary=summary,
                     steps=conform(steps, STEP_COLUMNS)[0], probes=conform(pd.DataFrame(probe_rows), PROBE_COLUMNS)[0],
                     presentations=conform(pd.DataFrame(shown), PRESENTATION_COLUMNS)[0])


def test_too_few_evals_for_the_cross_effect_leave_it_nan_with_the_reason_in_the_notes():
    row = analyse_run(_record(probe_every=10)).row
    assert row["steady_start_step"] == 11 and row["forgetting_window_evals"] == 9
    assert forgetting.MIN_EVALS <= 9 < forgetting.cross_band_min_evals(6) == 11
    assert np.isfinite(row["residual_amplitude"]) and np.isfinite(row["own_share_slope"])
    assert np.isnan(row["cross_band_effect"])
    note = next(n for n in row["notes"].split("; ") if explains(n, "cross_band_effect"))
    assert note == ("cross_band_effect: 9 probe evals from the steady-state start (step 11), minimum 11 with 6 probe "
                    "bands (forgetting.cross_band_min_evals)")
    assert not explains(row["notes"], "residual_amplitude") and not explains(row["notes"], "own_share_slope")


def test_enough_evals_fill_the_cross_effect_without_a_note():
    row = analyse_run(_record(probe_every=5)).row  # 18 evals in the window
    assert row["forgetting_window_evals"] == 18 and np.isfinite(row["cross_band_effect"])
    assert not explains(row["notes"], "cross_band_effect")


def test_every_nan_comparison_column_of_a_bare_run_is_named_in_its_notes():
    bare = RunRecord(run_id="bare", source="local", location="/bare", summary={"status": "finished"},
                     steps=conform(pd.DataFrame({"step": [1, 2], "loss": [3.0, 2.9]}), STEP_COLUMNS)[0])
    row = analyse_run(bare).row
    endpoints = {"probe_loss_at_tokens"}  # set across runs by compare_records
    silent = [c for c in COMPARISON_COLUMNS
              if c not in endpoints and np.isnan(row[c]) and not explains(row["notes"], c)]
    assert silent == ["loop_score"]  # a shuffled order (no sampler known): no period, NaN by definition


def test_nan_losses_are_counted_and_named_in_the_comparison_notes():
    """Issue 43: steps logged with a null loss (a skipped non-finite update) change jumpiness, spike_score, the
    steady state and final_loss; the comparison says how many and which."""
    from dflash_lab.analysis.summarize import compare_records

    clean, poisoned = _record(probe_every=10), _record(probe_every=10)
    poisoned.steps.loc[poisoned.steps["step"].isin([3, 57, 100]), "loss"] = np.nan
    clean_row = analyse_run(clean).row
    assert "finite loss" not in clean_row["notes"]
    runs = compare_records([poisoned]).runs
    note = ("loss: 3 of 100 steps logged no finite loss (steps [3, 57, 100], updates skipped by "
            "trainer.skip_nonfinite): jumpiness, spike_score, the steady-state start and final_loss are computed "
            "without them")
    assert note in runs.loc[0, "notes"].split("; ")
    assert runs.loc[0, "jumpiness"] != clean_row["jumpiness"]   # the numbers the note is about did change
