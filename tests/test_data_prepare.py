"""Preparing chat data at scale (issue 42): the token store is the same byte for byte for any ``data.num_proc``,
it is written chunk by chunk in bounded memory, the preparation says how far it is, and a process waiting for
another one's build says so."""

from __future__ import annotations

import json
import logging
import threading
import time
import tracemalloc

import numpy as np
import pytest

from dflash_lab.data import build_dataset
from dflash_lab.data.cache import build_once
from dflash_lab.data.jsonl import JsonlReport, UnusableLine, encode_jsonl, encode_line, line_chunks
from dflash_lab.data.parallel import available_cpus, ordered_map, resolve_num_proc
from dflash_lab.data.progress import ItemProgress
from dflash_lab.data.store import StoreWriter, chunked
from dflash_lab.data.tokenizer import ByteTokenizer

WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this".split()


def _chat_file(path, lines: int, seed: int = 0) -> None:
    """A chat file of every kind of line: both formats, reasoning, replies long enough to be cut at
    max_length=2048, empty lines, and lines skipped for five reasons (malformed_json, invalid_utf8,
    no_assistant_turn, tool_result_without_call, too_long); the last line has no newline."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(lines):
        words = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 900))))
        kind = i % 23
        if kind == 3:
            rows.append(b"{not json")
        elif kind == 7:
            rows.append(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}')   # invalid UTF-8
        elif kind == 11:
            rows.append(json.dumps({"messages": [{"role": "user", "content": words}]}).encode())
        elif kind == 13:
            rows.append(b"")
        elif kind == 17:
            rows.append(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "4"},
                                                 {"role": "assistant", "content": words}]}).encode())
        elif kind == 21:   # a prompt longer than max_length=2048: too_long
            rows.append(json.dumps({"messages": [{"role": "user", "content": "y" * 2100},
                                                 {"role": "assistant", "content": words}]}).encode())
        elif kind == 19:
            rows.append(json.dumps({"conversations": [{"from": "human", "value": words[:40]},
                                                      {"from": "gpt", "value": words}]}).encode())
        else:
            turn = {"role": "assistant", "content": words}
            if kind == 5:
                turn["reasoning_content"] = words[:200]
            rows.append(json.dumps({"messages": [{"role": "user", "content": words[:300]}, turn]}).encode())
    path.write_bytes(b"\n".join(rows))


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_stores_built_with_one_and_two_processes_are_byte_identical(tmp_path):
    """Three chunks of about 1 MiB: one process or two, the cache entry (same key) holds the same files, byte for
    byte, and they hold what encoding the file line by line gives."""
    chat = tmp_path / "chat.jsonl"
    _chat_file(chat, 1400)
    assert len(line_chunks(chat)) == 3
    one = build_dataset("jsonl", path=str(chat), cache_dir=tmp_path / "one", max_length=2048,
                        max_bad_fraction=0.3, max_truncated_fraction=1.0, num_proc=1)
    two = build_dataset("jsonl", path=str(chat), cache_dir=tmp_path / "two", max_length=2048,
                        max_bad_fraction=0.3, max_truncated_fraction=1.0, num_proc=2)
    one_dir, two_dir = (tmp_path / name / "data" for name in ("one", "two"))
    assert [p.name for p in one_dir.iterdir() if p.is_dir()] == [p.name for p in two_dir.iterdir() if p.is_dir()]
    entry_one, entry_two = one.meta["directory"], two.meta["directory"]
    files_one, files_two = _files(type(one_dir)(entry_one)), _files(type(two_dir)(entry_two))
    assert sorted(files_one) == ["lengths.npy", "loss_mask.npy", "meta.json", "offsets.npy", "skipped_lines.jsonl",
                                 "tokens.npy"]   # no chunk left behind
    assert files_one == files_two
    # ... and what one pass over the lines gives, line numbers included
    tokenizer, ids, skipped, cut = ByteTokenizer(), [], [], 0
    for number, raw in enumerate(chat.read_bytes().split(b"\n"), start=1):
        if raw.strip():
            try:
                line_ids, _mask, truncated = encode_line(tokenizer, raw, max_length=2048)
                ids.append(line_ids)
                cut += truncated
            except UnusableLine as error:
                skipped.append((number, error.reason))
    assert [len(i) for i in ids] == one.lengths.tolist()
    assert np.array_equal(np.concatenate([np.asarray(i, np.int32) for i in ids]),
                          np.load(type(one_dir)(entry_one) / "tokens.npy"))
    assert [(row["line"], row["reason"]) for row in one.skipped_lines()] == skipped
    assert len({reason for _, reason in skipped}) == 5 and one.stats["truncated"] == cut > 0
    assert one.stats["notes"] == two.stats["notes"]


def test_chunks_of_any_size_in_two_processes_give_the_one_pass_result(tmp_path):
    """encode_jsonl with 4 KiB chunks in two processes: the same arrays and the same report (counts, examples,
    every skipped line with its number, rendered lengths) as one chunk in this process."""
    chat = tmp_path / "chat.jsonl"
    _chat_file(chat, 120, seed=1)
    results = []
    for num_proc, chunk_bytes in ((1, 2**20), (2, 4096)):
        report = JsonlReport()
        chunks = [tuple(np.array(a) for a in chunk) for chunk in
                  encode_jsonl(ByteTokenizer(), path=str(chat), max_length=2048, max_bad_fraction=0.3, report=report,
                               num_proc=num_proc, spill_dir=tmp_path, chunk_bytes=chunk_bytes)]
        assert not list(tmp_path.glob("chunk-*"))   # every spilled chunk removed once yielded
        results.append(([np.concatenate(part) for part in zip(*chunks)], report, len(chunks)))
    (arrays_one, report_one, count_one), (arrays_two, report_two, count_two) = results
    assert count_one == 1 and count_two > 20
    assert all(np.array_equal(a, b) for a, b in zip(arrays_one, arrays_two))
    assert report_one.as_dict() == report_two.as_dict()
    assert report_one.skipped_lines == report_two.skipped_lines and len(report_one.skipped_lines) > 10
    assert list(report_one.rendered_lengths) == list(report_two.rendered_lengths)


def test_a_hugging_face_template_in_forked_workers_gives_the_one_process_result(tmp_path):
    """The HF adapter (a fast tokenizer, Qwen3's template with tools and reasoning) in two forked workers: the same
    ids, masks, counts and notes (turns whose reasoning the template leaves out) as in this process."""
    from helpers import CONVERSATIONS, QWEN3_TOOLS, TOOL_RECORDS, tiny_tool_tokenizer, write_jsonl

    from dflash_lab.data import HFTokenizerAdapter
    from dflash_lab.data.tokenizer import load_chat_template

    reasoning = [{"role": "user", "content": "q1"},
                 {"role": "assistant", "content": "a1", "reasoning_content": "think one"},
                 {"role": "user", "content": "q2"},
                 {"role": "assistant", "content": "a2", "reasoning_content": "think two"}]
    records = [{"messages": c} for c in CONVERSATIONS] + [r for r, _calls, _results in TOOL_RECORDS]
    chat = write_jsonl(tmp_path / "chat.jsonl", (records + [{"messages": reasoning}, "{bad"]) * 20)
    tokenizer, template = HFTokenizerAdapter(tiny_tool_tokenizer()), load_chat_template(str(QWEN3_TOOLS))
    results = []
    for num_proc, chunk_bytes in ((1, 2**20), (2, 2048)):
        report = JsonlReport()
        arrays = [tuple(np.array(a) for a in chunk) for chunk in
                  encode_jsonl(tokenizer, path=str(chat), max_length=4096, max_bad_fraction=0.2, report=report,
                               chat_template=template, num_proc=num_proc, spill_dir=tmp_path,
                               chunk_bytes=chunk_bytes)]
        results.append(([np.concatenate(part) for part in zip(*arrays)], report.as_dict()))
    (arrays_one, stats_one), (arrays_two, stats_two) = results
    assert all(np.array_equal(a, b) for a, b in zip(arrays_one, arrays_two)) and stats_one == stats_two
    assert stats_one["kept"] == 140 and stats_one["skipped"]["malformed_json"] == 20
    assert stats_one["notes"]["reasoning_not_rendered"] == 20


def test_preparation_logs_progress_then_time_and_size_and_a_cache_hit_says_so(tmp_path, caplog):
    chat = tmp_path / "chat.jsonl"
    _chat_file(chat, 200, seed=2)
    report, progress = JsonlReport(), ItemProgress(chat.name, chat.stat().st_size, every_s=0.0)
    with caplog.at_level(logging.INFO, logger="dflash_lab"):
        chunks = list(encode_jsonl(ByteTokenizer(), path=str(chat), max_length=2048, max_bad_fraction=0.3,
                                   report=report, progress=progress, chunk_bytes=16384))
    lines = [r.getMessage() for r in caplog.records if "% of chat.jsonl" in r.getMessage()]
    assert len(lines) == progress.lines >= len(chunks) > 5
    done = [int(line.split()[1].replace(",", "")) for line in lines]
    assert done == sorted(done) and done[-1] == report.total_lines
    assert "(100% of chat.jsonl)" in lines[-1] and "conversations/s, ETA 0s" in lines[-1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash_lab"):
        dataset = build_dataset("jsonl", path=str(chat), cache_dir=tmp_path / "cache", max_length=2048,
                                max_bad_fraction=0.3, max_truncated_fraction=1.0, num_proc=2)
    text = caplog.text
    assert f"data: tokenizing {chat} (" in text and " in 1 process into " in text   # one chunk: one process
    assert f"conversations/s in 1 process): {len(dataset):,} samples, {int(dataset.lengths.sum()):,} tokens, " in text
    assert " on disk in " in text and f"data: {len(dataset):,} samples written in " in text
    assert text.index("samples written") < text.index("hashing the store") < text.index("built in")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash_lab"):
        build_dataset("jsonl", path=str(chat), cache_dir=tmp_path / "cache", max_length=2048, max_bad_fraction=0.3,
                      max_truncated_fraction=1.0)
    assert "data: cached store " in caplog.text and "tokenizing" not in caplog.text


def _sleep_then_square(shared, task):
    time.sleep(shared)
    return task * task


def test_waiting_for_a_slow_worker_still_calls_on_wait_and_keeps_the_order():
    """A task slower than the wait: ``on_wait`` (the progress line) runs meanwhile; results come in task order."""
    calls = []
    results = list(ordered_map(_sleep_then_square, 0.4, range(4), num_proc=2,
                               on_wait=lambda: calls.append(time.monotonic()), wait_s=lambda: 0.1))
    assert results == [0, 1, 4, 9]
    assert len(calls) >= 3


def test_progress_line_names_count_share_rate_and_eta():
    clock = iter([0.0, 4.0, 10.0, 10.0, 10.0])
    progress = ItemProgress("chat.jsonl", 4000, every_s=10.0, clock=lambda: next(clock))
    progress.advance(100, 1000)   # at 4 s: not due yet
    assert progress.lines == 0
    assert progress.line() == "data: 100 conversations (25% of chat.jsonl) in 10s: 10 conversations/s, ETA 30s"


def test_the_store_writer_writes_what_np_save_writes_holding_one_chunk(tmp_path):
    """40 chunks of 1 MiB of tokens: the files are np.save's of the whole arrays, byte for byte, while the writer's
    allocations peak near one chunk (tracemalloc sees numpy's buffers), not near the 200 MB written."""
    rng = np.random.default_rng(0)
    chunk_tokens, count = 2**18, 40   # 1 MiB of int32 a chunk
    seeds = rng.integers(0, 2**31, size=count)
    tracemalloc.start()
    with StoreWriter(tmp_path) as writer:
        for seed in seeds:
            chunk_rng = np.random.default_rng(int(seed))
            tokens = chunk_rng.integers(0, 264, size=chunk_tokens, dtype=np.int32)
            writer.add(tokens, tokens % 3 == 0, np.full(16, chunk_tokens // 16))
            del tokens
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 5 * chunk_tokens, f"peak {peak / 1e6:.1f} MB while writing {count * 5 * chunk_tokens / 1e6:.0f} MB"
    whole = np.concatenate([np.random.default_rng(int(seed)).integers(0, 264, size=chunk_tokens, dtype=np.int32)
                            for seed in seeds])
    for name, array in (("tokens.npy", whole), ("loss_mask.npy", whole % 3 == 0),
                        ("offsets.npy", np.arange(0, whole.size + 1, chunk_tokens // 16, dtype=np.int64)),
                        ("lengths.npy", np.full(16 * count, chunk_tokens // 16, dtype=np.int64))):
        np.save(tmp_path / f"expected_{name}", array)
        assert (tmp_path / name).read_bytes() == (tmp_path / f"expected_{name}").read_bytes(), name
    assert np.load(tmp_path / "tokens.npy", mmap_mode="r").shape == (whole.size,)


def test_chunked_gathers_single_samples_and_the_writer_refuses_disagreeing_arrays(tmp_path):
    samples = [([1] * n, [True] * n) for n in (3, 5, 2, 7, 1)]
    chunks = list(chunked(samples, chunk_tokens=6))
    assert [lengths.tolist() for _, _, lengths in chunks] == [[3, 5], [2, 7], [1]]
    with pytest.raises(ValueError, match="must agree"), StoreWriter(tmp_path) as writer:
        writer.add(np.zeros(3, np.int32), np.zeros(3, bool), np.array([2]))


def test_a_process_waiting_for_another_ones_build_says_so(tmp_path, caplog):
    """Two builders of one entry (as DDP ranks on one node): the second waits on the lock, logs that it waits for
    the builder and how long it waited, then uses the entry without building it."""
    entry, building = tmp_path / "entry", threading.Event()

    def slow_build(tmp):
        building.set()
        time.sleep(0.5)
        (tmp / "done").write_text("built")

    builder = threading.Thread(target=build_once, args=(entry, slow_build))
    builder.start()
    assert building.wait(10)
    with caplog.at_level(logging.INFO, logger="dflash_lab"):
        path, built = build_once(entry, lambda tmp: pytest.fail("built twice"))
    builder.join()
    assert not built and (path / "done").read_text() == "built"
    assert f"waiting for another process to finish building {entry} (it holds {entry}.lock)" in caplog.text
    assert "waited " in caplog.text


def test_num_proc_defaults_to_the_usable_cpus_and_refuses_nonsense(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    cpus = available_cpus()
    assert resolve_num_proc(None) == cpus >= 1
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert resolve_num_proc(None) == 1 and resolve_num_proc(3) == 3
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="data.num_proc="):
            resolve_num_proc(bad)
    with pytest.raises(ValueError, match="data.num_proc applies to data=jsonl, not data=synthetic"):
        build_dataset("synthetic", cache_dir=tmp_path, num_samples=50, num_proc=2)


def test_a_reader_that_defers_the_digest_opens_at_once_and_is_refused_when_it_asks(tmp_path):
    """check_digest=False (the planner) opens a store without streaming it; asking for its content_digest (what a
    run records) streams it then and refuses a damaged one, as a checked load does at once."""
    from dflash_lab.refusal import DamagedCache

    clean = build_dataset("synthetic", cache_dir=str(tmp_path), num_samples=200)
    digest = clean.content_digest
    deferred = build_dataset("synthetic", cache_dir=str(tmp_path), num_samples=200, check_digest=False)
    assert "content_digest" not in deferred.meta and deferred.split()[0].content_digest == digest
    tokens = tmp_path / "data" / clean.meta["directory"].rsplit("/", 1)[1] / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-5] ^= 0x21
    tokens.write_bytes(bytes(data))
    damaged = build_dataset("synthetic", cache_dir=str(tmp_path), num_samples=200, check_digest=False)
    with pytest.raises(DamagedCache, match=f"records {digest}"):
        _ = damaged.content_digest
    with pytest.raises(DamagedCache, match=f"records {digest}"):
        build_dataset("synthetic", cache_dir=str(tmp_path), num_samples=200)


def test_hashing_a_large_store_logs_how_far_it_is(tmp_path, caplog):
    """The digest pass (seconds per GB) is not silent: with a line always due, a line after every read (1 MiB)."""
    from dflash_lab.data.datasets import content_digest

    with StoreWriter(tmp_path) as writer:
        writer.add(np.zeros(2**20, np.int32), np.ones(2**20, bool), np.array([2**20]))   # 5 MiB of arrays
    with caplog.at_level(logging.INFO, logger="dflash_lab"):
        quiet = content_digest(tmp_path)
        assert not caplog.records
        assert content_digest(tmp_path, log_every_s=0.0) == quiet
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 5 and lines[-1].startswith(f"data: hashing {tmp_path.name}: 5.24 MB of 5.24 MB in ")


def test_a_run_resumes_with_another_num_proc():
    """data.num_proc changes nothing a run computes (the same store): a resume with another value is let through."""
    from dflash_lab.records.checkpoint import check_resume_config

    old = {"data": {"kind": "jsonl", "path": "chat.jsonl", "num_proc": None}, "trainer": {"lr": 1e-3}}
    assert check_resume_config(old, {**old, "data": {**old["data"], "num_proc": 16}}) == []
