"""Compare training runs across batching policies and sweep settings: `python -m dflash_lab.compare PATH...`.

    python -m dflash_lab.compare multirun/ablation/<time> --baseline full_random --out docs/ablation
    python -m dflash_lab.compare --wandb my-entity/dflash_lab --group ablation --baseline full_random

PATH may be a run directory, a multirun directory (expanded to every run below it) or a folder of offline W&B runs.

Arms. Runs are grouped by setting: the sampler plus every key the sweep varied, read from the Hydra overrides each
run recorded in its own run_config.json (seeds are replicates, not settings). A boundaries sweep gives one arm per
boundary list (columns `boundaries`, `K`); an ablation gives arms such as `bucketed run_length=8
band_skills=aligned`.

Baseline and strata. --baseline names the arm every other arm is compared with: a sampler name (`full_random`) or
comma-separated key=value terms (`sampler=full_random,sampler.some_option=false`). The selector's keys and the swept
keys below them (`sampler.*` below `sampler`) are compared; every other swept key (e.g. `data.band_skills`) defines
strata, and an arm is paired only with the baseline of its own stratum: bucket_sequential on independent data
against full_random on independent data. When several arms of a stratum match, the one overriding the fewest
compared keys is the baseline (plain full_random over a full_random variant); a tie is an error.

Paired statistics. Runs pair by seed (same seed = same init and data). Per arm and endpoint: the mean paired
difference (arm - baseline), its t and bootstrap intervals, an exact sign-flip permutation p-value, Holm's
correction over the arm's endpoints, and a verdict: "equivalent" (TOST inside the declared margin), "better" /
"worse" (Holm-significant, by the endpoint's better direction), else "inconclusive". Baseline, endpoints, margins,
cost model and alpha are those the sweep declared before its runs: the `analysis` section frozen in its
`protocol.json` at launch (runs without one: the section every run recorded). The options below override them;
the answer is then not the launch protocol's: the first note and verdict.json's `launch_protocol` say which keys
were overridden and give the launch protocol's answer next to the overridden one.

Duplicates. Two runs of one arm with one seed (the same sweep launched twice, a rerun in another folder, a run
given both as its directory and as W&B run) are separate runs, not two seeds. By default compare refuses them, naming
both runs: pass only one, give reruns different seeds, or choose --duplicates=latest (keep the run that wrote its
files last) or --duplicates=first (keep the first given); the run kept is named in the notes. Runs recorded on
different topologies (summary.json `topology`: 1 node x 2 ranks, 2 nodes x 1 rank) are not duplicates: the topology
is then a swept key, and each is its own arm (`bucketed topology=2x1`; dflash_lab/analysis/arms.py).

Digests. Each run's summary.json records what it trained against: target_digest (the target's weights) and
data_digest (the training data). The batching policy changes neither, so runs that agree on every swept key outside
the sampler (`sampler`, `sampler.*`) must agree on both: the same command on another machine that pretrained its
own tiny target gives another target_digest, and such runs are not replicates or pairs. By default compare refuses
them, listing which runs hold which digest; --mixed-digests=allow compares them anyway and says so in their notes.
Runs recorded before digests existed are compared, with a note that their digests are unknown.

Equal compute. probe_loss_at_steps / _at_tokens / _at_time: the mean probe loss over bands, read at the largest
optimizer-step, real-token and modelled-time budget every finished run reaches (modelled time needs a cost model).

Writes to --out (default ./comparison): comparison.csv (one row per run: every column of
dflash_lab.analysis.schema.RUN_COLUMNS, then the swept keys), comparison_groups.csv (one row per setting, mean/std
over seeds), paired.csv (with a baseline), comparison.md (all tables, printed too), bands.csv, cross_effects.csv,
curves.csv (probe loss on the compute axes), gradients.csv (per run, bucket and phase: arm, seed, bucket, phase
warmup|after, steps, grad_norm_mean, grad_norm_median, clip_frac, grouped_by; the bucket of a policy without buckets
is the probe band of the step's longest document; dflash_lab/metrics/gradients.py), verdict.json (when the runs declare analysis.verdict: controls, the
question arm against its baseline, throughput ratio, co-primary endpoints and the answer, dflash_lab/analysis/verdict.py;
its `protocol` names the rules version that judged it and the protocol recorded at launch) and PNG plots.

--out holds exactly one complete comparison: the files are written to a temporary folder beside --out (same file
system) and swapped in by renames (old folder renamed away, new one renamed in, old one deleted), so an earlier
comparison's extra files (paired.csv, verdict.json of a comparison with a baseline) never linger and an error or
Ctrl-C midway leaves the previous comparison as it was. A folder holding only files compare writes is replaced
whole; one holding anything else (your notes, runs, a folder of the same name) is refused, naming those files,
unless --force (which deletes them). --out is never the current directory or above it, nor a folder holding a PATH.

Bad paths are reported and skipped. A sweep killed mid-way: the jobs it planned (its `multirun.yaml`) that never
started have no folder; a note names them with the relaunch that runs them (dflash_lab/analysis/sweep_jobs.py). A refusal (invalid option or protocol, duplicate runs, mixed digests, an --out
that would not be replaced) prints one line, `error: ...`, and exits 2 (--debug or HYDRA_FULL_ERROR=1: the full traceback); exit
code 1 if no run loaded or --out could not be written.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from dflash_lab.analysis import compare_records, load_runs, markdown_tables
from dflash_lab.analysis.arms import DUPLICATE_POLICIES, MIXED_DIGEST_POLICIES
from dflash_lab.analysis.plots import PLOT_FILES, write_all_plots
from dflash_lab.analysis.protocol import (RULE_CHANGES, RULES_VERSION, analysis_code_digest, overridden_keys,
                                         recorded_protocol, resolve_protocol, section_disagreements)
from dflash_lab.analysis.recommendation import THROUGHPUT_SOURCES, compared_policies, decide, plan_throughput
from dflash_lab.analysis.summarize import Comparison
from dflash_lab.analysis.sweep_jobs import unstarted_job_notes
from dflash_lab.metrics.forgetting import LEARNED_THRESHOLD
from dflash_lab.refusal import Refused


def _endpoints(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _margins(text: str) -> dict[str, float]:
    margins = {}
    for term in text.split(","):
        name, _, value = term.partition("=")
        try:
            margins[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--margins {text!r}: write endpoint=margin pairs separated by commas, "
                                             "e.g. --margins jumpiness=0.01,ktok_s=2") from None
    return margins


def _cost(text: str) -> dict[str, float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--cost {text!r}: write C0,C1[,C2] (seconds, seconds per padded token, "
                                         "seconds per attention token), e.g. --cost 0.02,5e-5,0")
    return dict(zip(("c0", "c1", "c2"), values))


def _window(text: str) -> float | str:
    if text == "steady":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window {text!r}: give a share of the run's end step (e.g. 0.25) or "
                                         "steady") from None


def _target(text: str) -> dict:
    """--target LEVEL or RULE=SHARE, each optionally followed by ,margin=RATIO (analysis.target)."""
    fix = ("write a probe-loss level or baseline_mean_at=SHARE, optionally with ,margin=RATIO, e.g. --target 2.316 "
           "or --target baseline_mean_at=0.5,margin=0.1")
    first, *rest = text.split(",")
    name, equals, value = first.partition("=")
    try:
        target: dict = {"rule": name.strip(), "at": float(value)} if equals else {"probe_loss": float(first)}
        for term in rest:
            key, _, number = term.partition("=")
            if key.strip() != "margin":
                raise ValueError(key)
            target["margin"] = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--target {text!r}: {fix}") from None
    return target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dflash_lab.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="run directories, multirun directories or offline W&B run folders")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also load runs from this W&B project")
    parser.add_argument("--group", help="W&B group (experiment name) to restrict --wandb to")
    parser.add_argument("--offline-wandb", action="store_true",
                        help="read folders of offline W&B runs from their .wandb logs (W&B's undocumented format, "
                             "read for the pinned wandb range; `wandb sync` + --wandb is the documented way)")
    parser.add_argument("--out", default="comparison", help="output directory (default: ./comparison)")
    parser.add_argument("--baseline", metavar="SELECTOR",
                        help="baseline arm: a sampler name or key=value terms (default: analysis.baseline)")
    parser.add_argument("--endpoints", type=_endpoints, metavar="A,B,...",
                        help="endpoints of the paired comparison (default: analysis.endpoints, else "
                             "ktok_s,jumpiness,residual_amplitude,own_share_slope,band_forgetting,"
                             "probe_loss_at_tokens)")
    parser.add_argument("--margins", type=_margins, metavar="ENDPOINT=M,...",
                        help="equivalence margins for TOST (default: analysis.margins)")
    parser.add_argument("--cost", type=_cost, metavar="C0,C1[,C2]",
                        help="step-time model c0 + c1 x padded + c2 x attention tokens, per rank, for the "
                             "modelled-time axis (default: analysis.cost)")
    parser.add_argument("--alpha", type=float, help="test level (default: analysis.alpha, else 0.05)")
    parser.add_argument("--test", choices=("t", "sign_flip"),
                        help="the paired test verdicts use: t (paired t test) or sign_flip (exact; cannot reach "
                             "p_holm < 0.05 below 6 seeds); both are reported (default: analysis.test, else t)")
    parser.add_argument("--window", type=_window, metavar="SHARE|steady",
                        help="where the analysis window of jumpiness and forgetting starts: a share of each run's "
                             "end step, or steady (each run's own steady state) (default: analysis.window, else "
                             "the protocol rules' default, 0.25)")
    parser.add_argument("--target", type=_target, metavar="LEVEL|baseline_mean_at=SHARE[,margin=R]",
                        help="probe-loss level of the time-to-target endpoints: a fixed level, or the baseline "
                             "arm's mean probe loss at SHARE x the common step budget; margin: a ratio margin "
                             "(default: analysis.target, else none)")
    parser.add_argument("--throughput-ratio", type=float, metavar="R",
                        help="the throughput ratio (question / baseline real tokens per GPU second) the "
                             "recommendation assumes, e.g. a measured run's: 1.23 (default: the ratio the verdict "
                             "claims, the modelled cost; rules version >= 6)")
    parser.add_argument("--throughput-source", metavar="TEXT",
                        help="where --throughput-ratio comes from, in words (recorded next to it), e.g. 'measured: "
                             "one H200, an epoch of the seed workload'")
    parser.add_argument("--throughput-from", metavar="PLAN_JSON",
                        help="take the throughput ratio from a plan of your data and GPU: the plan.json that "
                             "python -m dflash_lab.plan wrote (its predicted Ktok/s of the question's and the "
                             "baseline's policies)")
    parser.add_argument("--theta", type=float, default=LEARNED_THRESHOLD,
                        help="block accuracy at which a training example counts as learned, for forgetting events "
                             f"(default {LEARNED_THRESHOLD})")
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    parser.add_argument("--duplicates", choices=DUPLICATE_POLICIES, default="error",
                        help="runs of one arm with one seed are separate runs, not seeds: refuse them (error, the "
                             "default), or keep the one that wrote its files last (latest) or was given first (first)")
    parser.add_argument("--mixed-digests", choices=MIXED_DIGEST_POLICIES, default="error",
                        help="runs of one setting (every swept key outside the sampler equal) trained against "
                             "different target weights or data (summary.json target_digest / data_digest) are not "
                             "replicates or pairs: refuse them (error, the default) or compare them anyway, noting "
                             "it in their notes (allow)")
    parser.add_argument("--force", action="store_true",
                        help="replace an --out folder that holds files compare never writes (they are deleted)")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a refusal (also HYDRA_FULL_ERROR=1)")
    args = parser.parse_args(argv)
    if not args.paths and not args.wandb:
        parser.error("give at least one PATH or --wandb ENTITY/PROJECT")
    if args.throughput_ratio is not None and args.throughput_from:
        parser.error("give --throughput-ratio or --throughput-from, not both")
    if args.throughput_ratio is not None and not args.throughput_ratio > 0:
        parser.error(f"--throughput-ratio {args.throughput_ratio:g}: give a ratio > 0, e.g. 1.23")
    if args.throughput_source and args.throughput_ratio is None:
        parser.error("--throughput-source describes --throughput-ratio: give both")
    return args


TABLE_FILES = ("comparison.csv", "comparison_groups.csv", "comparison.md", "paired.csv", "bands.csv",
               "cross_effects.csv", "curves.csv", "gradients.csv", "verdict.json")
OUTPUT_FILES = frozenset(TABLE_FILES + PLOT_FILES)  # every file compare may write: what it owns in --out


def check_out(out: Path | str, force: bool = False, inputs: list[str | Path] = ()) -> Path:
    """The folder --out names (a symlink followed), once it is safe to replace it whole.

    Raises:
        Refused: --out is a file; it is the current directory or above it, or holds an input PATH (even with
            force: replacing it would delete them); or it holds files compare never writes (`OUTPUT_FILES`) and
            not force: those are named.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp()) / "o"
        >>> out.mkdir(); _ = (out / "paired.csv").write_text(""); _ = (out / "notes.txt").write_text("")
        >>> check_out(out)
        Traceback (most recent call last):
        ...
        dflash_lab.refusal.Refused: --out ... holds 1 file compare never writes (notes.txt): choose another --out, move it away, or pass --force to replace the folder whole (deleting it)
        >>> check_out(out, force=True) == out.resolve()
        True
    """
    target = Path(out).resolve()
    if target.exists() and not target.is_dir():
        raise Refused(f"--out {out} is a file, not a folder: choose a folder")
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        raise Refused(f"--out {out} is the current directory or above it: compare replaces --out whole; choose a "
                      "folder of its own (e.g. --out comparison)")
    for path in inputs:
        resolved = Path(path).resolve()
        if resolved == target or target in resolved.parents:
            raise Refused(f"--out {out} holds the input {path}: compare replaces --out whole; choose another --out")
    if not target.is_dir() or force:
        return target
    foreign = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in target.iterdir()
                     if entry.name not in OUTPUT_FILES or not entry.is_file())
    if foreign:
        shown = ", ".join(foreign[:10]) + (f", ... ({len(foreign) - 10} more)" if len(foreign) > 10 else "")
        raise Refused(f"--out {out} holds {len(foreign)} file{'s' if len(foreign) > 1 else ''} compare never writes "
                      f"({shown}): choose another --out, move {'them' if len(foreign) > 1 else 'it'} away, or pass "
                      f"--force to replace the folder whole (deleting {'them' if len(foreign) > 1 else 'it'})")
    return target


def publish(target: Path, build: Callable[[Path], list[Path]]) -> list[Path]:
    """Write a comparison into a fresh folder beside `target` with `build(folder)`, then swap it in: the old
    `target` is renamed away, the new folder renamed to `target`, the old one deleted. Returns the written paths
    (under `target`).

    If `build` raises (an error, Ctrl-C), the new folder is deleted and `target` is left as it was. The folders
    are siblings (same file system), so each step is a rename; `target` is missing only between two renames.
Compares publishing into one folder take turns (:func:`publishing_lock`), and each first cleans what a compare
killed with kill -9 left there (:func:`clean_leftovers`).

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "o"
        >>> [p.name for p in publish(target, lambda d: [d / "a.csv"] if (d / "a.csv").write_text("1") else [])]
        ['a.csv']
        >>> def broken(folder):
        ...     raise RuntimeError("midway")
        >>> publish(target, broken)
        Traceback (most recent call last):
        ...
        RuntimeError: midway
        >>> sorted(p.name for p in target.parent.iterdir()), (target / "a.csv").read_text()
        (['o'], '1')
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with publishing_lock(target.parent):
        clean_leftovers(target)
        return _publish(target, build)


@contextlib.contextmanager
def publishing_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on `folder` itself while a comparison is published into it: compares writing beside
    each other take turns, so the staged folders present while one holds the lock are its own or left by a killed
    compare. Nothing is written for the lock (a directory can be flocked on Linux)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)   # closing drops the lock


def clean_leftovers(target: Path) -> None:
    """Remove the ``.<out>.new-*`` / ``.<out>.old-*`` folders of a compare killed (kill -9) while publishing
    `target` (call it under :func:`publishing_lock`). A kill between its two renames leaves `target` missing and
    the previous comparison in ``.old-*``: that one is put back first.

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "o"
        >>> (target.parent / ".o.new-x1").mkdir(); (target.parent / ".o.old-x1").mkdir()
        >>> clean_leftovers(target)
        >>> sorted(p.name for p in target.parent.iterdir())
        ['o']
    """
    olds = sorted(target.parent.glob(f".{glob.escape(target.name)}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not target.exists():
        os.rename(olds.pop(), target)   # the newest previous comparison, as it was before the killed swap
    for leftover in [*olds, *target.parent.glob(f".{glob.escape(target.name)}.new-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _publish(target: Path, build: Callable[[Path], list[Path]]) -> list[Path]:
    if target.is_dir():
        mode = target.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o777 & ~umask
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
    old, swapped = None, False
    try:
        os.chmod(stage, mode)
        written = build(stage)
        if target.exists():
            old = stage.with_name(stage.name.replace(".new-", ".old-", 1))
            os.rename(target, old)
        os.rename(stage, target)
        swapped = True
    finally:
        if not swapped:
            if old is not None and old.exists() and not target.exists():
                os.rename(old, target)  # the new folder never arrived: the previous comparison goes back
            shutil.rmtree(stage, ignore_errors=True)
        elif old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return [target / Path(path).relative_to(stage) for path in written]


def write_outputs(comparison: Comparison, out: Path) -> list[Path]:
    """The comparison's CSV and markdown files in `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "comparison.csv", out / "comparison_groups.csv", out / "comparison.md"]
    comparison.runs.to_csv(written[0], index=False)
    comparison.groups.to_csv(written[1])
    written[2].write_text(markdown_tables(comparison) + "\n")
    tables = (("paired.csv", comparison.paired if comparison.protocol.baseline else None),
              ("bands.csv", comparison.bands), ("cross_effects.csv", comparison.cross),
              ("curves.csv", comparison.curves), ("gradients.csv", comparison.gradients))
    for name, table in tables:
        if table is not None and (not table.empty or name == "paired.csv"):
            table.to_csv(out / name, index=False)
            written.append(out / name)
    if comparison.verdict is not None:
        (out / "verdict.json").write_text(json.dumps(comparison.verdict, indent=2) + "\n")
        written.append(out / "verdict.json")
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    debug = args.debug or os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        return _compare(args)
    except Refused as error:
        if debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2


def changed_rules(since: int) -> str:
    """The rule changes after version ``since``, one sentence each."""
    return "; ".join(f"v{version}: {text}" for version, text in sorted(RULE_CHANGES.items()) if version > since)


def protocol_note(recorded: dict | None, comparison, today) -> str:
    """The comparison's first note: which protocol judged it, and whether today's rules would answer otherwise."""
    if recorded is None:
        return (f"protocol: none recorded at launch (a single run, W&B runs, or a sweep launched before protocols "
                f"were recorded): judged by today's rules (version {RULES_VERSION})")
    note = (f"protocol: as recorded at launch ({recorded.get('recorded_at')}, rules version "
            f"{recorded['rules_version']}, analysis code {recorded.get('analysis_code')})")
    if today is not None:
        same = (today.verdict or {}).get("answer") == (comparison.verdict or {}).get("answer")
        note += (f"; today's rules (version {RULES_VERSION}) give the same answer" if same else
                 f"; today's rules (version {RULES_VERSION}) answer differently: "
                 f"{(today.verdict or {}).get('answer')} (changed: {changed_rules(recorded['rules_version'])})")
    return note


def launch_protocol(records, rules: int):
    """The protocol declared before the runs (the sweep's protocol.json, else the runs' own sections), without the
    command line; None when the runs declare different values and only the command line settles them."""
    try:
        return resolve_protocol(records, rules=rules)
    except ValueError:
        return None


def override_text(overridden: dict) -> str:
    """``--margins {...} (launch: {...})``, one term per overridden key."""
    return "; ".join(f"--{key} {entry['applied']!r} (launch: {entry['launch']!r})"
                     for key, entry in overridden.items())


def override_note(overridden: dict, comparison, launch_comparison) -> str:
    """The first note when the command line changed the launch protocol: which keys, and both answers."""
    note = f"protocol overridden on the command line: {override_text(overridden)}; the answers are NOT the launch " \
           "protocol's"
    if comparison.verdict is not None or (launch_comparison is not None and launch_comparison.verdict is not None):
        note += (f"; verdict with the overrides: {(comparison.verdict or {}).get('answer')}; the launch protocol's "
                 f"verdict: {((launch_comparison.verdict if launch_comparison else None) or {}).get('answer')}")
    return note


def launch_protocol_entry(overridden: dict, comparison, launch_comparison) -> dict:
    """verdict.json's ``launch_protocol``: whether the verdict is the launch protocol's; if not, the overridden keys
    (launch and applied values) and both answers."""
    if not overridden:
        return {"applied": True}
    launch_verdict = (launch_comparison.verdict if launch_comparison is not None else None) or {}
    return {"applied": False, "overridden": overridden, "answer": launch_verdict.get("answer"),
            "valid": launch_verdict.get("valid"), "overridden_answer": (comparison.verdict or {}).get("answer")}


def verdict_protocol(recorded: dict | None, rules: int, today) -> dict:
    """verdict.json's ``protocol``: the rules version that judged it, whether it was recorded at launch (when, and
    the analysis code's digest then and now), and today's answer where today's rules differ."""
    entry = {"rules_version": rules, "recorded_at_launch": recorded is not None,
             "recorded_at": (recorded or {}).get("recorded_at"),
             "analysis_code_at_launch": (recorded or {}).get("analysis_code"),
             "analysis_code_now": analysis_code_digest(), "declared": (recorded or {}).get("declared")}
    if today is not None:
        entry["today"] = {"rules_version": RULES_VERSION, "answer": (today.verdict or {}).get("answer")}
    return entry


def given_throughput(args: argparse.Namespace, recommendation: dict) -> dict | None:
    """The throughput ratio given on the command line ({value, source, detail}), None when none was given.

    Raises:
        Refused: --throughput-from names a file that is not a plan.json, or one without both policies."""
    if args.throughput_ratio is not None:
        return {"value": float(args.throughput_ratio), "source": "command_line",
                "detail": args.throughput_source or THROUGHPUT_SOURCES["command_line"]}
    if not args.throughput_from:
        return None
    try:
        plan = json.loads(Path(args.throughput_from).read_text())
    except (OSError, ValueError) as error:
        raise Refused(f"--throughput-from {args.throughput_from}: cannot be read as JSON ({error}); give the "
                      "plan.json that python -m dflash_lab.plan wrote") from None
    try:
        return plan_throughput(plan, *compared_policies(recommendation), args.throughput_from)
    except ValueError as error:
        raise Refused(str(error)) from None


def apply_throughput(args: argparse.Namespace, *comparisons) -> None:
    """Redo each comparison's recommendation (verdict.json's, rules version >= 6) for the throughput ratio the
    command line gives (:func:`given_throughput`); the recommendations stay as built when none is given."""
    for comparison in comparisons:
        verdict = (comparison.verdict or {}) if comparison is not None else {}
        if "recommendation" in verdict:
            throughput = given_throughput(args, verdict["recommendation"])
            if throughput is not None:
                verdict["recommendation"] = decide(verdict["recommendation"], throughput)


def recommendation_lines(comparison, today) -> list[str]:
    """What compare prints first: the recommendation of the rules that judged the sweep, else today's (a sweep
    recorded under rules older than 6 has none of its own), named as such."""
    own = (comparison.verdict or {}).get("recommendation")
    if own is not None:
        return [f"recommendation: {own['text']}", ""]
    later = ((today.verdict if today is not None else None) or {}).get("recommendation")
    if later is not None:
        return [f"recommendation (today's rules, version {RULES_VERSION}; the sweep's rules have none): "
                f"{later['text']}", ""]
    return []


def _compare(args: argparse.Namespace) -> int:
    target = check_out(args.out, force=args.force, inputs=args.paths)
    report = load_runs(args.paths, wandb=args.wandb, group=args.group, offline_wandb=args.offline_wandb)
    for problem in report.problems:
        print(f"skipped: {problem}", file=sys.stderr)
    if not report.runs:
        print("no runs loaded; nothing to compare", file=sys.stderr)
        return 1
    options = dict(baseline=args.baseline, endpoints=args.endpoints, margins=args.margins, cost=args.cost,
                   alpha=args.alpha, test=args.test, window=args.window, target=args.target)
    try:
        recorded = recorded_protocol(report.runs)
        rules = recorded["rules_version"] if recorded else RULES_VERSION
        protocol = resolve_protocol(report.runs, rules=rules, **options)
        launch = launch_protocol(report.runs, rules)
        overridden = overridden_keys(launch, protocol) if launch is not None else {}
        comparison = compare_records(report.runs, theta=args.theta, protocol=protocol, duplicates=args.duplicates,
                                     mixed_digests=args.mixed_digests)
        launch_comparison = None
        if overridden:   # the launch protocol's own answer, shown next to the overridden one
            launch_comparison = compare_records(report.runs, theta=args.theta, protocol=launch,
                                                duplicates=args.duplicates, mixed_digests=args.mixed_digests)
        today = None
        if rules != RULES_VERSION:   # judged as recorded; today's rules too, to show what they would say
            today = compare_records(report.runs, theta=args.theta, duplicates=args.duplicates,
                                    mixed_digests=args.mixed_digests,
                                    protocol=resolve_protocol(report.runs, rules=RULES_VERSION, **options))
        disagreements = section_disagreements(report.runs, recorded, rules)
    except ValueError as error:
        raise Refused(str(error)) from error
    apply_throughput(args, comparison, today)
    comparison.notes[0:0] = [protocol_note(recorded, comparison, today), *disagreements]
    # a sweep killed mid-way: its jobs that never started have no record to name them (analysis/sweep_jobs.py)
    comparison.notes.extend(unstarted_job_notes([r.location for r in report.runs if r.source == "local"]))
    if overridden:
        comparison.notes.insert(0, override_note(overridden, comparison, launch_comparison))
    if comparison.verdict is not None:
        comparison.verdict["protocol"] = verdict_protocol(recorded, protocol.rules, today)
        comparison.verdict["launch_protocol"] = launch_protocol_entry(overridden, comparison, launch_comparison)
    compared = set(comparison.runs["run_id"])
    records = [record for record in report.runs if record.run_id in compared]  # less duplicates left out

    def build(folder: Path) -> list[Path]:
        written = write_outputs(comparison, folder)
        if not args.no_plots:
            written += write_all_plots(records, comparison, folder)
        return written

    try:
        written = publish(target, build)
    except OSError as error:
        print(f"error: could not write --out {args.out} ({error}); it is left as it was", file=sys.stderr)
        return 1
    partial = int(comparison.runs["partial"].sum())
    print("\n".join(recommendation_lines(comparison, today) + [markdown_tables(comparison)]))
    if comparison.verdict is not None:
        print(f"\nverdict ({comparison.verdict['seeds']} seeds, protocol rules version {protocol.rules}): "
              f"{comparison.verdict['answer']}")
        if overridden:
            print(f"NOT the launch protocol's verdict ({override_text(overridden)}); the launch protocol answers: "
                  f"{comparison.verdict['launch_protocol']['answer']}")
    if today is not None and today.verdict is not None and comparison.verdict is not None \
            and today.verdict["answer"] != comparison.verdict["answer"]:
        print(f"today's rules (version {RULES_VERSION}) would answer: {today.verdict['answer']}\n"
              f"rules changed since the sweep was launched: {changed_rules(rules)}")
    print(f"\n{len(records)} run(s) ({partial} partial) in {len(comparison.groups)} setting(s); wrote "
          f"{', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
