"""Your data, in the run's own records and before the run: the skipped lines listed in the run directory, a
verdict the run's probes cannot compute and a tau measured on fewer prompts than configured said at the start of
training, and the planner's one-line data errors and its data counts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import write_jsonl

SMALL = [
    "++model.hidden_size=64", "++model.num_layers=2", "++model.num_heads=4", "++model.num_kv_heads=2",
    "++model.intermediate_size=128", "++model.pretrain_steps=20", "++model.pretrain_tokens_per_step=2048",
    "++model.block_size=4", "sampler.max_tokens=1024", "trainer.num_threads=1", "trainer.progress=false",
    "model.decode_max_new_tokens=8", "probes.per_band=2",
]
VERDICT = ("analysis.verdict={endpoint: residual_amplitude, positive_control: 'sampler=bucket_sequential', "
           "negative_control: 'sampler=bucketed', question: 'sampler=full_random'}")


def _chats(count: int, bad: dict[int, object]) -> list:
    records = [{"messages": [{"role": "user", "content": f"question {i}?"},
                             {"role": "assistant", "content": f"answer number {i} " * (1 + i % 4)}]}
               for i in range(count)]
    for index, record in bad.items():
        records[index] = record
    return records


BAD = {4: "{not json", 17: {"messages": [{"role": "user", "content": "no reply"}]},
       30: {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"},
                         {"role": "assistant", "content": "42 it is"}]}}


@pytest.mark.integration
def test_a_run_lists_its_skipped_lines_and_warns_before_step_one(tmp_path):
    from hydra import compose, initialize_config_module

    from dflash_lab.train import train

    too_long = {"messages": [{"role": "user", "content": "why? " * 220}, {"role": "assistant", "content": "ok."}]}
    data = write_jsonl(tmp_path / "chat.jsonl", _chats(60, {**BAD, 44: too_long}))
    run_dir = tmp_path / "run"
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            f"run_dir={run_dir}", *SMALL, "data=jsonl", f"data.path={data}", "data.max_bad_fraction=0.1",
            f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=4", "trainer.measure_tau=true",
            "probes.every=15", "model.decode_num_prompts=12", VERDICT])
    summary = train(cfg)
    assert summary["status"] == "finished"
    rows = [json.loads(line) for line in (run_dir / "data_skipped.jsonl").read_text().splitlines()]
    assert [(row["line"], row["reason"]) for row in rows] == [
        (5, "malformed_json"), (18, "no_assistant_turn"), (31, "tool_result_without_call"), (45, "too_long")]
    assert summary["data_skipped"]["tool_result_without_call"] == 1
    log = (run_dir / "train_rank0.log").read_text()
    assert f"the 4 skipped line(s) of data.path, with their line numbers, reasons and messages: {run_dir}" in log
    assert "keeps 99% of the lines whole (now 1024)" in log   # the too_long line: the length that keeps it
    first_step = log.index("running steps 0..4")   # the warnings come before the loop starts
    verdict = log.index("analysis: this run probes 1 time(s) in the analysis window (steps 2..4 of 4")
    assert verdict < first_step and "residual_amplitude needs 8" in log
    # tau is measured (issue 31: with trainer.measure_tau=false the warning about its prompts is not given)
    assert log.index("tau: only ") < first_step and "of the 12 prompts of model.decode_num_prompts exist" in log


@pytest.mark.integration
def test_the_planner_reports_data_errors_in_one_line_and_its_counts(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", _chats(60, BAD))
    command = [sys.executable, "-m", "dflash_lab.plan", "data=jsonl", f"data.path={data}",
               f"data.cache_dir={tmp_path / 'cache'}", "sampler.max_tokens=1024", "policies=[bucketed]",
               f"hydra.run.dir={tmp_path / 'plan'}"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.startswith("dflash_lab.plan: error: ") and "data.max_bad_fraction=0.01" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 2   # the message and the HYDRA_FULL_ERROR hint
    planned = subprocess.run([*command, "data.max_bad_fraction=0.1"], capture_output=True, text=True, timeout=300,
                             check=False)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "data: 57 of 60 lines kept; skipped: malformed_json 1, no_assistant_turn 1, tool_result_without_call 1 " \
           "(every skipped line: " in planned.stdout
    meta = json.loads((tmp_path / "plan" / "plan.json").read_text())["meta"]
    assert meta["data"]["skipped"] == {"malformed_json": 1, "no_assistant_turn": 1, "tool_result_without_call": 1}
    assert meta["data"]["truncated"] == 0 and meta["data"]["kept"] == 57
