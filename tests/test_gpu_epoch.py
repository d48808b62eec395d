"""benchmarks/gpu_epoch.py: the stratified sample of an epoch plan's steps, the step-time fit on gpu_check's step
lines (a known intercept and FLOP rate come back), and the epoch priced by the fit through the planner's
``predict_throughput``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_epoch():
    spec = importlib.util.spec_from_file_location("gpu_epoch", ROOT / "benchmarks" / "gpu_epoch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_epoch"] = module
    spec.loader.exec_module(module)
    return module


def step_lines(rng, a: float, b_s_per_flop: float, flops: np.ndarray, noise: float = 0.0) -> list[dict]:
    """gpu_check ``step`` records of timed steps whose time is ``a + b x FLOPs`` (times a relative noise)."""
    seconds = (a + b_s_per_flop * flops) * (1.0 + noise * rng.standard_normal(flops.size))
    return [{"policy": "bucketed", "phase": "timed", "step": i, "seconds": float(t), "executed_tflop": float(f) / 1e12,
             "compiled": False, "oom": None} for i, (t, f) in enumerate(zip(seconds, flops))]


def test_one_step_from_each_equal_count_cost_stratum(gpu_epoch):
    cost = np.random.default_rng(0).lognormal(0.0, 1.0, 1476)   # an epoch plan's skewed step costs
    chosen = gpu_epoch.stratified_steps(cost, 10)
    ranks = np.argsort(np.argsort(cost, kind="stable"), kind="stable")   # each step's rank by cost
    bands = [set(band) for band in np.array_split(np.argsort(cost, kind="stable"), 10)]
    assert len(chosen) == 10 == len(set(chosen))
    assert all(step in band for step, band in zip(chosen, bands))          # the k-th step from the k-th decile
    assert all(abs(ranks[step] - (min(ranks[list(band)]) + len(band) // 2)) <= 1 for step, band in zip(chosen, bands))
    assert list(cost[chosen]) == sorted(cost[chosen])


def test_stratified_sample_avoids_excluded_steps_and_refuses_too_few(gpu_epoch):
    cost = np.arange(20, dtype=float)
    chosen = gpu_epoch.stratified_steps(cost, 4, exclude=[2, 7, 12, 17])   # each stratum's middle excluded
    assert not {2, 7, 12, 17} & set(chosen) and len(chosen) == 4
    assert [step // 5 for step in chosen] == [0, 1, 2, 3]                   # still one per stratum of 4 left
    assert gpu_epoch.stratified_steps(cost, 20) == list(range(20))
    with pytest.raises(ValueError, match="raise --num-samples"):
        gpu_epoch.stratified_steps(cost, 5, exclude=range(16))


def test_the_stratified_sample_estimates_the_epochs_tokens_per_flop(gpu_epoch):
    """The point of the sample (the first H200 run's 25.3 vs 19.7 real Ktok per executed PFLOP): over a plan whose
    costliest steps carry fewer tokens per FLOP, the first steps of a cost-sorted plan are biased, the stratified
    sample is not."""
    rng = np.random.default_rng(1)
    flops = rng.lognormal(0.0, 0.6, 2000)
    tokens = 30.0 * flops ** 0.7 * rng.uniform(0.9, 1.1, flops.size)   # tokens per FLOP falls with cost
    epoch = tokens.sum() / flops.sum()
    sample = gpu_epoch.stratified_steps(flops, 10)
    assert tokens[sample].sum() / flops[sample].sum() == pytest.approx(epoch, rel=0.05)
    cheapest = np.argsort(flops)[:10]
    assert tokens[cheapest].sum() / flops[cheapest].sum() > 1.5 * epoch


def test_fit_recovers_a_known_intercept_and_flop_rate_from_step_lines(gpu_epoch):
    rng = np.random.default_rng(2)
    a, rate = 0.12, 430e12                                            # 0.12 s per step, 430 TFLOP/s
    flops = np.sort(rng.uniform(0.35e15, 4.7e15, 10))                 # the Qwen3-8B seed regime's range
    lines = step_lines(rng, a, 1.0 / rate, flops)
    lines += [{**lines[0], "phase": "warmup", "seconds": 40.0}, {**lines[1], "compiled": True, "seconds": 30.0},
              {**lines[2], "oom": "CUDA out of memory", "seconds": 0.1}]   # none of these may enter the fit
    fit = gpu_epoch.fit_step_records(lines)
    assert fit.points == 10
    assert fit.intercept_s == pytest.approx(a, rel=1e-6) and fit.marginal_tflops == pytest.approx(430.0, rel=1e-6)
    assert fit.rms_rel_residual < 1e-9
    noisy = gpu_epoch.fit_step_records(step_lines(rng, a, 1.0 / rate, flops, noise=0.02))   # the H200's +-3%
    assert noisy.marginal_tflops == pytest.approx(430.0, rel=0.05) and 0.0 <= noisy.intercept_s < 0.5
    assert 0.005 < noisy.rms_rel_residual < 0.05


def test_fit_keeps_intercept_and_slope_non_negative(gpu_epoch):
    flops = np.array([1e15, 2e15, 3e15, 4e15])
    through_zero = gpu_epoch.fit_step_time(flops, 1e-15 * flops - 0.1 + np.array([0.1, 0.0, 0.0, 0.0]))
    assert through_zero.intercept_s == pytest.approx(0.0, abs=1e-12) and through_zero.slope_s_per_flop > 0
    flat = gpu_epoch.fit_step_time(flops, [2.0, 1.8, 1.9, 1.7])
    assert flat.slope_s_per_flop == 0.0 and flat.intercept_s == pytest.approx(1.85)
    with pytest.raises(ValueError, match="two steps of different executed FLOPs"):
        gpu_epoch.fit_step_time([1e15, 1e15], [1.0, 1.1])


def test_the_fit_prices_the_epoch_as_the_planner_prices_it(gpu_epoch):
    """predict_throughput with the fitted cost = the epoch's real tokens over the sum of a + b x executed FLOPs of
    its steps (the planner's definition, not a second one); a flat fit prices every step at a."""
    from dflash_lab.metrics.throughput import ktok_s_over_time
    from dflash_lab.model import footprint
    from dflash_lab.plan import predict_throughput
    from dflash_lab.presets import preset
    from dflash_lab.sampling import build_policy

    step_model = footprint.StepModel.from_model_config(preset("model", "tiny", draft_layers=1, block_size=8))
    lengths = np.random.default_rng(3).integers(20, 400, 400)
    policy = build_policy("bucketed", lengths, max_tokens=1024, seed=0, boundaries=[0, 100, 200, 400])
    batches = policy.global_plan(0).batches
    shapes = footprint.batch_shapes(batches, policy.lengths, packed=False, model=step_model,
                                    anchors=footprint.policy_anchors(policy, step_model))
    executed = footprint.step_flops(step_model, shapes)["executed"]
    real = np.array([lengths[b].sum() for b in batches], dtype=float)
    fit = gpu_epoch.StepTimeFit(0.05, 2e-12, 10, 0.0)
    predicted = predict_throughput(policy, gpu_epoch.fitted_cost(fit), 1.0, step_model=step_model)
    assert predicted["ktok_s"] == pytest.approx(ktok_s_over_time(real, 0.05 + 2e-12 * executed), rel=1e-9)
    flat = predict_throughput(policy, gpu_epoch.fitted_cost(gpu_epoch.StepTimeFit(0.5, 0.0, 4, 0.1)), 1.0,
                              step_model=step_model)
    assert flat["ktok_s"] == pytest.approx(ktok_s_over_time(real, np.full(real.size, 0.5)), rel=1e-9)


def test_ratio_is_none_without_both_figures(gpu_epoch):
    assert gpu_epoch.ratio(6.0, 10.0) == 0.6
    assert gpu_epoch.ratio(None, 10.0) is None and gpu_epoch.ratio(6.0, None) is None
    assert gpu_epoch.ratio(6.0, 0.0) is None and gpu_epoch.ratio(float("nan"), 1.0) is None


def test_a_flat_fit_has_no_marginal_rate_and_still_reports(gpu_epoch):
    import json

    flat = gpu_epoch.fit_step_time([1e15, 2e15, 4e15], [3.0, 2.0, 2.5])
    assert flat.marginal_tflops is None and json.loads(json.dumps(flat.as_dict()))["slope_s_per_pflop"] == 0.0
