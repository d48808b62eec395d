"""A run's record is the truth (issue 23, items 3, 5-10): the data digest comes from the bytes trained on, resume
checks every side file, records of steps that ran are replaced only with overwrite=true, a fresh start gets a new
W&B run, refusals and a full disk are one line, and nothing is left or written through where it should not be."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tracemalloc
from pathlib import Path

import pytest
from helpers import SHORT_CLI, compose_small, stop_at, train_cli, without_permission_override

from dflash_lab.records import checkpoint as ckpt
from dflash_lab.records import record
from dflash_lab.compare import publish
from dflash_lab.data.datasets import build_dataset
from dflash_lab.data.jsonl import encode_line
from dflash_lab.data.tokenizer import ByteTokenizer
from dflash_lab.refusal import Refused
from dflash_lab.records.run_dir import RunDirectory
from dflash_lab.records.run_lock import RunDirLock
from dflash_lab.train import train


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def one_line_error(stderr: str) -> str:
    """The refusal line of a command's stderr (asserting there is no traceback)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("dflash_lab.train: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------------ 3. data digest
def test_a_damaged_cached_tokens_file_is_refused_with_the_cache_to_delete(tmp_path):
    clean = build_dataset("synthetic", cache_dir=str(tmp_path), num_samples=200)
    digest = clean.content_digest
    entry = Path(clean.meta["directory"])
    tokens = entry / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-7] ^= 0x5A   # one token id changed, size and meta.json untouched
    tokens.write_bytes(bytes(data))
    with pytest.raises(Refused, match=rf"cached dataset {entry} has content digest .* records {digest}.*rm -rf"):
        build_dataset("synthetic", cache_dir=str(tmp_path), num_samples=200)
    shutil.rmtree(entry)   # the fix the message names
    assert build_dataset("synthetic", cache_dir=str(tmp_path), num_samples=200).content_digest == digest


def test_a_chat_file_edited_in_place_with_its_mtime_restored_is_rebuilt(tmp_path):
    chat = tmp_path / "chat.jsonl"
    line = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world!"}]}
    chat.write_text(json.dumps(line) + "\n")
    stat = chat.stat()
    before = build_dataset("jsonl", path=str(chat), cache_dir=str(tmp_path / "cache"))
    chat.write_text(json.dumps(line).replace("world!", "earth!") + "\n")   # same size
    os.utime(chat, ns=(stat.st_atime_ns, stat.st_mtime_ns))                 # touch -r: the old mtime
    after = build_dataset("jsonl", path=str(chat), cache_dir=str(tmp_path / "cache"))
    assert after.content_digest != before.content_digest
    assert "earth!" in ByteTokenizer().decode(after[0]["input_ids"].tolist())


@pytest.mark.integration
def test_a_run_on_a_damaged_data_cache_stops_before_step_one(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    common = ["trainer.measure_tau=false", "probes.every=0", f"data.cache_dir={cache}", "trainer.ckpt_every=2"]
    first = train(compose_small(run_dir, "trainer.max_steps=2", *common))
    (entry,) = [p for p in (cache / "data").iterdir() if p.is_dir()]
    tokens = entry / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[len(data) // 2] ^= 0x21
    tokens.write_bytes(bytes(data))
    rows_before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(Refused, match=rf"cached dataset {entry} has content digest .* records {first['data_digest']}"):
        train(compose_small(run_dir, "trainer.max_steps=4", *common))
    assert (run_dir / "metrics.jsonl").read_bytes() == rows_before   # not one step on the damaged tokens


# ------------------------------------------------------------------------------------ 5. resume coverage
@pytest.mark.integration
def test_resume_refuses_side_files_missing_steps_and_repairs_a_torn_line_with_a_log_line(tmp_path):
    run_dir = tmp_path / "cover"
    common = ["trainer.measure_tau=true", "trainer.ckpt_every=10"]   # tau rows at each segment's end
    train(compose_small(run_dir, "trainer.max_steps=10", *common))
    old_presentations = (run_dir / "presentations.parquet").read_bytes()
    train(compose_small(run_dir, "trainer.max_steps=20", *common))
    assert [row["step"] for row in read_rows(run_dir / "tau.jsonl")] == [10, 20]
    saved = {name: (run_dir / name).read_bytes() for name in record.RUN_FILES}

    def restore() -> None:
        for name, data in saved.items():
            (run_dir / name).write_bytes(data)

    # an older presentations.parquet copied back over the current one: steps 11..20 would stay missing
    (run_dir / "presentations.parquet").write_bytes(old_presentations)
    with pytest.raises(Refused, match=r"presentations\.parquet holds \d+ rows.*steps \[11, 12"):
        train(compose_small(run_dir, "trainer.max_steps=30", *common))
    restore()
    # probes.jsonl lacking an earlier probe evaluation (step 5; the last one, 20, is there)
    rows = read_rows(run_dir / "probes.jsonl")
    (run_dir / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] != 5))
    with pytest.raises(Refused, match=r"probes\.jsonl lacks the probe evaluations of steps \[5\]"):
        train(compose_small(run_dir, "trainer.max_steps=30", *common))
    restore()
    # tau.jsonl torn mid-line: the row of step 10 (before the checkpoint of step 20) would be lost in silence; the
    # refusal names the torn line and leaves it in the file
    first_row = (run_dir / "tau.jsonl").read_text().splitlines()[0]
    (run_dir / "tau.jsonl").write_text(first_row[: len(first_row) // 2])
    with pytest.raises(Refused, match=r"tau\.jsonl lacks the tau measurements of steps \[10\]; tau\.jsonl line 1 is "
                                      r"read as no row: not JSON \(e\.g\. a line torn by a kill\)"):
        train(compose_small(run_dir, "trainer.max_steps=30", *common))
    assert (run_dir / "tau.jsonl").read_text() == first_row[: len(first_row) // 2]
    restore()
    # issue 31, defect 1: the last band row of the checkpointed step deleted, or torn by a kill (repaired, then
    # missing): that evaluation would keep 5 of its 6 bands, and compare would count the band one evaluation short
    lines = (run_dir / "probes.jsonl").read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])
    assert last["step"] == 20 and last["band"] == 5
    for damaged in ("".join(lines[:-1]), "".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]):
        (run_dir / "probes.jsonl").write_text(damaged)
        with pytest.raises(Refused, match=r"probes\.jsonl lacks band rows of probe evaluations: step 20 holds "
                                          r"bands \[0, 1, 2, 3, 4\] of \[0, 1, 2, 3, 4, 5\] \(missing \[5\]\)"):
            train(compose_small(run_dir, "trainer.max_steps=30", *common))
        restore()
    # a torn last line after the checkpoint (a kill while it was written) is repaired, with a log line
    with open(run_dir / "tau.jsonl", "a") as handle:
        handle.write('{"step": 21, "tau": 1.')
    log_before = (run_dir / "train_rank0.log").read_text()
    summary = train(compose_small(run_dir, "trainer.max_steps=30", *common))
    assert summary["status"] == "finished" and summary["steps"] == 30
    added = (run_dir / "train_rank0.log").read_text()[len(log_before):]
    assert "repaired" in added and "skipped 1 unusable line(s) in tau.jsonl" in added
    assert [row["step"] for row in read_rows(run_dir / "tau.jsonl")] == [10, 20, 30]


# ------------------------------------------------------------- 6. records protected, 7. a new W&B run id
@pytest.mark.integration
def test_a_stopped_run_that_lost_its_checkpoints_keeps_its_records_unless_overwrite(tmp_path):
    run_dir = tmp_path / "lost"
    common = ["trainer.max_steps=12", "trainer.measure_tau=false", "trainer.ckpt_every=4", "logger=wandb"]
    with pytest.raises(ckpt.Preempted):   # stopped after the checkpoint of step 8
        train(compose_small(run_dir, *common), stop_at(8))
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["status"] = "running"        # as a kill -9 after that checkpoint leaves it (a preemption says preempted)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    old_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    shutil.rmtree(run_dir / "checkpoints")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "train_rank0.log"}
    assert json.loads(before["summary.json"])["status"] == "running"

    with pytest.raises(Refused, match=r"stopped while running .*records of its 8 steps.*overwrite=true"):
        train(compose_small(run_dir, *common))
    with pytest.raises(FileNotFoundError, match="resume=true"):
        train(compose_small(run_dir, *common, "resume=true"))
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "train_rank0.log"}
    assert after == before   # a refusal writes nothing: the 8 rows and the full summary.json are kept

    summary = train(compose_small(run_dir, *common, "overwrite=true"))
    assert summary["status"] == "finished" and summary["steps"] == 12
    new_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    assert new_id != old_id
    offline = [p.name for p in (run_dir / "wandb").glob("offline-run-*")]
    assert offline and all(name.endswith(new_id) for name in offline), offline


@pytest.mark.integration
def test_overwrite_starts_a_new_wandb_run(tmp_path):
    run_dir = tmp_path / "again"
    common = ["trainer.max_steps=3", "trainer.measure_tau=false", "probes.every=0", "logger=wandb"]
    train(compose_small(run_dir, *common))
    old_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    shutil.rmtree(run_dir / "checkpoints")   # overwrite=true applies where no checkpoint is left to continue from
    train(compose_small(run_dir, *common, "overwrite=true"))
    new_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    assert new_id != old_id
    offline = [p.name for p in (run_dir / "wandb").glob("offline-run-*")]
    assert offline and all(name.endswith(new_id) for name in offline), offline


# --------------------------------------------------------------------------------------- 8. one line
def test_refusals_of_damaged_caches_and_checkpoints_are_refusals(tmp_path):
    from dflash_lab.model.target import load_cached_tiny_target

    with pytest.raises(Refused, match="lacks config.json"):
        load_cached_tiny_target(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_3.pt").write_bytes(b"torn")
    with pytest.raises(Refused, match="no intact checkpoint"):
        ckpt.load_run_checkpoint(tmp_path)


@pytest.mark.integration
def test_all_checkpoints_truncated_is_one_line_naming_the_fix(tmp_path):
    run_dir = tmp_path / "torn"
    first = train_cli(f"hydra.run.dir={run_dir}", *SHORT_CLI, "trainer.max_steps=10", "trainer.ckpt_every=5")
    assert first.returncode == 0, first.stderr[-3000:]
    for path in (run_dir / "checkpoints").glob("step_*.pt"):
        path.write_bytes(path.read_bytes()[:1000])
    again = train_cli(f"hydra.run.dir={run_dir}", *SHORT_CLI, "trainer.max_steps=20", "trainer.ckpt_every=5")
    assert again.returncode == 2
    assert "no intact checkpoint" in one_line_error(again.stderr)


def test_a_symlinked_run_lock_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.lock").symlink_to(victim)
    with pytest.raises(Refused, match=r"run\.lock is a symbolic link.*Remove the link"):
        RunDirLock(run_dir).acquire()
    assert victim.read_text() == "keep me\n"


@pytest.mark.integration
@pytest.mark.parametrize("what", ["run.lock", "run directory", "sweep directory"])
def test_a_read_only_run_directory_or_lock_is_one_line(tmp_path, what):
    prefix = without_permission_override()
    if prefix is None:
        pytest.skip("running as root without setpriv: permissions cannot be enforced")
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    if what == "run.lock":
        (run_dir / ".hydra").mkdir()
        (run_dir / "run.lock").write_text("")
        (run_dir / "run.lock").chmod(0o444)
    else:
        run_dir.chmod(0o555)
    where = ["-m", f"hydra.sweep.dir={run_dir / 'sweep'}", "seed=0,1"] if what == "sweep directory" else [
        f"hydra.run.dir={run_dir}"]
    try:
        result = train_cli(*where, *SHORT_CLI, prefix=prefix, timeout=180)
    finally:
        run_dir.chmod(0o755)
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_line_error(result.stderr)
    key = "hydra.sweep.dir=" if what == "sweep directory" else "hydra.run.dir="
    assert "Permission denied" in line and "chmod" in line and key in line


# ----------------------------------------------------------------------------------------- 9. disk full
@pytest.mark.integration
def test_a_full_disk_is_named_and_keeps_the_step_count(tmp_path):
    warm = train_cli(f"hydra.run.dir={tmp_path / 'warm'}", *SHORT_CLI, "trainer.max_steps=0")  # caches built
    assert warm.returncode == 0, warm.stderr[-3000:]
    run_dir = tmp_path / "df"
    full = train_cli(f"hydra.run.dir={run_dir}", *SHORT_CLI, prefix=("bash", "-c", 'ulimit -f 600; exec "$@"', "-"))
    assert full.returncode == 1, full.stderr[-3000:]
    line = one_line_error(full.stderr)
    assert "disk full" in line and "File too large" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 10 and "File too large" in summary["error"]
    assert max(row["step"] for row in read_rows(run_dir / "metrics.jsonl")) == 10
    again = train_cli(f"hydra.run.dir={run_dir}", *SHORT_CLI)
    assert again.returncode == 2
    line = one_line_error(again.stderr)
    assert "failed before its first step" not in again.stderr + line and "(status failed)" in line and "records of its 10 steps" in line


# ----------------------------------------------------------------------------------------- 10. leftovers
def test_publish_cleans_what_a_killed_compare_left(tmp_path):
    target = tmp_path / "report"
    target.mkdir()
    (target / "comparison.md").write_text("old\n")
    (tmp_path / ".report.new-abc123").mkdir()     # killed while building
    (tmp_path / ".report.old-def456").mkdir()     # killed after a swap, before removing the old folder
    publish(target, lambda folder: [folder / "comparison.md"] if (folder / "comparison.md").write_text("new\n")
            else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    assert (target / "comparison.md").read_text() == "new\n"
    # killed between the two renames: the previous comparison comes back before the next one is published
    target.rename(tmp_path / ".report.old-xyz")
    publish(target, lambda folder: [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_huge_line_is_cut_before_it_is_encoded_with_the_same_result():
    tokenizer = ByteTokenizer()
    rng = random.Random(0)
    for _ in range(200):   # the cut changes nothing of the kept tokens, their mask or the outcome
        turns = [{"role": rng.choice(["user", "assistant", "system"]),
                  "content": "".join(rng.choice("ab\u00e9\u4e2d\U0001f600") for _ in range(rng.randint(0, 40)))}
                 for _ in range(rng.randint(1, 5))]
        raw = json.dumps({"messages": turns}).encode()
        max_length = rng.randint(2, 60)
        ids, mask = tokenizer.encode_chat(turns)
        try:
            got = encode_line(tokenizer, raw, max_length=max_length)
        except ValueError as exc:
            got = getattr(exc, "reason", exc)
        pairs = sum(1 for a, b in zip(mask[:-1], mask[1:]) if a and b)
        cut_pairs = sum(1 for a, b in zip(mask[:max_length - 1], mask[1:max_length]) if a and b)
        expected = ("no_assistant_turn" if pairs == 0 else (ids, mask, False) if len(ids) <= max_length
                    else "too_long" if cut_pairs == 0 else (ids[:max_length], mask[:max_length], True))
        assert got == expected, (turns, max_length)
    huge = json.dumps({"messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a" * 5_000_000}]}).encode()
    tracemalloc.start()
    ids, mask, truncated = encode_line(tokenizer, huge, max_length=1024)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(ids) == 1024 and truncated and all(mask[5:]) and not any(mask[:5])
    assert peak < 40e6, f"peak {peak / 1e6:.0f} MB for a 5 MB line: it was encoded whole"


# ------------------------------------------------------ issue 31, defect 4: a record file that cannot be written
def _immutable(path: Path) -> bool:
    """``chattr +i path`` where the file system and the user allow it (root on ext4/overlay), else False."""
    import subprocess

    return shutil.which("chattr") is not None and subprocess.run(["chattr", "+i", str(path)],
                                                                capture_output=True).returncode == 0


@pytest.mark.integration
def test_a_record_file_that_cannot_be_written_is_one_line_naming_it(tmp_path):
    import subprocess

    run_dir = tmp_path / "blocked"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("")
    immutable = _immutable(metrics)
    if not immutable:   # no chattr here: a directory where the file should be refuses the write as well
        metrics.unlink()
        metrics.mkdir()
    try:
        result = train_cli(f"hydra.run.dir={run_dir}", *SHORT_CLI, "trainer.max_steps=3")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(metrics)], check=True)
    assert result.returncode == 1, result.stderr[-3000:]
    line = one_line_error(result.stderr)
    assert f"cannot write {metrics}" in line and "chattr -i" in line, line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and f"cannot write {metrics}" in summary["error"]


# ------------------------------ issue 43: a row without its columns, a finished run relaunched, a stray temporary copy
def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory but its text log, by path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != "train_rank0.log"}


@pytest.mark.integration
def test_a_metrics_row_without_its_columns_is_refused_naming_the_file_and_step_and_changes_no_file(tmp_path):
    """Defect 1: ``{"step": 6}`` in place of the last row passed the resume check, then the summary builder died
    with a KeyError after run_config.json had been rewritten for a launch that trained nothing."""
    run_dir = tmp_path / "stripped"
    common = ["trainer.measure_tau=false", "probes.every=0", "trainer.ckpt_every=3"]
    train(compose_small(run_dir, "trainer.max_steps=6", *common))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps({"step": 6})]) + "\n")
    before = _files(run_dir)
    with pytest.raises(Refused, match=r"^resume from the checkpoint of step 6: metrics\.jsonl's row of step 6 lacks "
                                      r"the columns epoch, loss, acc, .* and 12 more \(every row holds the 21 of "
                                      r"record\.STEP_FIELDS\)\. The run's records are incomplete or damaged: "
                                      r"restore them"):
        train(compose_small(run_dir, "trainer.max_steps=8", "resume=true", *common))   # a new config: not recorded
    assert _files(run_dir) == before


@pytest.mark.integration
def test_a_finished_run_with_a_torn_summary_relaunched_measures_no_tau_it_has_and_cleans_a_stray_copy(tmp_path):
    """Defect 2: the relaunch measured the trained draft's tau again and appended it (tau.jsonl held step 6
    twice). Now it takes the row it has and measures only the untrained draft, whose tau lived in the lost summary.
    Also: the temporary copy a kill leaves between writing metrics.jsonl's new content and its rename is removed."""
    run_dir = tmp_path / "torn_summary"
    common = ["trainer.max_steps=6", "trainer.ckpt_every=3", "probes.every=3"]
    first = train(compose_small(run_dir, *common))
    text = (run_dir / "summary.json").read_text()
    (run_dir / "summary.json").write_text(text[: len(text) // 2])
    (run_dir / "metrics.jsonl.tmp").write_text((run_dir / "metrics.jsonl").read_text()[:100])
    before, log_before = _files(run_dir), (run_dir / "train_rank0.log").read_text()
    again = train(compose_small(run_dir, *common))
    after = _files(run_dir)
    assert [row["step"] for row in read_rows(run_dir / "tau.jsonl")] == [6]
    assert {name for name in before if after.get(name) != before[name]} == {"summary.json", "metrics.jsonl.tmp"}
    assert "metrics.jsonl.tmp" not in after
    assert again["status"] == "finished" and again["steps"] == 6 and again["segments"] == 2
    for key in ("tau", "tau_se", "tau_by_band", "tau_band_min", "tau_baseline", "tau_baseline_by_band", "final_loss",
                "ktok_s", "pad_eff"):
        assert again[key] == first[key], key
    added = (run_dir / "train_rank0.log").read_text()[len(log_before):]
    assert "tau (trained draft): step 6 was measured already (tau.jsonl" in added
    assert "removed metrics.jsonl.tmp: left by a run killed while it rewrote metrics.jsonl" in added


def test_the_temporary_copies_of_killed_rewrites_are_removed_under_the_lock_and_named(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "metrics.jsonl.tmp").write_text('{"step": 1}\n{"st')   # killed before its rename
    (run_dir / "summary.json.tmp").write_text("{")
    (run_dir / "notes.tmp").write_text("not the run's")                 # a file the run does not write: kept
    directory = RunDirectory(run_dir, is_main=True)
    assert directory.remove_unfinished_writes(logging.getLogger("dflash_lab")) == []   # not claimed: not its files
    directory.claim()
    try:
        with caplog.at_level(logging.WARNING, logger="dflash_lab"):
            removed = directory.remove_unfinished_writes(logging.getLogger("dflash_lab"))
    finally:
        directory.release()
    assert removed == ["metrics.jsonl.tmp", "summary.json.tmp"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "notes.tmp", "run.lock"]
    assert "removed metrics.jsonl.tmp, summary.json.tmp: left by a run killed while it rewrote metrics.jsonl, " \
           "summary.json, whose last complete version is kept" in caplog.text


# ------------------------------------------------ a refused resume changes nothing; saved rows are checked for types
def _tree(run_dir: Path) -> dict[str, bytes | str]:
    """Every entry of a run directory but its text log, by path: a file's bytes, a link's target, a folder. A file
    inside a W&B run's folder counts by its path only: W&B's service process may still be finishing it after
    ``wandb.finish`` has returned (a new run shows as a new folder, and as new targets of wandb/'s links)."""
    def entry(path: Path) -> bytes | str:
        if path.is_symlink():
            return f"link to {os.readlink(path)}"
        if not path.is_file():
            return "folder"
        parts = path.relative_to(run_dir).parts
        return "W&B's file" if parts[0] == "wandb" and len(parts) > 2 else path.read_bytes()

    return {str(p.relative_to(run_dir)): entry(p) for p in sorted(run_dir.rglob("*")) if p.name != "train_rank0.log"}


DAMAGED_ROW_2 = {
    "without_columns": ({"step": 2}, r"metrics\.jsonl's row of step 2 lacks the columns epoch, loss, .*"),
    "loss_a_list": ({"loss": [1.5, 2.0]}, r"metrics\.jsonl's row of step 2 holds loss \[1\.5, 2\.0\] where the trainer "
                                          r"writes a number or null\. "),
}


@pytest.mark.integration
@pytest.mark.parametrize("damage", sorted(DAMAGED_ROW_2))
def test_a_refused_resume_drops_no_row_and_starts_no_wandb_run(tmp_path, damage):
    """A resume refused by the records check used to drop the rows logged after its checkpoint and start its W&B
    run (offline files in wandb/) before it refused: now it refuses first, so the directory stays as it was, and the
    relaunch after the fix the message names drops those rows and trains them again. A value of another type than
    the trainer writes (a loss that is a list) used to pass the check; it is refused like a missing column."""
    run_dir = tmp_path / damage
    common = ["logger=wandb", "trainer.measure_tau=false", "probes.every=0", "trainer.ckpt_every=3",
              "trainer.max_steps=6"]
    train(compose_small(run_dir, *common))
    (run_dir / "checkpoints" / "step_6.pt").unlink()   # as a kill after step 6's row, before its checkpoint
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    change, refusal = DAMAGED_ROW_2[damage]
    row_2 = change if damage == "without_columns" else {**json.loads(lines[1]), **change}
    metrics.write_text("".join([lines[0], json.dumps(row_2) + "\n", *lines[2:]]))
    before = _tree(run_dir)
    assert any(name.startswith("wandb/offline-run-") for name in before)
    with pytest.raises(Refused, match=rf"^resume from the checkpoint of step 3: {refusal}.*restore them .*"
                                      rf"hydra\.run\.dir=<new dir>"):
        train(compose_small(run_dir, *common))
    assert _tree(run_dir) == before   # rows 4..6 kept, nothing written into wandb/
    metrics.write_text("".join(lines))   # the records restored
    summary = train(compose_small(run_dir, *common))
    assert summary["status"] == "finished" and [row["step"] for row in read_rows(metrics)] == [1, 2, 3, 4, 5, 6]
