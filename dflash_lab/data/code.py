"""Real text: top-level functions and classes of the running Python's standard library, read at run time.

Algorithm: walk ``sysconfig.get_paths()["stdlib"]`` in sorted order (skipping tests, demos, site-packages),
parse each module with ``ast`` and take the source of every top-level ``def``/``class``. A sample is
``# module: <name>`` + the decorators and signature (prompt, no loss) followed by the body (loss), then EOS;
it is capped at ``max_length`` tokens. Samples with fewer than ``min_length`` tokens or without a body are
skipped. The walk stops after ``num_samples`` samples (None: all of them).

Cost: parsing the whole stdlib takes tens of seconds on a slow core; the dataset layer caches the result.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_files(stdlib_dir: str | None = None) -> list[Path]:
    """Python files of the standard library in a stable (sorted) order."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / name for name in sorted(filenames) if name.endswith(".py"))
    return files


def iter_code(tokenizer, *, num_samples: int | None, max_length: int, min_length: int,
              stdlib_dir: str | None = None, report=None) -> Iterator[tuple[list[int], list[bool]]]:
    """Yield (ids, loss_mask) per top-level function or class of the stdlib.

    Args:
        tokenizer: ByteTokenizer or HFTokenizerAdapter.
        num_samples: stop after this many samples (None: all).
        max_length: cap on tokens per sample (longer sources are truncated, their last token set to EOS).
        min_length: skip shorter samples.
        stdlib_dir: override the standard-library directory (tests).
        report: optional counter with ``kept`` and ``truncated`` attributes (data.jsonl.JsonlReport): the samples
            yielded, and those among them cut to ``max_length`` (summary.json ``data_truncated``).
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    produced = 0
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for path in stdlib_files(str(root)):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are templates or use another encoding: not our concern
        lines = source.splitlines(keepends=True)
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not node.body:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            body_start = node.body[0].lineno - 1
            # Docstrings and bodies on the signature line leave no separate body: skip those tiny defs.
            if body_start <= first or node.end_lineno is None:
                continue
            header = f"# module: {module}\n" + "".join(lines[first:body_start])
            body = "".join(lines[body_start:node.end_lineno])
            prompt_ids = bos + tokenizer.encode(header)
            body_ids = tokenizer.encode(body) + eos
            ids = prompt_ids + body_ids
            mask = [False] * len(prompt_ids) + [True] * len(body_ids)
            cut = len(ids) > max_length
            if cut:
                ids, mask = ids[:max_length], mask[:max_length]
                if eos:
                    ids[-1] = eos[0]
            if len(ids) < min_length or sum(mask) < 2:
                continue
            if report is not None:
                report.kept += 1
                report.truncated += int(cut)
            yield ids, mask
            produced += 1
            if num_samples is not None and produced >= num_samples:
                return
