"""Chat data from JSONL: ShareGPT (``conversations`` of {from, value}) or ``messages`` (of {role, content}).

Algorithm: read the file line by line as bytes; decode each non-empty line as UTF-8, parse it as one
conversation, normalise roles, render it with the target's chat template (``tokenizer.encode_chat``: our template
for the byte tokenizer, the HF tokenizer's template or ``data.chat_template`` for ``model=hf``), loss only on
assistant tokens, cap at ``max_length`` tokens. A line that cannot be used is skipped and counted under one
reason (:data:`SKIP_REASONS`):

    invalid_utf8       the line is not valid UTF-8 (never silently replaced)
    malformed_json     not JSON, or not a conversation: an object with a non-empty ``conversations`` or
                       ``messages`` list of turns with string role/content and a known role
    no_assistant_turn  no assistant turn, or assistant turns with fewer than two tokens to learn
    template_error     the chat template fails on the conversation or its assistant turns cannot be located
    too_long           the ``max_length`` cut leaves fewer than two assistant tokens (the prompt is too long)
    tool_calls         a tool-calling conversation (a ``tools`` list, ``tool_calls`` / ``function_call`` on a
                       turn, a ``tool`` / ``function`` / ``ipython`` role): not rendered by this version, so never
                       trained on a text with its calls dropped

More than ``max_bad_fraction`` of skipped lines is an error naming the file, the commonest reason with an
example line and its message, and the config key.

Cost: one pass over the file, O(characters), plus the tokenizer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from dflash_lab.data.tokenizer import normalise_role

SKIP_REASONS = ("invalid_utf8", "malformed_json", "no_assistant_turn", "template_error", "too_long", "tool_calls")
TOOL_ROLES = ("tool", "function", "ipython")
TOOL_KEYS = ("tool_calls", "function_call")
_EXAMPLES_PER_REASON = 5


class UnusableLine(ValueError):
    """A line that cannot be used, with its :data:`SKIP_REASONS` reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_conversation(record) -> list[dict]:
    """Messages [{role, content}] of one JSON record (ShareGPT or messages format).

    Raises:
        UnusableLine: ``malformed_json`` for a record that is not a conversation, ``no_assistant_turn`` for one
            without an assistant turn, ``tool_calls`` for a tool-calling conversation.

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
    if record.get("tools") or any(isinstance(turn, dict) and (
            any(turn.get(key) for key in TOOL_KEYS) or str(turn.get(role_key, "")).strip().lower() in TOOL_ROLES)
            for turn in turns):
        raise UnusableLine("tool_calls", "a tool-calling conversation (tools, tool_calls or a tool role): not "
                                         "rendered by this version of the jsonl loader")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise UnusableLine("malformed_json", "turn is not an object")
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str) or not isinstance(content, str):
            raise UnusableLine("malformed_json", f"turn needs string {role_key!r} and {content_key!r}")
        try:
            messages.append({"role": normalise_role(role), "content": content})
        except ValueError as exc:
            raise UnusableLine("malformed_json", str(exc)) from exc
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
    try:
        ids, mask = (tokenizer.encode_chat(messages) if chat_template is None
                     else tokenizer.encode_chat(messages, chat_template=chat_template))
    except ValueError as exc:  # ChatTemplateError and whatever else the template raises as a value problem
        raise UnusableLine("template_error", str(exc)) from exc
    if _supervised_pairs(mask) == 0:
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
            + ": fix the file (or set data.chat_template for template errors) or raise data.max_bad_fraction"
        )
