"""Install what the GPU check needs and this Python lacks, from wheelhouse/ with no index; fail fast otherwise.

    python scripts/gpu_deps.py --wheelhouse wheelhouse --target .gpu_deps

Run by scripts/gpu_check.sh before anything imports the project (standard library only, so it runs on a bare
image). Steps, each in seconds:

1. Which of the modules the check imports (``REQUIRED``) cannot be found (``importlib.util.find_spec``, nothing
   imported; ``--target`` is searched too, so a second run reuses an earlier install). None: done.
2. Install into ``--target`` every wheel of the wheelhouse whose distribution this Python does not already hold
   (``pip install --no-index --no-deps --target``; without pip, the pure-Python wheels are unpacked there), so
   the image's own torch, numpy, PyYAML, ... stay the ones used. The caller puts ``--target`` on PYTHONPATH.
3. Check again, in a fresh interpreter with ``--target`` on its path: every required module must import.

Exit code 0 when everything imports; 2 with one line naming each missing module, where it should come from
(the image or the wheelhouse) and the fix (build the wheelhouse with scripts/gpu_wheelhouse.sh and carry it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# module -> distribution, for what the GPU check imports; "image": expected from the GPU image itself
IMAGE_MODULES = {"torch": "torch", "transformers": "transformers", "numpy": "numpy", "pandas": "pandas",
                 "safetensors": "safetensors", "scipy": "scipy", "yaml": "pyyaml", "tokenizers": "tokenizers",
                 "pyarrow": "pyarrow"}
WHEELHOUSE_MODULES = {"omegaconf": "omegaconf", "hydra": "hydra-core", "antlr4": "antlr4-python3-runtime",
                      "pytest": "pytest", "hypothesis": "hypothesis"}
REQUIRED = {**IMAGE_MODULES, **WHEELHOUSE_MODULES}


def missing_modules(modules, extra_path: Path | None = None) -> list[str]:
    """The modules of ``modules`` that cannot be found (with ``extra_path`` first on the search path)."""
    if extra_path is not None and extra_path.is_dir() and str(extra_path) not in sys.path:
        sys.path.insert(0, str(extra_path))
        importlib.invalidate_caches()
    return [m for m in modules if importlib.util.find_spec(m) is None]


def wheel_distribution(path: Path) -> str:
    """A wheel file's distribution name, normalised (PEP 503): ``hydra_core-1.3.8-py3-none-any.whl`` -> hydra-core."""
    return re.sub(r"[-_.]+", "-", path.name.split("-")[0]).lower()


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def wheels_to_install(wheelhouse: Path) -> list[Path]:
    """The wheelhouse's wheels whose distribution this Python does not hold (the image's own stay in use)."""
    return [w for w in sorted(wheelhouse.glob("*.whl")) if not installed(wheel_distribution(w))]


def install(wheels: list[Path], target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, check=False).returncode == 0
    if has_pip:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
               "--disable-pip-version-check", "--no-warn-script-location", "--target", str(target),
               *map(str, wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""}, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install --no-index failed: {proc.stderr.strip()[-1500:]}")
        return
    for wheel in wheels:   # no pip: a wheel is a zip laid out as site-packages (pure-Python ones need no more)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)


def import_errors(modules, target: Path) -> dict[str, str]:
    """Import each module in a fresh interpreter with ``target`` first on the path: {module: error}."""
    code = ("import importlib, json, sys\nerrors = {}\nfor m in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(m)\n    except Exception as exc:\n"
            "        errors[m] = f'{type(exc).__name__}: {exc}'\nprint(json.dumps(errors))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {m: proc.stderr.strip()[-300:] for m in modules}
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def source_of(module: str) -> str:
    if module in IMAGE_MODULES:
        return f"{IMAGE_MODULES[module]} (expected in the image; not in the wheelhouse)"
    return f"{WHEELHOUSE_MODULES[module]} (from the wheelhouse)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheelhouse", default="wheelhouse", help="folder of wheels (scripts/gpu_wheelhouse.sh)")
    parser.add_argument("--target", default=".gpu_deps", help="install folder (put it on PYTHONPATH)")
    args = parser.parse_args(argv)
    wheelhouse, target = Path(args.wheelhouse), Path(args.target).resolve()
    missing = missing_modules(REQUIRED, target)
    if not missing:
        print(f"gpu_deps: every required module is present ({', '.join(REQUIRED)})", file=sys.stderr)
        return 0
    fix = ("build it where the registry can be reached with `bash scripts/gpu_wheelhouse.sh` (--python-version "
           f"{sys.version_info.major}.{sys.version_info.minor} for this Python) and carry wheelhouse/ with the "
           "working tree")
    if not any(wheelhouse.glob("*.whl")):
        print(f"gpu_deps: missing {', '.join(source_of(m) for m in missing)}; {wheelhouse}/ holds no wheels: {fix}",
              file=sys.stderr)
        return 2
    built_for = (wheelhouse / "python_version").read_text().strip() if (wheelhouse / "python_version").exists() else "?"
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if built_for != running:
        fix = f"the wheelhouse was built for Python {built_for}, this is {running}: " + fix
    wheels = wheels_to_install(wheelhouse)
    try:
        if wheels:
            install(wheels, target)
    except (RuntimeError, OSError, zipfile.BadZipFile) as exc:
        print(f"gpu_deps: installing {len(wheels)} wheels from {wheelhouse}/ into {target} failed ({exc}); "
              f"missing {', '.join(missing)}: {fix}", file=sys.stderr)
        return 2
    errors = import_errors(list(REQUIRED), target)
    if errors:
        print("gpu_deps: still missing after installing from the wheelhouse: "
              + "; ".join(f"{source_of(m)}: {e}" for m, e in errors.items()) + f"; {fix}", file=sys.stderr)
        return 2
    print(f"gpu_deps: installed {', '.join(w.name for w in wheels)} into {target} (no index)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
