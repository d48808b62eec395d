"""Tokenizers: our own tiny byte-level tokenizer and an adapter that gives a Hugging Face tokenizer the same face.

ByteTokenizer: ids 0..7 are special tokens (PAD=0, BOS, EOS, MASK, then the chat role markers SYSTEM, USER,
ASSISTANT, END_OF_TURN); every UTF-8 byte b is id 8 + b, so vocab_size = 264 and every string round-trips.
Chat template (our own, minimal):  BOS {ROLE text END_OF_TURN}*  with EOS closing the last assistant turn.
Loss is on assistant text and its END_OF_TURN / EOS (the model must learn to stop); role markers are prompt.

HFTokenizerAdapter wraps a transformers tokenizer: encode/decode, its chat template for chat data (assistant
tokens found by rendering growing prefixes of the conversation), and a MASK id for the draft blocks.

Cost: encode is one ``str.encode`` + a list comprehension, O(characters).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

PAD, BOS, EOS, MASK, SYSTEM, USER, ASSISTANT, END_OF_TURN = range(8)
_SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>", "<mask>", "<system>", "<user>", "<assistant>", "<eot>")
_BYTE_OFFSET = 8
_ROLE_IDS = {"system": SYSTEM, "user": USER, "human": USER, "assistant": ASSISTANT, "gpt": ASSISTANT}


def normalise_role(role: str) -> str:
    """Map ShareGPT (human/gpt) and OpenAI (user/assistant) role names onto system | user | assistant.

    Raises:
        ValueError: for a role name neither format uses.
    """
    key = str(role).strip().lower()
    if key in ("system",):
        return "system"
    if key in ("user", "human"):
        return "user"
    if key in ("assistant", "gpt", "model"):
        return "assistant"
    raise ValueError(f"unknown chat role {role!r}: expected system, user/human or assistant/gpt")


class ByteTokenizer:
    """Deterministic byte-level tokenizer with PAD=0, BOS, EOS, MASK and chat role markers.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.decode(tok.encode("hi"))
        'hi'
    """

    pad_token_id = PAD
    bos_token_id = BOS
    eos_token_id = EOS
    mask_token_id = MASK
    end_of_turn_id = END_OF_TURN
    vocab_size = _BYTE_OFFSET + 256
    name = "byte-v1"

    @property
    def fingerprint(self) -> str:
        """Stable identity of the tokenizer (enters the data and model cache keys)."""
        return self.name

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end a generated reply."""
        return [EOS, END_OF_TURN]

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` shifted past the special ids; no BOS/EOS added."""
        return [b + _BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], *, show_special: bool = False) -> str:
        """Inverse of :meth:`encode`; special ids are dropped (or rendered as ``<name>`` with show_special)."""
        out = bytearray()
        pieces: list[str] = []
        for token in ids:
            token = int(token)
            if token >= _BYTE_OFFSET:
                out.append(token - _BYTE_OFFSET)
            elif show_special:
                pieces.append(out.decode("utf-8", errors="replace"))
                out = bytearray()
                pieces.append(_SPECIAL_NAMES[token])
        pieces.append(out.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def encode_chat(self, messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
        """Render a conversation with our template; loss mask True on assistant text + its closing token.

        Args:
            messages: dicts with ``role`` (system/user/assistant or human/gpt) and ``content`` (str).

        Returns:
            (ids, loss_mask) of equal length, starting with BOS.
        """
        ids: list[int] = [BOS]
        mask: list[bool] = [False]
        roles = [normalise_role(m["role"]) for m in messages]
        last_assistant = max((i for i, role in enumerate(roles) if role == "assistant"), default=-1)
        for i, message in enumerate(messages):
            role = normalise_role(message["role"])
            body = self.encode(message["content"])
            is_assistant = role == "assistant"
            ids.append(_ROLE_IDS[role])
            mask.append(False)
            ids.extend(body)
            mask.extend([is_assistant] * len(body))
            ids.append(EOS if i == last_assistant else END_OF_TURN)
            mask.append(is_assistant)
        return ids, mask


class HFTokenizerAdapter:
    """Gives a transformers tokenizer the ByteTokenizer interface used by datasets, model and decoding.

    Args:
        hf_tokenizer: a ``transformers`` tokenizer (fast tokenizers give exact assistant spans via offsets).
        mask_token_id: id used for the MASK slots of draft blocks; None takes the tokenizer's mask token, else
            its pad token, else its EOS (the draft only needs one fixed, frozen embedding for "unknown").
    """

    def __init__(self, hf_tokenizer, mask_token_id: int | None = None):
        self.hf = hf_tokenizer
        if mask_token_id is None:
            for candidate in (hf_tokenizer.mask_token_id, hf_tokenizer.pad_token_id, hf_tokenizer.eos_token_id):
                if candidate is not None:
                    mask_token_id = int(candidate)
                    break
        if mask_token_id is None:
            raise ValueError("the tokenizer has no mask, pad or eos token: set model.mask_token_id to a token id")
        self.mask_token_id = int(mask_token_id)
        pad = hf_tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (hf_tokenizer.eos_token_id or 0))
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)

    @property
    def fingerprint(self) -> str:
        """Hash of the vocabulary size, special ids, name and chat template."""
        blob = json.dumps(
            [
                getattr(self.hf, "name_or_path", ""),
                self.vocab_size,
                self.pad_token_id,
                self.mask_token_id,
                getattr(self.hf, "chat_template", None),
            ],
            sort_keys=True,
            default=str,
        )
        return "hf-" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def stop_token_ids(self) -> list[int]:
        """EOS plus any end-of-turn token the tokenizer declares."""
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
            token_id = self.hf.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != getattr(self.hf, "unk_token_id", None) and token_id >= 0:
                stops.append(token_id)
        return sorted(set(stops))

    def encode(self, text: str) -> list[int]:
        """Token ids without special tokens."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, show_special: bool = False) -> str:
        """Decode ids (special tokens skipped unless show_special)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=not show_special)

    def encode_chat(self, messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
        """Render with the tokenizer's chat template; loss mask True on the assistant turns' tokens.

        Assistant spans are character spans [len(render(prefix before turn)), len(render(prefix with turn))):
        chat templates render a conversation as the concatenation of its turns, so a growing prefix grows the
        text at its end. A template that violates this (rewrites earlier turns) raises ValueError.
        """
        convo = [{"role": normalise_role(m["role"]), "content": m["content"]} for m in messages]
        text = self.hf.apply_chat_template(convo, tokenize=False)
        spans: list[tuple[int, int]] = []
        previous = ""
        for i, message in enumerate(convo):
            rendered = self.hf.apply_chat_template(convo[: i + 1], tokenize=False)
            if not text.startswith(rendered) or not rendered.startswith(previous):
                raise ValueError("the chat template does not render conversations turn by turn (prefix mismatch)")
            if message["role"] == "assistant":
                start = len(previous)
                # The assistant header (e.g. "<|im_start|>assistant\n") is prompt; the body and end marker are loss.
                body_at = rendered.find(message["content"], start) if message["content"] else -1
                spans.append((body_at if body_at >= 0 else start, len(rendered)))
            previous = rendered
        encoded = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        mask = [any(s <= lo < e for s, e in spans) for lo, _hi in encoded["offset_mapping"]]
        return ids, mask
