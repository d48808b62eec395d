"""Tokenizers: our own tiny byte-level tokenizer and an adapter that gives a Hugging Face tokenizer the same face.

ByteTokenizer: ids 0..7 are special tokens (PAD=0, BOS, EOS, MASK, then the chat role markers SYSTEM, USER,
ASSISTANT, END_OF_TURN); every UTF-8 byte b is id 8 + b, so vocab_size = 264 and every string round-trips.
Chat template (our own, minimal):  BOS {ROLE text END_OF_TURN}*  with EOS closing the last assistant turn.
Loss is on assistant text and its END_OF_TURN / EOS (the model must learn to stop); role markers are prompt.

HFTokenizerAdapter wraps a transformers tokenizer: encode/decode, its chat template (or a ``data.chat_template``
override) for chat data, and a MASK id for the draft blocks. Assistant tokens: the conversation is rendered ONCE
and each assistant turn is located by the template's markers, learned by rendering a probe conversation
(:func:`chat_markers`): the assistant header (what ``add_generation_prompt`` appends) and the end-of-turn marker
(what follows a reply). Loss covers everything from the end of a header to the end of the next end-of-turn marker
(the reply, any ``<think>`` block the template puts there, and the marker: the model must learn to stop). So
templates that rewrite earlier turns (Qwen3 strips ``<think>`` from all but the last replies) are handled.

Cost: ByteTokenizer.encode is one ``str.encode`` + a list comprehension, O(characters); HF chat encoding is one
template render + one tokenizer call per conversation (the probe renders run once per template).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

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
        self._markers: dict[str | None, tuple[str, str]] = {}  # chat template -> (assistant header, end marker)

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

    def encode_chat(self, messages: Sequence[dict],
                    chat_template: str | None = None) -> tuple[list[int], list[bool]]:
        """Render with the chat template; loss mask True on the assistant turns' tokens (module docstring).

        Args:
            messages: dicts with ``role`` and ``content``.
            chat_template: Jinja template text replacing the tokenizer's own (``data.chat_template``).

        Raises:
            ChatTemplateError: the template fails on this conversation, or its rendering does not show one
                assistant header per assistant turn.
        """
        convo = [{"role": normalise_role(m["role"]), "content": m["content"]} for m in messages]

        def render(conversation, add_generation_prompt=False) -> str:
            try:
                return self.hf.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                   add_generation_prompt=add_generation_prompt)
            except Exception as exc:  # jinja errors, raise_exception() in the template, missing template
                raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

        key = chat_template if chat_template is not None else getattr(self.hf, "chat_template", None)
        if key not in self._markers:
            self._markers[key] = chat_markers(render)
        header, end = self._markers[key]
        text = render(convo)
        spans = assistant_spans(text, header, end, sum(m["role"] == "assistant" for m in convo))
        encoded = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(s <= lo < e for s, e in spans) for lo, _hi in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask


class ChatTemplateError(ValueError):
    """A chat template failed on a conversation, or its assistant turns could not be located."""


_PROBE_USER, _PROBE_REPLY = "dflashprobeuserturn", "dflashprobeassistantreply"


def chat_markers(render: Callable[..., str]) -> tuple[str, str]:
    """(assistant header, end-of-turn marker) of a chat template, from renders of a probe conversation.

    The header is the longest prefix of the generation prompt (what ``add_generation_prompt`` appends) that the
    template also writes before a reply; templates without a generation prompt fall back to all the text between
    the user's content and the reply (the user turn's end and the assistant header). The end marker is the text
    after a final reply, whitespace stripped.

    Args:
        render: ``render(messages, add_generation_prompt=False) -> str`` with the template to inspect.

    Raises:
        ChatTemplateError: the template writes no recognisable header or no end-of-turn marker.

    Example:
        >>> def chatml(messages, add_generation_prompt=False):
        ...     text = "".join(f"<|im_start|>{m['role']}\\n{m['content']}<|im_end|>\\n" for m in messages)
        ...     return text + ("<|im_start|>assistant\\n" if add_generation_prompt else "")
        >>> chat_markers(chatml)
        ('<|im_start|>assistant\\n', '<|im_end|>')
    """
    probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
    full, prompt = render(probe), render(probe[:1])
    with_prompt = render(probe[:1], add_generation_prompt=True)
    user_at, reply_at = full.find(_PROBE_USER), full.find(_PROBE_REPLY)
    if user_at < 0 or reply_at < user_at:
        raise ChatTemplateError("the chat template does not render the message contents of a user/assistant probe")
    before_reply = full[user_at + len(_PROBE_USER):reply_at]
    generation = with_prompt[len(prompt):] if with_prompt.startswith(prompt) else ""
    header = next((generation[:n] for n in range(len(generation), 0, -1) if generation[:n] in before_reply), "")
    if not header.strip():
        header = before_reply
    end = full[reply_at + len(_PROBE_REPLY):].strip()
    if not header.strip() or not end:
        raise ChatTemplateError(
            f"cannot find the assistant header ({header!r}) or end-of-turn marker ({end!r}) of the chat template: "
            "set data.chat_template to a template that marks assistant turns"
        )
    return header, end


def assistant_spans(text: str, header: str, end: str, num_assistant: int) -> list[tuple[int, int]]:
    """Character spans [start, stop) of the assistant turns in a rendered conversation.

    A span starts after an assistant ``header`` and stops after the next ``end`` marker (or at the end of text).

    Raises:
        ChatTemplateError: ``text`` holds a different number of headers than ``num_assistant``.

    Example:
        >>> assistant_spans("<u>hi</e><a>yo</e>", "<a>", "</e>", 1)
        [(12, 18)]
    """
    found = text.count(header)
    if found != num_assistant:
        raise ChatTemplateError(f"the rendered conversation holds {found} assistant header(s) {header!r} for "
                                f"{num_assistant} assistant turn(s)")
    spans, position = [], 0
    for _ in range(num_assistant):
        start = text.index(header, position) + len(header)
        stop = text.find(end, start)
        position = len(text) if stop < 0 else stop + len(end)
        spans.append((start, position))
    return spans


def load_chat_template(value: str | None) -> str | None:
    """``data.chat_template`` as template text: None (the tokenizer's own), a path to a Jinja file, or the text.

    Example:
        >>> load_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")[:6]
        '{% for'
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"data.chat_template={value!r}: give a path to a Jinja file or the template text")
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.chat_template={value!r}: no such file, and not a Jinja template (no '{{{{' "
                                "or '{%'): give a path to a .jinja file or the template text")
    return path.read_text(encoding="utf-8")
