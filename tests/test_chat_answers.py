"""The parts of a chat answer `aotgen serve` sends apart. Tool calls (aotgen/tool_calls.py,
`tools` / `tool_choice`): each family's format read back from text as vLLM's parsers read it,
streamed in pieces as read whole; chat templates rendered with tools as transformers renders
them; a forced call always well formed, with arguments matching the tool's schema. Reasoning
(aotgen/runtime/reasoning.py, `reasoning_content`): split as Qwen3's template splits its history,
streamed as whole. `aotgen serve` answering the official `openai` client with both, whole and
streamed."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from reference import CHAT_TEMPLATES as TEMPLATES
from reference import with_chat_template

from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.reasoning import ReasoningStream, opens_reasoning, split_reasoning
from aotgen.runtime.sampling import SamplingParams
from aotgen.runtime.tokenizer import Tokenizer
from aotgen.tool_call_stream import ToolCallStream
from aotgen.tool_calls import (
    GraniteFormat,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    ToolCall,
    XmlFormat,
    tool_format,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]


def matches_schema(call: ToolCall) -> bool:
    """The call names one of TOOLS and its arguments satisfy that tool's parameters (the
    schemas above: required keys, no others, enums and integers)."""
    tool = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}.get(call.name)
    if tool is None:
        return False
    args = json.loads(call.arguments)
    if not set(tool["required"]) <= set(args) <= set(tool["properties"]):
        return False
    for key, value in args.items():
        spec = tool["properties"][key]
        if "enum" in spec and value not in spec["enum"]:
            return False
        if spec["type"] == "integer" and not (
            isinstance(value, int) and spec["minimum"] <= value <= spec["maximum"]
        ):
            return False
    return True


# ---- reading calls back (vLLM's hermes and llama3_json parsers' cases) ---------------------

HERMES_CASES = [
    ("Hello there.", "Hello there.", []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}',
        "Let me check.\n",
        [
            ToolCall("add", '{"a": 1, "b": 2}'),
            ToolCall("get_weather", '{"city": "Rome", "unit": "c"}'),
        ],
    ),
    # Not JSON inside the tags: the answer stays text.
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
]

LLAMA3_CASES = [
    ("The answer is 4.", "The answer is 4.", []),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "add", "arguments": {"a": 3, "b": 4}}',
        None,
        [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("add", '{"a": 3, "b": 4}')],
    ),
    ('{"not": "a call"}', '{"not": "a call"}', []),
]


MISTRAL_CASES = [
    ("Hello there.", "Hello there.", []),
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "add", "arguments": {"a": 3, "b": 4}}]',
        "Sure. ",
        [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("add", '{"a": 3, "b": 4}')],
    ),
    ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
]
# vLLM's granite parser cases: the marker, then a JSON list.
GRANITE_CASES = [
    ("Paris is sunny.", "Paris is sunny.", []),
    (
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        'On it. <|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
        "On it. ",
        [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("get_weather", '{"city": "Rome"}')],
    ),
    ("<|tool_call|>[oops", "<|tool_call|>[oops", []),
]
# vLLM's qwen3_coder parser cases: each value typed by the tool's schema (a string as written).
XML_CASES = [
    ("Paris is sunny.", "Paris is sunny.", []),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        "Let me check.\n\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
        "<parameter=b>\n-2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\n12\n</parameter>\n</function>\n</tool_call>",
        "Let me check.\n\n",
        [ToolCall("add", '{"a": 1, "b": -2}'), ToolCall("get_weather", '{"city": "12"}')],
    ),
    ("<tool_call>\nnot a call", "<tool_call>\nnot a call", []),
]
FORMAT_CASES = (
    [(HermesFormat(), *c) for c in HERMES_CASES]
    + [(Llama3JsonFormat(), *c) for c in LLAMA3_CASES]
    + [(MistralFormat(), *c) for c in MISTRAL_CASES]
    + [(GraniteFormat(), *c) for c in GRANITE_CASES]
    + [(XmlFormat(TOOLS), *c) for c in XML_CASES]
)
FORMATS = [HermesFormat(), Llama3JsonFormat(), MistralFormat(), GraniteFormat(), XmlFormat(TOOLS)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), FORMAT_CASES)
def test_parse(fmt, text, content, calls):
    assert fmt.parse(text) == (content, calls)


def _stream_calls(fmt, pieces) -> tuple[str, list[ToolCall], bool, list[int]]:
    """The content, the calls (their pieces joined) and whether the answer ended as calls, of
    an answer streamed in `pieces`; and after which piece each call's name went out."""
    stream, content, names, arguments, named = ToolCallStream(fmt), "", {}, {}, []
    for i, piece in enumerate(pieces):
        sent, deltas = stream.feed(piece)
        content += sent
        for d in deltas:
            if d.name is not None:
                names[d.index] = d.name
                named.append(i)
            arguments[d.index] = arguments.get(d.index, "") + d.arguments
    rest, ended = stream.finish()
    calls = [ToolCall(names[i], arguments[i]) for i in sorted(names)]
    return content + rest, calls, ended, named


@pytest.mark.parametrize(("fmt", "text"), [(f, text) for f, text, _, _ in FORMAT_CASES])
def test_streamed_in_pieces_reads_as_whole(fmt, text):
    """Fed in pieces of every size, the content sent along the way plus what the end gives
    equals the whole text's content, the calls' pieces add up to the same calls, and nothing
    of a call leaks out as content."""
    content, calls = fmt.parse(text)
    for size in (1, 2, 3, 7, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        sent, streamed, ended, _ = _stream_calls(fmt, pieces)
        assert (streamed, ended) == (calls, bool(calls))
        assert sent == (content or "" if calls else text)
        if calls:
            assert "<tool_call>" not in sent and "{" not in sent and "[TOOL" not in sent
            assert "<|tool" not in sent


def _random_value(rng, depth=0):
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        alphabet = 'ab "\\/\n\t\u00e9\u4e2d\U0001f600<>{}[],:;\x01'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind == "int":
        return rng.randrange(-(10**12), 10**12)
    if kind == "float":
        return rng.choice([0.5, -1.25, 1e-7, 3.0, 123456.789, 1e22])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def _written(rng, value) -> str:
    """`value` as a model may write JSON: any spacing, escaped or not, numbers spelt apart."""
    text = json.dumps(
        value,
        ensure_ascii=rng.random() < 0.5,
        indent=rng.choice([None, 2]),
        separators=rng.choice([(",", ":"), (", ", ": "), (" ,", " : ")]),
    )
    return re.sub(r"(?<=[\s:\[,])3\.0(?=[\s,\]}])", "3.00", text)  # read back 3.0


@pytest.mark.parametrize("seed", range(6))
def test_streamed_arguments_equal_whole_on_random_json(seed):
    """Random arguments (nested, escapes, surrogate pairs, numbers and literals), written in
    every JSON spacing, in Hermes', Llama 3's, Mistral's and Granite's layouts, with "name"
    before or after them, fed in random pieces: the pieces add up to the whole answer's
    arguments, and a call's name goes out before its object ends."""
    import random

    rng = random.Random(seed)
    for _ in range(40):
        calls = []
        for _ in range(rng.randrange(1, 3)):
            value = {f"p{i}": _random_value(rng) for i in range(rng.randrange(4))}
            if rng.random() < 0.15:
                value = json.dumps(value)  # arguments sent as a JSON string
            calls.append(("f" + str(rng.randrange(9)), value))

        def objects(key: str, calls=calls) -> list[str]:
            out = []
            for name, value in calls:
                parts = [f'"name": "{name}"', f'"{key}": {_written(rng, value)}']
                out.append("{" + ", ".join(parts[:: rng.choice([1, -1])]) + "}")
            return out

        texts = [
            (
                HermesFormat(),
                "Sure. "
                + "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects("arguments")),
            ),
            (Llama3JsonFormat(), "; ".join(objects("parameters"))),
            (MistralFormat(), "[TOOL_CALLS][" + ", ".join(objects("arguments")) + "]"),
            (GraniteFormat(), "<|tool_call|>[" + ", ".join(objects("arguments")) + "]"),
        ]
        for fmt, text in texts:
            content, whole = fmt.parse(text)
            assert [c.name for c in whole] == [name for name, _ in calls], text
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 30))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            sent, streamed, ended, _ = _stream_calls(fmt, pieces)
            assert (sent, streamed, ended) == (content or "", whole, True), text


@pytest.mark.parametrize("seed", range(4))
def test_streamed_xml_calls_equal_whole_on_random_values(seed):
    """Qwen3-Coder's calls with random values written as its template writes them (strings as
    they are, with line breaks, `<`, quotes and a trailing newline; other types as JSON), fed
    in random pieces: the pieces add up to the whole answer's arguments."""
    import random

    rng = random.Random(seed)
    types = {"s": "string", "i": "integer", "n": "number", "b": "boolean", "o": "object"}
    properties = {key: {"type": kind} for key, kind in types.items()}
    fmt = XmlFormat([{"function": {"name": "f", "parameters": {"properties": properties}}}])
    for _ in range(60):
        blocks = []
        for _ in range(rng.randrange(1, 3)):
            params = []
            for key in rng.sample(sorted(types), rng.randrange(len(types) + 1)):
                value = {
                    "s": "".join(
                        rng.choice('ab <>"\\\n\u00e9{}/') for _ in range(rng.randrange(15))
                    ),
                    "i": str(rng.randrange(-99, 99)),
                    "n": str(rng.choice([0.5, -2.25, 1e-3])),
                    "b": rng.choice(["true", "false"]),
                    "o": json.dumps(_random_value(rng, 2)),
                }[key]
                params.append(f"<parameter={key}>\n{value}\n</parameter>\n")
            blocks.append(f"<tool_call>\n<function=f>\n{''.join(params)}</function>\n</tool_call>")
        text = rng.choice(["", "Let me see.\n\n"]) + "\n".join(blocks)
        content, whole = fmt.parse(text)
        assert len(whole) == len(blocks), text
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 40)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stream_calls(fmt, pieces)[:3] == (content or "", whole, True), text


def test_call_streams_before_it_ends():
    """A call's name goes out once written and its arguments as they come: a long string
    argument, fed a character at a time, arrives in many pieces before the call's end; a
    Qwen3-Coder string parameter too, and an answer cut inside a call ends not as calls."""
    body = "print('hello')\n" * 8
    for fmt, text, name_at in [
        (
            HermesFormat(),
            '<tool_call>\n{"name": "write", "arguments": {"code": ' + json.dumps(body) + "}}",
            len('<tool_call>\n{"name": "write"'),
        ),
        (
            XmlFormat(
                [
                    {
                        "function": {
                            "name": "write",
                            "parameters": {"properties": {"code": {"type": "string"}}},
                        }
                    }
                ]
            ),
            f"<tool_call>\n<function=write>\n<parameter=code>\n{body}\n</parameter>\n</function>",
            len("<tool_call>\n<function=write>"),
        ),
    ]:
        stream, pieces = ToolCallStream(fmt), []
        for i, c in enumerate(text):
            _, deltas = stream.feed(c)
            pieces += [(i, d) for d in deltas]
        assert pieces[0][0] == name_at - 1 and pieces[0][1].name == "write"
        before_end = [d.arguments for i, d in pieces if i < len(text) - 20]
        assert len(before_end) > 40, before_end
        assert json.loads("".join(d.arguments for _, d in pieces)) == {"code": body}
        cut = ToolCallStream(fmt)
        cut.feed(text[: len(text) // 2])
        assert cut.finish() == ("", False)


def test_tool_format_of_real_templates():
    formats = {p.stem: tool_format(p.read_text()) for p in TEMPLATES.glob("*.jinja")}
    names = {stem: (f.name if f else None) for stem, f in formats.items()}
    assert names["Qwen-Qwen2.5-7B-Instruct"] == names["Qwen-Qwen3-0.6B"] == "hermes"
    assert names["compact-tools-thinking"] == "hermes"
    assert names["meta-llama-Llama-3.1-8B-Instruct"] == "llama3_json"
    assert names["meta-llama-Llama-3.2-3B-Instruct"] == "llama3_json"
    assert names["ibm-granite-granite-3.3-2B-Instruct"] == "granite"
    assert names["Qwen-Qwen3.5-4B"] == "qwen3_coder"
    assert (
        names["google-gemma-2-2b-it"] is None and names["microsoft-Phi-3.5-mini-instruct"] is None
    )
    assert tool_format(None) is None


# ---- reasoning ---------------------------------------------------------------------------

REASONING_CASES = [
    # (answer, whether the prompt opened the reasoning, reasoning, content)
    ("<think>\nLet me add.\n</think>\n\nIt is 4.", False, "Let me add.", "It is 4."),
    ("Let me add.\n</think>\n\nIt is 4.", True, "Let me add.", "It is 4."),
    ("It is 4.", False, None, "It is 4."),
    ("\n\nStill thinking, cut short", True, "Still thinking, cut short", ""),
    ("<think>\n\n</think>\n\nIt is 4.", False, "", "It is 4."),
    ("<thinking> is a tag", False, None, "<thinking> is a tag"),
    ("a </thin b </think>c", True, "a </thin b ", "c"),
]


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), REASONING_CASES)
def test_split_reasoning(tiny_checkpoint, tmp_path, text, thinking, reasoning, content):
    """The split of each case; where the answer closes its reasoning, the one Qwen3's own
    template makes of it when it renders the answer back in the history."""
    assert split_reasoning(text, thinking) == (reasoning, content)
    if "</think>" in text:
        source = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
        tok = Tokenizer.from_dir(_with_template(tiny_checkpoint, tmp_path / "qwen3", source))
        turn = [HISTORY[1], {"role": "assistant", "content": text}]
        rendered = tok.apply_chat_template(turn, add_generation_prompt=False)
        expected = f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}<|im_end|>\n"
        assert rendered.endswith(expected), rendered


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), REASONING_CASES)
def test_reasoning_streamed_in_pieces_reads_as_whole(text, thinking, reasoning, content):
    for size in (1, 2, 3, 5, len(text)):
        stream = ReasoningStream(thinking)
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        pieces.append(stream.finish())
        assert "".join(r for r, _ in pieces) == (reasoning or "")
        assert "".join(c for _, c in pieces) == content


def test_thinking_switch_of_qwen3_equals_transformers(tiny_checkpoint, tmp_path):
    """chat_template_kwargs reach the template: Qwen3's enable_thinking false closes an empty
    reasoning in the prompt, as transformers renders it; DeepSeek-R1's prompt opens one."""
    transformers = pytest.importorskip("transformers")
    for i, (name, kwargs, opened) in enumerate(
        [
            ("Qwen-Qwen3-0.6B", {"enable_thinking": False}, None),
            ("Qwen-Qwen3-0.6B", {}, False),
            ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {"enable_thinking": True}, True),
        ]
    ):
        source = (TEMPLATES / f"{name}.jinja").read_text()
        directory = _with_template(tiny_checkpoint, tmp_path / str(i), source)
        ours = Tokenizer.from_dir(directory).chat_prompt(HISTORY[:2], template_kwargs=kwargs)
        reference = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
            HISTORY[:2], tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert ours == reference
        assert opens_reasoning(ours) == opened
        assert ours.endswith("<think>\n\n</think>\n\n") == (kwargs == {"enable_thinking": False})


@pytest.mark.parametrize(
    ("opened", "text", "taken"),
    [
        (True, 'I think </b> 3.</think>\n\n{"a": 3}', True),
        (True, '{"a": 3}', False),  # the prompt opened the reasoning: it must close
        (False, '<think>\nhm</think>\n{"a": 3}', True),
        (False, '{"a": 3}', True),  # the model need not think
        (False, 'hm</think>{"a": 3}', False),
        (True, 'hm</think>{"a": "x"}', False),  # the answer still obeys the schema
        (True, "hm</think>\nyes", True),  # choices: a Lark grammar inside
        (False, "<think>a</think>maybe", False),
    ],
)
def test_a_grammar_after_reasoning(tiny_checkpoint, opened, text, taken):
    """A grammar under a reasoning template constrains the answer only: the reasoning before
    `</think>` is free (required when the prompt opened it, optional otherwise)."""
    llguidance = pytest.importorskip("llguidance")
    from aotgen.runtime.grammar import Grammar

    tok = Tokenizer.from_dir(tiny_checkpoint)
    table = llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=[0])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = Grammar.choice(["yes", "no"]) if text[-1] != "}" else Grammar.json_schema(schema)
    grammar = answer.after_reasoning(opened)
    matcher = llguidance.LLMatcher(table, grammar.text(), log_level=0)
    ids = tok.encode(text)
    assert (all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()) == taken


def _with_template(checkpoint: Path, directory: Path, source: str) -> Path:
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": source}))
    return directory


# ---- prompts with tools: the template's own rendering, as transformers does it -------------

HISTORY = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",  # null in OpenAI's request: "" to templates (ChatMessage.for_template)
        "tool_calls": [
            {
                "id": "abcDEF123",  # Mistral's template takes nine letters and digits
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temperature": 21}'},
]


@pytest.mark.parametrize(
    "template",
    [
        "Qwen-Qwen2.5-7B-Instruct",
        "Qwen-Qwen3-0.6B",
        "meta-llama-Llama-3.2-3B-Instruct",
        "mistralai-Mistral-Nemo-Instruct-2407",
        "ibm-granite-granite-3.3-2B-Instruct",
        "Qwen-Qwen3.5-4B",
    ],
)
@pytest.mark.parametrize("history", [False, True], ids=["question", "after-a-call"])
def test_prompt_with_tools_equals_transformers(tiny_checkpoint, tmp_path, template, history):
    transformers = pytest.importorskip("transformers")
    source = (TEMPLATES / f"{template}.jinja").read_text()
    directory = _with_template(tiny_checkpoint, tmp_path / "tok", source)
    messages = HISTORY if history else HISTORY[:2]
    ours = Tokenizer.from_dir(directory).chat_prompt(messages, tools=TOOLS)
    reference = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours == reference
    assert "get_weather" in ours and "add" in ours


def test_calls_qwen35_template_writes_read_back(tiny_checkpoint, tmp_path):
    """Qwen3.5's template writes an assistant's calls (a string, integers); the qwen3_coder
    format reads the same calls back from that text."""
    source = (TEMPLATES / "Qwen-Qwen3.5-4B.jinja").read_text()
    tok = Tokenizer.from_dir(_with_template(tiny_checkpoint, tmp_path / "tok", source))
    calls = [("get_weather", {"city": "Paris"}), ("add", {"a": 12, "b": -3})]
    answer = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}}
            for name, args in calls
        ],
    }
    rendered = tok.chat_prompt([HISTORY[1], answer], tools=TOOLS, add_generation_prompt=False)
    text = rendered.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    assert XmlFormat(TOOLS).parse(text)[1] == [
        ToolCall(name, json.dumps(args)) for name, args in calls
    ]


# ---- an answer that continues the final assistant message --------------------------------

PREFILLED = [
    {"role": "user", "content": "Give me JSON."},
    {"role": "assistant", "content": 'Sure: {"a": '},
]


@pytest.mark.parametrize(
    "template",
    [
        None,  # the tiny checkpoint's own ChatML
        "Qwen-Qwen2.5-7B-Instruct",
        "meta-llama-Llama-3.2-3B-Instruct",
        "google-gemma-2-2b-it",
    ],
)
@pytest.mark.parametrize("final", ['Sure: {"a": ', " padded ", "<|im_start|>x"])
def test_continue_final_message_equals_transformers(tiny_checkpoint, tmp_path, template, final):
    """The prompt ends inside the final assistant message, as transformers'
    `continue_final_message` cuts it (trimmed content too); content with control-token text
    still encodes as text, the prompt's ids ending with the content's own."""
    transformers = pytest.importorskip("transformers")
    directory = tiny_checkpoint
    if template is not None:
        source = (TEMPLATES / f"{template}.jinja").read_text()
        directory = _with_template(tiny_checkpoint, tmp_path / "tok", source)
    messages = [PREFILLED[0], {"role": "assistant", "content": final}]
    if template and "gemma" not in template:  # the template renders it (not plain ChatML)
        messages.insert(0, {"role": "system", "content": "Be brief."})
    tok = Tokenizer.from_dir(directory)
    ours = tok.chat_prompt(messages, add_generation_prompt=False, continue_final=True)
    reference = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == reference
    ids = tok.encode_chat(messages, add_generation_prompt=False, continue_final=True)
    if "<|im_start|>" in final:
        assert tok.decode(ids).endswith(final)
        assert ids.count(tok.token_to_id("<|im_start|>")) == reference.count("<|im_start|>") - 1
    else:
        assert ids == tok.encode(ours)
    with pytest.raises(ValueError, match="not both"):
        tok.chat_prompt(messages, continue_final=True)
    with pytest.raises(ValueError, match="final assistant message"):
        tok.chat_prompt(messages[:1], add_generation_prompt=False, continue_final=True)


# ---- a forced call: well formed whatever the model, arguments matching the schema ----------


def _completed(fmt, text: str) -> str:
    """An answer cut short, up to the last call it completed."""
    if isinstance(fmt, HermesFormat | XmlFormat):
        return text[: text.rfind(fmt.close) + len(fmt.close)]
    if isinstance(fmt, MistralFormat):
        return text[: text.rfind("}, {") + 1] + "]"
    return text[: text.rfind("; ")]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_forced_calls_parse_and_match_the_schema(tiny_package, fmt):
    """A random model under the grammar of tool_choice "required" (greedy and 6 seeds) and of
    one named function: every answer ends (bounded arguments, no free whitespace) and reads
    back as one call of the tools with arguments that satisfy their schemas. With parallel
    calls allowed, every call it completes does."""
    engine = Engine.load(tiny_package)
    prompt = engine.tokenizer.encode("What is the weather in Paris?")
    configs = [SamplingParams()] + [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    for sampling in configs:
        one = GenerationConfig(100, sampling=sampling, grammar=fmt.grammar(TOOLS, False))
        result = engine.generate(prompt, one)
        content, calls = fmt.parse(result.text)
        assert result.finish_reason == "eos" and content is None, result.text
        assert len(calls) == 1 and matches_schema(calls[0]), result.text

        many = GenerationConfig(130, sampling=sampling, grammar=fmt.grammar(TOOLS, True))
        result = engine.generate(prompt, many)
        text = result.text if result.finish_reason == "eos" else _completed(fmt, result.text)
        content, calls = fmt.parse(text)
        assert content is None and calls and all(matches_schema(c) for c in calls), result.text
    named = GenerationConfig(120, grammar=fmt.grammar([ADD], parallel=False))
    result = engine.generate(prompt, named)
    assert [c.name for c in fmt.parse(result.text)[1]] == ["add"], result.text


# ---- tool_choice "auto": free text, and a call the model opens well formed ------------------

WRITE = {
    "type": "function",
    "function": {
        "name": "write",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
            "required": ["path", "text"],
        },
    },
}
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]


def _marker_tokenizer(out: Path) -> Tokenizer:
    """The tiny tokenizer with the call markers as special tokens (as some vocabularies have
    them), so a model can write a marker as one token."""
    from tiny import SPECIALS, make_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, specials=[*SPECIALS, *MARKERS])
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "compact-tools-thinking.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(out)


def _plain_piece(tok: Tokenizer, token: int) -> bool:
    """A token of whole UTF-8 characters, not a special one: what a grammar of text takes
    (llguidance refuses bytes that cannot become UTF-8, and special tokens but eos)."""
    try:
        tok.token_bytes(token).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return token not in tok.special_tokens.values()


def _taken(tok: Tokenizer, grammar, ids: list[int]) -> tuple[bool, bool]:
    """Whether the grammar takes every id, and whether it may end there (eos)."""
    from aotgen.runtime.grammar import GrammarTokens

    matcher = GrammarTokens(tok, 320).constraint(grammar).matcher
    return all(matcher.consume_token(i) for i in ids), matcher.is_accepting()


@pytest.mark.parametrize("special", [False, True], ids=["typed-marker", "special-marker"])
@pytest.mark.parametrize(
    "fmt",
    [HermesFormat(), XmlFormat([*TOOLS, WRITE]), MistralFormat(), Llama3JsonFormat()],
    ids=lambda f: f.name,
)
def test_auto_grammar_leaves_text_free_and_makes_a_call_well_formed(
    tiny_checkpoint, tmp_path, fmt, special
):
    """The grammar of tool_choice "auto" (llama.cpp's lazy grammar): any text that holds no
    call marker, ending anywhere (a marker's first characters too); from the marker on, calls
    of the tools only, with arguments their schemas take; the marker typed out or, where the
    vocabulary has it, as its special token. A Qwen3-Coder string value may run over lines and
    hold `<`, as a file does, where a forced call's is one line."""
    tok = _marker_tokenizer(tmp_path / "tok") if special else Tokenizer.from_dir(tiny_checkpoint)
    tools = [*TOOLS, WRITE]
    grammar = fmt.auto_grammar(tools, False, tok.special_tokens)
    marker = getattr(fmt, "open", Llama3JsonFormat.python_tag)
    assert (marker in tok.special_tokens) == special
    for text in ["Paris is sunny.", "if a < b: tool_call(x) > y", "Hmm <tool_ca [TOOL_", ""]:
        assert _taken(tok, grammar, tok.encode(text)) == (True, True), text
    # Random answers of whole characters without a marker: the grammar takes every token.
    import random

    rng = random.Random(0)
    plain = [i for i in range(tok.vocab_size) if _plain_piece(tok, i)]
    for _ in range(100):
        ids = [rng.choice(plain) for _ in range(rng.randrange(1, 40))]
        if fmt.start(tok.decode(ids)) is None:
            assert _taken(tok, grammar, ids) == (True, True), tok.decode(ids)
    call, wrong, long_text, two = _auto_cases(fmt)
    if isinstance(fmt, XmlFormat):
        forced = fmt.grammar(tools, False, tok.special_tokens)
        assert not _taken(tok, forced, tok.encode(long_text))[0]  # a forced string: one line
    text_first = " " if isinstance(fmt, Llama3JsonFormat) else "Let me check.\n"
    for answer in (call, text_first + call, long_text):
        assert _taken(tok, grammar, tok.encode(answer)) == (True, True), answer
        assert fmt.parse(answer)[1], answer
    for answer in wrong:
        assert not _taken(tok, grammar, tok.encode(answer))[0], answer
    assert not _taken(tok, grammar, tok.encode(two))[0]  # parallel_tool_calls false: one
    assert _taken(tok, fmt.auto_grammar(tools, True, tok.special_tokens), tok.encode(two))[0]
    if isinstance(fmt, Llama3JsonFormat):  # led by <|python_tag|>, as token or typed out
        for tag in (tok.encode(marker), tok.encode_text(marker)):
            assert _taken(tok, grammar, tag + tok.encode(call)) == (True, True)
            assert not _taken(tok, grammar, tag + tok.encode(wrong[0]))[0]
    elif special:  # typed out, the marker opens a call as well
        typed = tok.encode("Ok ") + tok.encode_text(call)
        assert _taken(tok, grammar, typed) == (True, True)
        assert not _taken(tok, grammar, tok.encode("Ok ") + tok.encode_text(wrong[0]))[0]


def _auto_cases(fmt) -> tuple[str, list[str], str, str]:
    """A call of `add` in `fmt`, two calls its schema refuses, a `write` call whose text runs
    over lines, and two calls of `add`."""
    if isinstance(fmt, XmlFormat):
        call = (
            "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n"
            "</parameter>\n</function>\n</tool_call>"
        )
        wrong = [call.replace("=add", "=sub"), call.replace("\n2\n", "\n20\n")]
        long_text = (
            "<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n"
            "<parameter=text>\nx = 1\nif x < 2:\n    pass\n</parameter>\n</function>\n</tool_call>"
        )
        return call, wrong, long_text, call + "\n" + call
    key = "parameters" if isinstance(fmt, Llama3JsonFormat) else "arguments"
    obj = json.dumps({"name": "add", key: {"a": 1, "b": 2}})
    write = obj.replace('"add"', '"write"').replace(
        '"a": 1, "b": 2', '"path": "a.py", "text": "x = 1\\nif x < 2: pass"'
    )
    wrong = [obj.replace('"add"', '"sub"'), obj.replace('"b": 2', '"b": 20')]
    if isinstance(fmt, HermesFormat):
        block = "<tool_call>\n{}\n</tool_call>".format
        return block(obj), [block(w) for w in wrong], block(write), block(obj) + "\n" + block(obj)
    if isinstance(fmt, Llama3JsonFormat):
        return obj, wrong, write, f"{obj}; {obj}"
    array = "[TOOL_CALLS][{}]".format
    return array(obj), [array(w) for w in wrong], array(write), array(f"{obj}, {obj}")


@pytest.mark.parametrize(
    "fmt",
    [HermesFormat(), XmlFormat(TOOLS), MistralFormat(), Llama3JsonFormat()],
    ids=lambda f: f.name,
)
def test_a_random_model_that_opens_a_call_under_auto_writes_it_well_formed(
    tiny_package, tmp_path, fmt
):
    """A random model pushed to open a call (a logit bias on the marker's special token),
    sampled with six seeds: under the auto grammar every answer is one call of the tools
    whose arguments match the schemas; without it, its answers are not calls."""
    from aotgen.package.manifest import read_manifest, write_manifest
    from aotgen.runtime.rules import Penalties

    package = Path(shutil.copytree(tiny_package, tmp_path / "pkg"))
    _marker_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / name, package / "tokenizer" / name)
    write_manifest(package, read_manifest(package))
    engine = Engine.load(package)
    tok = engine.tokenizer
    prompt = tok.encode("What is the weather in Paris?")
    marker = getattr(fmt, "open", Llama3JsonFormat.python_tag)
    push = Penalties(logit_bias=((tok.token_to_id(marker), 100.0),))
    grammar = fmt.auto_grammar(TOOLS, False, tok.special_tokens)
    free_calls = 0
    for seed in range(6):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        config = GenerationConfig(140, sampling=sampling, penalties=push, grammar=grammar)
        result = engine.generate(prompt, config)
        content, calls = fmt.parse(result.text)
        assert result.finish_reason == "eos" and content is None, result.text
        assert len(calls) == 1 and matches_schema(calls[0]), result.text
        free = engine.generate(prompt, GenerationConfig(140, sampling=sampling, penalties=push))
        free_calls += bool(fmt.parse(free.text)[1])
    assert free_calls == 0


# ---- aotgen serve: the openai client's tools ------------------------------------------------


@pytest.fixture(scope="module")
def tools_server(tiny_batch_package, tmp_path_factory):
    """`aotgen serve` on the tiny batch package with a Hermes-style template that takes tools
    (tests/data/chat_templates/compact-tools-thinking.jinja), its manifest hashed again."""
    pytest.importorskip("fastapi")
    from test_serve import Server

    dest = tmp_path_factory.mktemp("tools") / "pkg"
    package = with_chat_template(tiny_batch_package, dest, "compact-tools-thinking.jinja")
    names = [arg for name in ("m", "m-alias", "m") for arg in ("--served-model-name", name)]
    server = Server(package, *names)
    server.package = package
    yield server
    server.close()


QUESTION = [{"role": "user", "content": "Hi"}]  # the tiny package has 160 positions


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def _as_calls(tool_calls) -> list[ToolCall]:
    return [ToolCall(c.function.name, c.function.arguments) for c in tool_calls]


def _joined(pieces) -> tuple[list[ToolCall], list[str]]:
    """Streamed call pieces joined by index as OpenAI's clients join them: the first names the
    call and carries its id; and the ids."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.id is not None:
            calls[piece.index] = [piece.id, piece.function.name, ""]
        calls[piece.index][2] += piece.function.arguments or ""
    joined = [calls[i] for i in sorted(calls)]
    return [ToolCall(name, arguments) for _, name, arguments in joined], [i for i, _, _ in joined]


def test_served_model_names(tools_server):
    """--served-model-name, two names (one given twice): /v1/models lists each once and
    /v1/models/NAME gives one, an answer carries the name its request gave, and a name the
    server does not serve is OpenAI's 404 `model_not_found`."""
    openai = pytest.importorskip("openai")
    client = _client(tools_server)
    assert [m.id for m in client.models.list().data] == ["m", "m-alias"]
    assert client.models.retrieve("m-alias").id == "m-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    ask = {"messages": QUESTION, "max_tokens": 2, "temperature": 0}
    for name in ("m", "m-alias"):
        assert client.chat.completions.create(model=name, **ask).model == name
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model=tools_server.package.name, **ask)
    error = refused.value.body
    assert (error["code"], error["param"]) == ("model_not_found", "model"), error
    assert "'m', 'm-alias'" in error["message"]


def test_required_and_named_calls_whole_and_streamed(tools_server):
    """tool_choice "required": the answer is a call (finish_reason "tool_calls", an id, no
    content) whose arguments match the schemas; streamed, the same call arrives; a named
    function is the one called. (One call each: parallel calls from a random model go on
    until max_tokens.)"""
    client = _client(tools_server)
    ask = {"model": "m", "messages": QUESTION, "tools": TOOLS, "max_tokens": 94, "temperature": 0}
    ask["parallel_tool_calls"] = False
    # Thinking off: a random model that opened a reasoning would never close it.
    ask["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    whole = client.chat.completions.create(**ask, tool_choice="required")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    calls = _as_calls(choice.message.tool_calls)
    assert len(calls) == 1 and matches_schema(calls[0])
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)

    content, pieces, finish = "", [], None
    for event in client.chat.completions.create(**ask, tool_choice="required", stream=True):
        for c in event.choices:
            content += c.delta.content or ""
            pieces += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    streamed, ids = _joined(pieces)
    assert (content, streamed, finish) == ("", calls, "tool_calls")
    assert ids[0].startswith("call_") and len(pieces) > 3  # the arguments came in pieces

    named = {"type": "function", "function": {"name": "add"}}
    answer = client.chat.completions.create(**ask, tool_choice=named).choices[0]
    assert [c.name for c in _as_calls(answer.message.tool_calls)] == ["add"]
    assert matches_schema(_as_calls(answer.message.tool_calls)[0])


def _auto(tok: Tokenizer, prompt: list[int], fmt, parallel: bool = True):
    """The grammar serve gives a tool_choice "auto" answer: the format's, after reasoning."""
    from aotgen.runtime.reasoning import thinking_of

    grammar = fmt.auto_grammar(TOOLS, parallel, tok.special_tokens)
    thinking = thinking_of(tok, prompt)
    return grammar if thinking is None else grammar.after_reasoning(opened=thinking)


def test_auto_answers_text_as_the_engine_does(tools_server):
    """tool_choice "auto" with a model that answers in text: the engine's text under the auto
    grammar, whole and streamed, no calls; the prompt is the template's with the tools."""
    client = _client(tools_server)
    engine = Engine.load(tools_server.package)
    prompt = engine.tokenizer.encode_chat(QUESTION, tools=TOOLS)
    grammar = _auto(engine.tokenizer, prompt, HermesFormat())
    expected = engine.generate(prompt, GenerationConfig(12, grammar=grammar)).text
    ask = {"model": "m", "messages": QUESTION, "tools": TOOLS, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**ask)
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.choices[0].message.content == expected and not whole.choices[0].message.tool_calls
    streamed = "".join(
        c.delta.content or ""
        for e in client.chat.completions.create(**ask, stream=True)
        for c in e.choices
    )
    assert streamed == expected


def test_auto_calls_are_well_formed_through_the_openai_client(tiny_batch_package, tmp_path):
    """tool_choice "auto" served (the vocabulary's special tokens passed to the grammar): a
    random model pushed to open a call (logit_bias on the `<tool_call>` token) answers with
    one call of the tools matching their schemas, finish_reason tool_calls, the same whole and
    streamed, for three seeds; pushed away from it, its text is the engine's under the same
    grammar."""
    from test_serve import Server

    from aotgen.package.manifest import read_manifest, write_manifest
    from aotgen.runtime.rules import Penalties

    package = Path(shutil.copytree(tiny_batch_package, tmp_path / "pkg"))
    marker = _marker_tokenizer(tmp_path / "tok").token_to_id(MARKERS[0])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / name, package / "tokenizer" / name)
    write_manifest(package, read_manifest(package))
    server = Server(package, "--served-model-name", "m")
    try:
        client = _client(server)
        ask = {"model": "m", "messages": QUESTION, "tools": TOOLS, "max_tokens": 94}
        ask |= {"parallel_tool_calls": False, "temperature": 1.0, "logit_bias": {marker: 100}}
        ask["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
        for seed in range(3):
            choice = client.chat.completions.create(**ask, seed=seed).choices[0]
            calls = _as_calls(choice.message.tool_calls or [])
            assert choice.finish_reason == "tool_calls", choice.message
            assert len(calls) == 1 and matches_schema(calls[0]), calls
            pieces = []
            for event in client.chat.completions.create(**ask, seed=seed, stream=True):
                pieces += [p for c in event.choices for p in c.delta.tool_calls or []]
            assert _joined(pieces)[0] == calls
        engine = Engine.load(package)
        prompt = engine.tokenizer.encode_chat(
            QUESTION, tools=TOOLS, template_kwargs={"enable_thinking": False}
        )
        away = Penalties(logit_bias=((marker, -100.0),))
        grammar = _auto(engine.tokenizer, prompt, HermesFormat(), parallel=False)
        expected = engine.generate(prompt, GenerationConfig(12, penalties=away, grammar=grammar))
        expected = expected.text
        text = client.chat.completions.create(
            **ask | {"temperature": 0, "max_tokens": 12, "logit_bias": {marker: -100}}
        )
        assert text.choices[0].message.content == expected
    finally:
        server.close()


def test_a_conversation_with_calls_and_results(tools_server):
    """An assistant turn with tool_calls (arguments as OpenAI's JSON text) and the tool's
    answer render through the template as the Python tokenizer renders them."""
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "abcDEF123",  # Mistral's template takes nine letters and digits
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    client = _client(tools_server)
    answer = client.chat.completions.create(
        model="m", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    engine = Engine.load(tools_server.package)
    rendered = [
        history[0],
        {
            **history[1],
            "content": "",
            "tool_calls": [
                {
                    **history[1]["tool_calls"][0],
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        history[2],
    ]
    prompt = engine.tokenizer.encode_chat(rendered, tools=TOOLS)
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        in engine.tokenizer.decode(prompt)
    )
    assert answer.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "NAME one of tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "no response_format",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "is not JSON",
        ),
    ],
)
def test_bad_tool_requests(tools_server, change, message):
    httpx = pytest.importorskip("httpx")
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 4} | change
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_reasoning_apart_whole_and_streamed(tools_server):
    """With the template's thinking on (chat_template_kwargs), the prompt opens the reasoning:
    a random model never closes it, so its whole answer is reasoning_content, whole and
    streamed; with it off the answer is content, as the engine's text."""
    client = _client(tools_server)
    engine = Engine.load(tools_server.package)
    for thinking in (True, False):
        kwargs = {"enable_thinking": thinking}
        prompt = engine.tokenizer.encode_chat(QUESTION, template_kwargs=kwargs)
        assert engine.tokenizer.decode(prompt).endswith("<think>\n") == thinking
        text = engine.generate(prompt, GenerationConfig(12)).text
        ask = {"model": "m", "messages": QUESTION, "max_tokens": 12, "temperature": 0}
        ask["extra_body"] = {"chat_template_kwargs": kwargs}
        message = client.chat.completions.create(**ask).choices[0].message
        reasoning, content = "", ""
        for event in client.chat.completions.create(**ask, stream=True):
            for c in event.choices:
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
                content += c.delta.content or ""
        if thinking:
            assert message.reasoning_content == reasoning == text.strip("\n") and text.strip()
            assert message.content == content == ""
        else:
            assert getattr(message, "reasoning_content", None) is None and reasoning == ""
            assert message.content == content == text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chat_template_kwargs": {"tools": []}}, "set by the request itself"),
    ],
)
def test_bad_reasoning_requests(tools_server, change, message):
    test_bad_tool_requests(tools_server, change, message)


def test_structured_answer_after_reasoning(tools_server):
    """A regex on a reasoning template constrains the answer, not the reasoning: with thinking
    off the content matches it; with the prompt opening the reasoning, a random model (which
    never closes it) reasons to max_tokens, as the engine does under the same grammar."""
    from aotgen.runtime.grammar import Grammar

    client = _client(tools_server)
    engine = Engine.load(tools_server.package)
    regex = "[a-z]{1,8}"
    ask = {"model": "m", "messages": QUESTION, "max_tokens": 20, "temperature": 0}
    ask["extra_body"] = {"structured_outputs": {"regex": regex}}
    ask["extra_body"]["chat_template_kwargs"] = {"enable_thinking": False}
    answer = client.chat.completions.create(**ask).choices[0]
    assert re.fullmatch(regex, answer.message.content), answer.message
    ask["extra_body"]["chat_template_kwargs"] = {"enable_thinking": True}
    answer = client.chat.completions.create(**ask).choices[0]
    prompt = engine.tokenizer.encode_chat(QUESTION, template_kwargs={"enable_thinking": True})
    grammar = Grammar("regex", regex).after_reasoning(opened=True)
    text = engine.generate(prompt, GenerationConfig(20, grammar=grammar)).text
    assert "</think>" not in text and answer.finish_reason == "length"
    assert answer.message.reasoning_content == text.strip("\n") and answer.message.content == ""


def test_thinking_token_budget_closes_the_reasoning(tools_server):
    """vLLM's thinking_token_budget (and aotgen's reasoning_budget_message): the answer is the
    engine's under the same budget, its reasoning cut with the message, the rest content,
    whole and streamed; a negative budget is a 400."""
    client = _client(tools_server)
    engine = Engine.load(tools_server.package)
    kwargs = {"enable_thinking": True}
    prompt = engine.tokenizer.encode_chat(QUESTION, template_kwargs=kwargs)
    config = GenerationConfig(24, reasoning_budget=5, reasoning_budget_message="Enough.")
    text = engine.generate(prompt, config).text
    reasoning, _, content = text.partition("</think>")
    assert reasoning.strip().endswith("Enough.") and content.strip()
    ask = {"model": "m", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    budget = {"thinking_token_budget": 5, "reasoning_budget_message": "Enough."}
    ask["extra_body"] = {"chat_template_kwargs": kwargs} | budget
    message = client.chat.completions.create(**ask).choices[0].message
    assert message.reasoning_content == reasoning.strip("\n")
    assert message.content == content.lstrip("\n")
    streamed = {"reasoning_content": "", "content": ""}
    for event in client.chat.completions.create(**ask, stream=True):
        for c in event.choices:
            for key in streamed:
                streamed[key] += getattr(c.delta, key, None) or ""
    assert streamed == {"reasoning_content": message.reasoning_content, "content": message.content}
    test_bad_tool_requests(tools_server, {"thinking_token_budget": -1}, "greater than or equal")


def test_the_servers_reasoning_budget_is_the_default(tools_server):
    """`serve --reasoning-budget 3 --reasoning-budget-message M`: a request without a budget
    gets the server's (the engine's answer under it), one with its own keeps it."""
    httpx = pytest.importorskip("httpx")
    from test_serve import Server

    engine = Engine.load(tools_server.package)
    kwargs = {"enable_thinking": True}
    prompt = engine.tokenizer.encode_chat(QUESTION, template_kwargs=kwargs)
    ask = {"messages": QUESTION, "max_tokens": 16, "temperature": 0}
    ask["chat_template_kwargs"] = kwargs
    args = ("--reasoning-budget", "3", "--reasoning-budget-message", "Enough.")
    server = Server(tools_server.package, *args)
    try:
        for own, budget in ((None, 3), (7, 7)):
            body = ask if own is None else ask | {"thinking_token_budget": own}
            got = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
            config = GenerationConfig(
                16, reasoning_budget=budget, reasoning_budget_message="Enough."
            )
            reasoning = engine.generate(prompt, config).text.partition("</think>")[0]
            assert got["choices"][0]["message"]["reasoning_content"] == reasoning.strip("\n")
    finally:
        server.close()


def test_a_chat_answer_continues_the_final_message(tools_server):
    """continue_final_message (with add_generation_prompt false): the prompt the engine runs
    ends inside the prefilled assistant message, and the answer continues it as the engine's
    own generation from those ids; with a generation prompt too, a 400."""
    engine = Engine.load(tools_server.package)
    ids = engine.tokenizer.encode_chat(PREFILLED, add_generation_prompt=False, continue_final=True)
    expected = engine.generate(ids, GenerationConfig(8)).text
    body = {"messages": PREFILLED, "max_tokens": 8, "temperature": 0}
    body |= {"continue_final_message": True, "add_generation_prompt": False}
    httpx = pytest.importorskip("httpx")
    url = f"{tools_server.url}/v1/chat/completions"
    answer = httpx.post(url, json=body).json()
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["choices"][0]["message"]["content"] == expected
    tokenized = httpx.post(f"{tools_server.url}/tokenize", json=body).json()
    assert tokenized["tokens"] == ids
    r = httpx.post(url, json=body | {"add_generation_prompt": True})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]


# ---- aotgen run --chat: the reasoning apart ---------------------------------------------------


def test_run_chat_shows_reasoning_apart_from_the_answer(tiny_package, tmp_path):
    """`aotgen run --chat` with a template that takes reasoning: the reasoning streams on stderr,
    the answer alone on stdout (its own line after the reasoning); `--json` holds them apart as
    `split_reasoning` does, beside the raw text. A regex makes the random model reason."""
    import subprocess
    import sys

    package = with_chat_template(tiny_package, tmp_path / "pkg", "compact-tools-thinking.jinja")
    answer = "<think>\nI think so.\n</think>\n\nYes, it is."
    args = [sys.executable, "-m", "aotgen", "run", str(package), "--chat", "Is it?"]
    args += ["--regex", re.escape(answer), "--max-new-tokens", "60", "--threads", "1"]
    streamed = subprocess.run(args, capture_output=True, text=True, check=True)
    assert streamed.stdout == "Yes, it is.\n"
    assert streamed.stderr.startswith("I think so.\nload "), streamed.stderr
    whole = json.loads(subprocess.run([*args, "--json"], capture_output=True, check=True).stdout)
    assert whole["text"] == answer
    assert (whole["reasoning"], whole["content"]) == split_reasoning(answer, thinking=False)
    assert (whole["reasoning"], whole["content"]) == ("I think so.", "Yes, it is.")
