"""data=jsonl as exported chat data comes: nothing is dropped or changed without a named reason.

Reasoning (``reasoning_content``) is rendered by the chat template and trained with its turn; OpenAI content parts
and tool results given as objects are accepted, non-text parts refused by name; a tool result with no call before
it, or for a call that does not exist, is a named skip; the too_long refusal names ``data.max_length`` with the
length that keeps 99% of the lines whole; every skipped line is listed with its number and reason. The tokenizer
and the Qwen3-shaped template are the test fixtures (tests/helpers.py): nothing is downloaded.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers import LLAMA3, QWEN3_TOOLS, tiny_tool_tokenizer, write_jsonl

from dflash_lab.data import ByteTokenizer, HFTokenizerAdapter, build_dataset
from dflash_lab.data.jsonl import SKIP_REASONS

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer():
    return HFTokenizerAdapter(tiny_tool_tokenizer())


def _build(tmp_path, tokenizer, records, template=QWEN3_TOOLS, **options):
    file = write_jsonl(tmp_path / "chat.jsonl", records)
    return build_dataset("jsonl", tokenizer=tokenizer, path=str(file), cache_dir=tmp_path / "cache",
                         **({"chat_template": str(template)} if template else {}), **options)


def _texts(tokenizer, sample) -> tuple[str, str]:
    """(trained text, prompt text) of one sample."""
    ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m], show_special=True)
    return trained, tokenizer.decode([t for t, m in zip(ids, mask) if not m], show_special=True)


def _skipped(**counts) -> dict[str, int]:
    return {**dict.fromkeys(SKIP_REASONS, 0), **counts}


def _call(call_id, name="get_weather", arguments='{"city": "Paris"}'):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- reasoning_content ---------------------------------------------------------------------------------------------
REASONING = {"messages": [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4", "reasoning_content": "add two and two"}]}
TWO_TURNS = {"messages": [{"role": "user", "content": "a?"},
                          {"role": "assistant", "content": "first answer", "reasoning_content": "first thought"},
                          {"role": "user", "content": "b?"},
                          {"role": "assistant", "content": "second answer", "reasoning_content": "second thought"}]}
PLAIN = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


def test_reasoning_content_is_rendered_by_the_template_and_trained(tmp_path, tokenizer):
    """Qwen3's template writes reasoning_content in a <think> block inside the last replies: trained. Before the
    last user turn it writes none (as at inference): counted, not hidden."""
    ds = _build(tmp_path, tokenizer, [REASONING, TWO_TURNS], max_bad_fraction=0.0)
    assert ds.stats["skipped"] == _skipped() and len(ds) == 2
    trained, _ = _texts(tokenizer, ds[0])
    assert "<think>\nadd two and two\n</think>\n\n4<|im_end|>" in trained
    trained, prompt = _texts(tokenizer, ds[1])
    assert "<think>\nsecond thought\n</think>\n\nsecond answer" in trained
    assert "first thought" not in trained + prompt and "first answer" in trained
    assert ds.stats["notes"] == {"reasoning_not_rendered": 1}


def test_a_template_that_renders_no_reasoning_is_a_named_skip(tmp_path, tokenizer):
    ds = _build(tmp_path, tokenizer, [REASONING, PLAIN, PLAIN], template=LLAMA3, max_bad_fraction=0.5)
    assert ds.stats["skipped"] == _skipped(template_lacks_reasoning=1) and len(ds) == 2
    assert "reasoning_content" in ds.stats["skipped_examples"]["template_lacks_reasoning"][0][1]


def test_the_byte_tokenizer_trains_reasoning_in_qwen3s_form(tmp_path):
    """model=tiny writes the reasoning as Qwen3 does; vLLM's newer ``reasoning`` key is read the same way, and two
    different reasonings on one turn are refused."""
    as_vllm = json.loads(json.dumps(REASONING).replace('"reasoning_content"', '"reasoning"'))
    both = json.loads(json.dumps(REASONING))
    both["messages"][1]["reasoning"] = "something else"
    ds = _build(tmp_path, ByteTokenizer(), [REASONING, as_vllm, both], template=None, max_bad_fraction=0.5)
    assert ds.stats["skipped"] == _skipped(malformed_json=1) and len(ds) == 2
    for sample in (ds[0], ds[1]):
        assert (ByteTokenizer().decode(sample["input_ids"][sample["loss_mask"]])
                == "<think>\nadd two and two\n</think>\n\n4")


# ---- content parts, tool results as objects -----------------------------------------------------------------------
def test_content_parts_and_tool_objects_are_accepted_and_images_refused_by_name(tmp_path, tokenizer):
    parts = {"tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": {"temp": 18, "sky": "sunny"}},
        {"role": "assistant", "content": [{"type": "text", "text": "18C and sunny."}]}]}
    image = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": "https://example.org/cat.png"}}]},
        {"role": "assistant", "content": "a cat"}]}
    ds = _build(tmp_path, tokenizer, [parts, image, parts], max_bad_fraction=0.5)
    assert ds.stats["skipped"] == _skipped(non_text_content=1) and len(ds) == 2
    trained, prompt = _texts(tokenizer, ds[0])
    assert "Weather in\nParis?" in prompt                                # text parts joined by a newline
    assert '<tool_response>\n{"temp": 18, "sky": "sunny"}\n</tool_response>' in prompt   # the object as JSON
    assert "18C and sunny.<|im_end|>" in trained and "sunny" not in trained.replace("18C and sunny.", "")
    assert "'image_url' part" in ds.stats["skipped_examples"]["non_text_content"][0][1]
    assert ds.stats["skipped_examples"]["non_text_content"][0][0] == 2


# ---- tool results that answer no call -----------------------------------------------------------------------------
def test_tool_results_without_their_call_are_named_skips(tmp_path, tokenizer):
    def line(*turns):
        return {"tools": [WEATHER_TOOL], "messages": [{"role": "user", "content": "Weather?"}, *turns]}

    result = {"role": "tool", "tool_call_id": "c1", "content": "18C"}
    records = [
        line(result, {"role": "assistant", "content": "18C."}),                      # no call before it
        line({"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
             {**result, "tool_call_id": "c9"}, {"role": "assistant", "content": "18C."}),   # an id of no call
        line({"role": "assistant", "content": None, "tool_calls": [_call("c1")]}, result,
             {"role": "user", "content": "and?"}, {**result, "tool_call_id": None},
             {"role": "assistant", "content": "18C."}),                              # after a user turn: no call
        line({"role": "assistant", "content": None, "tool_calls": [_call("c1"), _call("c2")]}, result,
             {**result, "tool_call_id": "c2"}, {"role": "assistant", "content": "18C twice."}),   # kept
    ]
    ds = _build(tmp_path, tokenizer, records, max_bad_fraction=0.9)
    assert ds.stats["skipped"] == _skipped(tool_result_without_call=2, tool_call_id_unmatched=1) and len(ds) == 1
    examples = ds.stats["skipped_examples"]
    assert [line for line, _ in examples["tool_result_without_call"]] == [1, 3]
    assert "'c9' matches no call" in examples["tool_call_id_unmatched"][0][1]


# ---- too long: the message names data.max_length ------------------------------------------------------------------
def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_too_long_lines_name_the_max_length_that_keeps_them(tmp_path):
    records = [_chat("why " * (40 + 10 * i), "because.") if i % 2 else _chat(f"q{i}", "short answer")
               for i in range(20)]
    with pytest.raises(ValueError) as err:
        _build(tmp_path, ByteTokenizer(), records, template=None, max_length=64)
    message = str(err.value)
    assert "commonest reason too_long (10 lines" in message and "data.max_bad_fraction" in message
    suggested = int(re.search(r"raise data\.max_length for the too_long lines: data\.max_length=(\d+) keeps 99% "
                              r"of the rendered lines whole \(now 64", message).group(1))
    ds = _build(tmp_path, ByteTokenizer(), records, template=None, max_length=suggested)   # the advice works
    assert ds.stats["skipped"] == _skipped() and ds.stats["truncated"] == 0 and len(ds) == 20
    assert ds.stats["length_keeping_99pct"] == suggested == ds.stats["longest_line_tokens"]

    # Cut, not skipped (the answer is what is long): the truncation refusal names the length too.
    records = [_chat("q", "answer " * (20 + i)) for i in range(20)]
    with pytest.raises(ValueError, match=r"raise data\.max_length \(data\.max_length=\d+ keeps 99% of the lines "
                                         r"whole\), or accept the cut"):
        _build(tmp_path, ByteTokenizer(), records, template=None, max_length=64)


# ---- every skipped line, listed -----------------------------------------------------------------------------------
def test_every_skipped_line_is_listed_with_its_number_and_reason(tmp_path):
    records = [_chat(f"q{i}", f"answer {i}") for i in range(10)]
    records[2] = "{not json"
    records[6] = {"messages": [{"role": "user", "content": "no reply"}]}
    ds = _build(tmp_path, ByteTokenizer(), records, template=None, max_bad_fraction=0.5)
    rows = ds.skipped_lines()
    assert [(row["line"], row["reason"]) for row in rows] == [(3, "malformed_json"), (7, "no_assistant_turn")]
    assert "not JSON" in rows[0]["message"]
    (tmp_path / "clean").mkdir()
    clean = _build(tmp_path / "clean", ByteTokenizer(), [_chat("q", "answer")], template=None)
    assert clean.skipped_lines() == []
    assert build_dataset("synthetic", num_samples=20, cache_dir=tmp_path / "cache").skipped_lines() is None
    json.dumps(rows)   # plain JSON rows, as data_skipped.jsonl holds them


# ---- issue 31, defect 2: a lone surrogate escape is a named skip, not an error that names neither file nor line ---
@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["byte tokenizer", "hf tokenizer"])
def test_a_lone_surrogate_is_skipped_under_its_reason_with_its_line(tmp_path, tokenizer, with_tokenizer):
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world, \U0001f600"}]}
    lone = '{"messages": [{"role": "user", "content": "hi \\ud800 there"}, {"role": "assistant", "content": "ok!"}]}'
    paired = '{"messages": [{"role": "user", "content": "a \\ud83d\\ude00"}, {"role": "assistant", "content": "ok!"}]}'
    file = write_jsonl(tmp_path / "chat.jsonl", [good] * 120 + [lone, paired])
    options = {"tokenizer": tokenizer, "chat_template": str(QWEN3_TOOLS)} if with_tokenizer else {}
    ds = build_dataset("jsonl", path=str(file), cache_dir=tmp_path / "cache", **options)
    assert ds.stats["skipped"] == _skipped(lone_surrogate=1) and len(ds) == 121   # the pair is one emoji: kept
    (skipped,) = ds.skipped_lines()
    assert skipped["line"] == 121 and skipped["reason"] == "lone_surrogate"
    assert "U+D800 at character 3" in skipped["message"] and "not encodable as UTF-8" in skipped["message"]
