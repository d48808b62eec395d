"""Chat data on real template shapes: assistant-token masks, data.chat_template, skipped lines by reason.

The templates are fixtures (tests/fixtures/chat_templates/): a Qwen3-style one, which strips <think> from replies
before the last user turn and gives the last reply a think block, a Llama-3-style one, which trims contents, and
one modelled on Qwen3's own template with tool calling (qwen3_tools.jinja; neither of the other two renders tools).
The tokenizer is built here with the `tokenizers` library (byte-level, no merges, the templates' markers as
single tokens): tokenizing a text piece by piece gives the same ids as tokenizing it whole, so the expected mask
is written piece by piece from what each template is documented to render, and compared token by token.
"""

from __future__ import annotations

import json

import pytest
from helpers import (  # tests/ is on sys.path (pytest rootdir-relative import)
    CONVERSATIONS,
    TOOL_RECORDS,
    openai_tool_call,
    LLAMA3,
    QWEN3,
    QWEN3_TOOLS,
    local_qwen3,
    tiny_chat_tokenizer,
    tiny_tool_tokenizer,
    write_jsonl,
)

from dflash_lab.data import ByteTokenizer, HFTokenizerAdapter, build_dataset
from dflash_lab.data.datasets import DATA_KEYS
from dflash_lab.data.jsonl import SKIP_REASONS, parse_conversation, parse_tools
from dflash_lab.data.tokenizer import (
    ChatTemplateError,
    TemplateLacksTools,
    chat_markers,
    load_chat_template,
)
from dflash_lab.plan import CONF_DIR

@pytest.fixture(scope="module")
def tokenizer():
    return HFTokenizerAdapter(tiny_chat_tokenizer())


def _split_think(content: str) -> tuple[str, str]:
    if "</think>" not in content:
        return "", content
    return content.split("</think>")[0].split("<think>")[-1].strip("\n"), content.split("</think>")[-1].lstrip("\n")


def qwen3_pieces(messages) -> list[tuple[str, bool]]:
    """(text, is_assistant) pieces of the Qwen3-style rendering: header and the newline after <|im_end|> are
    prompt; the reply (think block included where the template keeps one) and <|im_end|> are assistant."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    pieces = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            pieces.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
            continue
        reasoning, answer = _split_think(m["content"])
        think = (f"<think>\n{reasoning}\n</think>\n\n"
                 if i > last_user and (i == len(messages) - 1 or reasoning) else "")
        pieces += [("<|im_start|>assistant\n", False), (think + answer + "<|im_end|>", True), ("\n", False)]
    return pieces


def llama3_pieces(messages) -> list[tuple[str, bool]]:
    """Llama-3-style: BOS, per turn header + trimmed content + <|eot_id|>; reply and <|eot_id|> are assistant."""
    pieces = [("<|begin_of_text|>", False)]
    for m in messages:
        header = f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
        if m["role"] == "assistant":
            pieces += [(header, False), (m["content"].strip() + "<|eot_id|>", True)]
        else:
            pieces.append((header + m["content"].strip() + "<|eot_id|>", False))
    return pieces


def expected_ids_and_mask(tokenizer, pieces):
    ids, mask = [], []
    for text, is_assistant in pieces:
        piece_ids = tokenizer.encode(text)
        ids += piece_ids
        mask += [is_assistant] * len(piece_ids)
    return ids, mask


def assert_token_by_token(tokenizer, got_ids, got_mask, pieces):
    want_ids, want_mask = expected_ids_and_mask(tokenizer, pieces)
    assert list(got_ids) == want_ids, "the rendering differs from the template's documented output"
    wrong = [(i, tokenizer.decode([t], show_special=True), g, w)
             for i, (t, g, w) in enumerate(zip(got_ids, got_mask, want_mask)) if bool(g) != w]
    assert not wrong, f"mask wrong at (position, token, got, want): {wrong[:10]}"
    assert any(want_mask) and not all(want_mask)


@pytest.mark.parametrize("template, pieces", [(QWEN3, qwen3_pieces), (LLAMA3, llama3_pieces)],
                         ids=["qwen3_style", "llama3_style"])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_every_assistant_token_in_and_every_other_out(tokenizer, template, pieces, index):
    messages = CONVERSATIONS[index]
    ids, mask = tokenizer.encode_chat(messages, chat_template=load_chat_template(str(template)))
    assert_token_by_token(tokenizer, ids, mask, pieces(messages))


def test_qwen3_style_rewrites_earlier_turns(tokenizer):
    # The reason prefix renders cannot work: the first reply renders differently once a later turn exists.
    template = QWEN3.read_text()
    render = tokenizer.hf.apply_chat_template
    messages = CONVERSATIONS[3]
    assert not render(messages, tokenize=False, chat_template=template).startswith(
        render(messages[:2], tokenize=False, chat_template=template))


def test_the_tokenizers_own_template_is_the_default():
    hf = tiny_chat_tokenizer()
    hf.chat_template = QWEN3.read_text()
    adapter = HFTokenizerAdapter(hf)
    ids, mask = adapter.encode_chat(CONVERSATIONS[2])
    assert_token_by_token(adapter, ids, mask, qwen3_pieces(CONVERSATIONS[2]))


def test_markers_are_learned_from_the_template(tokenizer):
    def render(template):
        return lambda messages, add_generation_prompt=False: tokenizer.hf.apply_chat_template(
            messages, tokenize=False, chat_template=template, add_generation_prompt=add_generation_prompt)

    assert chat_markers(render(QWEN3.read_text())) == ("<|im_start|>assistant\n", "<|im_end|>")
    assert chat_markers(render(LLAMA3.read_text())) == ("<|start_header_id|>assistant<|end_header_id|>\n\n",
                                                        "<|eot_id|>")
    with pytest.raises(ChatTemplateError, match="end-of-turn"):
        chat_markers(render("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"))


_write_jsonl = write_jsonl


def _as_sharegpt(messages):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


@pytest.mark.parametrize("template, pieces", [(QWEN3, qwen3_pieces), (LLAMA3, llama3_pieces)],
                         ids=["qwen3_style", "llama3_style"])
def test_mixed_single_and_multi_turn_file_skips_nothing(tmp_path, tokenizer, template, pieces):
    records = [{"messages": m} if i % 2 else _as_sharegpt(m) for i, m in enumerate(CONVERSATIONS * 3)]
    file = _write_jsonl(tmp_path / "chat.jsonl", records)
    ds = build_dataset("jsonl", tokenizer=tokenizer, path=str(file), chat_template=str(template),
                       cache_dir=tmp_path / "cache", max_bad_fraction=0.0)
    assert ds.stats["skipped"] == dict.fromkeys(SKIP_REASONS, 0)
    assert len(ds) == ds.stats["kept"] == ds.stats["total_lines"] == len(records)
    for i in range(len(ds)):
        sample = ds[i]
        assert_token_by_token(tokenizer, sample["input_ids"].tolist(), sample["loss_mask"].tolist(),
                              pieces(CONVERSATIONS[i % len(CONVERSATIONS)]))


def test_skipped_lines_are_counted_by_reason(tmp_path, tokenizer):
    good = [{"messages": CONVERSATIONS[0]}] * 6
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}
    bad = [
        "{not json",                                                          # malformed_json
        json.dumps({"messages": [{"role": "user", "content": "q"},            # template_lacks_tools: this
                                 {"role": "assistant", "content": "let me look", "tool_calls": [call]}]}),  # template
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),  # no_assistant_turn
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',            # invalid_utf8 (Latin-1 byte)
        json.dumps({"messages": [{"role": "user", "content": "q " * 40}, {"role": "assistant", "content": "ok!"}]}),
    ]                                                                          # too_long (max_length 64)
    file = _write_jsonl(tmp_path / "mixed.jsonl", good[:3] + bad + good[3:])
    ds = build_dataset("jsonl", tokenizer=tokenizer, path=str(file), chat_template=str(QWEN3), max_length=64,
                       cache_dir=tmp_path / "cache", max_bad_fraction=0.5)
    assert ds.stats["skipped"] == {**dict.fromkeys(SKIP_REASONS, 0), "invalid_utf8": 1, "malformed_json": 1,
                                   "no_assistant_turn": 1, "too_long": 1,
                                   "template_lacks_tools": 1}                 # drops the call: never trained on
    assert ds.stats["skipped_examples"]["invalid_utf8"][0][0] == 7 and len(ds) == 6

    # A template that cannot render the file: template_error, the commonest reason, named with an example line.
    failing = "{% for m in messages %}{{ raise_exception('no ' + m['role'] + ' allowed') }}{% endfor %}"
    with pytest.raises(ValueError) as err:
        build_dataset("jsonl", tokenizer=tokenizer, path=str(file), chat_template=failing, max_length=64,
                      cache_dir=tmp_path / "cache", max_bad_fraction=0.5)
    message = str(err.value)
    # Every line the template sees fails, the tool-calling one too: a template error, not a lack of tool syntax.
    assert "commonest reason template_error (8 lines, e.g. line 1:" in message and "no user allowed" in message
    assert "data.max_bad_fraction=0.5" in message and "malformed_json 1" in message
    assert "template_lacks_tools" not in message


def test_invalid_utf8_is_never_replaced(tmp_path):
    file = _write_jsonl(tmp_path / "latin1.jsonl", [{"messages": CONVERSATIONS[0]},
                                                     '{"messages": [{"role": "user", "content": "x"}, '
                                                     '{"role": "assistant", "content": "caf\xe9 au lait"}]}'.encode(
                                                         "latin-1")])
    with pytest.raises(ValueError, match="commonest reason invalid_utf8 .*line 2: byte"):
        build_dataset("jsonl", path=str(file), cache_dir=tmp_path, max_bad_fraction=0.1)


def test_chat_template_override_forms_and_errors(tmp_path, tokenizer):
    text = LLAMA3.read_text()
    assert load_chat_template(str(LLAMA3)) == text == load_chat_template(text)
    assert load_chat_template(None) is None
    with pytest.raises(FileNotFoundError, match="data.chat_template"):
        load_chat_template(str(tmp_path / "absent.jinja"))
    file = _write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(ValueError, match="data.chat_template needs model=hf"):
        build_dataset("jsonl", tokenizer=ByteTokenizer(), path=str(file), chat_template=text, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="data.chat_template applies to data=jsonl"):
        build_dataset("synthetic", tokenizer=tokenizer, chat_template=text, cache_dir=tmp_path)


def test_unknown_data_keys_are_refused_and_every_config_key_is_valid(tmp_path):
    with pytest.raises(ValueError, match=r"unknown data key\(s\) \['max_lenght'\]; valid keys: .*max_length"):
        build_dataset("synthetic", num_samples=10, max_lenght=64, cache_dir=tmp_path)
    for file in sorted((CONF_DIR / "data").glob("*.yaml")):
        from omegaconf import OmegaConf

        keys = set(OmegaConf.to_container(OmegaConf.load(file)))
        assert keys <= set(DATA_KEYS), (file.name, keys - set(DATA_KEYS))


@pytest.mark.integration
def test_mixed_chat_file_trains_with_nothing_skipped(tmp_path):
    """model=hf (a random tiny Qwen3 saved with the tokenizer above) + data=jsonl + data.chat_template: trains."""
    from hydra import compose, initialize_config_module

    from dflash_lab.train import train

    target = local_qwen3(tmp_path / "target")
    records = [{"messages": m} if i % 2 else _as_sharegpt(m) for i, m in enumerate(CONVERSATIONS * 10)]
    file = _write_jsonl(tmp_path / "chat.jsonl", records)
    overrides = [
        "model=hf", f"model.target_path={target}", "model.device=cpu", "model.block_size=4", "model.draft_layers=1",
        "model.decode_num_prompts=2", "model.decode_max_new_tokens=4", "model.decode_max_prompt_tokens=32",
        f"model.cache_dir={tmp_path / 'cache'}", "data=jsonl", f"data.path={file}", f"data.chat_template={QWEN3}",
        "data.max_bad_fraction=0.0", f"data.cache_dir={tmp_path / 'cache'}", "sampler.max_tokens=512",
        "sampler.boundaries=[0,64,512]", "probes.every=0", "trainer.max_steps=2", "trainer.num_threads=1",
        "trainer.progress=false", f"run_dir={tmp_path / 'run'}",
    ]
    with initialize_config_module("dflash_lab.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    summary = train(cfg)
    assert summary["status"] == "finished" and summary["steps"] == 2
    assert summary["data_skipped"] == dict.fromkeys(SKIP_REASONS, 0)
    from transformers import AutoTokenizer

    dataset = build_dataset("jsonl", tokenizer=HFTokenizerAdapter(AutoTokenizer.from_pretrained(str(target))),
                            path=str(file), chat_template=str(QWEN3), max_bad_fraction=0.0,
                            cache_dir=tmp_path / "cache")
    assert dataset.stats["skipped"] == dict.fromkeys(SKIP_REASONS, 0) and len(dataset) == len(records)


# --- tool calling: the OpenAI/HF schema rendered as the target's template renders it ------------------------------

@pytest.fixture(scope="module")
def tool_tokenizer():
    return HFTokenizerAdapter(tiny_tool_tokenizer())


def _encode_record(tokenizer, record, template):
    return tokenizer.encode_chat(parse_conversation(record), chat_template=template, tools=parse_tools(record))


@pytest.mark.parametrize("index", range(len(TOOL_RECORDS)))
def test_tool_calls_are_trained_and_tool_responses_are_not(tool_tokenizer, index):
    record, calls, responses = TOOL_RECORDS[index]
    template = QWEN3_TOOLS.read_text()
    ids, mask = _encode_record(tool_tokenizer, record, template)
    # The sequence is the template's own rendering (HF form: dict arguments, no content key on a bare call turn).
    hf_messages = [{k: v for k, v in m.items() if v is not None} for m in record["messages"]]
    for m in hf_messages:
        for call in m.get("tool_calls", []):
            if isinstance(call["function"]["arguments"], str):
                call["function"] = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
    rendered = tool_tokenizer.hf.apply_chat_template(hf_messages, tools=record["tools"], tokenize=False,
                                                     chat_template=template)
    assert ids == tool_tokenizer.encode(rendered)
    trained = tool_tokenizer.decode([t for t, m in zip(ids, mask) if m], show_special=True)
    prompt = tool_tokenizer.decode([t for t, m in zip(ids, mask) if not m], show_special=True)
    for call_text in calls:                        # byte-exact: the call as the template writes it, trained on
        assert call_text in rendered and call_text in trained
    for response in responses:                     # tool results are context, never targets
        wrapped = f"<tool_response>\n{response}\n</tool_response>"
        assert wrapped in prompt and wrapped not in trained and "tool_response" not in trained
    for turn in record["messages"]:
        if turn["role"] in ("system", "user"):
            assert turn["content"] in prompt and turn["content"] not in trained
        if turn["role"] == "assistant" and turn["content"]:
            assert turn["content"] in trained
    for tool in record["tools"]:                   # the tools list (as tojson writes it) is prompt
        assert json.dumps(tool) in prompt
    assert "<tools>" not in trained


def test_string_and_dict_arguments_render_the_same(tool_tokenizer):
    template = QWEN3_TOOLS.read_text()
    record = TOOL_RECORDS[0][0]
    as_dict = json.loads(json.dumps(record))
    as_dict["messages"][2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert _encode_record(tool_tokenizer, record, template) == _encode_record(tool_tokenizer, as_dict, template)


def test_tool_calling_jsonl_loads_with_nothing_skipped(tmp_path, tool_tokenizer):
    records = [record for record, _, _ in TOOL_RECORDS] * 4 + [{"messages": m} for m in CONVERSATIONS]
    file = _write_jsonl(tmp_path / "tools.jsonl", records)
    ds = build_dataset("jsonl", tokenizer=tool_tokenizer, path=str(file), chat_template=str(QWEN3_TOOLS),
                       cache_dir=tmp_path / "cache", max_bad_fraction=0.0)
    assert ds.stats["skipped"] == dict.fromkeys(SKIP_REASONS, 0)
    assert len(ds) == ds.stats["kept"] == len(records)
    for i in range(len(TOOL_RECORDS) * 4):
        sample = ds[i]
        trained = tool_tokenizer.decode(sample["input_ids"][sample["loss_mask"]].tolist(), show_special=True)
        for call_text in TOOL_RECORDS[i % len(TOOL_RECORDS)][1]:
            assert call_text in trained


@pytest.mark.parametrize("template", [QWEN3, LLAMA3, "raises"], ids=["qwen3_style", "llama3_style", "raises"])
def test_a_template_without_tool_support_is_a_named_skip(tmp_path, tool_tokenizer, template):
    """qwen3_style renders tool turns but drops calls and the tools list; llama3_style likewise; the third raises
    on a tool role: each tool-calling line is counted as template_lacks_tools, the plain chats are kept."""
    if template == "raises":
        template = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                    "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
                    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    records = [record for record, _, _ in TOOL_RECORDS] + [{"messages": m} for m in CONVERSATIONS]
    file = _write_jsonl(tmp_path / "tools.jsonl", records)
    ds = build_dataset("jsonl", tokenizer=tool_tokenizer, path=str(file), chat_template=str(template),
                       cache_dir=tmp_path / "cache", max_bad_fraction=0.5)
    assert ds.stats["skipped"] == {**dict.fromkeys(SKIP_REASONS, 0), "template_lacks_tools": len(TOOL_RECORDS)}
    assert len(ds) == len(CONVERSATIONS)
    assert "data.chat_template" in ds.stats["skipped_examples"]["template_lacks_tools"][0][1]


def test_a_rendering_that_drops_a_tool_response_or_the_tools_list_is_refused(tool_tokenizer):
    """Templates that raise on nothing but leave out a part: the tool turn's result, or the tools list."""
    record = TOOL_RECORDS[0][0]
    drops_results = QWEN3_TOOLS.read_text().replace("{{- content }}\n        {{- '\\n</tool_response>' }}",
                                                    "{{- '\\n</tool_response>' }}")
    drops_tools = QWEN3_TOOLS.read_text().replace("{{- tool | tojson }}", "{{- 'a tool' }}")
    assert drops_results != QWEN3_TOOLS.read_text() != drops_tools
    with pytest.raises(TemplateLacksTools, match="drops a tool response"):
        _encode_record(tool_tokenizer, record, drops_results)
    with pytest.raises(TemplateLacksTools, match="does not render the tools list.*get_weather"):
        _encode_record(tool_tokenizer, record, drops_tools)


def test_bad_tool_call_arguments_and_shapes_are_named(tmp_path, tool_tokenizer):
    def line(call=None, tools=None):
        record = {"messages": [{"role": "user", "content": "q"},
                               {"role": "assistant", "content": None, "tool_calls": [call]},
                               {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]}
        return {**record, "tools": tools} if tools is not None else record

    records = [
        line(openai_tool_call("x", "get_weather", "city=Paris")),          # bad_tool_arguments: a string, not JSON
        line(openai_tool_call("x", "get_weather", "[1, 2]")),              # bad_tool_arguments: JSON, not an object
        line({"type": "function", "function": {"arguments": "{}"}}),   # malformed_json: no function name
        line(openai_tool_call("x", "get_weather", "{}"), tools=["get_weather"]),  # malformed_json: tools not schemas
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]},  # null, no calls
    ] + [record for record, _, _ in TOOL_RECORDS] * 3
    file = _write_jsonl(tmp_path / "bad_tools.jsonl", records)
    ds = build_dataset("jsonl", tokenizer=tool_tokenizer, path=str(file), chat_template=str(QWEN3_TOOLS),
                       cache_dir=tmp_path / "cache", max_bad_fraction=0.5)
    assert ds.stats["skipped"] == {**dict.fromkeys(SKIP_REASONS, 0), "bad_tool_arguments": 2, "malformed_json": 3}
    messages = dict(ds.stats["skipped_examples"]["bad_tool_arguments"])
    assert "not JSON" in messages[1] and "must be a JSON object" in messages[2]
