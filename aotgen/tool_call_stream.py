"""Tool calls read as their text arrives, so a streamed answer sends each call's name as soon
as the model has written it and its arguments piece by piece, as OpenAI's API streams them
(vLLM's streaming tool parsers, llama-server's argument diffs).

The arguments stream as the JSON text a whole answer's call carries (aotgen/tool_calls.py:
Python's `json.dumps` of the value the model wrote, `ensure_ascii=False`), written forward as
the model's JSON arrives: `{`, `[`, `,` and `:` as soon as they come, a string's characters as
they are decoded, a number or a literal once it ends. The pieces of a call therefore add up to
the whole answer's arguments. Where the model writes malformed calls the two can part: a whole
answer that does not read as calls is text, while a streamed call, once its name went out,
stays a call (one cut short by max_tokens ends with `length`, its arguments as far as they came).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aotgen.tool_grammar import is_text

if TYPE_CHECKING:
    from aotgen.tool_calls import ToolFormat

_SCALAR = frozenset("+-.0123456789eEtrufalsn")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@dataclass(frozen=True)
class CallDelta:
    """A piece of the `index`-th call of an answer: its first piece carries the name."""

    index: int
    arguments: str
    name: str | None = None


class CallReader(Protocol):
    """A format's calls read from the text after the answer's first call marker."""

    def feed(self, text: str) -> list[CallDelta]: ...

    def ended(self) -> bool:
        """Whether every call begun has ended."""
        ...


def _dumps(text: str) -> str:
    """A string's characters escaped as `json.dumps(..., ensure_ascii=False)` escapes them."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class JsonLexer:
    """JSON text as tokens, fed in pieces: ("open"/"close", bracket), ("comma"/"colon", ""),
    ("string", ""), then ("chars", decoded characters) as they come and ("end", ""), and
    ("scalar", text) for a number or literal once it ends. Characters JSON has no place for
    come as ("other", c); whitespace between tokens is dropped."""

    def __init__(self) -> None:
        self.in_string = False
        self.escape = ""  # an escape read so far: "\\", "\\u00", ...
        self.high = ""  # a \\u high surrogate waiting for its low half
        self.scalar = ""

    def feed(self, text: str) -> Iterator[tuple[str, str]]:
        run: list[str] = []  # a string's characters decoded in this piece
        for c in text:
            if self.in_string:
                if self.escape:
                    run.append(self._escaped(c))
                elif c == "\\":
                    self.escape = c
                elif c == '"':
                    run.append(self.high)
                    self.high, self.in_string = "", False
                    if chars := "".join(run):
                        yield "chars", chars
                    run = []
                    yield "end", ""
                else:
                    run += [self.high, c]
                    self.high = ""
                continue
            if self.scalar:
                if c in _SCALAR:
                    self.scalar += c
                    continue
                yield "scalar", self.scalar
                self.scalar = ""
            if c in " \t\r\n":
                continue
            if c == '"':
                self.in_string = True
                yield "string", ""
            elif c in "{[":
                yield "open", c
            elif c in "}]":
                yield "close", c
            elif c in ",:":
                yield ("comma" if c == "," else "colon"), ""
            elif c in _SCALAR:
                self.scalar = c
            else:
                yield "other", c
        if self.in_string and (chars := "".join(run)):
            yield "chars", chars

    def _escaped(self, c: str) -> str:
        """The characters an escape's next character completes ("" while it goes on)."""
        self.escape += c
        if self.escape[1] != "u":
            self.escape, high = "", self.high
            self.high = ""
            return high + _ESCAPES.get(c, c)
        if len(self.escape) < 6:
            return ""
        digits, self.escape = self.escape[2:], ""
        try:
            code = int(digits, 16)
        except ValueError:  # not an escape JSON has: its text as it stands
            return "\\u" + digits
        if 0xD800 <= code < 0xDC00:  # a high surrogate: its low half should follow
            high, self.high = self.high, chr(code)
            return high
        if 0xDC00 <= code < 0xE000 and self.high:
            pair = 0x10000 + ((ord(self.high) - 0xD800) << 10) + (code - 0xDC00)
            self.high = ""
            return chr(pair)
        high, self.high = self.high, ""
        return high + chr(code)


def _scalar(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text


@dataclass
class _Call:
    index: int
    name: str | None = None
    arguments_seen: bool = False
    pending: str = ""  # arguments written before the name
    ended: bool = False


@dataclass
class _Value:
    """A value inside a call object being read: what it is for and how deep it began."""

    role: str  # "name", "arguments" (JSON), "text" (arguments given as a JSON string), "skip"
    depth: int
    started: bool = False
    name: list[str] = field(default_factory=list)


class JsonCallReader:
    """Calls written as JSON objects, `{"name": ..., KEY: {...}}` (Hermes' blocks, Llama 3's
    `; `-separated objects, Mistral's and Granite's list), the arguments under `KEY`
    ("arguments" or "parameters", either read as `_decode_call` reads them)."""

    def __init__(self, arguments_key: str):
        self.keys = (arguments_key, "arguments", "parameters")
        self.lexer = JsonLexer()
        self.depth = 0  # 0: between calls; 1: in a call object's keys
        self.key: list[str] | None = None  # a key being read
        self.last_key = ""
        self.value: _Value | None = None
        self.all: list[_Call] = []

    def ended(self) -> bool:
        return all(c.ended for c in self.all)

    def feed(self, text: str) -> list[CallDelta]:
        out: list[CallDelta] = []
        for kind, value in self.lexer.feed(text):
            self._token(kind, value, out)
        return out

    def _token(self, kind: str, value: str, out: list[CallDelta]) -> None:
        if self.depth == 0:  # between calls only an object's opening counts
            if (kind, value) == ("open", "{"):
                self.depth = 1
                self.all.append(_Call(len(self.all)))
            return
        call = self.all[-1]
        if self.value is not None:
            self._value_token(call, kind, value, out)
        elif self.key is not None:
            if kind == "chars":
                self.key.append(value)
            elif kind == "end":
                self.last_key, self.key = "".join(self.key), None
        elif kind == "string":
            self.key = []
        elif kind == "colon":
            self.value = _Value(self._role(call), self.depth)
        elif kind == "close":
            self._end(call, out)

    def _role(self, call: _Call) -> str:
        if self.last_key == "name" and call.name is None:
            return "name"
        if self.last_key in self.keys and not call.arguments_seen:
            call.arguments_seen = True
            return "arguments"
        return "skip"

    def _value_token(self, call: _Call, kind: str, value: str, out: list[CallDelta]) -> None:
        v = self.value
        assert v is not None
        if not v.started and v.role == "arguments" and kind == "string":
            v.role = "text"  # arguments sent as a JSON string: its text is the arguments
        if not v.started and v.role == "name" and kind != "string":
            v.role = "skip"
        v.started = True
        if kind == "open":
            self.depth += 1
        elif kind == "close":
            self.depth -= 1
            if self.depth < v.depth:  # the object closed with no value after its colon
                self.value = None
                self._end(call, out)
                return
        piece = self._piece(v, kind, value)
        if v.role in ("arguments", "text") and piece:
            self._arguments(call, piece, out)
        if self.depth == v.depth and kind in ("scalar", "end", "close", "other"):
            self.value = None  # the value is whole
            if v.role == "name":
                call.name = "".join(v.name)
                out.append(CallDelta(call.index, call.pending, call.name))

    def _piece(self, v: _Value, kind: str, value: str) -> str:
        """The JSON text (or, for "text", the characters) a token adds to the value."""
        if v.role == "name":
            if kind == "chars":
                v.name.append(value)
            return ""
        if v.role == "text":
            return value if kind == "chars" else ""
        return {
            "open": value,
            "close": value,
            "comma": ", ",
            "colon": ": ",
            "string": '"',
            "end": '"',
            "chars": _dumps(value),
            "scalar": _scalar(value),
        }.get(kind, "")

    def _arguments(self, call: _Call, piece: str, out: list[CallDelta]) -> None:
        if call.name is None:
            call.pending += piece
        else:
            out.append(CallDelta(call.index, piece))

    def _end(self, call: _Call, out: list[CallDelta]) -> None:
        self.depth, call.ended = 0, True
        if call.name is None:  # not a call after all: `parse` decides at the end
            return
        if not call.arguments_seen:
            out.append(CallDelta(call.index, "{}"))


class XmlCallReader:
    """Qwen3-Coder's calls: `<function=NAME>`, then `<parameter=KEY>\\nVALUE\\n</parameter>`
    each, then `</function>`. A string parameter's value streams as it comes (a file a
    `write_file` call carries); others, typed by the tool's schema, once their parameter ends."""

    def __init__(
        self, schemas: dict[str, dict[str, Any]], typed: Callable[[str, dict[str, Any]], Any]
    ):
        """`schemas`: each tool's parameters; `typed`: a value's text as its schema types it."""
        self.schemas, self.typed = schemas, typed
        self.text, self.at = "", 0
        self.state = "call"  # call, name, body, key, value
        self.all: list[_Call] = []
        self.params = 0  # parameters of the current call so far
        self.spec: dict[str, Any] = {}
        self.value_at = 0  # where the value begins (-1: its leading newline not seen yet)
        self.sent = 0  # how much of a string value went out

    def ended(self) -> bool:
        return all(c.ended for c in self.all)

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        out: list[CallDelta] = []
        while self._step(out):
            pass
        return out

    def _find(self, marker: str) -> int:
        return self.text.find(marker, self.at)

    def _step(self, out: list[CallDelta]) -> bool:
        """One state's move on the text so far; False where it needs more text."""
        if self.state == "call":
            at = self._find("<function=")
            if at < 0:
                return False
            self.at, self.state = at + len("<function="), "name"
        elif self.state == "name":
            at = self._find(">")
            if at < 0:
                return False
            call = _Call(len(self.all), self.text[self.at : at].strip())
            self.all.append(call)
            self.at, self.state, self.params = at + 1, "body", 0
            out.append(CallDelta(call.index, "{", call.name))
        elif self.state == "body":
            param, end = self._find("<parameter="), self._find("</function>")
            if end >= 0 and (param < 0 or end < param):
                self.at, self.state = end + len("</function>"), "call"
                self.all[-1].ended = True
                out.append(CallDelta(self.all[-1].index, "}"))
            elif param >= 0:
                self.at, self.state = param + len("<parameter="), "key"
            else:
                return False
        elif self.state == "key":
            at = self._find(">")
            if at < 0 or at + 1 >= len(self.text):  # its value's leading newline unknown yet
                return False
            key = self.text[self.at : at].strip()
            self.spec = self.schemas.get(self.all[-1].name or "", {}).get(key, {})
            self.at = at + 1 + (self.text[at + 1] == "\n")
            self.value_at, self.sent, self.state = self.at, self.at, "value"
            head = (", " if self.params else "") + json.dumps(key, ensure_ascii=False) + ": "
            self.params += 1
            out.append(CallDelta(self.all[-1].index, head + ('"' if self._string() else "")))
        else:
            return self._value(out)
        return True

    def _string(self) -> bool:
        return is_text(self.spec)

    def _value(self, out: list[CallDelta]) -> bool:
        end = self._find("</parameter>")
        index = self.all[-1].index
        if end < 0:  # a string streams but for what may still be "\n</parameter>"
            if self._string() and (upto := len(self.text) - len("\n</parameter>")) > self.sent:
                out.append(CallDelta(index, _dumps(self.text[self.sent : upto])))
                self.sent = upto
            return False
        value = self.text[self.value_at : end]
        value = value[:-1] if value.endswith("\n") else value
        if self._string():
            rest = self.text[self.sent : self.value_at + len(value)]
            out.append(CallDelta(index, _dumps(rest) + '"'))
        else:
            typed = self.typed(value, self.spec)
            out.append(CallDelta(index, json.dumps(typed, ensure_ascii=False)))
        self.at, self.state = end + len("</parameter>"), "body"
        return True


class ToolCallStream:
    """A streamed answer's text split into content that may go out now and the pieces of its
    calls; text that may still become a call's marker is held back until it cannot."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.text, self.sent = fmt, "", 0
        self.reader: CallReader | None = None
        self.named = False  # whether a call's name went out

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        """The content and the call pieces `piece` lets go out."""
        self.text += piece
        content = ""
        if self.reader is None:
            at = self.fmt.start(self.text)
            if at is None:
                upto = max(len(self.text) - self.fmt.pending(self.text), self.sent)
                content, self.sent = self.text[self.sent : upto], upto
                return content, []
            content, self.sent = self.text[self.sent : at], at
            self.reader, piece = self.fmt.reader(), self.text[at:]
        deltas = self.reader.feed(piece)
        self.named = self.named or any(d.name is not None for d in deltas)
        return content, deltas

    def finish(self) -> tuple[str, bool]:
        """The content not sent yet (the held-back text, where no call went out), and whether
        the answer ended as calls: each call begun also ended."""
        if not self.named:
            content, self.sent = self.text[self.sent :], len(self.text)
            return content, False
        assert self.reader is not None
        return "", self.reader.ended()
