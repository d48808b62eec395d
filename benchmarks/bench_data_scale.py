"""Chat data preparation at scale: the token store against Hugging Face ``datasets.map``, same file, same line
encoder, same number of processes; then what a second start and a training rank cost on the prepared store.

    python benchmarks/bench_data_scale.py                                  # 20K, 80K, 200K conversations; 1, 2 processes
    python benchmarks/bench_data_scale.py --sizes 2000 --num-proc 1 2      # a quick check (tests/test_bench_data_scale.py)

Data: per size, one synthetic chat JSONL (the issue's shape: 1-3 user/assistant exchanges, log-normal words per
conversation with median 300 and sigma 1.0, at most 6,000; words of a fixed random vocabulary, Zipf frequencies),
written once into ``--work`` (same seed: the smaller files are not prefixes of the larger ones).

Measured, each in a fresh Python process (its memory is its own; ``--repeats N``: N rounds over every cell in
turn, the fastest of each cell reported), for each size and ``--num-proc`` value:
- ours: ``build_dataset("jsonl", ..., num_proc=P)`` into an empty cache, with the issue's settings
  (``data.max_length=16384``, ``data.max_truncated_fraction=1.0``) and the tiny target's byte tokenizer: seconds
  of the call (interpreter start and imports excluded; the file's digest, the tokenizing, the store's digest
  included), conversations (non-empty lines) per second, CPU seconds of the builder and of its workers, the
  builder's peak RSS (``ru_maxrss``: the process that writes the store) and the peak PSS of the builder and its
  workers together (``/proc/<pid>/smaps_rollup`` sampled every 0.2 s: pages shared between forked processes
  counted once);
- ``datasets.map``: ``load_dataset("text")`` of the same file, then ``Dataset.map`` of the same per-line encoder
  (``dflash_lab.data.jsonl.encode_line``, the byte tokenizer, an unusable line giving an empty sample) with
  ``batched=True``, ``num_proc=P`` and int32/bool features, into an empty cache: the same figures; its token
  count is checked against ours.
Then, per size, on the store built last (a cache hit):
- second start: ``python -m dflash_lab.plan data=jsonl ... sampler.max_tokens=32768`` (the issue's command): seconds
  from launch to its first plan line (``Plan for ...``) and to its end;
- a training rank: ``python -m dflash_lab.train data=jsonl ... trainer.max_steps=3`` (``sampler.max_tokens=2048``,
  ``sampler.overlong=truncate``: the tiny target reads 2,048 positions): its RSS when ``metrics.jsonl`` gets its
  first row (the first training step done), split into anonymous and file-backed pages, the resident pages of the
  memory-mapped store among them (file-backed: shared by the ranks of a node), and the seconds from launch to
  that step.

Prints markdown tables (``--out FILE`` writes them too) and the Amdahl fit used to extrapolate to other sizes and
core counts: T(P) = S + W / P per size, S and W from the 1- and 2-process times at the largest size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MAX_LENGTH = 16384                       # the data.max_length
DATA_ARGS = [f"data.max_length={MAX_LENGTH}", "data.max_truncated_fraction=1.0"]


# ------------------------------------------------------------------------------------------------- the data
def write_chats(path: Path, n: int, seed: int = 0, median_words: int = 300, sigma: float = 1.0,
                max_words: int = 6000) -> None:
    """``n`` synthetic conversations as chat JSONL (module docstring), deterministic in ``(n, seed)``."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    frequency = np.array([12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0,
                          1.9, 1.5, 1.0, 0.8, 0.15, 0.15, 0.1, 0.07])
    vocabulary = ["".join(rng.choice(letters, size=int(k), p=frequency / frequency.sum()))
                  for k in rng.integers(1, 10, size=4000)]
    zipf = 1.0 / np.arange(1, len(vocabulary) + 1)
    words = [vocabulary[i] for i in rng.choice(len(vocabulary), size=1 << 20, p=zipf / zipf.sum())]
    starts = np.zeros(len(words) + 1, dtype=np.int64)   # text of words [a, b): pool[starts[a]:starts[b] - 1]
    np.cumsum([len(word) + 1 for word in words], out=starts[1:])
    pool = " ".join(words) + " "
    totals = np.clip(np.rint(rng.lognormal(np.log(median_words), sigma, size=n)), 8, max_words).astype(int)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as out:
        for total in totals:
            exchanges = int(rng.integers(1, 4))
            cuts = np.sort(rng.integers(1, total, size=2 * exchanges - 1))
            bounds = [0, *cuts.tolist(), int(total)]
            messages = []
            for turn in range(2 * exchanges):
                count = max(1, bounds[turn + 1] - bounds[turn])
                first = int(rng.integers(0, len(words) - count))
                messages.append({"role": "user" if turn % 2 == 0 else "assistant",
                                 "content": pool[starts[first]:starts[first + count] - 1]})
            out.write(json.dumps({"messages": messages}) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------- memory
def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/<pid>/task/*/children)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                queue.extend(int(child) for child in (task / "children").read_text().split())
            except OSError:
                pass
    return found


def _status(pid: int) -> dict[str, int]:
    """Memory lines of /proc/<pid>/status in bytes (VmRSS, VmHWM, RssAnon, RssFile, RssShmem)."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            values[key] = int(rest.split()[0]) * 1024
    return values


class PeakPss(threading.Thread):
    """Samples the summed PSS of this process and its descendants every ``every_s`` seconds; ``peak`` in bytes."""

    def __init__(self, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.every_s, self.peak, self.stopping = every_s, 0, threading.Event()

    def sample(self) -> None:
        total = 0
        for pid in _tree(os.getpid()):
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        self.peak = max(self.peak, total)

    def run(self) -> None:
        while not self.stopping.wait(self.every_s):
            self.sample()

    def stop(self) -> int:
        self.sample()
        self.stopping.set()
        self.join()
        return self.peak


def _mapped_rss(pid: int, prefix: str) -> int:
    """Resident bytes of the files under ``prefix`` that process ``pid`` has memory-mapped (/proc/<pid>/smaps)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].endswith(":"):   # a mapping's header: address perms offset dev inode [path]
            inside = len(fields) >= 6 and fields[5].startswith(prefix)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def _peaks(started_cpu: os.times_result) -> dict[str, float]:
    """Peak RSS of this process and of the largest of its waited-for children, in bytes (Linux: KiB units), and
    the CPU seconds of both since ``started_cpu``."""
    now = os.times()
    return {"builder_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "worker_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "builder_cpu_s": now.user - started_cpu.user + now.system - started_cpu.system,
            "workers_cpu_s": (now.children_user - started_cpu.children_user + now.children_system
                              - started_cpu.children_system)}


# ------------------------------------------------------------------------------------ children (one process each)
def child_ours(path: str, num_proc: int, cache: str) -> dict:
    from dflash_lab.data import build_dataset

    sampler = PeakPss()
    sampler.start()
    started, started_cpu = time.perf_counter(), os.times()
    dataset = build_dataset("jsonl", path=path, cache_dir=cache, max_length=MAX_LENGTH, max_truncated_fraction=1.0,
                            num_proc=num_proc)
    seconds = time.perf_counter() - started
    directory = Path(dataset.meta["directory"])
    return {"seconds": seconds, "lines": int(dataset.stats["total_lines"]), "samples": len(dataset),
            "tokens": int(dataset.lengths.sum()), "store_bytes": sum(p.stat().st_size for p in directory.iterdir()),
            "peak_pss": sampler.stop(), **_peaks(started_cpu)}


def child_datasets(path: str, num_proc: int, cache: str) -> dict:
    import datasets

    from dflash_lab.data.jsonl import UnusableLine, encode_line
    from dflash_lab.data.tokenizer import ByteTokenizer

    datasets.disable_progress_bars()
    tokenizer = ByteTokenizer()

    def encode(batch):
        ids, masks = [], []
        for line in batch["text"]:
            try:
                line_ids, line_mask, _cut = encode_line(tokenizer, line.encode("utf-8"), max_length=MAX_LENGTH)
            except UnusableLine:
                line_ids, line_mask = [], []
            ids.append(line_ids)
            masks.append(line_mask)
        return {"input_ids": ids, "loss_mask": masks}

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("bool"))})
    sampler = PeakPss()
    sampler.start()
    started, started_cpu = time.perf_counter(), os.times()
    raw = datasets.load_dataset("text", data_files=path, split="train", cache_dir=cache)
    mapped = raw.map(encode, batched=True, num_proc=num_proc if num_proc > 1 else None, remove_columns=["text"],
                     features=features)
    seconds = time.perf_counter() - started
    table = mapped.data.table
    tokens = int(sum(np.asarray(chunk.value_lengths()).sum() for chunk in table.column("input_ids").chunks))
    files = [Path(f["filename"]) for f in mapped.cache_files]
    return {"seconds": seconds, "lines": len(raw), "tokens": tokens, "store_bytes": sum(f.stat().st_size for f in files),
            "peak_pss": sampler.stop(), **_peaks(started_cpu)}


def run_child(mode: str, path: Path, num_proc: int, cache: Path, env: dict) -> dict:
    """One preparation in a fresh process, into an empty cache (left for the caller to use or remove)."""
    shutil.rmtree(cache, ignore_errors=True)
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--path", str(path), "--child-num-proc",
                          str(num_proc), "--cache", str(cache)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def prepare(path: Path, size: int, args, env: dict, work: Path) -> tuple[list[dict], Path]:
    """Every num_proc for ours and datasets.map, ``args.repeats`` rounds taken in turn (a busy spell of the machine
    hits every cell alike), the fastest of each cell kept; returns the rows and the store of the last preparation."""
    best: dict[tuple[str, int], dict] = {}
    last = None
    for _round in range(args.repeats):
        for num_proc in args.num_proc:
            for mode in ("ours",) if args.no_datasets else ("ours", "datasets"):
                cache = work / f"{'ours' if mode == 'ours' else 'hf'}_{size}_p{num_proc}"
                result = run_child(mode, path, num_proc, cache, env)
                if mode == "ours":
                    if last is not None and last != cache:
                        shutil.rmtree(last, ignore_errors=True)
                    last = cache
                else:
                    shutil.rmtree(cache, ignore_errors=True)
                if (mode, num_proc) not in best or result["seconds"] < best[mode, num_proc]["seconds"]:
                    best[mode, num_proc] = result
    rows = []
    for num_proc in args.num_proc:
        row = {"size": size, "num_proc": num_proc, "ours": best["ours", num_proc]}
        if not args.no_datasets:
            row["datasets"] = best["datasets", num_proc]
            if row["datasets"]["tokens"] != row["ours"]["tokens"]:
                raise RuntimeError(f"datasets.map made {row['datasets']['tokens']} tokens, ours "
                                   f"{row['ours']['tokens']}: not the same work")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows, last


# ------------------------------------------------------------------------------------ second start and a rank
def _launch(args: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd)


def second_start(path: Path, cache: Path, out_dir: Path, env: dict) -> dict:
    """The issue's plan command on a cached store: seconds to its first plan line and to its end."""
    started = time.perf_counter()
    proc = _launch(["dflash_lab.plan", "data=jsonl", f"data.path={path}", *DATA_ARGS, "sampler.max_tokens=32768",
                    f"data.cache_dir={cache}", f"hydra.run.dir={out_dir}"], env, out_dir.parent)
    first, text = None, []
    for line in proc.stdout:
        text.append(line)
        if first is None and line.startswith("Plan for "):
            first = time.perf_counter() - started
    if proc.wait() != 0 or first is None:
        raise RuntimeError("the plan failed:\n" + "".join(text)[-4000:])
    return {"first_plan_line_s": first, "plan_done_s": time.perf_counter() - started,
            "cached": any("cached store" in line for line in text)}


def rank_at_first_step(path: Path, cache: Path, run_dir: Path, env: dict) -> dict:
    """A one-process training run on the cached store: its memory when its first step's row is written."""
    started = time.perf_counter()
    proc = _launch(["dflash_lab.train", "data=jsonl", f"data.path={path}", *DATA_ARGS, f"data.cache_dir={cache}",
                    "sampler=bucketed", "sampler.max_tokens=2048", "sampler.overlong=truncate", "trainer.max_steps=3",
                    "trainer.measure_tau=false", "probes.every=0", f"hydra.run.dir={run_dir}"], env, run_dir.parent)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    metrics, found = run_dir / "metrics.jsonl", None
    while proc.poll() is None and found is None:
        try:
            if metrics.is_file() and metrics.stat().st_size > 0:
                found = {**_status(proc.pid), "store_rss": _mapped_rss(proc.pid, str(cache)),
                         "first_step_s": time.perf_counter() - started}
        except OSError:
            break
        time.sleep(0.05)
    proc.wait()
    reader.join()
    if proc.returncode != 0 or found is None:
        raise RuntimeError("the training run failed or ended before its memory was read:\n"
                           + "".join(output)[-4000:])
    return found


# ------------------------------------------------------------------------------------------------- the report
def gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def prep_table(rows: list[dict]) -> str:
    """One row per size and num_proc: ours, then datasets.map (GB: 1e9 bytes)."""
    lines = ["| conversations | tokens | num_proc | ours s | ours conv/s | ours CPU s (builder + workers) | "
             "ours builder peak RSS GB | ours peak PSS GB, all processes | ours store GB | datasets.map s | "
             "datasets.map conv/s | datasets.map CPU s | datasets.map peak RSS GB | datasets.map peak PSS GB, all "
             "processes | datasets.map Arrow GB |",
             "|" + "---|" * 15]
    for r in rows:
        ours, peer = r["ours"], r.get("datasets")
        cells = [f"{r['size']:,}", f"{ours['tokens'] / 1e6:,.0f} M", str(r["num_proc"]), f"{ours['seconds']:.1f}",
                 f"{ours['lines'] / ours['seconds']:,.0f}",
                 f"{ours['builder_cpu_s']:.1f} + {ours['workers_cpu_s']:.1f}", gb(ours["builder_peak_rss"]),
                 gb(ours["peak_pss"]), gb(ours["store_bytes"])]
        cells += ([f"{peer['seconds']:.1f}", f"{peer['lines'] / peer['seconds']:,.0f}",
                   f"{peer['builder_cpu_s']:.1f} + {peer['workers_cpu_s']:.1f}", gb(peer["builder_peak_rss"]),
                   gb(peer["peak_pss"]), gb(peer["store_bytes"])] if peer else ["-"] * 6)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def start_table(rows: list[dict]) -> str:
    """One row per size: the second start's plan and a training rank on the cached store."""
    lines = ["| conversations | second start: first plan line s | second start: plan done s | rank: first step s | "
             "rank RSS at first step GB | anonymous GB | file-backed GB | of it the store's pages GB | "
             "rank peak RSS GB |",
             "|" + "---|" * 9]
    for r in rows:
        start, rank = r.get("start"), r.get("rank")
        cells = [f"{r['size']:,}"]
        cells += [f"{start['first_plan_line_s']:.1f}", f"{start['plan_done_s']:.1f}"] if start else ["-", "-"]
        cells += ([f"{rank['first_step_s']:.1f}", gb(rank["VmRSS"]), gb(rank["RssAnon"]),
                   gb(rank["RssFile"] + rank.get("RssShmem", 0)), gb(rank["store_rss"]), gb(rank["VmHWM"])]
                  if rank else ["-"] * 6)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def amdahl(rows: list[dict]) -> str:
    """T(P) = S + W / P fitted at the largest size from its 1- and 2-process times; both parts grow linearly with
    the number of conversations (the other processes' speed assumed that of this machine's)."""
    largest = max(r["size"] for r in rows)
    times = {r["num_proc"]: r["ours"]["seconds"] for r in rows if r["size"] == largest}
    if 1 not in times or 2 not in times:
        return ""
    work = 2 * (times[1] - times[2])
    if work <= 0:
        return f"No speed-up from 1 to 2 processes at {largest:,} conversations: no Amdahl fit."
    serial = max(times[1] - work, 0.0)
    lines = [f"Amdahl fit at {largest:,} conversations: T(P) = {serial:.1f} s + {work:.1f} s / P (speed-up at P=2: "
             f"{times[1] / times[2]:.2f}x); at 800,000 conversations:"]
    scale = 800_000 / largest
    for procs in (1, 2, 8, 64):
        lines.append(f"- {procs} process{'es' if procs > 1 else ''}: ~{(serial + work / procs) * scale / 60:.1f} min")
    return "\n".join(lines)


def machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}; "
            f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 80_000, 200_000])
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of preparations (every cell in turn); the fastest of each cell is reported")
    parser.add_argument("--work", type=Path, default=None, help="files and caches (default: a temporary directory)")
    parser.add_argument("--no-datasets", action="store_true", help="skip datasets.map")
    parser.add_argument("--no-start", action="store_true", help="skip the second start and the training rank")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here too")
    parser.add_argument("--child", choices=["ours", "datasets"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--child-num-proc", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = (child_ours if args.child == "ours" else child_datasets)(args.path, args.child_num_proc, args.cache)
        print(json.dumps(result))
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_data_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DFLASH_LAB_CACHE": str(work / "dflash_cache"), "HF_DATASETS_CACHE": str(work / "hf_cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    before = machine()
    rows, starts = [], []
    for size in args.sizes:
        path = work / f"chats_{size}.jsonl"
        if not path.is_file():
            write_chats(path, size)
        size_rows, last_cache = prepare(path, size, args, env, work)
        rows += size_rows
        start_row = {"size": size}
        if not args.no_start:
            for name in ("plan", "run"):
                shutil.rmtree(work / f"{name}_{size}", ignore_errors=True)
            start_row["start"] = second_start(path, last_cache, work / f"plan_{size}", env)
            start_row["rank"] = rank_at_first_step(path, last_cache, work / f"run_{size}", env)
            print(json.dumps(start_row), file=sys.stderr, flush=True)
        starts.append(start_row)
        shutil.rmtree(last_cache, ignore_errors=True)
    command = "python benchmarks/bench_data_scale.py " + " ".join(sys.argv[1:])
    report = (f"Command: `{command.strip()}`  \nMachine before: {before}  \nMachine after: {machine()}\n\n"
              f"Preparation (a fresh process and an empty cache each; the fastest of {args.repeats} round"
              f"{'s' if args.repeats > 1 else ''}):\n\n{prep_table(rows)}\n\n"
              f"On the prepared store (cache hit, store of the last num_proc):\n\n{start_table(starts)}\n\n"
              f"{amdahl(rows)}\n")
    print(report)
    if args.out:
        args.out.write_text(report)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
