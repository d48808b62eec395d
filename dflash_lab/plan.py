"""Planner: what each batching policy will cost *before* any GPU-day is spent.

``python -m dflash_lab.plan`` composes the same ``conf/`` as training, builds every policy's epoch plan on the
configured data (or a reference length workload, ``data=lengths``), and prints one row per policy: padding
efficiency, batches and steps per epoch, samples per batch, the diversity diagnostics of ``sampling.stats``, and
predicted Ktok/s and ETA for the configured run (``epochs``, ``world_size``). It writes ``plan.csv``, ``plan.json``
and ``plan.md`` to its output directory; ``sweep_k=[lo,hi]`` adds a bucket-count sweep (``k_sweep.csv`` and
``k_sweep.png``: padding efficiency against within-batch diversity, the trade-off the boundaries choose), and
``target_pad_eff=0.9`` reports the fewest fitted buckets whose plan reaches that efficiency.

Cost model (explicit, per rank and step; a step lasts as long as its slowest rank):

    step time = c0 + c1 x padded tokens + c2 x squared tokens

with padded/squared tokens as defined in ``metrics.throughput``. Coefficients come from config (``conf_plan/cost/``),
are fitted by least squares on a finished run's ``metrics.jsonl`` (``cost.from_run=RUN_DIR``), or are calibrated
by a short micro-benchmark of the configured model (``cost.calibrate=true``).
Predicted Ktok/s = real tokens of the epoch (all ranks) / sum of step times / 1000; ETA = epochs x epoch time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from .metrics.throughput import full_run_eta_seconds, ktok_per_s
from .sampling import POLICIES, Policy, fit_boundaries, policy_from_config, smallest_k_for_efficiency
from .sampling.stats import plan_padding, plan_stats

CONF_DIR = Path(__file__).resolve().parent / "conf"  # package data (dflash_lab.conf), in a checkout and a wheel
# Keys that describe the budget rather than the policy: the chosen sampler's values apply to every policy compared.
SHARED_KEYS = ("max_tokens", "max_samples", "quadratic_length", "drop_last", "overlong")
BOUNDARY_KEYS = ("boundaries", "num_buckets", "fit_method")


@dataclass(frozen=True)
class CostModel:
    """Per-rank step time = c0 + c1 x padded tokens + c2 x squared tokens (seconds)."""

    c0: float
    c1: float
    c2: float = 0.0

    def step_time(self, padded: np.ndarray, squared: np.ndarray) -> np.ndarray:
        return self.c0 + self.c1 * np.asarray(padded, dtype=np.float64) + self.c2 * np.asarray(squared, np.float64)

    @classmethod
    def fit(cls, padded: np.ndarray, squared: np.ndarray, step_time: np.ndarray) -> "CostModel":
        """Non-negative least squares on (1, padded, squared) -> step time; a term that would go negative is dropped."""
        x = np.stack([np.ones_like(padded, dtype=np.float64), padded, squared], axis=1).astype(np.float64)
        y = np.asarray(step_time, dtype=np.float64)
        if y.size < 3:
            raise ValueError(f"need at least 3 logged steps to fit the cost model, got {y.size}")
        active = [0, 1, 2]
        while True:
            scale = np.abs(x[:, active]).max(axis=0)
            scale[scale == 0] = 1.0
            coef, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
            coef = coef / scale
            if np.all(coef >= 0) or len(active) == 1:
                break
            active.pop(int(np.argmin(coef)))
        full = np.zeros(3)
        full[active] = np.maximum(coef, 0)
        return cls(*map(float, full))

    @classmethod
    def from_run(cls, run_dir: str | Path, warmup_steps: int = 10) -> "CostModel":
        """Fit from a finished run: its metrics.jsonl step times against its per-rank padded/squared tokens."""
        run_dir = Path(run_dir)
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            raise ValueError(f"cost.from_run={str(run_dir)!r}: no metrics.jsonl there; point it at a run directory")
        rows = pd.read_json(path, lines=True)
        missing = {"padded_tokens", "sq_tokens", "step_time_s"} - set(rows.columns)
        if missing:
            raise ValueError(f"{path}: missing fields {sorted(missing)} needed to fit the cost model")
        world = 1
        summary = run_dir / "summary.json"
        if summary.is_file():
            world = int(json.loads(summary.read_text()).get("world_size", 1) or 1)
        rows = rows.iloc[warmup_steps:] if len(rows) > warmup_steps + 3 else rows
        # Logged token counts are summed over ranks; the model is per rank.
        return cls.fit(rows["padded_tokens"] / world, rows["sq_tokens"] / world, rows["step_time_s"])


def calibrate_cost(
    model_cfg: Mapping[str, Any], max_tokens: int, *, row_lengths: Sequence[int] = (), repeats: int = 3, seed: int = 0
) -> CostModel:
    """Fit the cost model from a short micro-benchmark of the configured model (forward + backward + AdamW step).

    Times full-budget padded batches at several row lengths (``max_tokens // length`` rows each) and half-budget
    ones (so the constant term is identifiable), then fits ``CostModel.fit`` on (padded, squared, seconds).
    """
    import time

    import torch

    from .data import collate_padded
    from .model import build_model

    model, tokenizer = build_model(**dict(model_cfg))
    model.train()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(seed)
    lengths = list(row_lengths) or [n for n in (32, 64, 128, 256, 512, 1024, 2048) if n <= max_tokens]
    padded, squared, seconds = [], [], []
    for length in lengths:
        for share in (1.0, 0.5):
            rows = max(1, int(max_tokens * share) // length)
            ids = torch.randint(4, int(tokenizer.vocab_size), (rows, length), generator=generator)
            samples = [{"input_ids": row, "loss_mask": torch.ones(length, dtype=torch.bool)} for row in ids]
            batch = collate_padded(samples, list(range(rows)), [length] * rows, tokenizer.pad_token_id)
            for attempt in range(repeats + 1):
                start = time.perf_counter()
                out = model(batch, generator)
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if attempt:  # the first pass warms up allocators and kernels
                    padded.append(rows * length)
                    squared.append(rows * length * length)
                    seconds.append(time.perf_counter() - start)
    return CostModel.fit(np.asarray(padded, float), np.asarray(squared, float), np.asarray(seconds))


def predict_throughput(policy: Policy, cost: CostModel, epochs: float, epoch: int = 0) -> dict[str, float]:
    """Predicted step time, Ktok/s and full-run ETA of a policy's plan under a cost model (all ranks)."""
    plan = policy.global_plan(epoch)
    padding = plan_padding(plan.batches, policy.lengths, packed=policy.packed)
    per_batch = cost.step_time(padding["per_batch_padded"], padding["per_batch_attention"])
    step_times = per_batch.reshape(plan.steps, policy.world_size).max(axis=1)  # the slowest rank sets the pace
    epoch_seconds = float(step_times.sum())
    return {
        "step_time_s": float(step_times.mean()) if step_times.size else float("nan"),
        "ktok_s": ktok_per_s(padding["real_tokens"], epoch_seconds),
        "epoch_hours": epoch_seconds / 3600.0,
        "eta_s": full_run_eta_seconds(epochs, plan.steps, float(step_times.mean()) if step_times.size else 0.0),
        "eta_days": full_run_eta_seconds(epochs, plan.steps, float(step_times.mean())) / 86400.0
        if step_times.size
        else float("nan"),
    }


def sampler_configs(chosen: Mapping[str, Any], policies: str | Sequence[str]) -> dict[str, dict[str, Any]]:
    """The sampler config of each compared policy: its own conf/sampler file, with the chosen budget keys applied.

    The chosen sampler (``sampler=...``) is used as composed; the others take their file's policy-specific keys
    and the chosen sampler's budget keys (and boundary keys, for bucketed policies) so all share one budget.
    """
    from omegaconf import OmegaConf

    names = list(POLICIES) if policies in ("all", None) else list(policies)
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"policies={unknown}: unknown; choose from {', '.join(POLICIES)} or 'all'")
    out = {}
    for name in names:
        if name == chosen["name"]:
            out[name] = dict(chosen)
            continue
        own = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "sampler" / f"{name}.yaml"), resolve=True)
        for key in SHARED_KEYS:
            if key in chosen and key in own:
                own[key] = chosen[key]
        for key in BOUNDARY_KEYS:
            if key in chosen and key in own:
                own[key] = chosen[key]
        out[name] = own
    return out


def plan_table(
    lengths: np.ndarray,
    samplers: Mapping[str, Mapping[str, Any]],
    *,
    seed: int,
    world_size: int,
    epochs: float,
    cost: CostModel,
    bands: Sequence[int] | None = None,
) -> pd.DataFrame:
    """One row per policy: diagnostics (``sampling.stats.plan_stats``) + predicted throughput and ETA."""
    rows = []
    for name, sampler_cfg in samplers.items():
        policy = policy_from_config(sampler_cfg, lengths, seed=seed, world_size=world_size, rank=0)
        rows.append(
            {
                **plan_stats(policy, bands=bands),
                **{f"pred_{k}": v for k, v in predict_throughput(policy, cost, epochs).items()},
                "boundaries": policy.boundaries,
            }
        )
    return pd.DataFrame(rows).set_index("policy")


def sweep_bucket_counts(
    lengths: np.ndarray,
    k_range: Sequence[int],
    sampler_cfg: Mapping[str, Any],
    *,
    method: str,
    seed: int,
    world_size: int,
) -> pd.DataFrame:
    """Padding efficiency and diversity of bucketed (and bucketed_megabatch) plans for K fitted buckets."""
    base = {k: v for k, v in sampler_cfg.items() if k in SHARED_KEYS}
    rows = []
    for k in range(int(k_range[0]), int(k_range[-1]) + 1):
        boundaries = fit_boundaries(lengths, k, method)
        for name in ("bucketed", "bucketed_megabatch"):
            cfg = {"name": name, **base, "boundaries": boundaries}
            stats = plan_stats(policy_from_config(cfg, lengths, seed=seed, world_size=world_size))
            rows.append({"num_buckets": k, "boundaries": boundaries, **stats})
    return pd.DataFrame(rows)


def plot_k_sweep(sweep: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, group in sweep.groupby("policy"):
        ax.plot(group["within_batch_spread"], group["pad_eff"], marker="o", label=name)
        for _, row in group.iterrows():
            ax.annotate(str(row["num_buckets"]), (row["within_batch_spread"], row["pad_eff"]), fontsize=7)
    ax.set_xlabel("within-batch length spread (mean CV): higher = more mixed batches")
    ax.set_ylabel("padding efficiency")
    ax.set_title("Bucket count K: padding vs batch diversity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_lengths(data_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any] | None = None) -> np.ndarray:
    """Sample lengths for planning: a reference workload (``kind: lengths``) or a dataset's cached lengths."""
    data_cfg = dict(data_cfg)
    kind = data_cfg.pop("kind", None)
    if kind == "lengths":
        from .data.lengths import reference_lengths

        return reference_lengths(data_cfg["workload"], int(data_cfg["num_samples"]), seed=int(data_cfg.get("seed", 0)))
    from .data import build_dataset
    from .data.tokenizer import ByteTokenizer, HFTokenizerAdapter

    model_cfg = dict(model_cfg or {})
    if model_cfg.get("kind") == "hf":
        # Lengths only need the target's tokenizer, not its weights.
        from transformers import AutoTokenizer

        tokenizer = HFTokenizerAdapter(AutoTokenizer.from_pretrained(model_cfg["target_path"]))
    else:
        tokenizer = ByteTokenizer()
    train, _ = build_dataset(kind, tokenizer=tokenizer, **data_cfg).split()
    return train.lengths


def to_markdown(table: pd.DataFrame, columns: Sequence[str]) -> str:
    """A compact markdown table (numbers rounded for reading; the CSV keeps full precision)."""
    shown = table[[c for c in columns if c in table.columns]].copy()
    header = "| policy | " + " | ".join(shown.columns) + " |"
    lines = [header, "|" + "---|" * (len(shown.columns) + 1)]
    for i, name in enumerate(shown.index):
        cells = []
        for column in shown.columns:
            value = shown[column].iloc[i]
            if isinstance(value, (float, np.floating)):
                cells.append(f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}")
            else:
                cells.append(str(value))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SUMMARY_COLUMNS = (
    "pad_eff", "budget_fill", "steps_per_epoch", "mean_samples_per_batch", "max_samples_per_batch",
    "composition_repeat", "adjacent_length_corr", "bucket_run_length", "within_batch_spread",
    "dropped_overlong", "truncated", "repeated_remainder", "pred_ktok_s", "pred_eta_days",
)


def run_plan(cfg: Mapping[str, Any]) -> pd.DataFrame:
    """Plan every configured policy, write plan.csv/json/md (+ the K sweep) to ``out_dir``; return the table."""
    out_dir = Path(cfg["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    cost_cfg = dict(cfg["cost"])
    if cost_cfg.get("from_run"):
        cost = CostModel.from_run(cost_cfg["from_run"])
    elif cost_cfg.get("calibrate"):
        cost = calibrate_cost(cfg["model"], int(cfg["sampler"]["max_tokens"]), seed=int(cfg["seed"]))
    else:
        cost = CostModel(float(cost_cfg["c0"]), float(cost_cfg["c1"]), float(cost_cfg.get("c2", 0.0)))
    lengths = load_lengths(cfg["data"], cfg.get("model"))
    samplers = sampler_configs(cfg["sampler"], cfg.get("policies", "all"))
    table = plan_table(
        lengths, samplers, seed=int(cfg["seed"]), world_size=int(cfg["world_size"]), epochs=float(cfg["epochs"]),
        cost=cost, bands=cfg.get("bands"),
    )
    table.to_csv(out_dir / "plan.csv")
    meta = {"num_samples": int(lengths.size), "mean_length": float(lengths.mean()), "cost_model": asdict(cost),
            "epochs": cfg["epochs"], "world_size": cfg["world_size"]}
    (out_dir / "plan.json").write_text(
        json.dumps({"meta": meta, "policies": json.loads(table.to_json(orient="index"))}, indent=2)
    )
    markdown = (
        f"Plan for {lengths.size:,} samples (mean length {lengths.mean():.0f}), world size {cfg['world_size']}, "
        f"{cfg['epochs']} epochs; cost model step = {cost.c0:g} + {cost.c1:g} x padded + {cost.c2:g} x squared\n\n"
        + to_markdown(table, SUMMARY_COLUMNS)
    )
    (out_dir / "plan.md").write_text(markdown + "\n")
    print(markdown)
    if cfg.get("sweep_k"):
        sweep = sweep_bucket_counts(
            lengths, cfg["sweep_k"], cfg["sampler"], method=cfg.get("sweep_method", "optimal"),
            seed=int(cfg["seed"]), world_size=int(cfg["world_size"]),
        )
        sweep.to_csv(out_dir / "k_sweep.csv", index=False)
        plot_k_sweep(sweep, out_dir / "k_sweep.png")
        print(f"\nK sweep written to {out_dir / 'k_sweep.csv'} and k_sweep.png")
    if cfg.get("target_pad_eff"):
        shared = {k: v for k, v in cfg["sampler"].items() if k in SHARED_KEYS and k != "max_tokens"}
        found = smallest_k_for_efficiency(
            lengths, float(cfg["target_pad_eff"]), max_tokens=int(cfg["sampler"]["max_tokens"]),
            method=cfg.get("sweep_method", "optimal"), seed=int(cfg["seed"]), **shared,
        )
        (out_dir / "smallest_k.json").write_text(json.dumps(found, indent=2))
        print(f"\nfewest buckets reaching padding efficiency {cfg['target_pad_eff']}: K={found['num_buckets']} "
              f"boundaries={found['boundaries']} (pad_eff {found['pad_eff']:.3f})")
    print(f"\nwrote {out_dir / 'plan.csv'}, plan.json, plan.md")
    return table


def main() -> None:
    import hydra
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(config_path="pkg://dflash_lab.conf", config_name="plan", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        run_plan(OmegaConf.to_container(cfg, resolve=True))

    _app()


if __name__ == "__main__":
    main()
