"""Anthropic's Messages API on `aotgen serve`, through the official `anthropic` client: a
message's text is the engine's answer to the same chat, whole and streamed (the client's own
stream accumulator builds the message from the events); thinking is a thinking block; a forced
call is a tool_use block and its tool_result continues the conversation as the chat API does;
stop sequences and token counts; bad requests are Anthropic-shaped 4xx."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_chat_answers import QUESTION, TOOLS, matches_schema, tools_server  # noqa: E402

from aotgen.runtime.engine import Engine, GenerationConfig  # noqa: E402
from aotgen.tool_calls import ToolCall  # noqa: E402

__all__ = ["tools_server"]  # the server with a template that takes tools and reasons

NO_THINKING = {"type": "disabled"}  # the template's enable_thinking false
# The client no longer sends sampling fields of its own; the server takes them from the body.
GREEDY = {"temperature": 0}
# The tools in the Messages API's shape: name, description, input_schema.
MESSAGE_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
]


@pytest.fixture(scope="module")
def client(tools_server):
    return anthropic.Anthropic(base_url=tools_server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def chat_client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key="none")


@pytest.fixture(scope="module")
def engine(tools_server) -> Engine:
    return Engine.load(tools_server.package)


def _prompt(engine: Engine, messages: list[dict], thinking: bool = False, **kw) -> list[int]:
    return engine.tokenizer.encode_chat(
        messages, template_kwargs={"enable_thinking": thinking}, **kw
    )


def test_text_equals_the_engines_answer_whole_and_streamed(client, engine, tools_server):
    """`system` is the system message; the text, usage and stop reason are the engine's
    answer's; streamed, the client's accumulator builds the same message from the events."""
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    prompt = _prompt(engine, messages)
    want = engine.generate(prompt, GenerationConfig(12))
    ask = {"model": "m", "system": "Be brief.", "messages": QUESTION, "max_tokens": 12}
    ask |= {"extra_body": GREEDY, "thinking": NO_THINKING}
    whole = client.messages.create(**ask)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == want.text
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt)
    assert usage.output_tokens == len(want.token_ids) == 12
    assert whole.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")

    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == want.text and final.id != whole.id
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == 12 and final.usage.cache_read_input_tokens > 0

    body = ask | GREEDY | {"stream": True}
    del body["extra_body"]
    with httpx.stream("POST", f"{tools_server.url}/v1/messages", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]  # each event named by its type
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]


def test_a_stop_sequence_ends_the_text_and_is_named(client, chat_client, engine):
    """stop_sequences: the engine's answer cut where the string starts; stop_reason
    stop_sequence naming it. The chat API's choices name it as vLLM's do (`stop_reason`: the
    stop string, or the stop token's id)."""
    prompt = _prompt(engine, QUESTION)
    text = engine.generate(prompt, GenerationConfig(12)).text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2].strip())
    want = engine.generate(prompt, GenerationConfig(12, stop=(stop,)))
    assert want.finish_reason == "stop" and want.stop_reason == stop
    got = client.messages.create(
        model="m",
        messages=QUESTION,
        max_tokens=12,
        extra_body=GREEDY,
        thinking=NO_THINKING,
        stop_sequences=["never here", stop],
    )
    assert got.content[0].text == want.text == text[: text.index(stop)]
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)

    ask = {"model": "m", "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = chat_client.chat.completions.create(**ask, stop=[stop], extra_body=off)
    assert (chat.choices[0].message.content, chat.choices[0].stop_reason) == (want.text, stop)
    end = engine.generate(prompt, GenerationConfig(12)).token_ids[3]
    chat = chat_client.chat.completions.create(**ask, extra_body=off | {"stop_token_ids": [end]})
    assert (chat.choices[0].finish_reason, chat.choices[0].stop_reason) == ("stop", end)


def test_thinking_is_a_thinking_block(client, engine):
    """thinking adaptive (no budget): the prompt opens the reasoning, which the random model
    never closes: the whole answer is a thinking block's text, whole and streamed."""
    text = engine.generate(_prompt(engine, QUESTION, thinking=True), GenerationConfig(12)).text
    ask = {"model": "m", "messages": QUESTION, "max_tokens": 12, "extra_body": GREEDY}
    ask["thinking"] = {"type": "adaptive"}
    whole = client.messages.create(**ask)
    assert [b.type for b in whole.content] == ["thinking"] and text.strip()
    assert whole.content[0].thinking == text.strip("\n")
    with client.messages.stream(**ask) as stream:
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == final.content[0].thinking == whole.content[0].thinking


def test_budget_tokens_close_the_thinking(client, engine):
    """thinking enabled with budget_tokens 6: the reasoning is closed after 6 tokens and the
    model answers, as the engine answers under reasoning_budget 6: a thinking block and a
    text block, whole and streamed."""
    config = GenerationConfig(24, reasoning_budget=6)
    text = engine.generate(_prompt(engine, QUESTION, thinking=True), config).text
    reasoning, closed, content = text.partition("</think>")
    assert closed and content.strip()
    ask = {"model": "m", "messages": QUESTION, "max_tokens": 24, "extra_body": GREEDY}
    ask["thinking"] = {"type": "enabled", "budget_tokens": 6}
    whole = client.messages.create(**ask)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == reasoning.strip("\n")
    assert whole.content[1].text == content.lstrip("\n")
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    fields = {"type", "thinking", "text"}
    assert [b.model_dump(include=fields) for b in final.content] == [
        b.model_dump(include=fields) for b in whole.content
    ]


def test_a_forced_call_and_its_result_answer_as_the_chat_api(client, chat_client, engine):
    """tool_choice any (one call): a tool_use block with the call the chat API makes for the
    same request, stop_reason tool_use, whole and streamed (its input in input_json_delta
    pieces as the model writes it); its tool_result sent back answers
    as the chat API answers the whole conversation, its earlier turns found in the KV cache."""
    ask = {"model": "m", "messages": QUESTION, "tools": MESSAGE_TOOLS, "max_tokens": 94}
    ask |= {"extra_body": GREEDY, "thinking": NO_THINKING}
    ask["tool_choice"] = {"type": "any", "disable_parallel_tool_use": True}
    first = client.messages.create(**ask)
    (call,) = first.content
    assert call.type == "tool_use" and call.id and first.stop_reason == "tool_use"
    assert matches_schema(ToolCall(call.name, json.dumps(call.input)))
    chat = {"model": "m", "tools": TOOLS, "temperature": 0}
    chat["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    forced = chat_client.chat.completions.create(
        **chat, messages=QUESTION, tool_choice="required", parallel_tool_calls=False, max_tokens=94
    )
    (chat_call,) = forced.choices[0].message.tool_calls
    assert (chat_call.function.name, json.loads(chat_call.function.arguments)) == (
        call.name,
        call.input,
    )
    with client.messages.stream(**ask) as stream:
        partial = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", call.name, call.input)
    ]
    assert len(partial) > 2 and json.loads("".join(partial)) == call.input  # input in pieces

    result = {"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}
    turns = [{"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = client.messages.create(
        **ask | {"messages": [*QUESTION, *turns], "tool_choice": {"type": "auto"}, "max_tokens": 6}
    )
    function = {"name": call.name, "arguments": json.dumps(call.input)}
    calls = [{"id": call.id, "type": "function", "function": function}]
    assistant = {"role": "assistant", "content": None, "tool_calls": calls}
    tool = {"role": "tool", "tool_call_id": call.id, "content": "21 C"}
    answer = chat_client.chat.completions.create(
        **chat, messages=[*QUESTION, assistant, tool], max_tokens=6
    )
    assert second.content[0].text == answer.choices[0].message.content
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == (
        answer.usage.prompt_tokens
    )
    assert second.usage.cache_read_input_tokens > 0


def test_a_json_schema_format_answers_as_the_engine_under_its_grammar(client, engine):
    """output_config.format (what `client.messages.parse` sends): the text is the engine's
    answer under the schema's grammar."""
    grammar = pytest.importorskip("aotgen.runtime.grammar")
    pytest.importorskip("llguidance")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    config = GenerationConfig(24, grammar=grammar.Grammar.json_schema(schema))
    want = engine.generate(_prompt(engine, QUESTION), config)
    got = client.messages.create(
        model="m",
        messages=QUESTION,
        max_tokens=24,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        thinking=NO_THINKING,
        extra_body=GREEDY,
    )
    assert got.content[0].text == want.text
    if got.stop_reason == "end_turn":
        assert json.loads(want.text) in ({"ok": True}, {"ok": False})


def test_a_final_assistant_message_is_continued(client, engine):
    """Anthropic's prefill: the answer continues the final assistant message (its text not
    repeated), as the engine continues the prompt that ends inside it."""
    messages = [*QUESTION, {"role": "assistant", "content": "Well,"}]
    ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final=True)
    assert engine.tokenizer.decode(ids).endswith("Well,")
    want = engine.generate(ids, GenerationConfig(8)).text
    got = client.messages.create(model="m", messages=messages, max_tokens=8, extra_body=GREEDY)
    assert [(b.type, b.text) for b in got.content] == [("text", want)]
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == len(ids)


def test_max_tokens_past_the_context_ends_at_its_window(client, engine):
    """Clients send their model's output limit as max_tokens: past the package's context the
    answer runs to the context's end, stop_reason model_context_window_exceeded."""
    prompt = _prompt(engine, QUESTION)
    room = engine.max_seq_len - len(prompt)
    want = engine.generate(prompt, GenerationConfig(room, ignore_eos=True))
    ask = {"model": "m", "messages": QUESTION, "max_tokens": 32000, "thinking": NO_THINKING}
    # The client streams requests this long (it refuses to wait for them whole).
    with client.messages.stream(**ask, extra_body=GREEDY | {"ignore_eos": True}) as stream:
        got = stream.get_final_message()
    assert got.content[0].text == want.text and got.usage.output_tokens == room
    assert got.stop_reason == "model_context_window_exceeded"


def test_count_tokens_counts_the_prompt_the_request_runs(client, engine):
    """count_tokens: the ids the request would run (system, tools and template included)."""
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    want = _prompt(engine, messages, tools=TOOLS)
    count = client.messages.count_tokens(
        model="m", system="Be brief.", messages=QUESTION, tools=MESSAGE_TOOLS, thinking=NO_THINKING
    )
    assert count.input_tokens == len(want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"messages": []}, "messages is empty"),
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "system", "content": "x"}]}, "give user or assistant"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "blocks of type 'image' are not served",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, "only custom tools"),
        ({"tool_choice": {"type": "tool"}, "tools": MESSAGE_TOOLS}, "{type: tool, name: NAME}"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"n": 2}, "not a Messages API field"),
        ({"temperature": 3}, "less than or equal to 2"),
        ({"output_config": {"format": {"type": "regex"}}}, "give {type: json_schema, schema}"),
    ],
)
def test_bad_requests_are_anthropic_shaped_400s(tools_server, change, message):
    body = {"model": "m", "messages": QUESTION, "max_tokens": 2} | change
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{tools_server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"], r.text


def test_an_unserved_model_is_the_clients_not_found_error(client):
    """The client lists the served names (GET /v1/models in both APIs' shapes); another name
    is its NotFoundError."""
    models = list(client.models.list())
    assert [(m.id, m.type, m.display_name) for m in models] == [
        ("m", "model", "m"),
        ("m-alias", "model", "m-alias"),
    ]
    assert models[0].created_at.year >= 2026
    assert client.models.retrieve("m-alias").id == "m-alias"
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("claude")
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude", messages=QUESTION, max_tokens=2)
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "'claude' is not served here" in missing.value.body["error"]["message"]


def test_content_blocks_become_the_chat_messages_anthropic_means():
    """System blocks are one system message; a user message's tool results are tool
    messages before its text; turns of one role in a row are one turn; thinking goes with
    its assistant turn, redacted thinking is left out; tool_use inputs are JSON arguments."""
    from aotgen.messages_api import MessagesRequest

    use = {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1}}
    request = MessagesRequest(
        max_tokens=1,
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Add."},
            {"role": "user", "content": [{"type": "text", "text": "Now."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Sum it.", "signature": ""},
                    {"type": "redacted_thinking", "data": "x"},
                    use,
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": "2"},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add.\n\nNow."},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Sum it.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "user", "content": "Thanks."},
    ]
