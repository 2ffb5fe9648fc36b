"""Tool calls in the shape a model family writes them, as its chat template teaches it.

A chat template that takes `tools` also tells the model how to call one; `tool_format` reads
which convention from the template (vLLM's `--tool-call-parser`, chosen per model there):

- `hermes` (Qwen2.5, Qwen3, Hermes, SmolLM3): `<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`, one block per call, after any text.
- `llama3_json` (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}`,
  calls separated by `; `, optionally led by `<|python_tag|>`.
- `mistral` (Mistral 7B v0.3, Nemo): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
  after any text; call ids of 9 letters and digits, which its template checks.
- `granite` (Granite 3.x): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, Mistral's
  JSON list after Granite's own marker.
- `qwen3_coder` (Qwen3.5, Qwen3-Coder): `<tool_call>\n<function=NAME>\n<parameter=KEY>\n
  VALUE\n</parameter>\n...</function>\n</tool_call>` after any text; each value is text, typed
  by the tool's schema (a string as written, other types as JSON, as the template writes them).
- `harmony` (gpt-oss): a message to `functions.NAME` whose body is the arguments, one call
  per answer (aotgen/runtime/harmony.py reads the answer's channels).

Each format reads calls back from the answer's text (`parse`), reads them as the text arrives
(`reader`: aotgen/tool_call_stream.py), says where a call may begin (`start`: text before it
streams as content), and gives the grammar that makes the model write calls of the given
tools (`grammar`: OpenAI's `tool_choice` "required" or a named function), so that a forced
call is always well formed and its arguments match the schema, and the one that leaves text
free until the model opens a call (`auto_grammar`: "auto"; aotgen/tool_grammar.py).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from aotgen.runtime import harmony
from aotgen.runtime.grammar import Grammar
from aotgen.tool_call_stream import CallReader, JsonCallReader, XmlCallReader
from aotgen.tool_grammar import (
    VALUE_END,
    Specials,
    call_schema,
    forced,
    is_text,
    json_rule,
    lazy,
    literal,
    regex_literal,
    value_rule,
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, call_id: str, index: int | None = None) -> dict[str, Any]:
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _openai_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _decode_call(text: str | dict[str, Any], arguments_key: str) -> ToolCall | None:
    """A call from a JSON object (or its text), or None if it is not one."""
    try:
        obj = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(obj["name"], text)


class _AfterText:
    """A format whose calls follow any text, from an opening marker on."""

    open: str

    def start(self, text: str) -> int | None:
        at = text.find(self.open)
        return None if at < 0 else at

    def pending(self, text: str) -> int:
        """Characters at the end that may begin the marker (held back until they cannot)."""
        for size in range(min(len(self.open) - 1, len(text)), 0, -1):
            if text.endswith(self.open[:size]):
                return size
        return 0

    def grammar(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials | None = None
    ) -> Grammar:
        return forced(self.open, self._after_open(tools, parallel, specials or {}, False), specials)

    def auto_grammar(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials | None = None
    ) -> Grammar:
        return lazy(self.open, self._after_open(tools, parallel, specials or {}, True), specials)

    def _after_open(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials, auto: bool
    ) -> str:
        """The Lark rules of what follows the first marker (`first`); `auto`: for a call the
        model opened itself."""
        raise NotImplementedError


class HermesFormat(_AfterText):
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    _blocks = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
    call_id = staticmethod(_openai_id)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.start(text)
        if at is None:
            return text, []
        calls = [_decode_call(m.group(1), "arguments") for m in self._blocks.finditer(text, at)]
        if not calls or None in calls:  # not calls after all: the answer is text
            return text, []
        return text[:at] or None, [c for c in calls if c is not None]

    @staticmethod
    def reader() -> CallReader:
        return JsonCallReader("arguments")

    def _after_open(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials, auto: bool
    ) -> str:
        """The first call's block and, with `parallel`, more, one a line as Qwen writes them."""
        more = ' ("\\n" call)*' if parallel else ""
        opening, closing = literal(self.open, specials), literal(self.close, specials)
        return (
            f'first: block{more}\ncall: {opening} block\nblock: "\\n" body "\\n" {closing}\n'
            f"body: {json_rule(call_schema(tools, 'arguments'))}\n"
        )


class Llama3JsonFormat:
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        """A call is the whole answer: it starts at the answer's first character or never."""
        return 0 if text.lstrip().startswith(("{", self.python_tag)) else None

    def pending(self, text: str) -> int:
        """All of it while the answer's start may still become a call."""
        stripped = text.lstrip()
        return len(text) if self.python_tag.startswith(stripped) else 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start(text) is None:
            return text, []
        body = text.strip().removeprefix(self.python_tag).strip()
        calls, at, decoder = [], 0, json.JSONDecoder()
        while at < len(body):  # objects one after another, `;` between (not split on "; ":
            try:  # a string argument may hold one)
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            calls.append(_decode_call(obj, "parameters"))
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        if None in calls:
            return text, []
        return None, [c for c in calls if c is not None]

    call_id = staticmethod(_openai_id)

    @staticmethod
    def reader() -> CallReader:
        return JsonCallReader("parameters")

    def auto_grammar(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials | None = None
    ) -> Grammar:
        """Text that does not begin as a call, or calls from the answer's start (after any
        whitespace and `<|python_tag|>`, typed out or its special token)."""
        more = ' ("; " call)*' if parallel else ""
        tag, rx = literal(self.python_tag, specials or {}), regex_literal(self.python_tag)
        return Grammar(
            "grammar",
            f"start: TEXT | SPACE {tag}? call{more}\n"
            f"TEXT: /(?s:.*)/ & ~/\\s*\\{{(?s:.*)/ & ~/\\s*{rx}(?s:.*)/\nSPACE: /\\s*/\n"
            f"call: {json_rule(call_schema(tools, 'parameters'))}\n",
        )

    def grammar(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials | None = None
    ) -> Grammar:
        more = ' ("; " call)*' if parallel else ""
        return Grammar(
            "grammar", f"start: call{more}\ncall: {json_rule(call_schema(tools, 'parameters'))}\n"
        )


class MistralFormat(_AfterText):
    name = "mistral"
    open = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.start(text)
        if at is None:
            return text, []
        try:
            items = json.loads(text[at + len(self.open) :])
        except json.JSONDecodeError:
            return text, []
        calls = (
            [_decode_call(item, "arguments") for item in items] if isinstance(items, list) else []
        )
        if not calls or None in calls:
            return text, []
        return text[:at] or None, [c for c in calls if c is not None]

    @staticmethod
    def reader() -> CallReader:
        return JsonCallReader("arguments")

    @staticmethod
    def call_id() -> str:
        """Nine letters and digits: Mistral's template refuses other ids in the history."""
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def _after_open(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials, auto: bool
    ) -> str:
        array = {"type": "array", "items": call_schema(tools, "arguments"), "minItems": 1}
        array |= {} if parallel else {"maxItems": 1}
        return f"first: {json_rule(array)}\n"


class GraniteFormat(MistralFormat):
    name = "granite"
    open = "<|tool_call|>"
    call_id = staticmethod(_openai_id)


class XmlFormat(_AfterText):
    """Qwen3.5's and Qwen3-Coder's calls (vLLM's `qwen3_coder` parser). The template writes a
    string argument as it is and others as JSON (`tojson`, Python's `str` for numbers and
    booleans), so the request's tools say how to read each value back."""

    name = "qwen3_coder"
    open, close = "<tool_call>", "</tool_call>"
    _blocks = re.compile(
        r"<tool_call>\s*<function=([^>\n]+)>\n?(.*?)</function>\s*(?:</tool_call>|$)", re.DOTALL
    )
    _params = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
    call_id = staticmethod(_openai_id)

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.schemas = {
            t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties", {})
            for t in tools or []
        }

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.start(text)
        if at is None:
            return text, []
        blocks = list(self._blocks.finditer(text, at))
        if not blocks or text[at : blocks[0].start()].strip():  # not calls after all
            return text, []
        calls = []
        for block in blocks:
            name, body = block.group(1).strip(), block.group(2)
            schema = self.schemas.get(name, {})
            args = {
                key.strip(): _typed(value, schema.get(key.strip(), {}))
                for key, value in self._params.findall(body)
            }
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return text[:at] or None, calls

    def reader(self) -> CallReader:
        return XmlCallReader(self.schemas, _typed)

    def _after_open(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials, auto: bool
    ) -> str:
        """Each tool's required parameters in its schema's order, then its optional ones, each
        value as its schema says: JSON for non-strings, one of an enum's strings, or text: a
        line (no `<`, no line break) in a forced call, any text up to its `</parameter>` in
        one the model opened itself (a file a `write_file` call carries, over many lines)."""
        more = ' ("\\n" call)*' if parallel else ""  # one block a line, as the template has
        rules = [f"first: block{more}", f"call: {literal(self.open, specials)} block"]
        rules.append(f"block: {' | '.join(f'call{i}' for i in range(len(tools)))}")
        closing, end = literal(self.close, specials), json.dumps(VALUE_END)
        for i, tool in enumerate(tools):
            function = tool["function"]
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties", {})
            required = set(parameters.get("required", ()))
            head = json.dumps(f"\n<function={function['name']}>\n")
            parts = []
            for j, (key, spec) in enumerate(properties.items()):
                name, opening = f"p{i}_{j}", json.dumps(f"<parameter={key}>\n")
                if auto and is_text(spec) and "enum" not in spec:
                    rules.append(f"{name}: {opening} v{i}_{j}")  # the value's lexeme ends it
                    rules.append(f"v{i}_{j}[lazy]: /(?s:.*){regex_literal(VALUE_END)}/")
                else:
                    rules.append(f"{name}: {opening} v{i}_{j} {end}")
                    rules.append(f"v{i}_{j}: {value_rule(spec)}")
                parts.append(name if key in required else f"{name}?")
            rules.append(f'call{i}: {head} {" ".join(parts)} "</function>\\n" {closing}')
        return "\n".join(rules) + "\n"


def _typed(value: str, spec: dict[str, Any]) -> Any:
    """A parameter's text as the value its schema types (vLLM's qwen3_coder rules): a string
    as written; integers, numbers, booleans and null from their text; objects and arrays as
    JSON; text that does not read as its type stays text."""
    kind = spec.get("type")
    if is_text(spec):
        return value
    if value.strip().lower() in ("null", "none") and kind != "string":
        return None
    if kind == "boolean":
        return value.strip().lower() == "true"
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    if kind == "integer" and isinstance(parsed, float) and parsed.is_integer():
        return int(parsed)
    return parsed


class HarmonyFormat:
    """gpt-oss's calls: read by `harmony.split_harmony` with the answer's channels (a harmony
    answer streams through `harmony.HarmonyStream`, not `ToolCallStream`)."""

    name = "harmony"
    call_id = staticmethod(_openai_id)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        split = harmony.split_harmony(text)  # after a generation prompt
        calls = [ToolCall(*call) for call in split.calls]
        return (split.content or None) if calls else split.content, calls

    def grammar(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials | None = None
    ) -> Grammar:
        """A call after free reasoning: `parallel` or not, one (`<|call|>` ends the answer)."""
        rules = [f"start: {' | '.join(f'call{i}' for i in range(len(tools)))}"]
        for i, tool in enumerate(tools):
            function = tool["function"]
            head = json.dumps(f"commentary to={harmony.FUNCTIONS}{function['name']} ")
            rules.append(f'call{i}: {head} {harmony.CONSTRAIN} "json" {harmony.MESSAGE} args{i}')
            rules.append(f"args{i}: {json_rule(function.get('parameters') or {'type': 'object'})}")
        calls = Grammar("grammar", "\n".join(rules) + "\n")
        return harmony.after_analysis(calls, harmony.CHANNEL)

    def auto_grammar(
        self, tools: list[dict[str, Any]], parallel: bool, specials: Specials | None = None
    ) -> Grammar | None:
        """None: a call is a channel message here, read as the model writes it (vLLM's auto)."""
        return None


ToolFormat = (
    HermesFormat | Llama3JsonFormat | MistralFormat | GraniteFormat | XmlFormat | HarmonyFormat
)


def tool_format(
    chat_template: str | None, tools: list[dict[str, Any]] | None = None
) -> ToolFormat | None:
    """How the model of this chat template calls tools, or None if the template takes none;
    `tools`: the request's, which type the arguments of a format that writes them as text."""
    if not chat_template or "tools" not in chat_template:
        return None
    if harmony.takes_harmony(chat_template):
        return HarmonyFormat()
    if "<function=" in chat_template:  # before Hermes: its calls are in <tool_call> too
        return XmlFormat(tools)
    if MistralFormat.open in chat_template:
        return MistralFormat()
    if GraniteFormat.open in chat_template:  # before Hermes: "<tool_call>" is not in it
        return GraniteFormat()
    if HermesFormat.open in chat_template:
        return HermesFormat()
    if '"parameters"' in chat_template or Llama3JsonFormat.python_tag in chat_template:
        return Llama3JsonFormat()
    return None
