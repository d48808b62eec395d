"""Helpers shared by the tests (import as ``from helpers import ...``: tests/ is on sys.path).

Chat data: the template fixtures (tests/fixtures/chat_templates/), a tiny fast byte-level tokenizer whose chat
markers, <think> tags and Qwen3's tool tags are single tokens (nothing is downloaded), a local random Qwen3 saved
with it (a ``model=hf`` target), and a JSONL writer.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3, LLAMA3 = TEMPLATES / "qwen3_style.jinja", TEMPLATES / "llama3_style.jinja"
QWEN3_TOOLS = TEMPLATES / "qwen3_tools.jinja"   # Qwen3's own shape: tools, tool calls, reasoning_content
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def tiny_chat_tokenizer():
    """A fast byte-level tokenizer (no merges) whose chat markers and <think> tags are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(["<pad>", *alphabet])}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<|begin_of_text|>",
                                        eos_token="<|im_end|>", additional_special_tokens=SPECIAL)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


def tiny_tool_tokenizer():
    """tiny_chat_tokenizer plus Qwen3's tool tags as single (added, non-special) tokens."""
    hf = tiny_chat_tokenizer()
    hf.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return hf


def local_qwen3(directory: Path, tokenizer=None) -> Path:
    """A real transformers Qwen3 (random weights, 4 tiny layers) saved with ``tokenizer`` (default
    :func:`tiny_chat_tokenizer`): a local ``model=hf`` target for tests (nothing is downloaded)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tokenizer or tiny_chat_tokenizer()
    tokenizer.save_pretrained(directory)
    config = Qwen3Config(vocab_size=len(tokenizer) + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def write_jsonl(path: Path, records) -> Path:
    """One line per record: dicts as JSON, str and bytes as given (bad lines on purpose)."""
    lines = [r if isinstance(r, (str, bytes)) else json.dumps(r) for r in records]
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return path
