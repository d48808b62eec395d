"""Chat data from JSONL: ShareGPT (``conversations`` of {from, value}) or ``messages`` (of {role, content}).

Algorithm: read the file line by line; parse each non-empty line as one conversation, normalise roles, render it
with the target's chat template (``tokenizer.encode_chat``: our template for the byte tokenizer, the HF
tokenizer's ``apply_chat_template`` for ``model=hf``), loss only on assistant tokens, cap at ``max_length``.
A line that is not valid JSON, has neither key, has a turn without a string role/content, has no assistant
turn, or leaves fewer than two supervised tokens is skipped and counted. More than ``max_bad_fraction`` of
bad lines is an error naming the file, the first bad line numbers and the config key.

Cost: one pass over the file, O(characters), plus the tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from dflash_lab.data.tokenizer import normalise_role


def parse_conversation(record) -> list[dict]:
    """Messages [{role, content}] of one JSON record (ShareGPT or messages format).

    Raises:
        ValueError: the record is not a conversation with at least one assistant turn.
    """
    if not isinstance(record, dict):
        raise ValueError("line is not a JSON object")
    if "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    else:
        raise ValueError("neither 'conversations' nor 'messages'")
    if not isinstance(turns, list) or not turns:
        raise ValueError("empty or non-list conversation")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError("turn is not an object")
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"turn needs string {role_key!r} and {content_key!r}")
        messages.append({"role": normalise_role(role), "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn")
    return messages


class JsonlReport:
    """Counts of one JSONL read: total non-empty lines, kept samples, bad line numbers (1-based)."""

    def __init__(self) -> None:
        self.total_lines = 0
        self.kept = 0
        self.bad_lines: list[int] = []

    def as_dict(self) -> dict:
        """Plain summary stored in the cache metadata."""
        return {"total_lines": self.total_lines, "kept": self.kept, "bad": len(self.bad_lines),
                "bad_line_numbers": self.bad_lines[:100]}


def iter_jsonl(tokenizer, *, path: str, max_length: int, max_bad_fraction: float,
               report: JsonlReport) -> Iterator[tuple[list[int], list[bool]]]:
    """Yield (ids, loss_mask) per usable conversation; fill ``report``; raise when too many lines are bad.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad lines exceed ``max_bad_fraction`` of the non-empty lines (checked after the pass).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.path={path!r} does not exist: point data.path at a ShareGPT/messages JSONL file")
    with open(file, encoding="utf-8", errors="replace") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            report.total_lines += 1
            try:
                messages = parse_conversation(json.loads(line))
                ids, mask = tokenizer.encode_chat(messages)
            except (ValueError, TypeError, KeyError):  # json.JSONDecodeError is a ValueError
                report.bad_lines.append(line_number)
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            if sum(1 for a, b in zip(mask[:-1], mask[1:]) if a and b) == 0:
                report.bad_lines.append(line_number)  # nothing a draft block could be trained on
                continue
            report.kept += 1
            yield ids, mask
    bad = len(report.bad_lines)
    if report.total_lines == 0:
        raise ValueError(f"{file}: no conversation lines: data.path must point at a non-empty JSONL file")
    if bad > max_bad_fraction * report.total_lines:
        shown = ", ".join(map(str, report.bad_lines[:10])) + (" ..." if bad > 10 else "")
        raise ValueError(
            f"{file}: {bad} of {report.total_lines} lines are malformed or unusable (lines {shown}), above "
            f"data.max_bad_fraction={max_bad_fraction}: fix the file or raise data.max_bad_fraction"
        )
