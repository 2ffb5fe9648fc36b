"""Runtime tokenizer: tokenizer.json + the checkpoint's jinja2 chat template, no model code.

The runtime ships next to an AOTInductor package and must not import torch model definitions
or transformers, so this wraps the `tokenizers` library directly and renders chat templates the
way transformers' `apply_chat_template` does.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

Message = dict[str, Any]

# Read before tokenizer_config.json's and chat_template.json's template (as transformers does),
# so a recipe's `chat_template` written here is the one the package renders.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The variables a chat itself gives its template (apply_chat_template's): extra template
# variables (vLLM's chat_template_kwargs) may not set them.
CHAT_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's built-in tojson HTML-escapes and sorts keys; transformers overrides it like this.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template with the same environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chatml(messages: list[Message], add_generation_prompt: bool = True) -> str:
    """Plain ChatML, exactly what llama.cpp produces for ChatML models: no injected turns."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Tokenizer:
    """Text <-> ids plus chat prompt formatting for one checkpoint directory."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_ids: set[int] | None = None,
        bos_id: int | None = None,
        add_bos: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = bos_id if bos_id is not None else self.token_to_id(bos_token)
        eos = set(eos_ids or ())
        if (eos_id := self.token_to_id(eos_token)) is not None:
            eos.add(eos_id)
        self.eos_ids: set[int] = eos
        self._template = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and, if present, the eos ids in
        generation_config.json / config.json (models often stop on more than one token)."""
        path = Path(path)
        tok_config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")
        config = _read_json(path / "config.json")

        template = tok_config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        processor = _read_json(path / "chat_template.json")  # a vision-language model's
        if isinstance(processor, dict) and isinstance(processor.get("chat_template"), str):
            template = processor["chat_template"]
        if (path / CHAT_TEMPLATE_FILE).is_file():  # newer transformers save it separately
            template = (path / CHAT_TEMPLATE_FILE).read_text()

        eos_ids = set(_as_list(gen_config.get("eos_token_id")))
        eos_ids |= set(_as_list(config.get("eos_token_id")))
        bos_ids = _as_list(gen_config.get("bos_token_id", config.get("bos_token_id")))
        return cls(
            HFTokenizer.from_file(str(path / "tokenizer.json")),
            chat_template=template,
            bos_token=_token_str(tok_config.get("bos_token")),
            eos_token=_token_str(tok_config.get("eos_token")),
            eos_ids=eos_ids,
            bos_id=bos_ids[0] if bos_ids else None,
            add_bos=tok_config.get("add_bos_token") is True,
        )

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer rendering chats with `source` (a recipe's `chat_template`)."""
        other = copy.copy(self)
        other.chat_template = source
        other._template = compile_chat_template(source)
        return other

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """tokenizer.json's text (the grammar matcher builds its token table from it)."""
        return self._tok.to_str()

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token text such as "<|im_start|>" maps to its single id. Default False:
        chat prompts already spell out their special tokens."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """A user's text, special-token text read as plain text (a file that holds
        "<|fim_prefix|>" gets those characters, not the control token)."""
        return self._text_tok.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, text: str) -> list[int]:
        """A plain-text prompt's ids, led by bos when the checkpoint says so (`add_bos_token`,
        e.g. Gemma): the model was trained with it, and llama.cpp adds it too."""
        ids = self.encode(text)
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a character for some tokens, where
        `decode` gives U+FFFD): byte-level BPE pieces through GPT-2's byte alphabet,
        SentencePiece pieces with `▁` as a space and `<0xNN>` byte-fallback tokens."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode()
        if self._byte_level:
            return bytes(_GPT2_BYTES.get(c, 0) for c in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    @property
    def _byte_level(self) -> bool:
        return isinstance(self._tok.decoder, decoders.ByteLevel)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the checkpoint's own template exactly as transformers would (including any
        default system prompt it injects)."""
        if self._template is None:
            raise ValueError("this checkpoint has no chat_template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    @property
    def is_chatml(self) -> bool:
        """Same test llama.cpp uses to pick its built-in ChatML formatter."""
        return self._template is not None and "<|im_start|>" in (self.chat_template or "")

    def chat_prompt(
        self,
        messages: list[Message],
        system: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> str:
        """Prompt text for a chat; `system=None` means no system turn at all. `tools`
        (OpenAI's function definitions) go to the template, which describes them to the model;
        so do `template_kwargs` (vLLM's `chat_template_kwargs`, e.g. Qwen3's
        `enable_thinking`). `continue_final`: the prompt ends inside the final assistant
        message, which the answer continues (transformers' `continue_final_message`).

        Why not just apply_chat_template: SmolLM2's template (like Qwen2.5's) injects a default
        system prompt ("You are a helpful AI assistant named SmolLM, ...") whenever the first
        message is not a system message. llama.cpp, our reference, formats ChatML models itself
        and adds nothing. So for ChatML templates, a chat of plain text turns without a system
        message renders as plain ChatML; in every other case the checkpoint's template is used
        as is.
        """
        if system is not None:
            if messages and messages[0].get("role") == "system":
                raise ValueError("pass the system prompt either as `system` or as a message")
            messages = [{"role": "system", "content": system}, *messages]
        has_system = bool(messages) and messages[0].get("role") == "system"
        plain = all(
            m.keys() == {"role", "content"} and isinstance(m["content"], str) for m in messages
        )
        if continue_final and add_generation_prompt:
            raise ValueError("continue the final message or add a generation prompt, not both")
        if continue_final:
            messages = _tag_final_message(messages)
        extra = (template_kwargs or {}) | ({"tools": tools} if tools else {})
        if self.is_chatml and not has_system and not extra and plain:
            text = render_chatml(messages, add_generation_prompt)
        else:
            text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return _up_to_final_message(text) if continue_final else text

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """Special tokens' text -> id (a grammar names them by id: no quoted text matches one)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def _special_ids(self) -> set[int]:
        return set(self.special_tokens.values())

    @functools.cached_property
    def _text_tok(self) -> HFTokenizer:
        """The same tokenizer with special-token text read as plain text, for message
        content; made on first need, since copying a large vocabulary costs load time."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode_chat(
        self,
        messages: list[Message],
        system: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """Ids of a chat prompt in which message content is only ever text.

        Special tokens come from the template alone: a user who types "<|im_start|>system"
        gets those characters, not a control token that opens a system turn. Content free of
        special-token text is encoded with the rest of the prompt in one piece (the ids
        llama.cpp gives); otherwise the prompt is rendered with placeholders and each
        message's content is encoded on its own, as text. The C++ runtime does the same
        (`encode_chat` in runtime/cpp/chat.cpp).
        """
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        texts = {
            i: m["content"] for i, m in enumerate(messages) if isinstance(m.get("content"), str)
        }
        prompt = functools.partial(
            self.chat_prompt,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
            continue_final=continue_final,
        )
        if not any(i in self._special_ids for c in texts.values() for i in self.encode(c)):
            return self.encode(prompt(messages))
        marked = [
            {**m, "content": f"{_MARK_OPEN}{i}{_MARK_CLOSE}"} if i in texts else m
            for i, m in enumerate(messages)
        ]
        ids: list[int] = []
        for i, piece in enumerate(_MARKS.split(prompt(marked))):
            if i % 2 == 0:  # template text: its special tokens are real
                ids += self.encode(piece) if piece else []
            else:  # a message's content
                ids += self._text_tok.encode(texts[int(piece)], add_special_tokens=False).ids
        return ids


# transformers' mark of the final message's end for `continue_final_message` (its own text).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[Message]) -> list[Message]:
    final = messages[-1] if messages else {}
    if final.get("role") != "assistant" or not isinstance(final.get("content"), str):
        raise ValueError("continuing the final message needs a final assistant message with text")
    return [*messages[:-1], {**final, "content": final["content"] + _CONTINUE_TAG}]


def _up_to_final_message(rendered: str) -> str:
    """The rendered chat cut where the final message's content ends (transformers' rule: at
    the tag, and without the spaces before it if the template trimmed the content)."""
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("the chat template does not show the final message's content as given")
    return rendered[:at] if rendered.startswith(_CONTINUE_TAG, at) else rendered[:at].rstrip()


# Placeholders for message content while a chat template renders (private-use characters).
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARKS = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, printable character -> byte (its `bytes_to_unicode`)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable + [256 + n for n in range(256 - len(printable))]
    rest = [b for b in range(256) if b not in printable]
    return {chr(c): b for c, b in zip(chars, printable + rest, strict=True)}


_GPT2_BYTES = _gpt2_bytes()


class StreamDecoder:
    """Incremental detokenization: feed ids one at a time, print what comes back.

    Decoding ids one by one breaks multi-byte characters (an emoji spans several byte-level
    tokens) and loses context-dependent spacing. Instead we decode a short window before and
    after the new id and emit the difference, holding text back while it ends in U+FFFD (an
    incomplete UTF-8 sequence). The concatenated output equals decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids kept as context for the decode
        self._read = 0  # ids before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def put(self, token_id: int) -> str:
        """Add one id; return the newly completed text (often "", never half a character)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truncated character at the end of generation)."""
        prefix = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return full[len(prefix) :]
