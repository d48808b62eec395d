"""JSONL chat data: both formats, loss only on assistant tokens, unusable lines skipped/counted by reason/refused."""

import json

import pytest

from dflash_lab.data import ByteTokenizer, build_dataset
from dflash_lab.data.jsonl import SKIP_REASONS


def _write(path, good, bad_lines=()):
    lines = []
    for i in range(good):
        if i % 2:
            record = {"conversations": [{"from": "human", "value": f"question {i}"},
                                        {"from": "gpt", "value": f"answer number {i}"}]}
        else:
            record = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"},
                                   {"role": "assistant", "content": f"reply {i} here"}]}
        lines.append(json.dumps(record))
    for position, text in bad_lines:
        lines.insert(position, text)
    path.write_text("\n".join(lines) + "\n")


def test_formats_and_assistant_only_loss(tmp_path):
    file = tmp_path / "chat.jsonl"
    _write(file, 300, bad_lines=[(5, "{not json"), (50, json.dumps({"messages": [{"role": "user", "content": "x"}]}))])
    ds = build_dataset("jsonl", path=str(file), cache_dir=tmp_path / "cache", max_bad_fraction=0.01)
    assert len(ds) == 300
    assert ds.stats["total_lines"] == 302 and ds.stats["kept"] == 300
    assert ds.stats["skipped"] == {**dict.fromkeys(SKIP_REASONS, 0), "malformed_json": 1, "no_assistant_turn": 1}
    assert [line for line, _ in ds.stats["skipped_examples"]["malformed_json"]] == [6]
    assert [line for line, _ in ds.stats["skipped_examples"]["no_assistant_turn"]] == [51]
    tok = ByteTokenizer()
    first, second = ds[0], ds[1]
    assert tok.decode(first["input_ids"][first["loss_mask"]]) == "reply 0 here"
    assert tok.decode(second["input_ids"][second["loss_mask"]]) == "answer number 1"
    assert "be brief" in tok.decode(first["input_ids"][~first["loss_mask"]])


def test_too_many_bad_lines_is_an_error_naming_file_lines_and_key(tmp_path):
    file = tmp_path / "bad.jsonl"
    _write(file, 20, bad_lines=[(0, "nope"), (3, "[1, 2]"), (7, json.dumps({"conversations": "x"}))])
    with pytest.raises(ValueError) as err:
        build_dataset("jsonl", path=str(file), cache_dir=tmp_path / "cache", max_bad_fraction=0.05)
    message = str(err.value)
    assert "bad.jsonl" in message and "3 of 23 lines" in message and "data.max_bad_fraction=0.05" in message
    assert "commonest reason malformed_json (3 lines, e.g. line 1: not JSON" in message
    # Nothing was cached: a later call with a laxer threshold reads the file again and succeeds.
    ds = build_dataset("jsonl", path=str(file), cache_dir=tmp_path / "cache", max_bad_fraction=0.2)
    assert len(ds) == 20 and ds.stats["skipped"]["malformed_json"] == 3


def test_missing_path_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="data.path"):
        build_dataset("jsonl", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="data.path"):
        build_dataset("jsonl", path=str(tmp_path / "absent.jsonl"), cache_dir=tmp_path)


def test_a_directory_as_data_path_is_named_as_one_with_what_is_expected(tmp_path):
    """Issue 43: it said "does not exist"."""
    folder = tmp_path / "chats"
    folder.mkdir()
    said = (f"data.path='{folder}' is a directory: data=jsonl reads one JSONL file, one conversation per line "
            f"({{\"messages\": [...]}} or ShareGPT's {{\"conversations\": [...]}}); point data.path at that file; ")

    def refusal() -> str:
        with pytest.raises(ValueError) as refused:
            build_dataset("jsonl", path=str(folder), cache_dir=tmp_path / "cache")
        return str(refused.value)

    assert refusal() == said + "it holds no *.jsonl file"
    _write(folder / "train.jsonl", 4)
    assert refusal() == said + f"it holds one: data.path={folder / 'train.jsonl'}"
    _write(folder / "extra.jsonl", 4)
    assert refusal() == said + (f"it holds 2 (extra.jsonl, train.jsonl): pick one, or concatenate them (cat "
                                f"{folder}/*.jsonl > all.jsonl) and point data.path at the result")
    assert not (tmp_path / "cache").exists()


def test_a_byte_order_mark_and_an_absurdly_nested_line_are_handled(tmp_path):
    """A UTF-8 BOM before line 1 (editors write one) keeps line 1; a line nested 200,000 levels deep is one
    malformed line, skipped and counted, not a RecursionError that ends the run."""
    file = tmp_path / "chat.jsonl"
    _write(file, 399, bad_lines=[(200, "[" * 200_000)])
    file.write_bytes("\ufeff".encode() + file.read_bytes())
    ds = build_dataset("jsonl", path=str(file), cache_dir=tmp_path / "cache", max_bad_fraction=0.01)
    assert ds.stats["total_lines"] == 400 and ds.stats["kept"] == 399 and len(ds) == 399
    assert ds.stats["skipped"]["malformed_json"] == 1
    assert [line for line, _ in ds.stats["skipped_examples"]["malformed_json"]] == [201]
    assert "reply 0 here" in ByteTokenizer().decode(ds[0]["input_ids"])   # line 1, after the BOM, is kept


def test_tool_calling_conversations_need_a_template_with_tool_syntax(tmp_path):
    """The tiny model's byte tokenizer has no tool syntax: a tool turn, tool_calls (null or string content) or a
    tools list is parsed (never refused as malformed JSON) and skipped as template_lacks_tools, never trained with
    the calls dropped from the text (model=hf with a tool-rendering template trains them:
    tests/test_data_chat_templates.py)."""
    file = tmp_path / "chat.jsonl"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool_lines = [
        (3, json.dumps({"messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": None, "tool_calls": [call]},
                                     {"role": "tool", "content": "42", "tool_call_id": "c1"},
                                     {"role": "assistant", "content": "it is 42"}]})),
        (9, json.dumps({"messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "calling", "tool_calls": [call]}]})),
        (15, json.dumps({"tools": [{"type": "function", "function": {"name": "f"}}],
                         "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})),
    ]
    _write(file, 300, bad_lines=tool_lines)
    ds = build_dataset("jsonl", path=str(file), cache_dir=tmp_path / "cache", max_bad_fraction=0.05)
    assert ds.stats["skipped"]["template_lacks_tools"] == 3 and ds.stats["skipped"]["malformed_json"] == 0
    assert [line for line, _ in ds.stats["skipped_examples"]["template_lacks_tools"]] == [4, 10, 16]
    assert "model=hf" in ds.stats["skipped_examples"]["template_lacks_tools"][0][1]
    assert len(ds) == 300
