"""Pretrain the reference tiny targets once and write them into the package (dflash_lab/model/targets/).

    python scripts/make_reference_targets.py                 # the default target and the protocol's five
    python scripts/make_reference_targets.py --presets '' --sweeps forgetting_ablation   # that sweep's six
    python scripts/make_reference_targets.py --check         # verify the shipped files against the manifest only

The reference targets are the tiny target of every pretrain seed the shipped sweeps use: conf/model/tiny.yaml with
``pretrain_seed`` 0 (the default run's target, ``target_seeds: 1``) to 4 (the forgetting protocol's
``target_seeds: 5``), and the targets of a sweep whose data carries band skills (``--sweeps``: the tiny target is
then pretrained on the run's own corpus, ``training.components.pretrain_corpus_follows_data``; every job of the
sweep is composed as Hydra will launch it and its distinct targets are made, named
``tiny_<band_skills>_n<num_samples>_s<pretrain seed>``). Each is pretrained here by the code every run uses
(``load_or_build_tiny_target`` with ``shipped=False``, in a fresh cache), saved as ``<name>.safetensors``
(``tiny_s<seed>`` for a preset) and entered in ``manifest.json`` with
its settings (shape, pretraining, corpus config, tokenizer fingerprint), the digest of its pretraining corpus, its
weights digest, the file's sha256, its pretraining loss and time, and the torch version and CPU capability it was
made with. A run whose tiny-target settings equal an entry's then loads that file (checking both digests) instead
of pretraining: the same weights, and ``target_digest``, on every machine.

Re-run it only to change the reference targets (a new shape, recipe or corpus): every committed result that names
their digests (docs/results.md, the sweeps' comparison.csv) then belongs to the old ones.

Cost: one tiny-target pretraining per target (~1-2 min each on one thread of a 2-core machine); composing a
sweep's jobs ~0.1 s each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_lab.data.tokenizer import ByteTokenizer
from dflash_lab.model import target as target_module
from dflash_lab.model.build import tiny_target_spec
from dflash_lab.presets import preset

SEEDS = (0, 1, 2, 3, 4)
SPEC_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings",
             "pretrain_steps", "pretrain_tokens_per_step", "pretrain_lr", "pretrain_window", "pretrain_seed",
             "pretrain_max_seconds")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def preset_section(name: str, seed: int) -> tuple[str, dict]:
    """(entry name, model section) of model preset ``name`` at pretrain seed ``seed``."""
    return f"{name}_s{seed}", preset("model", name, pretrain_seed=seed)


def sweep_sections(sweep: str) -> list[tuple[str, dict]]:
    """(entry name, model section) of every distinct tiny target the jobs of shipped sweep ``sweep`` load: each
    job composed as Hydra launches it (``cluster.launch.expand_sweep``), its target seed resolved and its
    pretraining corpus the run's own where the data carries band skills (``pretrain_corpus_follows_data``)."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from dflash_lab.cluster.launch import expand_sweep
    from dflash_lab.training.components import pretrain_corpus_follows_data

    sections: dict[str, dict] = {}
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        master = GlobalHydra.instance().hydra.compose_config(sweep, [], run_mode=RunMode.MULTIRUN)
        loader = GlobalHydra.instance().config_loader()
        for overrides in expand_sweep(master):
            job = loader.load_sweep_config(master, list(overrides))
            model = OmegaConf.to_container(job.model, resolve=True)
            if model["kind"] != "tiny":
                continue
            section = pretrain_corpus_follows_data(model, OmegaConf.to_container(job.data, resolve=True))
            data = section["pretrain_data"]
            name = f"tiny_{data.get('band_skills', 'none')}_n{data['num_samples']}_s{section['pretrain_seed']}"
            sections[name] = section
    return sorted(sections.items())


def make_target(name: str, section: dict, out: Path, cache: Path, preset_name: str = "tiny") -> dict:
    """Pretrain the tiny target of model section ``section`` in ``cache``; copy its weights into ``out`` as
    ``<name>.safetensors``; return its manifest entry."""
    arch, pretrain = tiny_target_spec(**{key: section[key] for key in SPEC_KEYS})
    corpus = dict(section["pretrain_data"])
    tokenizer = ByteTokenizer()
    started = time.perf_counter()
    model, meta = target_module.load_or_build_tiny_target(tokenizer=tokenizer, arch=arch, pretrain=pretrain,
                                                          corpus=corpus, cache_dir=str(cache), shipped=False)
    file = f"{name}.safetensors"
    shutil.copyfile(Path(meta["path"]) / "model.safetensors", out / file)
    built = json.loads((Path(meta["path"]) / "meta.json").read_text())
    return {"name": name, "preset": preset_name, "file": file,
            "settings": target_module.target_settings(tokenizer, arch, pretrain, corpus),
            "target_digest": meta["target_digest"], "corpus_digest": built["corpus_digest"],
            "file_sha256": file_sha256(out / file), "pretrain_stats": built["pretrain_stats"],
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "made_in_s": round(time.perf_counter() - started, 1), "made_by": "scripts/make_reference_targets.py"}


def check(out: Path) -> list[str]:
    """Each manifest entry's file: its sha256 and its weights digest as loaded (what every run checks). A folder
    without a manifest, or a manifest that lists no target, is a problem, not an empty success: there is nothing
    to verify."""
    manifest = out / target_module.MANIFEST
    make = "python scripts/make_reference_targets.py"
    make += "" if out == target_module.SHIPPED_DIR else f" --out {out}"
    if not manifest.is_file():
        return [f"no manifest to check: {manifest} does not exist; `{make}` makes the targets and writes it"]
    entries = target_module.shipped_targets(out)
    if not entries:
        return [f"no target to check: {manifest} lists none (its 'targets' list is empty); `{make}` makes the "
                f"targets and writes them into it"]
    problems = []
    for entry in entries:
        path = out / entry["file"]
        if not path.is_file() or file_sha256(path) != entry["file_sha256"]:
            problems.append(f"{path}: missing or not the file the manifest records")
            continue
        settings = entry["settings"]
        model, meta = target_module.load_shipped_target(entry, ByteTokenizer(), settings["corpus"], None,
                                                        directory=out)
        print(f"{entry['name']}: weights digest {meta['target_digest']} ({meta['source']})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny", help="model presets, comma-separated (default: tiny; '' none)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="pretrain seeds (default: 0,1,2,3,4)")
    parser.add_argument("--sweeps", default="", help="shipped sweeps whose jobs' tiny targets to make as well, "
                                                     "comma-separated (e.g. forgetting_ablation)")
    parser.add_argument("--only", default="", help="make only these entry names, comma-separated (to split the "
                                                   "work over processes; the manifest keeps the other entries)")
    parser.add_argument("--out", type=Path, default=target_module.SHIPPED_DIR, help="where the files go")
    parser.add_argument("--check", action="store_true", help="only verify the shipped files")
    args = parser.parse_args(argv)
    if not args.check:   # --check only reads: it leaves no empty --out folder behind
        args.out.mkdir(parents=True, exist_ok=True)
        made: dict[str, dict] = {}
        wanted = [preset_section(name, int(seed)) + (name,) for name in filter(None, args.presets.split(","))
                  for seed in args.seeds.split(",")]
        wanted += [entry + ("tiny",) for sweep in filter(None, args.sweeps.split(",")) for entry in sweep_sections(sweep)]
        only = set(filter(None, args.only.split(",")))
        with tempfile.TemporaryDirectory(prefix="reference-targets-") as cache:
            for name, section, preset_name in wanted:
                if only and name not in only:
                    continue
                entry = make_target(name, section, args.out, Path(cache), preset_name)
                made[entry["name"]] = entry
                print(f"{entry['name']}: weights digest {entry['target_digest']}, loss "
                      f"{entry['pretrain_stats']['loss']:.3f}, {entry['made_in_s']} s", flush=True)
        # the manifest as it is now (another process may have added entries meanwhile), with this run's entries
        made = {**{entry["name"]: entry for entry in target_module.shipped_targets(args.out)}, **made}
        manifest = {"about": "reference tiny targets: scripts/make_reference_targets.py (dflash_lab/model/target.py "
                             "loads a run's target from here when its settings equal an entry's)",
                    "targets": sorted(made.values(), key=lambda entry: entry["name"])}
        (args.out / target_module.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    problems = check(args.out)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
