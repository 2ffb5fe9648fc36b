"""gpt-oss's harmony answers (aotgen/runtime/harmony.py): the analysis channel read apart as
`reasoning_content`, the final channel as content, messages to `functions.NAME` as tool calls;
streamed as read whole; the chat template's own rendering of a call read back as that call;
grammars that keep the reasoning free and constrain the final message or force a call,
checked token by token through llguidance; `aotgen run --chat` and `aotgen serve` answering
with them apart."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from reference import CHAT_TEMPLATES, with_chat_template
from test_chat_answers import ADD, TOOLS, WEATHER, matches_schema
from tiny import SPECIALS, make_tokenizer

from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.grammar import Grammar, GrammarTokens
from aotgen.runtime.harmony import (
    MARKERS,
    HarmonyStream,
    answer_head,
    head_of,
    split_harmony,
    takes_harmony,
)
from aotgen.runtime.tokenizer import Tokenizer
from aotgen.tool_calls import HarmonyFormat, ToolCall, tool_format

TEMPLATE = "compact-harmony.jinja"
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>"]
RETURN = "<|return|>"

CASES = [
    # (answer after `<|start|>assistant`, reasoning, content, calls)
    (
        "<|channel|>analysis<|message|>User asks.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
        "User asks.",
        "Paris.",
        [],
    ),
    (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "Need the weather.",
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (  # the recipient in the role part, as the chat template renders a call
        ' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}',
        "",
        "",
        [("add", '{"a": 1, "b": 2}')],
    ),
    (  # a preamble to the user, then more reasoning and the answer
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>analysis"
        "<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done <|end|> here",
        "a\nb",
        "Checking.Done ",
        [],
    ),
    (
        "<|channel|>analysis<|message|>Still thinking, cut short",
        "Still thinking, cut short",
        "",
        [],
    ),
    (  # a built-in tool no request declares: reasoning, not a call of the request's tools
        "<|channel|>analysis<|message|>Search it.<|end|><|start|>assistant<|channel|>analysis"
        ' to=browser.search code<|message|>{"query": "Paris"}<|call|>',
        'Search it.\n{"query": "Paris"}',
        "",
        [],
    ),
    ("<|channel|>final<|message|>a <|mess b", "", "a <|mess b", []),
    ("Hi, no harmony here.", "", "Hi, no harmony here.", []),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_split(text, reasoning, content, calls):
    split = split_harmony(text)
    assert (split.reasoning, split.content, split.calls) == (reasoning, content, calls)
    expected = (content or None) if calls else content
    assert HarmonyFormat().parse(text) == (expected, [ToolCall(*c) for c in calls])


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_streamed_in_pieces_reads_as_whole(text, reasoning, content, calls):
    """Fed in pieces of every size, the deltas add up to the whole's split; nothing of a
    marker, or of a call's arguments, goes out along the way."""
    for size in (1, 2, 3, 5, len(text)):
        stream = HarmonyStream()
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        sent = "".join(r + c for r, c in pieces)
        assert not any(marker in sent for marker in MARKERS)
        assert "{" not in sent or not calls
        pieces.append(stream.finish())
        assert "".join(r for r, _ in pieces) == reasoning
        assert "".join(c for _, c in pieces) == content
        assert stream.calls == calls


def test_a_prompt_that_continues_a_message():
    head = answer_head("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final")
    assert head == "assistant<|channel|>final"
    split = split_harmony("<|message|>Hello", head)
    assert (split.reasoning, split.content) == ("", "Hello")
    assert answer_head("<|start|>user<|message|>Hi<|end|>") == ""


def _harmony_tokenizer(out: Path) -> Tokenizer:
    """The tiny tokenizer with harmony's markers as special tokens, the compact harmony
    template, and generation ending on `<|return|>` and `<|call|>` as gpt-oss's does."""
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out, specials=[*SPECIALS, *HARMONY, RETURN])
    config = json.loads((out / "tokenizer_config.json").read_text())
    config |= {"chat_template": (CHAT_TEMPLATES / TEMPLATE).read_text(), "eos_token": RETURN}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    ends = [tok.token_to_id(RETURN), tok.token_to_id("<|call|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return Tokenizer.from_dir(out)


@pytest.fixture(scope="module")
def harmony_tok(tmp_path_factory) -> Tokenizer:
    return _harmony_tokenizer(tmp_path_factory.mktemp("harmony") / "tok")


def test_the_template_is_read_as_harmony(harmony_tok):
    """A generation prompt leaves `assistant` as the answer's head; the call the template
    renders back in the history is read as that call."""
    template = harmony_tok.chat_template
    assert takes_harmony(template) and isinstance(tool_format(template), HarmonyFormat)
    ids = harmony_tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert head_of(harmony_tok, ids) == "assistant"
    long = "Paris is the capital of France. " * 8  # past any fixed window of tokens
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": long}]
    ids = harmony_tok.encode_chat(messages, add_generation_prompt=False, continue_final=True)
    assert head_of(harmony_tok, ids) == "assistant<|channel|>final<|message|>" + long
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    history = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "tool_calls": [call]}]
    rendered = harmony_tok.apply_chat_template(history, add_generation_prompt=False)
    answer = rendered.rpartition("<|start|>assistant")[2]
    assert split_harmony(answer).calls == [("add", json.dumps(call["function"]["arguments"]))]
    assert not takes_harmony((CHAT_TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())


def test_a_call_sent_back_keeps_its_reasoning(harmony_tok):
    """An assistant turn that called a tool, sent back with its `reasoning_content`, renders
    with its analysis message before the call (gpt-oss's template reads it as `thinking`);
    the result follows as a message from the tool."""
    from aotgen.openai_api import ChatRequest

    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [call], "reasoning_content": "Need it."},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = ChatRequest(model="m", messages=messages, tools=[WEATHER])
    prompt = harmony_tok.decode(request.prompt_ids(harmony_tok))
    turn = prompt.partition("Weather?<|end|><|start|>assistant")[2]
    assert turn.startswith("<|channel|>analysis<|message|>Need it.<|end|>"), prompt
    answer = turn.partition("<|call|>")[0]
    split = split_harmony(answer)
    assert (split.reasoning, split.calls) == ("Need it.", [("get_weather", '{"city": "Paris"}')])
    expected = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny"
    assert prompt.endswith(expected + "<|end|><|start|>assistant")


def test_reasoning_effort_reaches_the_template(harmony_tok):
    """OpenAI's `reasoning_effort` is the template keyword gpt-oss's template reads; one given in
    chat_template_kwargs too wins, as the more specific."""
    from aotgen.openai_api import ChatRequest

    messages = [{"role": "user", "content": "Hi"}]
    for fields, effort in (
        ({"reasoning_effort": "high"}, "high"),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}, "low"),
    ):
        request = ChatRequest(model="m", messages=messages, **fields)
        prompt = harmony_tok.decode(request.prompt_ids(harmony_tok))
        assert prompt.startswith(f"<|start|>system<|message|>Reasoning: {effort}<|end|>"), prompt
    plain = ChatRequest(model="m", messages=messages).prompt_ids(harmony_tok)
    assert not harmony_tok.decode(plain).startswith("<|start|>system")


def _walk(tokens: GrammarTokens, grammar: Grammar, lead: list[int], seed: int) -> list[int]:
    """`lead`, then tokens drawn uniformly from those the grammar allows, up to eos."""
    constraint = tokens.constraint(grammar)
    constraint.advance(lead)
    rng, ids = random.Random(seed), list(lead)
    for _ in range(200):
        allowed = constraint.allowed().nonzero().flatten().tolist()
        tok = rng.choice(allowed)
        if tok in tokens.tokenizer.eos_ids:
            return ids
        constraint.advance([tok])
        ids.append(tok)
    raise AssertionError(f"no end in 200 tokens: {tokens.tokenizer.decode(ids)!r}")


def test_a_structured_answer_follows_free_reasoning(harmony_tok):
    """response_format on a harmony template: any analysis, then the final channel holding
    the answer the regex matches; a final message straight away is taken too, a bare answer
    is not."""
    from aotgen.runtime.harmony import final_answer

    tokens = GrammarTokens(harmony_tok, harmony_tok.vocab_size)
    grammar = final_answer(Grammar("regex", "[a-z]{1,8}"))
    think = "<|channel|>analysis<|message|>So <|the> answer.<|end|><|start|>assistant"
    for lead in (think + "<|channel|>final", "<|channel|>final"):
        for seed in range(5):
            text = harmony_tok.decode(_walk(tokens, grammar, harmony_tok.encode(lead), seed))
            split = split_harmony(text)
            assert split.reasoning == ("So <|the> answer." if lead.startswith(think) else "")
            assert re.fullmatch("[a-z]{1,8}", split.content), text
    refused = tokens.constraint(grammar)
    assert not refused.matcher.consume_token(harmony_tok.encode("paris")[0])


def test_a_forced_call_follows_free_reasoning(harmony_tok):
    """tool_choice "required" and a named function: after the reasoning, one message to one
    of the tools whose arguments match its schema, then the end (`<|call|>`)."""
    tokens = GrammarTokens(harmony_tok, harmony_tok.vocab_size)
    fmt = HarmonyFormat()
    think = harmony_tok.encode("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant")
    for tools, names in ((TOOLS, {"get_weather", "add"}), ([ADD], {"add"})):
        grammar = fmt.grammar(tools, parallel=True)
        seen = set()
        for seed in range(8):
            lead = think + harmony_tok.encode("<|channel|>commentary")
            text = harmony_tok.decode(_walk(tokens, grammar, lead, seed))
            content, calls = fmt.parse(text)
            assert content is None and len(calls) == 1 and matches_schema(calls[0]), text
            seen.add(calls[0].name)
        assert seen <= names and (len(tools) == 1 or len(seen) == 2)
    final = tokens.constraint(fmt.grammar([WEATHER], parallel=False))
    final.advance(harmony_tok.encode("<|channel|>"))
    assert not final.matcher.consume_token(harmony_tok.encode("final")[0])


# ---- aotgen run --chat and aotgen serve -----------------------------------------------------


def test_run_chat_shows_the_analysis_apart_from_the_answer(tiny_package, tmp_path):
    """`aotgen run --chat` with a harmony template: the analysis streams on stderr, the final
    message alone on stdout; `--json` holds them apart as `split_harmony` does. A regex makes
    the random model write harmony (its markers as text: this tokenizer has none)."""
    package = with_chat_template(tiny_package, tmp_path / "pkg", TEMPLATE)
    answer = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"
    answer += "<|message|>Yes."
    args = [sys.executable, "-m", "aotgen", "run", str(package), "--chat", "Is it?"]
    args += ["--regex", re.escape(answer), "--max-new-tokens", "80", "--threads", "1"]
    streamed = subprocess.run(args, capture_output=True, text=True, check=True)
    assert streamed.stdout == "Yes.\n"
    assert streamed.stderr.startswith("Hm.\nload "), streamed.stderr
    whole = json.loads(subprocess.run([*args, "--json"], capture_output=True, check=True).stdout)
    assert whole["text"] == answer
    assert (whole["reasoning"], whole["content"]) == ("Hm.", "Yes.")


@pytest.fixture(scope="module")
def harmony_server(tiny_batch_package, tmp_path_factory):
    """`aotgen serve` on the tiny batch package given the harmony tokenizer (the same vocabulary
    size: the random model reads its ids as any others), its manifest hashed again."""
    pytest.importorskip("fastapi")
    from test_serve import Server

    from aotgen.package.manifest import read_manifest, write_manifest

    root = tmp_path_factory.mktemp("harmony-serve")
    package = Path(shutil.copytree(tiny_batch_package, root / "pkg"))
    source = root / "tok"
    _harmony_tokenizer(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, package / "tokenizer" / name)
    write_manifest(package, read_manifest(package))
    server = Server(package, "--served-model-name", "m")
    server.package = package
    yield server
    server.close()


def _streamed(client, ask) -> tuple[str, str, list]:
    reasoning, content, calls = "", "", []
    for event in client.chat.completions.create(**ask, stream=True):
        for c in event.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
    return reasoning, content, calls


@pytest.mark.parametrize("question", ["Hi", "Paris?"])
def test_serve_answers_harmony_apart(harmony_server, question):
    """A structured answer and a forced call, whole and streamed, split as `split_harmony`
    splits the engine's own (greedy) text under the same grammar. (Whether a random model
    reasons or answers is its choice: both ways are the grammar tests' and
    `test_chat_answer_of_a_call`'s.)"""
    from aotgen.runtime.harmony import final_answer

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{harmony_server.url}/v1", api_key="none")
    engine = Engine.load(harmony_server.package)
    messages = [{"role": "user", "content": question}]
    prompt = engine.tokenizer.encode_chat(messages)
    ask = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0}
    regex = {"extra_body": {"structured_outputs": {"regex": "[a-z]{1,8}"}}}
    forced = {"tools": TOOLS, "tool_choice": "required"}
    for extra, grammar in (
        ({}, None),
        (regex, final_answer(Grammar("regex", "[a-z]{1,8}"))),
        (forced, HarmonyFormat().grammar(TOOLS, parallel=True)),
    ):
        text = engine.generate(prompt, GenerationConfig(12, grammar=grammar)).text
        split = split_harmony(text)
        if extra is regex and text.startswith("<|channel|>final"):  # the model's choice
            assert re.fullmatch("[a-z]{1,8}", split.content), text
        message = client.chat.completions.create(**ask, **extra).choices[0].message
        assert (getattr(message, "reasoning_content", None) or "") == split.reasoning
        assert (message.content, message.tool_calls) == (split.content, None)
        reasoning, content, calls = _streamed(client, {**ask, **extra})
        assert (reasoning, content, calls) == (split.reasoning, split.content, [])


def test_serve_continues_a_final_message(harmony_server):
    """continue_final_message: the prompt ends inside the final channel's body, so the answer
    is content, the engine's own text."""
    httpx = pytest.importorskip("httpx")
    engine = Engine.load(harmony_server.package)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]
    ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final=True)
    assert head_of(engine.tokenizer, ids) == "assistant<|channel|>final<|message|>Yes"
    text = engine.generate(ids, GenerationConfig(8)).text
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    body |= {"continue_final_message": True, "add_generation_prompt": False}
    answer = httpx.post(f"{harmony_server.url}/v1/chat/completions", json=body).json()
    message = answer["choices"][0]["message"]
    assert message["content"] == split_harmony(text, head_of(engine.tokenizer, ids)).content
    assert "reasoning_content" not in message


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_chat_answer_of_a_call(text, reasoning, content, calls):
    """The chat answer's parts, whole and streamed: the calls as OpenAI's tool calls where the
    request took tools, none where it did not."""
    from aotgen.chat_answer import HarmonyAnswerStream, chat_message

    for fmt in (HarmonyFormat(), None):
        message, got = chat_message(text, None, fmt, "assistant")
        expected = [ToolCall(*c) for c in calls] if fmt else []
        assert got == expected and message.get("reasoning_content", "") == reasoning
        assert message["content"] == ((content or None) if expected else content)
        stream = HarmonyAnswerStream("assistant", fmt)
        fed = [stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
        last, pieces, ended = stream.finish()
        deltas = [d for d, _ in fed] + [last]
        pieces = [p for _, ps in fed for p in ps] + pieces
        streamed = [  # each call's pieces joined: the first names it
            ToolCall(p.name, "".join(q.arguments for q in pieces if q.index == p.index))
            for p in pieces
            if p.name is not None
        ]
        assert (streamed, ended) == (expected, bool(expected))
        if expected:  # the arguments came in pieces, not at the end
            assert sum(1 for _, ps in fed for p in ps if p.arguments) > 2
        assert "".join(d.get("content", "") for d in deltas) == content
        assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_messages_api_blocks_of_a_harmony_answer(harmony_tok, text, reasoning, content, calls):
    """Anthropic's Messages API: the analysis channel as thinking, the final channel (and a
    preamble) as text, each call as a tool_use block with its arguments as the input, whole
    and streamed in pieces; stop_reason tool_use where a call ends it."""
    from aotgen.chat_answer import ChatAnswers
    from aotgen.message_output import MessageOutput
    from aotgen.runtime.engine import GenerationResult

    result = GenerationResult(text, [1, 2], 3, "eos", 0.0, 0.0)
    for pieces in ([text], [text[i : i + 3] for i in range(0, len(text), 3)]):
        answers = ChatAnswers(harmony_tok, "m", 1, None, HarmonyFormat(), "assistant")
        output = MessageOutput("m", 3)
        for piece in pieces:
            if (chunk := answers.chunk(0, piece, None)) is not None:
                output.feed(chunk["choices"][0]["delta"])
        last = answers.chunk(0, "", "stop", result)["choices"][0]["delta"]
        events, message = output.finish(last, result)
        blocks = message["content"]
        assert "".join(b["thinking"] for b in blocks if b["type"] == "thinking") == reasoning
        assert "".join(b["text"] for b in blocks if b["type"] == "text") == content
        uses = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
        assert uses == [(name, json.loads(arguments)) for name, arguments in calls]
        assert message["stop_reason"] == ("tool_use" if calls else "end_turn")
        assert events[-2]["delta"]["stop_reason"] == message["stop_reason"]
