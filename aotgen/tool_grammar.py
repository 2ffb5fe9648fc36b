"""The grammars of tool calls, in llguidance's Lark: a forced call (OpenAI's `tool_choice`
"required" or a named function: the call at once) and tool_choice "auto" (llama.cpp's lazy
grammar: free text until the model writes a call's marker, then calls that parse). Each
format in aotgen/tool_calls.py gives the rules of what follows its first marker (`first`)."""

from __future__ import annotations

import json
import re
from typing import Any

from aotgen.runtime.grammar import Grammar


def call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """A JSON object calling one of `tools`: its name and arguments matching its parameters."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                arguments_key: tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def json_rule(schema: dict[str, Any]) -> str:
    """The grammar rule for JSON matching `schema`, laid out as the templates show it
    ({"name": ..., "arguments": {...}}): no free whitespace, which a weak model may emit
    without end."""
    layout = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    return f"%json {json.dumps(schema | {'x-guidance': layout})}"


Specials = dict[str, int]  # special tokens' text -> id (Tokenizer.special_tokens)
VALUE_END = "\n</parameter>\n"  # after a Qwen3-Coder parameter's value


def literal(text: str, specials: Specials) -> str:
    """Lark for a marker as a model may write it: its characters, or the special token it is
    in this vocabulary (which no quoted string matches)."""
    quoted = json.dumps(text)
    return f"({quoted} | <[{specials[text]}]>)" if text in specials else quoted


def regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/])", r"\\\1", text).replace("\n", "\\n")


def forced(marker: str, after: str, specials: Specials | None) -> Grammar:
    """A call at once: the marker, then `first` (the rules `after` define)."""
    return Grammar("grammar", f"start: {literal(marker, specials or {})} first\n{after}")


def lazy(marker: str, after: str, specials: Specials | None) -> Grammar:
    """Free text, or free text up to the marker and then `first`: llama.cpp's lazy grammar
    (triggered by the marker), so a call the model chooses to make is well formed while an
    answer in text is left as the model writes it. The marker may be typed out or, where the
    vocabulary has it, the special token."""
    rx = regex_literal(marker)
    start = "start: TEXT | lead first"
    if marker in (specials or {}):
        start += f" | TEXT <[{specials[marker]}]> first"
    text = f"TEXT: /(?s:.*)/ & ~/(?s:.*{rx}.*)/\nlead[lazy]: /(?s:.*){rx}/\n"
    return Grammar("grammar", f"{start}\n{text}{after}")


def is_text(spec: dict[str, Any]) -> bool:
    """Whether a parameter's value is its text as it stands: a string (or a string enum)."""
    return spec.get("type") == "string" or (spec.get("type") is None and "enum" in spec)


def value_rule(spec: dict[str, Any]) -> str:
    """The grammar of one parameter's value as the template writes it."""
    if is_text(spec):
        if "enum" in spec:
            return " | ".join(json.dumps(str(v)) for v in spec["enum"])
        return "/[^<\\n]*/"
    return json_rule(spec)
