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

Tool calling (the OpenAI/HF schema, parsed by ``data.jsonl``): a ``tools`` list goes to
``apply_chat_template(messages, tools=tools)``; an assistant turn's ``tool_calls`` are rendered by the template
inside that turn (Qwen3: ``<tool_call>...</tool_call>`` before ``<|im_end|>``), so they fall inside its span and are
trained on, as SpecForge's and HF's assistant masks do; ``tool`` turns (Qwen3: ``<tool_response>`` inside a user
turn), system and user turns are prompt. A template that cannot render them (it raises, or its rendering lacks a
call, a tool response or a listed tool) raises :class:`TemplateLacksTools`, never a silent drop. The byte
tokenizer's own format has no tool syntax: it raises the same.

Reasoning: an assistant turn's ``reasoning_content`` goes to the template, which writes it where it does (Qwen3: a
``<think>`` block inside the turn, only for replies after the last user turn, as at inference), so it is trained
with the reply. A template that renders no ``reasoning_content`` at all (probed once per template) raises
:class:`TemplateLacksReasoning`; turns whose reasoning the template leaves out are counted
(``reasoning_not_rendered``). The byte tokenizer writes ``<think>\n...\n</think>\n\n`` before the reply.

Cost: ByteTokenizer.encode is one ``str.encode`` + a list comprehension, O(characters); HF chat encoding is one
template render + one tokenizer call per conversation (the probe renders run once per template).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

PAD, BOS, EOS, MASK, SYSTEM, USER, ASSISTANT, END_OF_TURN = range(8)
_SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>", "<mask>", "<system>", "<user>", "<assistant>", "<eot>")
_BYTE_OFFSET = 8
_ROLE_IDS = {"system": SYSTEM, "user": USER, "human": USER, "assistant": ASSISTANT, "gpt": ASSISTANT}
TOOL_ROLES = ("tool", "function", "ipython")   # OpenAI's tool (and legacy function) results; Llama 3.1's ipython


def normalise_role(role: str) -> str:
    """Map ShareGPT (human/gpt), OpenAI (user/assistant/tool) and legacy tool-result role names onto
    system | user | assistant | tool.

    Raises:
        ValueError: for a role name none of these formats uses.
    """
    key = str(role).strip().lower()
    if key in ("system",):
        return "system"
    if key in ("user", "human"):
        return "user"
    if key in ("assistant", "gpt", "model"):
        return "assistant"
    if key in TOOL_ROLES:
        return "tool"
    raise ValueError(f"unknown chat role {role!r}: expected system, user/human, assistant/gpt or tool")


def uses_tools(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> bool:
    """True when a conversation needs a template's tool syntax: a tools list, a tool call or a tool turn."""
    return bool(tools) or any(m.get("tool_calls") or normalise_role(m["role"]) == "tool" for m in messages)


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

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    notes: Counter | None = None) -> tuple[list[int], list[bool]]:
        """Render a conversation with our template; loss mask True on assistant text + its closing token.

        Args:
            messages: dicts with ``role`` (system/user/assistant or human/gpt) and ``content`` (str); an assistant
                turn's ``reasoning_content`` is written before its content as ``<think>\n...\n</think>\n\n``
                (Qwen3's form) and trained with it.
            tools: must be empty: our format has no tool syntax.
            notes: accepted for the HF adapter's interface; our format drops nothing, so nothing is counted.

        Returns:
            (ids, loss_mask) of equal length, starting with BOS.

        Raises:
            TemplateLacksTools: the conversation has tools, tool calls or tool turns.
        """
        if uses_tools(messages, tools):
            raise TemplateLacksTools("the byte tokenizer's chat format (model=tiny) has no tool-call syntax: train "
                                     "tool-calling data with model=hf and a chat template that renders tools")
        ids: list[int] = [BOS]
        mask: list[bool] = [False]
        roles = [normalise_role(m["role"]) for m in messages]
        last_assistant = max((i for i, role in enumerate(roles) if role == "assistant"), default=-1)
        for i, message in enumerate(messages):
            role = normalise_role(message["role"])
            body = self.encode(with_reasoning(message["content"], message.get("reasoning_content")))
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
        self._renders_reasoning: dict[str | None, bool] = {}   # chat template -> renders reasoning_content

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

    def encode_chat(self, messages: Sequence[dict], chat_template: str | None = None,
                    tools: Sequence[dict] | None = None, notes: Counter | None = None
                    ) -> tuple[list[int], list[bool]]:
        """Render with the chat template; loss mask True on the assistant turns' tokens, their tool calls
        included (module docstring).

        Args:
            messages: dicts with ``role`` and ``content``; assistant turns may carry ``tool_calls`` (HF form:
                ``{"type": "function", "function": {"name", "arguments": dict}}``, content None when absent) and
                ``reasoning_content`` (rendered where the template renders it, inside the turn: trained), tool
                turns ``tool_call_id`` / ``name``.
            chat_template: Jinja template text replacing the tokenizer's own (``data.chat_template``).
            tools: function schemas for ``apply_chat_template(..., tools=tools)``.
            notes: counts what the template left out of a kept conversation: ``reasoning_not_rendered``, the
                assistant turns whose reasoning it does not write (Qwen3's: those before the last user turn, as
                at inference).

        Raises:
            TemplateLacksReasoning: the conversation has reasoning and the template renders no
                ``reasoning_content`` at all (a probe conversation shows it).
            TemplateLacksTools: the conversation uses tools and the template raises on it, or renders it without
                a tool call, a tool response or a listed tool.
            ChatTemplateError: the template fails on this conversation, or its rendering does not show one
                assistant header per assistant turn.
        """
        convo = [template_message(m) for m in messages]

        def render(conversation, add_generation_prompt=False, tools=None) -> str:
            try:
                return self.hf.apply_chat_template(conversation, tools=tools, tokenize=False,
                                                   chat_template=chat_template,
                                                   add_generation_prompt=add_generation_prompt)
            except Exception as exc:  # jinja errors, raise_exception() in the template, missing template
                raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

        key = chat_template if chat_template is not None else getattr(self.hf, "chat_template", None)
        if key not in self._markers:
            self._markers[key] = chat_markers(render)
        header, end = self._markers[key]
        with_tools = uses_tools(messages, tools)
        try:
            text = render(convo, tools=list(tools) if tools else None)
        except ChatTemplateError as exc:
            if with_tools:
                raise TemplateLacksTools(f"the chat template cannot render this tool-calling conversation ({exc}): "
                                         "set data.chat_template to one that renders tools") from exc
            raise
        spans = assistant_spans(text, header, end, sum(m["role"] == "assistant" for m in convo))
        if with_tools:
            check_tools_rendered(text, spans, convo, tools or [])
        if any(m.get("reasoning_content") for m in convo):
            if key not in self._renders_reasoning:
                self._renders_reasoning[key] = renders_reasoning(render)
            dropped = reasoning_not_rendered(text, spans, convo, self._renders_reasoning[key])
            if dropped and notes is not None:
                notes["reasoning_not_rendered"] += dropped
        encoded = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(s <= lo < e for s, e in spans) for lo, _hi in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask


class ChatTemplateError(ValueError):
    """A chat template failed on a conversation, or its assistant turns could not be located."""


class TemplateLacksTools(ChatTemplateError):
    """A chat template (or the byte tokenizer's format) cannot render a conversation's tools, calls or results."""


class TemplateLacksReasoning(ChatTemplateError):
    """A chat template renders no ``reasoning_content``: the reasoning would be dropped from the trained text."""


NEWLINE = "\n"


def with_reasoning(content: str | None, reasoning: str | None) -> str:
    """An assistant reply with its reasoning before it, as Qwen3's template writes a think block (the byte
    tokenizer's format); the content alone without reasoning.

    Example:
        >>> with_reasoning("4", "2+2")
        '<think>\\n2+2\\n</think>\\n\\n4'
    """
    content = content or ""
    if not reasoning:
        return content
    return f"<think>\n{reasoning.strip(NEWLINE)}\n</think>\n\n{content.lstrip(NEWLINE)}"


_PROBE_REASONING = "dflashprobereasoning"


def renders_reasoning(render: Callable[..., str]) -> bool:
    """Whether a chat template writes an assistant turn's ``reasoning_content``: rendered on a probe conversation
    (a user turn and a final assistant reply with reasoning, where Qwen3's template writes it).

    Example:
        >>> renders_reasoning(lambda messages, **_: "".join(m.get("reasoning_content", "") + m["content"]
        ...                                                  for m in messages))
        True
    """
    probe = [{"role": "user", "content": _PROBE_USER},
             {"role": "assistant", "content": _PROBE_REPLY, "reasoning_content": _PROBE_REASONING}]
    try:
        return _PROBE_REASONING in render(probe)
    except ChatTemplateError:
        return False


def reasoning_not_rendered(text: str, spans: list[tuple[int, int]], convo: Sequence[dict], renders: bool) -> int:
    """How many assistant turns' ``reasoning_content`` is missing from their span of the rendering (the template
    leaves it out there, as Qwen3's does before the last user turn).

    Raises:
        TemplateLacksReasoning: the template renders no reasoning at all (``renders`` False, from
            :func:`renders_reasoning`) and the conversation has some.

    Example:
        >>> turn = {"role": "assistant", "content": "4", "reasoning_content": "add"}
        >>> reasoning_not_rendered("<a>add 4</a>", [(3, 12)], [turn], True)
        0
    """
    reasoning = [(m.get("reasoning_content") or "").strip() for m in convo if m["role"] == "assistant"]
    if not any(reasoning):
        return 0
    if not renders:
        raise TemplateLacksReasoning("the chat template does not render reasoning_content (the reasoning would be "
                                     "dropped from the trained text): set data.chat_template to one that renders it "
                                     "(Qwen3's does), or put the reasoning in the content as <think>...</think>")
    return sum(1 for thought, (lo, hi) in zip(reasoning, spans) if thought and thought not in text[lo:hi])


def template_message(message: dict) -> dict:
    """One turn in the form HF chat templates read: role normalised; ``tool_calls`` and ``reasoning_content`` kept
    on assistant turns and ``tool_call_id`` / ``name`` on tool turns; a null content left out (HF's documented
    tool-call turn has no content key, so a template reading it gets an empty undefined value, never the text "None").

    Example:
        >>> template_message({"role": "gpt", "content": None, "tool_calls": [{"function": {"name": "f"}}]})
        {'role': 'assistant', 'tool_calls': [{'function': {'name': 'f'}}]}
    """
    role = normalise_role(message["role"])
    turn = {"role": role}
    if message.get("content") is not None:
        turn["content"] = message["content"]
    if role == "assistant" and message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    if role == "assistant" and message.get("reasoning_content"):
        turn["reasoning_content"] = message["reasoning_content"]
    if role == "tool":
        turn.update({key: message[key] for key in ("tool_call_id", "name") if message.get(key) is not None})
    return turn


def tool_name(tool) -> str | None:
    """The function name of one ``tools`` entry: OpenAI's ``{"type": "function", "function": {"name"}}`` or a bare
    ``{"name"}`` schema."""
    if not isinstance(tool, dict):
        return None
    function = tool.get("function", tool)
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def check_tools_rendered(text: str, spans: list[tuple[int, int]], convo: Sequence[dict], tools: Sequence) -> None:
    """Refuse a rendering that dropped tool content: every call's name and argument names must lie inside its
    assistant turn's span (the trained text), every tool response and every listed tool's name outside the spans.

    Raises:
        TemplateLacksTools: naming what is missing.

    Example:
        >>> turn = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}
        >>> check_tools_rendered("<a>say</a>", [(3, 10)], [turn], [])
        Traceback (most recent call last):
        ...
        dflash_lab.data.tokenizer.TemplateLacksTools: the chat template renders assistant turn 1 without its tool call 'f' ...
    """
    prompt = "".join(text[lo:hi] for lo, hi in zip([0] + [e for _, e in spans], [s for s, _ in spans] + [len(text)]))
    replies = iter(text[s:e] for s, e in spans)
    fix = "set data.chat_template to a template that renders tools (Qwen3's does)"
    for number, turn in enumerate((m for m in convo if m["role"] == "assistant"), start=1):
        reply = next(replies)
        for call in turn.get("tool_calls", []):
            function = call["function"]
            missing = [piece for piece in (function["name"], *function.get("arguments", {})) if piece not in reply]
            if missing:
                raise TemplateLacksTools(f"the chat template renders assistant turn {number} without its tool call "
                                         f"{function['name']!r} ({missing} missing from the reply): {fix}")
    for turn in convo:
        if turn["role"] == "tool" and turn.get("content") and turn["content"] not in prompt:
            raise TemplateLacksTools(f"the chat template drops a tool response ({turn['content'][:40]!r} is not in "
                                     f"the rendered prompt): {fix}")
    for tool in tools:
        name = tool_name(tool)
        if name and name not in prompt:
            raise TemplateLacksTools(f"the chat template does not render the tools list (tool {name!r} is not in "
                                     f"the rendered prompt): {fix}")


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
