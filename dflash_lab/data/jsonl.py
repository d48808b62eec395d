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
legacy ``function_call`` key (one call) are accepted too; ``tools`` may also be a JSON string of that list. A
``content`` may be OpenAI's list of parts (text parts joined by a newline, :func:`turn_content`), a tool turn's
content any JSON value (JSON-encoded); an assistant turn's ``reasoning_content`` goes to the template (trained with
the turn where the template writes it; ``tokenizer`` module docstring). A tool turn must answer a call
(:func:`check_tool_results`).

Algorithm: read the file line by line as bytes; decode each non-empty line as UTF-8, parse it as one
conversation, normalise roles and tool calls, render it with the target's chat template
(``tokenizer.encode_chat``: our template for the byte tokenizer, the HF tokenizer's template or
``data.chat_template`` for ``model=hf``, with ``tools=``), loss only on assistant turns (their tool calls included;
never system, user or tool turns), cap at ``max_length`` tokens. A line that cannot be used is skipped and counted
under one reason (:data:`SKIP_REASONS`):

    invalid_utf8          the line is not valid UTF-8 (never silently replaced)
    lone_surrogate        a string holds a lone surrogate escape (``"\\ud800"``): valid JSON, but no UTF-8 text
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
    non_text_content      a content part that is not text (image, audio, file)
    tool_result_without_call  a tool turn that follows no assistant turn with tool calls
    tool_call_id_unmatched    a tool turn's ``tool_call_id`` is none of the ids of the calls it answers
    template_lacks_reasoning  the line has ``reasoning_content`` and the template renders none

More than ``max_bad_fraction`` of skipped lines is an error naming the file, the commonest reason with an
example line and its message, and the fix (with ``too_long`` lines: the ``data.max_length`` that keeps 99% of the
rendered lines whole). Every skipped line (number, reason, message) is kept in the report
(``JsonlReport.skipped_lines``): the cache entry's ``skipped_lines.jsonl``, the run's ``data_skipped.jsonl``.

Parallel, in file order: the file is cut into chunks of whole lines of about ``CHUNK_BYTES`` (:func:`line_chunks`,
the same cut for any number of processes); each chunk is encoded on its own (:func:`encode_chunk`: its samples
as arrays and its own report, line numbers counted from the chunk's start) in ``data.num_proc`` processes
(``data.parallel.ordered_map``), and :func:`encode_jsonl` takes the chunks back in file order, adds each chunk's
report to the file's (line numbers shifted by the lines before it) and yields its arrays to the store writer. So
the samples, their order, the counts, the examples and the skipped lines are those of one pass in one process,
for any ``num_proc``; a progress line at least every 10 s (``data.progress``) counts the conversations done.

Cost: one pass over the file, O(characters), plus the tokenizer, spread over ``num_proc`` processes; memory: a
chunk's samples per process (about 5 bytes a token; a worker leaves them in a spill file for the builder, at most
``2 x num_proc`` chunks waiting), plus 16 bytes a line for the whole file (its length and rendered length).
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_lab.data.parallel import ordered_map
from dflash_lab.data.progress import ItemProgress
from dflash_lab.data.tokenizer import (
    TemplateLacksReasoning,
    TemplateLacksTools,
    normalise_role,
    tool_name,
)

SKIP_REASONS = ("invalid_utf8", "malformed_json", "no_assistant_turn", "template_error", "too_long",
                "bad_tool_arguments", "template_lacks_tools", "non_text_content", "tool_result_without_call",
                "tool_call_id_unmatched", "template_lacks_reasoning", "lone_surrogate")
TEXT_PART_SEPARATOR = "\n"   # between the text parts of one turn's content, as vLLM joins them when serving
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
    turns, role_key, content_key = conversation_turns(record)
    messages = [parse_turn(turn, role_key, content_key) for turn in turns]
    if not any(m["role"] == "assistant" for m in messages):
        raise UnusableLine("no_assistant_turn", "no assistant turn")
    check_tool_results(messages)
    return messages


def conversation_turns(record) -> tuple[list, str, str]:
    """The record's turns and the keys of each turn's role and content: ShareGPT (``conversations``, ``from`` and
    ``value``) or the messages format (``messages``, ``role`` and ``content``).

    Raises:
        UnusableLine: ``malformed_json`` for a record that is not an object holding a non-empty list of turns.

    Example:
        >>> conversation_turns({"messages": [{"role": "user", "content": "hi"}]})
        ([{'role': 'user', 'content': 'hi'}], 'role', 'content')
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
    return turns, role_key, content_key


def parse_turn(turn, role_key: str, content_key: str) -> dict:
    """One turn as a chat template reads it: ``{role, content}``, its ``tool_calls`` (an assistant turn; HF form),
    its ``reasoning_content`` (:func:`turn_reasoning`), a tool turn's ``tool_call_id`` and ``name``.

    Raises:
        UnusableLine: ``malformed_json`` for a turn whose role, content or calls cannot be read,
            ``bad_tool_arguments`` for unparseable call arguments, ``non_text_content`` for non-text parts.

    Example:
        >>> parse_turn({"from": "gpt", "value": "yo"}, "from", "value")
        {'role': 'assistant', 'content': 'yo'}
    """
    if not isinstance(turn, dict):
        raise UnusableLine("malformed_json", "turn is not an object")
    role = turn_role(turn, role_key)
    calls = turn_calls(turn, role)
    content = turn_content(turn.get(content_key), role, content_key)
    if not isinstance(content, str) and not (content is None and calls):
        raise UnusableLine("malformed_json", f"turn needs string {role_key!r} and {content_key!r} (null only on "
                                             "an assistant turn with tool_calls)")
    message = {"role": role, "content": content}
    if calls:
        message["tool_calls"] = [parse_tool_call(call) for call in calls]
    reasoning = turn_reasoning(turn, role)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if role == "tool":
        message.update({key: turn[key] for key in ("tool_call_id", "name") if turn.get(key) is not None})
    return message


def turn_role(turn: dict, role_key: str) -> str:
    """A turn's role, normalised (``human`` -> ``user``, ``gpt`` -> ``assistant``, ...: :func:`normalise_role`).

    Raises:
        UnusableLine: ``malformed_json`` for a role that is not a string or not a known role.
    """
    role = turn.get(role_key)
    if not isinstance(role, str):
        raise UnusableLine("malformed_json", f"turn needs a string {role_key!r}")
    try:
        return normalise_role(role)
    except ValueError as exc:
        raise UnusableLine("malformed_json", str(exc)) from exc


def turn_calls(turn: dict, role: str) -> list:
    """A turn's tool calls as given (``tool_calls``, or OpenAI's older single ``function_call``); [] without any.

    Raises:
        UnusableLine: ``malformed_json`` for calls on a turn other than the assistant's, or not a list.
    """
    calls = turn.get("tool_calls") or ([turn["function_call"]] if turn.get("function_call") else [])
    if calls and role != "assistant":
        raise UnusableLine("malformed_json", f"tool_calls on a {role} turn: only assistant turns call tools")
    if not isinstance(calls, list):
        raise UnusableLine("malformed_json", "tool_calls must be a list of calls")
    return calls


def turn_content(content, role: str, content_key: str = "content"):
    """A turn's content as the text a chat template reads: a string as given; OpenAI's list of content parts
    (``[{"type": "text", "text": ...}, ...]``) as its text parts joined by :data:`TEXT_PART_SEPARATOR`; on a tool
    turn, any other JSON value (an object, a list, a number) JSON-encoded, the tool's result as text. None stays
    None (the caller decides where null is allowed); anything else is returned as is for the caller to refuse.

    Raises:
        UnusableLine: ``non_text_content`` for a part that is not text (an image, audio, a file: this trainer
            trains a text model), ``malformed_json`` for a text part without a string ``text``.

    Example:
        >>> turn_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "user")
        'a\\nb'
        >>> turn_content({"temp": 18, "sky": "sunny"}, "tool")
        '{"temp": 18, "sky": "sunny"}'
    """
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, dict) and "type" in p for p in content):
        texts = []
        for part in content:
            if part["type"] != "text":
                raise UnusableLine("non_text_content", f"a {role} turn's {content_key!r} holds a {part['type']!r} "
                                                       "part: only text parts can be trained on a text model; drop "
                                                       "the line or its non-text parts")
            if not isinstance(part.get("text"), str):
                raise UnusableLine("malformed_json", f"a text part of a {role} turn's {content_key!r} needs a "
                                                     "string 'text'")
            texts.append(part["text"])
        return TEXT_PART_SEPARATOR.join(texts)
    if role == "tool":
        return json.dumps(content, ensure_ascii=False)
    return content


def turn_reasoning(turn: dict, role: str) -> str | None:
    """An assistant turn's ``reasoning_content`` (the key Qwen3's chat template reads), or its ``reasoning`` (what
    newer vLLM servers write) when it has no ``reasoning_content``; None when it has none (absent, null or empty).

    Raises:
        UnusableLine: ``malformed_json`` for reasoning that is not a string, both keys with different texts, or
            reasoning on another role's turn.

    Example:
        >>> turn_reasoning({"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4"}, "assistant")
        '2+2 is 4'
        >>> turn_reasoning({"role": "assistant", "content": "4", "reasoning": "2+2 is 4"}, "assistant")
        '2+2 is 4'
    """
    reasoning, alias = turn.get("reasoning_content"), turn.get("reasoning")
    if reasoning in (None, ""):
        reasoning = alias
    elif alias not in (None, "", reasoning):
        raise UnusableLine("malformed_json", "reasoning_content and reasoning differ: keep one of them")
    if reasoning is None or reasoning == "":
        return None
    if not isinstance(reasoning, str):
        raise UnusableLine("malformed_json", f"reasoning_content must be a string, got {type(reasoning).__name__}")
    if role != "assistant":
        raise UnusableLine("malformed_json", f"reasoning_content on a {role} turn: only assistant turns reason")
    return reasoning


def check_tool_results(messages: list[dict]) -> None:
    """Refuse tool results that answer no call: a ``tool`` turn must follow an assistant turn with ``tool_calls``
    (directly, or after that turn's other results: OpenAI's API requires the same), and a ``tool_call_id``, where
    given, must be the id of one of that turn's calls. A result without a call, or for another call, would train
    the assistant's next reply on an exchange that never happened.

    Raises:
        UnusableLine: ``tool_result_without_call`` or ``tool_call_id_unmatched``.

    Example:
        >>> check_tool_results([{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}])
        Traceback (most recent call last):
        ...
        dflash_lab.data.jsonl.UnusableLine: turn 2 is a tool result with no assistant tool call before it...
    """
    calls = None   # the ids of the calls that the current run of tool turns answers (None: no call to answer)
    for number, message in enumerate(messages, start=1):
        if message["role"] == "tool":
            if calls is None:
                raise UnusableLine("tool_result_without_call",
                                   f"turn {number} is a tool result with no assistant tool call before it: put the "
                                   "assistant turn with its tool_calls before the tool turn, or drop the line")
            call_id = message.get("tool_call_id")
            if call_id is not None and call_id not in calls:
                raise UnusableLine("tool_call_id_unmatched",
                                   f"turn {number}: tool_call_id {call_id!r} matches no call of the assistant turn "
                                   f"before it (its call ids: {sorted(map(str, calls)) or 'none'}): fix the ids")
        elif message["role"] == "assistant" and message.get("tool_calls"):
            calls = {call["id"] for call in message["tool_calls"] if "id" in call}
        else:
            calls = None


NOTES = ("reasoning_not_rendered",)   # counted on kept lines: what the chat template left out, by its design
WHOLE_SHARE = 0.99   # the data.max_length suggested in messages keeps this share of the rendered lines whole
_MESSAGE_CHARS = 300   # a skipped line's message in the list of skipped lines is cut to this many characters


class JsonlReport:
    """Counts of one JSONL read: non-empty lines, kept samples, truncated samples, skipped lines per reason (and
    every skipped line: number, reason, message), notes on kept lines, and the uncut token length of every line
    that rendered (kept or ``too_long``: what a ``data.max_length`` suggestion is computed from)."""

    def __init__(self) -> None:
        self.total_lines = 0
        self.kept = 0
        self.truncated = 0
        self.skipped: Counter[str] = Counter()
        self.examples: dict[str, list[tuple[int, str]]] = {}
        self.skipped_lines: list[tuple[int, str, str]] = []
        self.notes: Counter[str] = Counter()
        self.rendered_lengths = array("q")   # 8 bytes a line: a file of 10M lines costs 80 MB here

    def skip(self, line_number: int, reason: str, message: str) -> None:
        """Count line ``line_number`` (1-based) as skipped for ``reason``; keep the first few as examples."""
        self.skipped[reason] += 1
        self.skipped_lines.append((line_number, reason, message[:_MESSAGE_CHARS]))
        examples = self.examples.setdefault(reason, [])
        if len(examples) < _EXAMPLES_PER_REASON:
            examples.append((line_number, message))

    def length_keeping(self, share: float = WHOLE_SHARE) -> int | None:
        """The smallest ``data.max_length`` that keeps ``share`` of the rendered lines whole (None: none rendered).

        Example:
            >>> report = JsonlReport()
            >>> report.rendered_lengths = list(range(1, 201))
            >>> report.length_keeping(0.99)
            198
        """
        if not self.rendered_lengths:
            return None
        ordered = sorted(self.rendered_lengths)
        return int(ordered[max(0, math.ceil(share * len(ordered)) - 1)])

    def length_advice(self, max_length: int) -> str:
        """A clause naming the ``data.max_length`` that keeps :data:`WHOLE_SHARE` of the rendered lines whole and
        the longest rendered line ("" when nothing rendered or everything fits)."""
        keeping = self.length_keeping()
        if keeping is None or max(self.rendered_lengths) <= max_length:
            return ""
        return (f"data.max_length={keeping} keeps {WHOLE_SHARE:.0%} of the rendered lines whole (now {max_length}, "
                f"the longest line {max(self.rendered_lengths)} tokens)")

    def merge(self, other: JsonlReport, line_offset: int) -> None:
        """Add the counts of ``other``, the report of the lines after the first ``line_offset`` lines of the file
        (its line numbers count from there): the examples stay the first few of each reason in file order.

        Example:
            >>> first, second = JsonlReport(), JsonlReport()
            >>> second.skip(2, "malformed_json", "not JSON")
            >>> first.merge(second, line_offset=10)
            >>> first.skipped_lines
            [(12, 'malformed_json', 'not JSON')]
        """
        self.total_lines += other.total_lines
        self.kept += other.kept
        self.truncated += other.truncated
        self.skipped.update(other.skipped)
        for reason, examples in other.examples.items():
            mine = self.examples.setdefault(reason, [])
            mine.extend((line + line_offset, message)
                        for line, message in examples[:max(_EXAMPLES_PER_REASON - len(mine), 0)])
        self.skipped_lines.extend((line + line_offset, reason, message)
                                  for line, reason, message in other.skipped_lines)
        self.notes.update(other.notes)
        self.rendered_lengths.extend(other.rendered_lengths)

    def as_dict(self) -> dict:
        """Plain summary stored in the cache metadata (``skipped`` has every reason, zeros included)."""
        return {"total_lines": self.total_lines, "kept": self.kept, "truncated": self.truncated,
                "skipped": {reason: self.skipped[reason] for reason in SKIP_REASONS},
                "skipped_examples": {reason: [list(e) for e in examples] for reason, examples in self.examples.items()},
                "notes": {note: self.notes[note] for note in NOTES},
                "length_keeping_99pct": self.length_keeping(),
                "longest_line_tokens": max(self.rendered_lengths, default=None)}


class LineFacts:
    """What encoding one line tells besides its tokens: its uncut token length and the notes of its rendering."""

    def __init__(self) -> None:
        self.uncut_length: int | None = None
        self.notes: Counter[str] = Counter()


def _mask_array(mask) -> np.ndarray:
    """A loss mask (a list of bools, as the tokenizers give it) as a bool array, in one C pass where it can."""
    if isinstance(mask, np.ndarray):
        return mask.astype(bool, copy=False)
    try:
        return np.frombuffer(bytes(mask), dtype=np.bool_)   # Python bools are the bytes 0 and 1
    except (TypeError, ValueError):
        return np.asarray(mask, dtype=bool)


def _supervised_pairs(mask) -> int:
    """Adjacent supervised token pairs: what a draft block (anchor + next token) can be trained on.

    Example:
        >>> _supervised_pairs([False, True, True, True, False, True])
        2
    """
    flags = _mask_array(mask)
    return int(np.count_nonzero(flags[:-1] & flags[1:]))


def cut_before_encoding(tokenizer, messages: list[dict], tools, max_length: int) -> tuple[list[dict], int | None]:
    """The conversation cut to a few tokens past ``max_length`` before it is encoded, where the template allows:
    the byte tokenizer's own format (``model=tiny``) costs exactly one token per UTF-8 byte of a turn's content
    plus two per turn and one BOS, so the turn that crosses the budget is cut and the turns after it are emptied
    (a 50 MB line is no longer encoded whole, as Python ints, to keep 1024 tokens). The encoded prefix, its mask
    and the too_long/truncated outcome are those of the whole conversation: the cut keeps more than
    ``max_length`` tokens, and is made only when some assistant turn has text (else the line is
    ``no_assistant_turn`` either way) and no tools are used (the byte format refuses those whole). A chat
    template of a Hugging Face tokenizer is rendered and tokenized whole (its token count per character is not
    known before), and so is a conversation with reasoning (its rendering adds think tags). Returns (messages, the
    whole conversation's token count when it was cut, else None).

    Example:
        >>> from dflash_lab.data.tokenizer import ByteTokenizer
        >>> convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 1000}]
        >>> cut, whole = cut_before_encoding(ByteTokenizer(), convo, None, 16)
        >>> whole, len(cut[1]["content"])
        (1007, 18)
    """
    from dflash_lab.data.tokenizer import ByteTokenizer, uses_tools

    if (not isinstance(tokenizer, ByteTokenizer) or uses_tools(messages, tools)
            or any(m.get("reasoning_content") or m.get("reasoning") for m in messages)
            or not any(normalise_role(m["role"]) == "assistant" and m.get("content") for m in messages)):
        return messages, None
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
    if not cut:
        return messages, None
    return kept, 1 + sum(2 + len((m["content"] or "").encode("utf-8")) for m in messages)


def check_no_lone_surrogate(value) -> None:
    """Refuse a parsed JSON value holding a string with a lone surrogate (JSON's ``"\\ud800"`` escape without its
    pair): no tokenizer can encode it as UTF-8 text.

    Raises:
        UnusableLine: ``lone_surrogate``, naming the code point and where it is.

    Example:
        >>> check_no_lone_surrogate({"messages": [{"content": "ok \\U0001f600"}]})
        >>> check_no_lone_surrogate({"messages": [{"content": "hi \\ud800 there"}]})
        Traceback (most recent call last):
        ...
        dflash_lab.data.jsonl.UnusableLine: a string holds the lone surrogate U+D800 at character 3 ('hi \\ud800 there'): not encodable as UTF-8; write the character it stands for, or drop it
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = exc.start
            else:
                continue
            raise UnusableLine("lone_surrogate", f"a string holds the lone surrogate U+{ord(item[where]):04X} at "
                               f"character {where} ({item[max(where - 20, 0):where + 20]!r}): not encodable as "
                               f"UTF-8; write the character it stands for, or drop it")


def encode_line(tokenizer, raw: bytes, *, max_length: int, chat_template: str | None = None,
                facts: LineFacts | None = None) -> tuple[list[int], list[bool], bool]:
    """(ids, loss_mask, truncated) of one JSONL line; ``facts``, when given, gets its uncut length and notes.

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
    if "\\ud" in line or "\\uD" in line:   # only a \uXXXX escape can put a surrogate into the parsed text
        check_no_lone_surrogate(record)
    messages = parse_conversation(record)
    tools = parse_tools(record)
    messages, whole_length = cut_before_encoding(tokenizer, messages, tools, max_length)
    cut = whole_length is not None
    options = {"tools": tools} if tools else {}
    if chat_template is not None:
        options["chat_template"] = chat_template
    if facts is not None:
        options["notes"] = facts.notes
    try:
        ids, mask = tokenizer.encode_chat(messages, **options)
    except TemplateLacksTools as exc:
        raise UnusableLine("template_lacks_tools", str(exc)) from exc
    except TemplateLacksReasoning as exc:
        raise UnusableLine("template_lacks_reasoning", str(exc)) from exc
    except ValueError as exc:  # ChatTemplateError and whatever else the template raises as a value problem
        raise UnusableLine("template_error", str(exc)) from exc
    if not cut and _supervised_pairs(mask) == 0:   # a cut conversation has assistant text (cut_before_encoding)
        raise UnusableLine("no_assistant_turn", "the assistant turns hold fewer than two tokens")
    if facts is not None:
        facts.uncut_length = whole_length if cut else len(ids)
    if len(ids) <= max_length:
        return ids, mask, False
    ids, mask = ids[:max_length], mask[:max_length]
    if _supervised_pairs(mask) == 0:
        raise UnusableLine("too_long", f"no assistant tokens in the first data.max_length={max_length} tokens")
    return ids, mask, True


def check_data_path(path: str) -> Path:
    """``data.path`` as the one JSONL file data=jsonl reads (``~`` expanded), or the refusal that names what is
    there instead and what is expected.

    Raises:
        FileNotFoundError: nothing is there.
        ValueError: a directory (with the ``*.jsonl`` files it holds, to pick one or concatenate them), or anything
            else that is not a regular file.

    Example:
        >>> import tempfile
        >>> check_data_path(tempfile.gettempdir())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: data.path='...' is a directory: data=jsonl reads one JSONL file, one conversation per line ...
    """
    file = Path(path).expanduser()
    expected = ('one JSONL file, one conversation per line ({"messages": [...]} or ShareGPT\'s '
                '{"conversations": [...]})')
    if file.is_dir():
        inside = sorted(file.glob("*.jsonl"))
        if len(inside) == 1:
            hint = f"; it holds one: data.path={inside[0]}"
        elif inside:
            hint = (f"; it holds {len(inside)} ({', '.join(p.name for p in inside[:3])}"
                    f"{', ...' if len(inside) > 3 else ''}): pick one, or concatenate them (cat {file}/*.jsonl > "
                    f"all.jsonl) and point data.path at the result")
        else:
            hint = "; it holds no *.jsonl file"
        raise ValueError(f"data.path={path!r} is a directory: data=jsonl reads {expected}; point data.path at that "
                         f"file{hint}")
    if not file.exists():
        raise FileNotFoundError(f"data.path={path!r} does not exist: point data.path at a ShareGPT/messages JSONL "
                                f"file")
    if not file.is_file():
        raise ValueError(f"data.path={path!r} is not a regular file: data=jsonl reads {expected}")
    return file


CHUNK_BYTES = 1 << 20   # a unit of work: whole lines from about 1 MiB of the file (a longer line makes a longer one)


def line_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """Byte ranges ``[start, stop)`` of the file, in order and covering it, each ending after a newline (the last
    at the end of the file) and reaching at least ``chunk_bytes`` past its start unless the file ends first.

    Example:
        >>> import tempfile
        >>> file = Path(tempfile.mkdtemp()) / "chat.jsonl"
        >>> _ = file.write_bytes(b"aaaa\\nbb\\ncccccc\\nd")
        >>> line_chunks(file, chunk_bytes=4)
        [(0, 5), (5, 15), (15, 16)]
    """
    size = Path(path).stat().st_size
    bounds, start = [], 0
    with open(path, "rb") as handle:
        while start < size:
            if start + chunk_bytes >= size:
                stop = size
            else:
                handle.seek(start + chunk_bytes - 1)
                handle.readline()   # to the end of the line holding the chunk's last planned byte
                stop = handle.tell()
            bounds.append((start, stop))
            start = stop
    return bounds


@dataclass(frozen=True)
class ChunkSettings:
    """What encoding any chunk of a file needs (sent once to each worker process); ``spill_dir``: where a worker
    leaves a chunk's token arrays for the parent (None: they come back in the result)."""

    tokenizer: object
    path: str
    max_length: int
    chat_template: str | None = None
    spill_dir: str | None = None


@dataclass
class EncodedChunk:
    """One chunk's samples, concatenated (``tokens``, ``loss_mask``; ``lengths`` one per sample), its report (line
    numbers counted from the chunk's first line), the lines it holds (empty ones too) and its size in bytes.

    A worker process spills the two token arrays to files (``spilled``: their path without suffix) and sends only
    the rest: megabytes of arrays through the pool's one result pipe would make the workers queue behind each
    other (measured: two workers as slow as one)."""

    tokens: np.ndarray | None
    loss_mask: np.ndarray | None
    lengths: np.ndarray
    report: JsonlReport
    lines: int
    nbytes: int
    spilled: str | None = None

    def spill(self, prefix: str) -> None:
        """Move the token arrays to ``prefix.tokens`` and ``prefix.mask``."""
        self.tokens.tofile(prefix + ".tokens")
        self.loss_mask.tofile(prefix + ".mask")
        self.tokens = self.loss_mask = None
        self.spilled = prefix

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, loss_mask, lengths), spilled arrays memory-mapped."""
        if self.spilled is None:
            return self.tokens, self.loss_mask, self.lengths
        size = int(self.lengths.sum())
        return (np.memmap(self.spilled + ".tokens", dtype=np.int32, mode="r", shape=(size,)),
                np.memmap(self.spilled + ".mask", dtype=np.bool_, mode="r", shape=(size,)), self.lengths)

    def discard(self) -> None:
        """Remove the spilled files."""
        if self.spilled is not None:
            for suffix in (".tokens", ".mask"):
                Path(self.spilled + suffix).unlink(missing_ok=True)


def encode_chunk(settings: ChunkSettings, bounds: tuple[int, int]) -> EncodedChunk:
    """Encode the lines of bytes ``bounds`` of the file (a range of :func:`line_chunks`), as one pass in one
    process reads them: a line is split at ``\\n`` only and keeps it."""
    start, stop = bounds
    with open(settings.path, "rb") as handle:
        handle.seek(start)
        data = handle.read(stop - start)
    pieces = data.split(b"\n")
    last = pieces.pop()   # after the last newline: b"" or the file's unterminated last line
    raws = [piece + b"\n" for piece in pieces] + ([last] if last else [])
    report = JsonlReport()
    tokens, masks, lengths = [], [], []
    for line_number, raw in enumerate(raws, start=1):
        if not raw.strip():
            continue
        report.total_lines += 1
        facts = LineFacts()
        try:
            ids, mask, truncated = encode_line(settings.tokenizer, raw, max_length=settings.max_length,
                                               chat_template=settings.chat_template, facts=facts)
        except UnusableLine as exc:
            report.skip(line_number, exc.reason, str(exc))
            continue
        finally:
            if facts.uncut_length is not None:   # rendered: kept, or too_long
                report.rendered_lengths.append(facts.uncut_length)
        report.notes.update(facts.notes)
        report.kept += 1
        report.truncated += truncated
        tokens.append(np.asarray(ids, dtype=np.int32))
        masks.append(_mask_array(mask))
        lengths.append(len(ids))
    chunk = EncodedChunk(tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
                         loss_mask=np.concatenate(masks) if masks else np.zeros(0, bool),
                         lengths=np.asarray(lengths, dtype=np.int64), report=report, lines=len(raws),
                         nbytes=stop - start)
    if settings.spill_dir is not None and lengths:
        chunk.spill(str(Path(settings.spill_dir) / f"chunk-{start}"))
    return chunk


def encode_jsonl(tokenizer, *, path: str, max_length: int, max_bad_fraction: float, report: JsonlReport,
                 chat_template: str | None = None, num_proc: int = 1, progress: ItemProgress | None = None,
                 spill_dir: Path | None = None,
                 chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield the usable conversations as chunks ``(tokens, loss_mask, lengths)`` in file order, encoded in
    ``num_proc`` processes (module docstring); fill ``report``; raise when too many lines are bad.

    Args:
        progress: counts the conversations done (a line at least every ``progress.every_s`` seconds).
        spill_dir: with ``num_proc > 1``, where the workers leave each chunk's arrays (files removed once the chunk
            was yielded; default: a temporary directory).
        chunk_bytes: the size of a unit of work (:func:`line_chunks`); the result does not depend on it.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a directory or not a regular file (:func:`check_data_path`); skipped lines exceed
            ``max_bad_fraction`` of the non-empty lines (checked after the pass).
    """
    file = check_data_path(path)
    with contextlib.ExitStack() as stack:
        if num_proc > 1 and spill_dir is None:
            spill_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dflash-chunks-")))
        settings = ChunkSettings(tokenizer, str(file), int(max_length), chat_template,
                                 str(spill_dir) if num_proc > 1 else None)
        chunks = ordered_map(encode_chunk, settings, line_chunks(file, chunk_bytes), num_proc=num_proc,
                             on_wait=progress.tick if progress else None,
                             wait_s=progress.due_in if progress else (lambda: 1.0))
        lines_before = 0
        for chunk in chunks:
            report.merge(chunk.report, line_offset=lines_before)
            lines_before += chunk.lines
            if progress is not None:
                progress.advance(chunk.report.total_lines, chunk.nbytes)
            try:
                if chunk.lengths.size:
                    yield chunk.arrays()
            finally:
                chunk.discard()
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
            + ": " + bad_lines_fix(report, max_length)
        )


def bad_lines_fix(report: JsonlReport, max_length: int) -> str:
    """The fix named when too many lines are skipped: raise ``data.max_length`` (to the length that keeps
    :data:`WHOLE_SHARE` of the lines whole) first when ``too_long`` lines are among them; fix the file (or set
    data.chat_template for template errors and tool-calling data); or raise data.max_bad_fraction."""
    fix = ("fix the file (or set data.chat_template for template errors and tool-calling data) or raise "
           "data.max_bad_fraction")
    if not report.skipped["too_long"]:
        return fix
    advice = report.length_advice(max_length)
    return "raise data.max_length for the too_long lines" + (f": {advice}" if advice else "") + "; or " + fix
