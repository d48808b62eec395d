"""Planner: what each batching policy will cost *before* any GPU-day is spent.

``python -m dflash_lab.plan`` composes the same ``conf/`` as training, builds every policy's epoch plan on the
configured data (or a reference length workload, ``data=lengths``), and prints two narrow tables, one row per
policy. The first says which regime the prediction is for and what it predicts: padding efficiency, steps per
epoch, documents, real tokens, padded tokens and block slots per rank and step, predicted Ktok/s over time and on
the median step, ETA of the configured run (``epochs``, ``world_size``; days and hours); lines under it give each
policy's Ktok/s relative to bucketed and, for the FLOPs form, what a target off the trainer GPUs changes. The
second has the diversity diagnostics of ``sampling.stats`` (composition repeat, within-batch spread,
adjacent-length correlation) and, when memory is known, the predicted peak memory and whether it fits; a legend
says what each column measures, and one line recommends the fastest policy that clears the
``recommend.*`` diversity floors (and fits). It writes ``plan.csv`` (every column, full precision), ``plan.json``
(the same, the recommendation in ``meta``) and ``plan.md`` (the printed text, then every column) to its output
directory; ``sweep_k=[lo,hi]`` adds a bucket-count sweep (``k_sweep.csv`` and
``k_sweep.png``: padding efficiency against within-batch diversity, the trade-off the boundaries choose), and
``target_pad_eff=0.9`` reports the fewest fitted buckets whose plan reaches that efficiency. When the model config
gives the target's shape (``model=tiny``, ``model=qwen3_8b``, or ``model.target_config=config.json``), each row also
has the predicted peak GPU memory per rank with and without draft activation checkpointing, model TFLOPs per step,
a ``fits`` verdict against ``gpu_mem_gb`` and the largest ``max_tokens`` that fits (``dflash_lab.model.footprint``).

The plan says which model it is for (the ``model:`` line, ``plan.json`` meta ``model``) and is refused before any
work when its workload, cost model and model describe different models (``planning.cost.check_plan_belongs``: the
seed's workload or cost with the tiny model, a cost calibrated for one shipped model preset with another planned).

The parts live in ``dflash_lab.planning`` (``config``: groups, keys, policies and data; ``cost``: the cost model and
its prediction; ``table``: the plan table and K sweep; ``report``: what is printed); this module is the command
and re-exports their names.

Cost model (explicit, per rank and step; a step lasts as long as its slowest rank):

    step time = c0 + c1 x padded tokens + c2 x attention tokens

with the token counts of ``metrics.throughput.batch_token_counts`` (the trainer logs the same numbers). Coefficients
come from config (``conf_plan/cost/``), are fitted by non-negative least squares on a run's ``metrics.jsonl``
(``cost.from_run=RUN_DIR``), or are calibrated by a short micro-benchmark of the configured model
(``cost.calibrate=true``); ``cost.target`` (online | offline | disaggregated) says whether the FLOPs form prices
the target's forward. Predicted Ktok/s is Ktok/s over time (the epoch's real tokens over its summed step times,
``throughput.ktok_s_over_time``: what a run's tokens over its wall time measure); the median-step figure (the
trainer's summary definition) is its second column; ETA = epochs x steps per epoch x mean step time.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from .config_check import as_choice, as_float, as_int, refuse_unknown_keys
from .refusal import output_directory_problem
from .sampling import FIT_METHODS, resolve_auto_boundaries, smallest_k_for_efficiency, validate_boundaries
from .sampling.stats import resolve_matched_real_tokens
# The planner's parts live in dflash_lab.planning; every name is re-exported here, the module the CLI runs and
# callers import (``from dflash_lab.plan import CostModel, predict_throughput``).
from .planning.config import (  # noqa: F401
    BUCKET_KEYS, CONF_DIR, MAX_SWEEP_K, PLAN_CONF_DIR, SHARED_KEYS, conf_keys, data_keys,
    check_data_keys, data_counts, describe_data_counts, load_plan_data, load_plan_inputs, plan_block_tokens, plan_keys, policy_names, sampler_configs, sweep_range,
)
from .planning.cost import (  # noqa: F401
    GRADIENT_BYTES, gradient_allreduce_seconds, TARGET_MODES, TRIM_ROUNDS, TRIM_SIGMAS, CostModel, calibrate_cost, check_plan_belongs, cost_calibration_warning,
    cost_from_config,
    model_fingerprint, model_preset_config, predict_throughput,
)
from .planning.report import (  # noqa: F401
    DIVERSITY_COLUMNS, FLOORS, FULL_COLUMNS, NARROW_COLUMNS, STEP_COLUMNS, Column, describe_anchors,
    describe_block_budgets, describe_bucket_keying, describe_cost, describe_relative_speed, describe_target_mode,
    _number, full_columns, legend, recommend_floors, recommendation, to_markdown,
)
from .planning.progress import StageTimer
from .planning.table import (  # noqa: F401
    largest_block_budget, memory_columns, memory_inputs, plan_table, plot_k_sweep, quantile_bands,
    resolve_block_budget, sweep_bucket_counts,
)


REFUSED_EXIT_CODE = 2   # bad input or data: the one-line message names the fix (as dflash_lab.train's refusals)


@dataclass(frozen=True)
class PlanSettings:
    """The planner's own top-level keys, checked before any work (conf/plan.yaml gives and explains each)."""

    seed: int
    world_size: int
    nodes: int               # nodes the world_size ranks span (world_size / nodes ranks each)
    inter_node_busbw_gbs: float   # all-reduce bus bandwidth across nodes, GB/s (cost.gradient_allreduce_seconds)
    epochs: float
    bands: list[int] | None
    sweep_k: tuple[int, int] | None
    sweep_method: str
    target_pad_eff: float | None
    floors: dict[str, float | None]
    progress_every_s: float

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> PlanSettings:
        refuse_unknown_keys("plan", cfg, plan_keys())
        seed = as_int("seed", cfg["seed"], minimum=0)
        world_size = as_int("world_size", cfg["world_size"], minimum=1, example=8)
        nodes = as_int("nodes", cfg["nodes"], minimum=1, example=2)
        if world_size % nodes:
            raise ValueError(f"nodes={nodes} does not divide world_size={world_size}: world_size counts every rank "
                             f"(GPUs) of the run, e.g. nodes=2 world_size=16 for two 8-GPU nodes")
        busbw = as_float("inter_node_busbw_gbs", cfg["inter_node_busbw_gbs"], example=40)
        if busbw <= 0:
            raise ValueError(f"inter_node_busbw_gbs={busbw:g}: give the all-reduce bus bandwidth across nodes in GB/s "
                             f"(nccl-tests all_reduce_perf's busbw), e.g. inter_node_busbw_gbs=40")
        epochs = as_float("epochs", cfg["epochs"], example=6)
        if epochs <= 0:
            raise ValueError(f"epochs={epochs:g}: the configured run needs a positive number of epochs (e.g. epochs=6)")
        return cls(seed=seed, world_size=world_size, nodes=nodes, inter_node_busbw_gbs=busbw, epochs=epochs,
                   bands=None if cfg.get("bands") is None else validate_boundaries(cfg["bands"], key="bands"),
                   sweep_k=None if cfg.get("sweep_k") is None else sweep_range(cfg["sweep_k"]),
                   sweep_method=as_choice("sweep_method", cfg["sweep_method"], FIT_METHODS),
                   target_pad_eff=as_float("target_pad_eff", cfg.get("target_pad_eff"), maximum=1.0,
                                           allow_none=True, example=0.9),
                   floors=recommend_floors(cfg.get("recommend")),
                   progress_every_s=as_float("progress_every_s", cfg["progress_every_s"], minimum=0.0, example=5))


def run_plan(cfg: Mapping[str, Any]) -> pd.DataFrame:
    """Plan every configured policy, write plan.csv/json/md (+ the K sweep) to ``out_dir``; return the table.

    Every key is checked before any work: unknown keys are refused (valid ones listed) at the top level and in
    ``sampler``, ``data`` (by data kind) and ``cost``; values are typed (``config_check``). A plan that runs longer
    than ``progress_every_s`` seconds says on stderr what it is doing, every ``progress_every_s`` seconds
    (``planning.progress``; the printed plan and its files do not depend on it).
    """
    plan = PlanSettings.from_config(cfg)
    blocked = output_directory_problem(cfg["out_dir"])
    if blocked:   # said before any work: a long plan must not end in mkdir's traceback
        raise ValueError(f"out_dir: {blocked}: the plan's files (plan.csv, plan.json, plan.md) go into a directory; "
                         f"choose a new or existing directory (out_dir=<dir>)")
    with StageTimer("plan", plan.progress_every_s) as progress:
        return _plan(cfg, plan, progress)


def _plan(cfg: Mapping[str, Any], plan: PlanSettings, progress: StageTimer) -> pd.DataFrame:
    """:func:`run_plan`'s work after its own settings, each stage named to ``progress``."""
    progress.stage("checking the sampler, data and cost settings")
    builtin_corpus = (cfg.get("data") or {}).get("kind") == "synthetic"
    samplers = {name: resolve_auto_boundaries(sampler_cfg, builtin_corpus=builtin_corpus)
                for name, sampler_cfg in sampler_configs(cfg["sampler"], cfg["policies"]).items()}
    max_tokens = as_int("sampler.max_tokens", cfg["sampler"].get("max_tokens"), minimum=1, example=4096)
    check_data_keys(cfg["data"])   # a misspelt key is named before anything is read from it
    check_plan_belongs(dict(cfg["cost"]), cfg.get("model"), dict(cfg["data"]))   # one model, before any work
    progress.stage("the cost model" + (" (calibrating it: cost.calibrate=true)" if cfg["cost"].get("calibrate")
                                       else ""))
    cost = cost_from_config(dict(cfg["cost"]), cfg.get("model"), max_tokens, plan.seed, cfg.get("gpu"))
    cost_warning = cost_calibration_warning(dict(cfg["cost"]), cfg.get("model"))   # printed with the plan
    progress.stage(f"reading the data's lengths (data.kind={cfg['data'].get('kind')})")
    lengths, valid, counts = load_plan_inputs(cfg["data"], cfg.get("model"))
    progress.stage(f"block tokens of {lengths.size:,} samples")
    block_tokens = plan_block_tokens(valid, cfg.get("model"))
    memory = memory_inputs(cfg)
    comm_s = plan_comm_seconds(plan, memory)
    head = plan_head(lengths, plan, cost, cost_warning, counts, cfg.get("model"), block_tokens, memory, comm_s)
    print(head, end="", flush=True)   # the first lines now: planning every policy of a large corpus takes a while
    progress.stage("resolving the real tokens per step a policy matches")
    samplers = {name: resolve_matched_real_tokens(sampler_cfg, lengths, builtin_corpus=builtin_corpus,
                                                  seed=plan.seed, world_size=plan.world_size)
                for name, sampler_cfg in samplers.items()}

    out_dir = Path(cfg["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    table = plan_table(lengths, samplers, seed=plan.seed, world_size=plan.world_size, epochs=plan.epochs, cost=cost,
                       bands=plan.bands, memory=memory, block_tokens=block_tokens, comm_s=comm_s,
                       on_policy=progress.stage)
    progress.stage("writing plan.csv, plan.json and plan.md")
    table.to_csv(out_dir / "plan.csv")
    advice = recommendation(table, plan.floors, activation_checkpointing=bool(
        memory and memory["settings"].activation_checkpointing))
    meta = {"num_samples": int(lengths.size), "mean_length": float(lengths.mean()), "cost_model": asdict(cost),
            "epochs": plan.epochs, "world_size": plan.world_size, "nodes": plan.nodes,
            "inter_node_busbw_gbs": plan.inter_node_busbw_gbs, "comm_s": comm_s,
            "memory": {"gpu_mem_gb": memory["gpu_mem_gb"], **asdict(memory["settings"])} if memory else None,
            "recommend": plan.floors, "recommendation": {"policy": advice["policy"], "line": advice["line"]},
            "cost_warning": cost_warning, "data": counts,
            "model": {"kind": (cfg.get("model") or {}).get("kind"), "shape": model_fingerprint(cfg.get("model"))}}
    (out_dir / "plan.json").write_text(
        json.dumps({"meta": meta, "policies": json.loads(table.to_json(orient="index"))}, indent=2)
    )
    body = plan_body(table, cost, advice["line"])
    full = to_markdown(table, full_columns(table))
    (out_dir / "plan.md").write_text(f"{head}{body}\n## Every column (full precision in plan.csv)\n\n{full}\n")
    print(body)
    if plan.sweep_k is not None:
        sweep = sweep_bucket_counts(
            lengths, plan.sweep_k, cfg["sampler"], method=plan.sweep_method, seed=plan.seed, world_size=plan.world_size,
            on_count=progress.stage,
        )
        sweep.to_csv(out_dir / "k_sweep.csv", index=False)
        plot_k_sweep(sweep, out_dir / "k_sweep.png")
        print(f"\nK sweep written to {out_dir / 'k_sweep.csv'} and k_sweep.png")
    if plan.target_pad_eff is not None:
        progress.stage(f"the fewest buckets reaching target_pad_eff={plan.target_pad_eff}")
        shared = {k: v for k, v in cfg["sampler"].items()
                  if k in SHARED_KEYS and k not in ("max_tokens", "max_block_tokens")}
        found = smallest_k_for_efficiency(
            lengths, plan.target_pad_eff, max_tokens=max_tokens, method=plan.sweep_method, seed=plan.seed, **shared
        )
        (out_dir / "smallest_k.json").write_text(json.dumps(found, indent=2))
        print(f"\nfewest buckets reaching padding efficiency {plan.target_pad_eff}: K={found['num_buckets']} "
              f"boundaries={found['boundaries']} (pad_eff {found['pad_eff']:.3f})")
    print(f"\nwrote {out_dir / 'plan.csv'}, plan.json, plan.md (every column)")
    return table


def plan_comm_seconds(plan: PlanSettings, memory: Mapping[str, Any] | None) -> float:
    """Seconds each step of an N-node plan waits for the gradient all-reduce across nodes
    (``cost.gradient_allreduce_seconds``: the draft's trainable parameters from the model's shape); 0 on one node.

    Raises:
        ValueError: several nodes but no model shape to count the gradients of.
    """
    if plan.nodes == 1:
        return 0.0
    if not memory:
        raise ValueError(f"nodes={plan.nodes}: the gradient all-reduce across nodes is priced from the draft's size, "
                         f"which needs the model's shape: model=qwen3_8b, or model.target_config=/path/config.json")
    return gradient_allreduce_seconds(memory["model"].draft.params, world_size=plan.world_size, nodes=plan.nodes,
                                      busbw_gbs=plan.inter_node_busbw_gbs)


def describe_nodes(plan: PlanSettings, memory: Mapping[str, Any] | None, comm_s: float) -> str:
    """The plan's layout line: ranks over nodes and, across nodes, what the gradient all-reduce adds to a step."""
    if plan.nodes == 1:
        return f"layout: 1 node x {plan.world_size} ranks (no gradient all-reduce across nodes)\n"
    params = memory["model"].draft.params
    return (f"layout: {plan.nodes} nodes x {plan.world_size // plan.nodes} ranks; every step adds {comm_s * 1e3:.3g} ms "
            f"of gradient all-reduce across nodes ({params:,} draft parameters, {GRADIENT_BYTES} bytes "
            f"each, at {plan.inter_node_busbw_gbs:g} GB/s bus bandwidth: inter_node_busbw_gbs; not overlapped with "
            f"the backward, an upper bound)\n")


def plan_head(lengths: Any, plan: PlanSettings, cost: CostModel, cost_warning: str | None,
              counts: dict[str, Any] | None, model_cfg: Mapping[str, Any] | None, block_tokens: Any,
              memory: dict[str, Any] | None, comm_s: float = 0.0) -> str:
    """The printed plan's first lines, known before any policy is planned (printed then: on a large corpus the
    policies' plans take a while): the workload and cost model, the model, the layout over nodes (``comm_s``: the
    gradient all-reduce across nodes a step waits for), the data's counts, block budgets, memory."""
    return (
        f"Plan for {lengths.size:,} samples (mean length {lengths.mean():.0f}), world size {plan.world_size}, "
        f"{plan.epochs:g} epochs; {describe_cost(cost)}\n"
        + f"model: {(model_cfg or {}).get('kind')} ({model_fingerprint(model_cfg) or 'shape unknown'})\n"
        + describe_nodes(plan, memory, comm_s)
        + (f"{describe_data_counts(counts)}\n" if counts else "")
        + (f"{cost_warning}\n" if cost_warning else "")
        + describe_anchors(model_cfg, block_tokens) + "\n"
        + (f"memory: {memory['settings'].precision}, per rank, fits against {memory['gpu_mem_gb']:g} GiB "
           f"(dflash_lab/model/footprint.py)\n\n" if memory else
           "memory columns: set model.target_config=/path/to/config.json (or model=qwen3_8b)\n\n")
    )


def readable_plan(table: pd.DataFrame, lengths: Any, plan: PlanSettings, cost: CostModel, cost_warning: str | None,
                  counts: dict[str, Any] | None, model_cfg: Mapping[str, Any] | None, block_tokens: Any,
                  memory: dict[str, Any] | None, advice: str) -> str:
    """The printed plan (plan.md's head): the workload and cost model, the step table, relative speeds, the
    diversity and memory table with its legend, block budgets, bucket keying, supervision shares, the advice."""
    comm_s = float(table["pred_comm_s"].iloc[0]) if len(table) else 0.0
    return plan_head(lengths, plan, cost, cost_warning, counts, model_cfg, block_tokens, memory, comm_s) + plan_body(
        table, cost, advice)


def plan_body(table: pd.DataFrame, cost: CostModel, advice: str) -> str:
    """The printed plan after :func:`plan_head`: the tables, relative speeds, legend, budgets and the advice."""
    shares = [c for c in table.columns if c.startswith("share ")]
    return (
        "Per rank and step (means of the epoch plan), and predicted speed:\n\n"
        + to_markdown(table, STEP_COLUMNS) + "\n\n" + describe_relative_speed(table)
        + describe_target_mode(table, cost)
        + "Diversity and memory:\n\n" + to_markdown(table, DIVERSITY_COLUMNS) + "\n\n"
        + legend(table) + "\n\n" + describe_block_budgets(table)
        + describe_bucket_keying(table)
        + (f"Supervision share per length band (block tokens of an epoch in each band):\n\n"
           f"{to_markdown(table, [Column(c, c.removeprefix('share '), _number(3)) for c in shares])}\n\n"
           if shares else "")
        + advice + "\n"
    )


def main() -> None:
    import hydra
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(config_path="pkg://dflash_lab.conf", config_name="plan", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        try:
            run_plan(OmegaConf.to_container(cfg, resolve=True))
        except (ValueError, FileNotFoundError) as exc:   # bad input or data: one line naming the fix, as training
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"dflash_lab.plan: error: {exc}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
            raise SystemExit(REFUSED_EXIT_CODE) from None

    _app()


if __name__ == "__main__":
    main()
