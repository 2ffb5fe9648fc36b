"""OpenAI's Responses API on `aotgen serve`, through the official client: a response's text
is the engine's answer to the same chat, whole and streamed (the client's own stream
accumulator checks the events); reasoning and tool calls are output items; a stored response
is retrieved and continued by `previous_response_id`; bad requests are OpenAI-shaped 4xx."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_chat_answers import QUESTION, TOOLS, matches_schema, tools_server  # noqa: E402
from test_serve import Server  # noqa: E402, F401

from aotgen.runtime.engine import Engine, GenerationConfig  # noqa: E402
from aotgen.tool_calls import ToolCall  # noqa: E402

__all__ = ["tools_server"]  # the server with a template that takes tools and reasons

OFF = {"chat_template_kwargs": {"enable_thinking": False}}
# The tools in the Responses API's shape: the function's fields on the tool itself.
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key="none")


@pytest.fixture(scope="module")
def engine(tools_server) -> Engine:
    return Engine.load(tools_server.package)


def test_text_equals_the_engines_answer_whole_and_streamed(client, engine, tools_server):
    """`instructions` are the system message, `input` the user's; the text, usage and status
    are the engine's answer's; streamed, the client's accumulator gets the same response from
    events numbered in order, from response.created to its end."""
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    prompt = engine.tokenizer.encode_chat(messages, template_kwargs=OFF["chat_template_kwargs"])
    want = engine.generate(prompt, GenerationConfig(12))
    ask = {"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 12}
    ask |= {"temperature": 0, "extra_body": OFF}
    whole = client.responses.create(**ask)
    assert whole.output_text == want.text and [i.type for i in whole.output] == ["message"]
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(prompt), 12)
    length = want.finish_reason == "length"
    assert whole.status == ("incomplete" if length else "completed")
    assert (whole.incomplete_details is not None) == length

    # Ended by a stop token (vLLM's stop_token_ids): completed, as the client's accumulator
    # wants its stream to end (a response cut at max_output_tokens ends response.incomplete).
    end = want.token_ids[4]
    stopped = engine.generate(prompt, GenerationConfig(12, stop_token_ids=(end,)))
    extra = {"extra_body": OFF | {"stop_token_ids": [end]}}
    with client.responses.stream(**ask | extra) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == stopped.text and final.status == "completed"
    assert final.id != whole.id

    with httpx.stream(
        "POST", f"{tools_server.url}/v1/responses", json=ask | OFF | {"stream": True}
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == f"response.{whole.status}"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == want.text


def test_reasoning_is_an_output_item(client, engine):
    """With thinking on the prompt opens the reasoning, which the random model never closes:
    the whole answer is a reasoning item's text (its tokens counted), and no message."""
    prompt = engine.tokenizer.encode_chat(QUESTION, template_kwargs={"enable_thinking": True})
    text = engine.generate(prompt, GenerationConfig(12)).text
    body = {"model": "m", "input": "Hi", "max_output_tokens": 12, "temperature": 0}
    body["extra_body"] = {"chat_template_kwargs": {"enable_thinking": True}}
    whole = client.responses.create(**body)
    assert [i.type for i in whole.output] == ["reasoning"]  # cut before any answer
    assert whole.output[0].content[0].text == text.strip("\n") and text.strip()
    assert whole.output_text == "" and whole.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(**body, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert events[-1].type == "response.incomplete"  # at max_output_tokens
    final = events[-1].response
    assert reasoning == whole.output[0].content[0].text == final.output[0].content[0].text


def test_a_forced_call_and_its_result_continue_the_stored_conversation(client, engine):
    """tool_choice "required": one function_call item, the call the chat API makes for the
    same request, streamed as argument deltas as the model writes them; its output sent back
    by previous_response_id answers as the chat API answers the whole conversation, the
    earlier turns found in the KV cache."""
    ask = {"model": "m", "input": "Hi", "tools": RESPONSE_TOOLS, "tool_choice": "required"}
    ask |= {"parallel_tool_calls": False, "max_output_tokens": 94, "temperature": 0}
    first = client.responses.create(**ask, extra_body=OFF)
    (call,) = first.output
    assert call.type == "function_call" and call.call_id and call.status == "completed"
    assert matches_schema(ToolCall(call.name, call.arguments))
    chat = {"model": "m", "tools": TOOLS, "temperature": 0, "extra_body": OFF}
    forced = client.chat.completions.create(
        **chat, messages=QUESTION, tool_choice="required", parallel_tool_calls=False, max_tokens=94
    )
    (chat_call,) = forced.choices[0].message.tool_calls
    assert (chat_call.function.name, chat_call.function.arguments) == (call.name, call.arguments)
    events = list(client.responses.create(**ask, stream=True, store=False, extra_body=OFF))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 2 and "".join(deltas) == done.arguments == call.arguments  # in pieces
    assert events[-1].response.output[0].arguments == call.arguments

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[result],
        tools=RESPONSE_TOOLS,
        max_output_tokens=6,
        temperature=0,
        extra_body=OFF,
    )
    turn = {"role": "assistant", "content": None, "tool_calls": [chat_call.model_dump()]}
    tool = {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"}
    answer = client.chat.completions.create(**chat, messages=[*QUESTION, turn, tool], max_tokens=6)
    assert second.output_text == answer.choices[0].message.content
    assert second.usage.input_tokens == answer.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.previous_response_id == first.id


def test_stored_responses_are_retrieved_deleted_and_others_are_404(client):
    body = {"model": "m", "input": "Hi", "max_output_tokens": 3, "temperature": 0}
    kept = client.responses.create(**body, extra_body=OFF)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unstored = client.responses.create(**body, store=False, extra_body=OFF)
    for response_id in (unstored.id, "resp_none"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(response_id)
        assert "is not stored here" in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**body, previous_response_id="resp_none")
    client.responses.delete(kept.id)
    for gone in (
        lambda: client.responses.retrieve(kept.id),
        lambda: client.responses.delete(kept.id),
    ):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_a_stored_responses_input_items_are_listed_a_page_at_a_time(client, tools_server):
    """GET /v1/responses/ID/input_items: the response's own input as items with ids, newest
    first unless `order` asc; the client's pager follows `after` through pages of `limit`."""
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "input_text", "text": "Bye"}]},
    ]
    body = {"model": "m", "input": turns, "max_output_tokens": 2, "temperature": 0}
    kept = client.responses.create(**body, extra_body=OFF)
    pages = client.responses.input_items.list(kept.id, limit=2, order="asc")
    items = list(pages)  # two pages
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "Hi"),
        ("assistant", "Hello."),
        ("user", "Bye"),
    ]
    assert len({i.id for i in items}) == 3 and items[1].content[0].type == "output_text"
    newest = client.responses.input_items.list(kept.id)
    assert [i.id for i in newest.data] == [i.id for i in items][::-1] and not newest.has_more
    text = client.responses.create(**body | {"input": "Hi"}, extra_body=OFF)
    (only,) = client.responses.input_items.list(text.id).data
    assert (only.type, only.role, only.content[0].text) == ("message", "user", "Hi")
    url = f"{tools_server.url}/v1/responses/{kept.id}/input_items"
    assert httpx.get(url, params={"after": "msg_none"}).status_code == 404
    assert httpx.get(url, params={"limit": 0}).json()["error"]["param"] == "limit"


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"input": []}, "input", "input is empty"),
        ({"input": [{"type": "input_image"}]}, "input.0.type", "items of type 'input_image'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content",
            "only text content parts",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role", "give user, system"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
        ({"tool_choice": {"type": "mcp"}}, "tool_choice", "{type: function, name: NAME}"),
        ({"background": True}, "background", "while the request waits"),
        ({"messages": QUESTION}, "messages", "not a Responses API field"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs are not served"),
        ({"include": ["message.output_text.logprobs"]}, "include", "logprobs are not served"),
    ],
)
def test_bad_requests_are_openai_shaped_400s(tools_server, change, param, message):
    body = {"model": "m", "input": "Hi", "max_output_tokens": 2} | change
    r = httpx.post(f"{tools_server.url}/v1/responses", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and message in error["message"], r.text
    assert error["param"] == param


def test_input_items_become_the_chat_messages_openai_means():
    """A developer message is a system one; a reasoning item goes with the assistant turn
    after it; consecutive calls are one assistant turn; a call's output is a tool message."""
    from aotgen.responses_api import ResponsesRequest

    call = {"type": "function_call", "name": "add", "arguments": '{"a": 1}'}
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "Add."},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Sum it."}]},
        call | {"call_id": "c1"},
        call | {"call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "2"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
        {"role": "user", "content": "Thanks."},
    ]
    calls = [
        {"id": c, "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        for c in ("c1", "c2")
    ]
    assert ResponsesRequest(input=items).input_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "Sum it."},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "user", "content": "Thanks."},  # a reasoning item without its answer: dropped
    ]


def test_a_json_schema_format_answers_as_the_engine_under_its_grammar(client, engine):
    """text.format json_schema (what `client.responses.parse` sends): the text is the
    engine's answer under the schema's grammar."""
    grammar = pytest.importorskip("aotgen.runtime.grammar")
    pytest.importorskip("llguidance")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    prompt = engine.tokenizer.encode_chat(QUESTION, template_kwargs=OFF["chat_template_kwargs"])
    config = GenerationConfig(24, grammar=grammar.Grammar.json_schema(schema))
    want = engine.generate(prompt, config).text
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    got = client.responses.create(
        model="m",
        input="Hi",
        text={"format": fmt},
        max_output_tokens=24,
        temperature=0,
        extra_body=OFF,
    )
    assert got.output_text == want and got.text.format.type == "json_schema"
    if got.status == "completed":
        assert json.loads(want) in ({"ok": True}, {"ok": False})
