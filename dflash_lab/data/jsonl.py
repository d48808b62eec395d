"""Chat data from JSONL: ShareGPT (``conversations`` of {from, value}) or ``messages`` (of {role, content}), with
OpenAI/HF tool calling.

Schema of one line (one JSON object)::

    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}],   # optional
     "messages": [
        {"role": "system", "content": "..."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null,                       # null or a string beside the calls
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18C, sunny"},
        {"role": "assistant", "content": "18C and sunny."}]}

A call's ``arguments`` may be OpenAI's JSON string or HF's dict; strings are parsed into dicts, as HF's chat
templating docs ask (Qwen3's template writes ``arguments | tojson``). A flat ``{"name", "arguments"}`` call and the
legacy ``function_call`` key (one call) are accepted too; ``tools`` may also be a JSON string of that list.

Algorithm: read the file line by line as bytes; decode each non-empty line as UTF-8, parse it as one
conversation, normalise roles and tool calls, render it with the target's chat template
(``tokenizer.encode_chat``: our template for the byte tokenizer, the HF tokenizer's template or
``data.chat_template`` for ``model=hf``, with ``tools=``), loss only on assistant turns (their tool calls included;
never system, user or tool turns), cap at ``max_length`` tokens. A line that cannot be used is skipped and counted
under one reason (:data:`SKIP_REASONS`):

    invalid_utf8          the line is not valid UTF-8 (never silently replaced)
    malformed_json        not JSON, or not a conversation: an object with a non-empty ``conversations`` or
                          ``messages`` list of turns with a known string role and string content (null allowed on
                          an assistant turn with tool calls), tool calls with a function name, a list of tools
    no_assistant_turn     no assistant turn, or assistant turns with fewer than two tokens to learn
    template_error        the chat template fails on the conversation or its assistant turns cannot be located
    too_long              the ``max_length`` cut leaves fewer than two assistant tokens (the prompt is too long)
    bad_tool_arguments    a tool call's ``arguments`` is a string that is not JSON, or JSON that is not an object
    template_lacks_tools  the conversation uses tools and the template cannot render them: it raises, or drops a
                          call, a tool response or the tools list (the byte tokenizer of ``model=tiny`` always);
                          never trained on a text with its calls dropped

More than ``max_bad_fraction`` of skipped lines is an error naming the file, the commonest reason with an
example line and its message, and the config key.

Cost: one pass over the file, O(characters), plus the tokenizer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from dflash_lab.data.tokenizer import TemplateLacksTools, normalise_role, tool_name

SKIP_REASONS = ("invalid_utf8", "malformed_json", "no_assistant_turn", "template_error", "too_long",
                "bad_tool_arguments", "template_lacks_tools")
_EXAMPLES_PER_REASON = 5


class UnusableLine(ValueError):
    """A line that cannot be used, with its :data:`SKIP_REASONS` reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_tool_call(call) -> dict:
    """One tool call in HF's form ``{"type": "function", "function": {"name", "arguments": dict}}`` (``id`` kept).

    Raises:
        UnusableLine: ``malformed_json`` for a call without a function name, ``bad_tool_arguments`` for arguments
            that are neither a JSON object nor a string holding one.

    Example:
        >>> parse_tool_call({"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}})
        {'type': 'function', 'function': {'name': 'f', 'arguments': {'x': 1}}, 'id': 'c1'}
    """
    if not isinstance(call, dict):
        raise UnusableLine("malformed_json", "a tool call is not an object")
    function = call.get("function", call)   # OpenAI and HF wrap the call in "function"; a flat call is accepted
    name = tool_name(function)
    if name is None:
        raise UnusableLine("malformed_json", "a tool call needs function.name (a non-empty string)")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError) as exc:
            raise UnusableLine("bad_tool_arguments", f"tool call {name!r}: arguments is a string but not JSON "
                                                     f"({exc}): write the arguments as a JSON object") from exc
    if not isinstance(arguments, dict):
        raise UnusableLine("bad_tool_arguments", f"tool call {name!r}: arguments must be a JSON object, got "
                                                 f"{type(arguments).__name__}")
    parsed = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        parsed["id"] = call["id"]
    return parsed


def parse_tools(record: dict) -> list[dict] | None:
    """The line's ``tools`` list (function schemas, passed to the template as given), or None without one.

    Raises:
        UnusableLine: ``malformed_json`` for tools that are not a list of named function schemas.

    Example:
        >>> parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
        [{'type': 'function', 'function': {'name': 'f', 'parameters': {}}}]
    """
    tools = record.get("tools")
    if isinstance(tools, str):   # some exports store the list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise UnusableLine("malformed_json", f"'tools' is a string but not a JSON list: {exc}") from exc
    if not tools:
        return None
    if not isinstance(tools, list) or not all(tool_name(tool) for tool in tools):
        raise UnusableLine("malformed_json", "'tools' must be a list of function schemas, each with a name "
                                             "({\"type\": \"function\", \"function\": {\"name\": ...}})")
    return tools


def parse_conversation(record) -> list[dict]:
    """Messages of one JSON record (ShareGPT or messages format): ``{role, content}``, plus ``tool_calls`` (HF
    form, :func:`parse_tool_call`) on assistant turns that call tools (content None or a string) and
    ``tool_call_id`` / ``name`` on tool turns.

    Raises:
        UnusableLine: ``malformed_json`` for a record that is not a conversation, ``no_assistant_turn`` for one
            without an assistant turn, ``bad_tool_arguments`` for unparseable call arguments.

    Example:
        >>> parse_conversation({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
        [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]
    """
    if not isinstance(record, dict):
        raise UnusableLine("malformed_json", "line is not a JSON object")
    if "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    else:
        raise UnusableLine("malformed_json", "neither 'conversations' nor 'messages'")
    if not isinstance(turns, list) or not turns:
        raise UnusableLine("malformed_json", "empty or non-list conversation")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise UnusableLine("malformed_json", "turn is not an object")
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str):
            raise UnusableLine("malformed_json", f"turn needs a string {role_key!r}")
        try:
            role = normalise_role(role)
        except ValueError as exc:
            raise UnusableLine("malformed_json", str(exc)) from exc
        calls = turn.get("tool_calls") or ([turn["function_call"]] if turn.get("function_call") else [])
        if calls and role != "assistant":
            raise UnusableLine("malformed_json", f"tool_calls on a {role} turn: only assistant turns call tools")
        if not isinstance(calls, list):
            raise UnusableLine("malformed_json", "tool_calls must be a list of calls")
        if not isinstance(content, str) and not (content is None and calls):
            raise UnusableLine("malformed_json", f"turn needs string {role_key!r} and {content_key!r} (null only on "
                                                 "an assistant turn with tool_calls)")
        message = {"role": role, "content": content}
        if calls:
            message["tool_calls"] = [parse_tool_call(call) for call in calls]
        if role == "tool":
            message.update({key: turn[key] for key in ("tool_call_id", "name") if turn.get(key) is not None})
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise UnusableLine("no_assistant_turn", "no assistant turn")
    return messages


class JsonlReport:
    """Counts of one JSONL read: non-empty lines, kept samples, truncated samples, skipped lines per reason."""

    def __init__(self) -> None:
        self.total_lines = 0
        self.kept = 0
        self.truncated = 0
        self.skipped: Counter[str] = Counter()
        self.examples: dict[str, list[tuple[int, str]]] = {}

    def skip(self, line_number: int, reason: str, message: str) -> None:
        """Count line ``line_number`` (1-based) as skipped for ``reason``; keep the first few as examples."""
        self.skipped[reason] += 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < _EXAMPLES_PER_REASON:
            examples.append((line_number, message))

    def as_dict(self) -> dict:
        """Plain summary stored in the cache metadata (``skipped`` has every reason, zeros included)."""
        return {"total_lines": self.total_lines, "kept": self.kept, "truncated": self.truncated,
                "skipped": {reason: self.skipped[reason] for reason in SKIP_REASONS},
                "skipped_examples": {reason: [list(e) for e in examples] for reason, examples in self.examples.items()}}


def _supervised_pairs(mask: list[bool]) -> int:
    """Adjacent supervised token pairs: what a draft block (anchor + next token) can be trained on."""
    return sum(1 for a, b in zip(mask[:-1], mask[1:]) if a and b)


def cut_before_encoding(tokenizer, messages: list[dict], tools, max_length: int) -> tuple[list[dict], bool]:
    """The conversation cut to a few tokens past ``max_length`` before it is encoded, where the template allows:
    the byte tokenizer's own format (``model=tiny``) costs exactly one token per UTF-8 byte of a turn's content
    plus two per turn and one BOS, so the turn that crosses the budget is cut and the turns after it are emptied
    (a 50 MB line is no longer encoded whole, as Python ints, to keep 1024 tokens). The encoded prefix, its mask
    and the too_long/truncated outcome are those of the whole conversation: the cut keeps more than
    ``max_length`` tokens, and is made only when some assistant turn has text (else the line is
    ``no_assistant_turn`` either way) and no tools are used (the byte format refuses those whole). A chat
    template of a Hugging Face tokenizer is rendered and tokenized whole (its token count per character is not
    known before). Returns (messages, whether anything was cut).

    Example:
        >>> from dflash_lab.data.tokenizer import ByteTokenizer
        >>> convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 1000}]
        >>> cut, was_cut = cut_before_encoding(ByteTokenizer(), convo, None, 16)
        >>> was_cut, len(cut[1]["content"])
        (True, 18)
    """
    from dflash_lab.data.tokenizer import ByteTokenizer, uses_tools

    if (not isinstance(tokenizer, ByteTokenizer) or uses_tools(messages, tools)
            or not any(normalise_role(m["role"]) == "assistant" and m.get("content") for m in messages)):
        return messages, False
    budget = max_length + 8   # past max_length: a cut UTF-8 character may lose up to 3 bytes
    used, kept, cut = 1, [], False   # BOS
    for message in messages:
        room = max(budget - used - 1, 0)   # content bytes that still fit after the turn's role token
        content = message["content"]
        if len(content) > room:   # characters >= 1 byte each: cut (the encoded prefix is at most ``room`` bytes)
            content = content[:room].encode("utf-8")[:room].decode("utf-8", errors="ignore")
            message, cut = {**message, "content": content}, True   # later turns stay (empty): the last
        kept.append(message)                                          # assistant turn keeps its EOS
        used += 2 + len(content.encode("utf-8"))
    return (kept, True) if cut else (messages, False)


def encode_line(tokenizer, raw: bytes, *, max_length: int, chat_template: str | None = None
                ) -> tuple[list[int], list[bool], bool]:
    """(ids, loss_mask, truncated) of one JSONL line.

    Raises:
        UnusableLine: the line cannot be used (reason in :data:`SKIP_REASONS`).
    """
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnusableLine("invalid_utf8", f"byte {exc.start} is not UTF-8 ({exc.reason})") from exc
    line = line.removeprefix("\ufeff")   # a UTF-8 byte-order mark (editors write one at the start of a file)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UnusableLine("malformed_json", f"not JSON: {exc}") from exc
    except RecursionError as exc:   # json's decoder recurses per nesting level: one absurd line, not the run
        raise UnusableLine("malformed_json", "not JSON: nested deeper than the JSON decoder's recursion limit") from exc
    messages = parse_conversation(record)
    tools = parse_tools(record)
    messages, cut = cut_before_encoding(tokenizer, messages, tools, max_length)
    options = {"tools": tools} if tools else {}
    if chat_template is not None:
        options["chat_template"] = chat_template
    try:
        ids, mask = tokenizer.encode_chat(messages, **options)
    except TemplateLacksTools as exc:
        raise UnusableLine("template_lacks_tools", str(exc)) from exc
    except ValueError as exc:  # ChatTemplateError and whatever else the template raises as a value problem
        raise UnusableLine("template_error", str(exc)) from exc
    if not cut and _supervised_pairs(mask) == 0:   # a cut conversation has assistant text (cut_before_encoding)
        raise UnusableLine("no_assistant_turn", "the assistant turns hold fewer than two tokens")
    if len(ids) <= max_length:
        return ids, mask, False
    ids, mask = ids[:max_length], mask[:max_length]
    if _supervised_pairs(mask) == 0:
        raise UnusableLine("too_long", f"no assistant tokens in the first data.max_length={max_length} tokens")
    return ids, mask, True


def iter_jsonl(tokenizer, *, path: str, max_length: int, max_bad_fraction: float, report: JsonlReport,
               chat_template: str | None = None) -> Iterator[tuple[list[int], list[bool]]]:
    """Yield (ids, loss_mask) per usable conversation; fill ``report``; raise when too many lines are bad.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: skipped lines exceed ``max_bad_fraction`` of the non-empty lines (checked after the pass).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.path={path!r} does not exist: point data.path at a ShareGPT/messages JSONL file")
    with open(file, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            report.total_lines += 1
            try:
                ids, mask, truncated = encode_line(tokenizer, raw, max_length=max_length, chat_template=chat_template)
            except UnusableLine as exc:
                report.skip(line_number, exc.reason, str(exc))
                continue
            report.kept += 1
            report.truncated += truncated
            yield ids, mask
    if report.total_lines == 0:
        raise ValueError(f"{file}: no conversation lines: data.path must point at a non-empty JSONL file")
    bad = sum(report.skipped.values())
    if bad > max_bad_fraction * report.total_lines:
        reason, count = report.skipped.most_common(1)[0]
        line_number, message = report.examples[reason][0]
        others = ", ".join(f"{r} {n}" for r, n in report.skipped.most_common()[1:])
        raise ValueError(
            f"{file}: {bad} of {report.total_lines} lines cannot be used, above data.max_bad_fraction="
            f"{max_bad_fraction}; commonest reason {reason} ({count} lines, e.g. line {line_number}: {message})"
            + (f"; also {others}" if others else "")
            + ": fix the file (or set data.chat_template for template errors and tool-calling data) or raise "
              "data.max_bad_fraction"
        )
