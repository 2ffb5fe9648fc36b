"""`aotgen serve` as a real process on 127.0.0.1: the official `openai` client, concurrent
requests against the same requests served alone, OpenAI-shaped errors, a full queue, a client
that leaves mid-stream, and the bounded load test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from reference import with_generation_config  # noqa: E402

from aotgen.runtime.engine import Engine, GenerationConfig  # noqa: E402
from aotgen.runtime.lookup_cache import LookupCache  # noqa: E402
from aotgen.runtime.rules import Penalties  # noqa: E402
from aotgen.runtime.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
AOTGEN = [sys.executable, "-m", "aotgen"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`aotgen serve PACKAGE` in a subprocess, up once /health answers."""

    def __init__(self, package: Path, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*AOTGEN, "serve", str(package), "--port", str(self.port), "--threads", "1", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"aotgen serve exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)
        self.close()
        raise RuntimeError("aotgen serve did not come up in 120 s")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def tiny_server(tiny_batch_package):
    server = Server(tiny_batch_package)
    yield server
    server.close()


@pytest.fixture(scope="module")
def alone(tiny_batch_package) -> Engine:
    return Engine.load(tiny_batch_package, threads=1)


def _ids(i: int, n: int) -> list[int]:
    return [5 + (i * 37 + j * 11) % 200 for j in range(n)]


def test_models_and_health(tiny_server, tiny_batch_package, alone):
    models = httpx.get(f"{tiny_server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [tiny_batch_package.name]
    assert models["data"][0]["max_model_len"] == alone.max_seq_len
    assert tiny_server.health()["slots"] == 4
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    answer = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()
    assert answer["model"] == tiny_batch_package.name  # no `model`: the served one
    for path in ("/v1/completions", "/tokenize"):
        wrong = httpx.post(f"{tiny_server.url}{path}", json=body | {"model": "gpt-4o"})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_sixteen_concurrent_requests_equal_each_alone(tiny_server, alone):
    """16 requests at once on 4 slots, different prompts and lengths: each answer is the one
    the request gets alone, none lost or duplicated."""

    def ask(i: int) -> dict:
        body = {"prompt": _ids(i, 3 + 2 * i), "max_tokens": 4 + 3 * i, "temperature": 0}
        body |= {"stream": i % 2 == 1}
        if not body["stream"]:
            return httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()
        text, usage = "", None
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            event = json.loads(line[6:])
            text += "".join(c["text"] for c in event["choices"])
            usage = event.get("usage") or usage
        return {"choices": [{"text": text}], "usage": usage}

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    for i, answer in enumerate(answers):
        want = alone.generate(
            _ids(i, 3 + 2 * i), GenerationConfig(max_new_tokens=4 + 3 * i, ignore_eos=False)
        )
        assert answer["choices"][0]["text"] == want.text, i
        assert answer["usage"]["completion_tokens"] == len(want.token_ids)
        assert answer["usage"]["prompt_tokens"] == 3 + 2 * i


def test_n_choices_each_equal_a_request_alone(tiny_server, alone):
    """`n`: choice i is the request alone seeded with seed + i (vLLM's rule), whole and
    streamed (each choice's chunks under its index); usage counts the prompt once."""
    prompt = _ids(9, 7)
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.9, "seed": 77, "n": 3}
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()
    want = [
        alone.generate(prompt, GenerationConfig(10, SamplingParams(temperature=0.9, seed=77 + i)))
        for i in range(3)
    ]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert [c["text"] for c in got["choices"]] == [w.text for w in want]
    assert len({c["text"] for c in got["choices"]}) > 1  # the seeds differ
    assert got["usage"]["prompt_tokens"] == len(prompt)
    assert got["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "n": 2}
    chat |= {"temperature": 0.8, "seed": 5, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=chat) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    texts, roles, finishes = ["", ""], [0, 0], [0, 0]
    for event in events:
        for choice in event["choices"]:
            i = choice["index"]
            texts[i] += choice["delta"].get("content", "")
            roles[i] += choice["delta"].get("role") == "assistant"
            finishes[i] += choice["finish_reason"] is not None
    ids = alone.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    for i in range(2):
        sampling = SamplingParams(temperature=0.8, seed=5 + i)
        assert texts[i] == alone.generate(ids, GenerationConfig(8, sampling)).text
    assert roles == finishes == [1, 1]


def test_a_chat_turn_finds_the_conversation_in_the_cache(tiny_server, alone):
    """The next turn of a chat, sent whole, finds the last prompt and answer in the cache
    (OpenAI's usage.prompt_tokens_details.cached_tokens) and answers as a cold run does."""
    url = f"{tiny_server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "A prefix reuse check: the quick brown fox"}]
    body = {"max_tokens": 8, "temperature": 0}
    first = httpx.post(url, json={"messages": messages, **body}).json()
    answer = first["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    second = httpx.post(url, json={"messages": messages, **body}).json()
    ids = alone.tokenizer.encode_chat(messages)
    want = alone.generate(ids, GenerationConfig(max_new_tokens=8, reuse_prefix=False))
    assert second["choices"][0]["message"]["content"] == want.text
    # The first turn finds at most the chat template's opening tokens (other tests' chats).
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 8
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] <= cached < second["usage"]["prompt_tokens"] == len(ids)


def test_seeded_sampling_reproduces_the_request_alone(tiny_server, alone):
    body = {"prompt": _ids(3, 9), "max_tokens": 20, "temperature": 0.9, "seed": 1234}
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()
    sampling = SamplingParams(temperature=0.9, seed=1234)
    want = alone.generate(_ids(3, 9), GenerationConfig(max_new_tokens=20, sampling=sampling))
    assert got["choices"][0]["text"] == want.text
    # vLLM's top_k, min_p and repetition_penalty, OpenAI's penalties and logit bias.
    body |= {"top_k": 5, "frequency_penalty": 0.5, "presence_penalty": -0.2, "best_of": 1}
    body |= {"repetition_penalty": 1.3, "logit_bias": {"7": 2.5}, "min_p": 0.3}
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()
    sampling = SamplingParams(temperature=0.9, top_k=5, seed=1234, min_p=0.3)
    penalties = Penalties(repetition=1.3, presence=-0.2, frequency=0.5, logit_bias=((7, 2.5),))
    config = GenerationConfig(max_new_tokens=20, sampling=sampling, penalties=penalties)
    assert got["choices"][0]["text"] == alone.generate(_ids(3, 9), config).text


def test_structured_outputs_answer_as_the_request_alone(tiny_server, alone):
    """vLLM's `structured_outputs` (choice, regex) and OpenAI's `response_format`: the answer
    is what `Engine` gives the same grammar alone, and it matches the grammar."""
    grammar = pytest.importorskip("aotgen.runtime.grammar")
    pytest.importorskip("llguidance")
    cases = [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, grammar.Grammar.choice(["yes", "no"])),
        ({"structured_outputs": {"regex": "[a-z]{2,9}"}}, grammar.Grammar("regex", "[a-z]{2,9}")),
        ({"response_format": {"type": "json_object"}}, grammar.Grammar.json_object()),
    ]
    for extra, want_grammar in cases:
        body = {"prompt": _ids(4, 7), "max_tokens": 30, "temperature": 0, **extra}
        got = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()
        config = GenerationConfig(max_new_tokens=30, grammar=want_grammar)
        want = alone.generate(_ids(4, 7), config)
        assert got["choices"][0]["text"] == want.text, extra
    assert want.text.startswith("{")  # json_object: an object, whether or not it completed


def test_completion_logprobs_equal_the_request_alone(tiny_server, alone):
    """Legacy completions' `logprobs`: per token its text, logprob, top alternatives and text
    offset, equal to `Engine`'s for the same request (streamed: in the last chunk)."""
    body = {"prompt": _ids(5, 8), "max_tokens": 9, "temperature": 0, "logprobs": 3}
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()["choices"][0]
    want = alone.generate(_ids(5, 8), GenerationConfig(max_new_tokens=9, logprobs=3))
    lp = got["logprobs"]
    assert got["text"] == want.text
    assert lp["token_logprobs"] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
    for top, token in zip(lp["top_logprobs"], want.logprobs, strict=True):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(token.top[0][1], abs=1e-5)
    assert len(lp["tokens"]) == len(lp["text_offset"]) == len(want.token_ids)
    with httpx.stream(
        "POST", f"{tiny_server.url}/v1/completions", json={**body, "stream": True}
    ) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert len(streamed) == 1  # the prompt now runs from the cache: equal up to rounding
    assert streamed[0]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_echo_scores_the_prompt_as_lm_eval_asks(tiny_server, alone):
    """lm-eval-harness's loglikelihood request (`echo`, `logprobs: 1`, `max_tokens: 0`): the
    prompt's text and each token's logprob (the first none), equal to `Engine`'s."""
    prompt = _ids(6, 20)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()["choices"][0]
    want = alone.generate(prompt, GenerationConfig(max_new_tokens=0, prompt_logprobs=1))
    assert got["text"] == alone.tokenizer.decode(prompt)
    lp = got["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(
        [t.logprob for t in want.prompt_logprobs[1:]], abs=1e-5
    )
    assert len(lp["tokens"]) == len(prompt)
    more = httpx.post(f"{tiny_server.url}/v1/completions", json={**body, "max_tokens": 3})
    choice = more.json()["choices"][0]
    answer = alone.generate(prompt, GenerationConfig(max_new_tokens=3))
    assert choice["text"] == alone.tokenizer.decode(prompt) + answer.text
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + 3
    refused = httpx.post(
        f"{tiny_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 0}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_a_batch_of_prompts_as_lm_eval_sends_it(tiny_server, alone):
    """lm-eval-harness's `local-completions` sends its prompts as a list (token lists, or texts
    with `tokenized_requests=False`): one choice per prompt (with `n`, prompt x n + choice),
    each what the prompt alone gets."""
    prompts = [_ids(7, 12), _ids(8, 17), _ids(9, 9)]
    body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    for prompt, choice in zip(prompts, got["choices"], strict=True):
        want = alone.generate(prompt, GenerationConfig(max_new_tokens=0, prompt_logprobs=1))
        assert choice["text"] == alone.tokenizer.decode(prompt)
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            [t.logprob for t in want.prompt_logprobs[1:]], abs=1e-5
        )
    assert got["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    texts = ["the cat", "a dog ran"]
    body = {"prompt": texts, "max_tokens": 5, "temperature": 0.9, "seed": 3, "n": 2}
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()["choices"]
    for i, choice in enumerate(got):
        sampling = SamplingParams(temperature=0.9, seed=3 + i % 2)
        ids = alone.tokenizer.prompt_ids(texts[i // 2])
        assert choice["text"] == alone.generate(ids, GenerationConfig(5, sampling)).text, i
    empty = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"


def test_chat_logprobs_through_the_openai_client(tiny_server, alone, tiny_batch_package):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "the cat sat"}]
    reply = client.chat.completions.create(
        model=tiny_batch_package.name,
        messages=messages,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs.content
    ids = alone.tokenizer.encode_chat(messages)
    want = alone.generate(ids, GenerationConfig(max_new_tokens=8, logprobs=2))
    assert [c.logprob for c in content] == pytest.approx(
        [t.logprob for t in want.logprobs], abs=1e-5
    )
    text = b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace")
    assert text == reply.choices[0].message.content == want.text
    assert all(len(c.top_logprobs) == 2 for c in content)
    r = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "top_logprobs": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "[a-"}}, None),
        ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml"),
    ],
)
def test_bad_structured_outputs_are_400s(tiny_server, body, param):
    pytest.importorskip("llguidance")
    r = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    assert error["param"] == param


def test_ignore_eos_runs_to_max_tokens(tiny_server, alone):
    """vLLM's `ignore_eos`: eos (pushed up by a logit bias) ends a request at once without it,
    and is generated like any token with it, up to max_tokens, as the engine does alone."""
    eos = min(alone.tokenizer.eos_ids)
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    url = f"{tiny_server.url}/v1/completions"
    stopped = httpx.post(url, json=body).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 0
    ran = httpx.post(url, json=body | {"ignore_eos": True}).json()
    assert ran["choices"][0]["finish_reason"] == "length"
    config = GenerationConfig(6, ignore_eos=True, penalties=Penalties(logit_bias=((eos, 100.0),)))
    expected = alone.generate([5, 6, 7], config)
    assert ran["usage"]["completion_tokens"] == len(expected.token_ids) == 6
    assert ran["choices"][0]["text"] == expected.text


def test_stop_token_ids_end_the_answer_as_alone(tiny_server, alone):
    """vLLM's `stop_token_ids`: the answer ends before the first of them, finish "stop", as the
    engine's own answer with the same ids."""
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    url = f"{tiny_server.url}/v1/completions"
    full = alone.generate([5, 6, 7], GenerationConfig(12, ignore_eos=True)).token_ids
    stop = full[4]
    expected = alone.generate(
        [5, 6, 7], GenerationConfig(12, ignore_eos=True, stop_token_ids=(stop,))
    )
    assert expected.token_ids == full[: full.index(stop)]
    got = httpx.post(url, json=body | {"stop_token_ids": [stop]}).json()
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["choices"][0]["text"] == expected.text
    assert got["usage"]["completion_tokens"] == len(expected.token_ids)


def test_min_tokens_holds_the_end_off_as_alone(tiny_server, alone):
    """vLLM's `min_tokens`: eos, favoured at every step, ends the answer only once it has that
    many tokens, as in the engine's own answer."""
    eos = min(alone.tokenizer.eos_ids)
    bias = {"logit_bias": {str(eos): 100}}
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "min_tokens": 4} | bias
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()
    config = GenerationConfig(12, min_tokens=4, penalties=Penalties(logit_bias=((eos, 100.0),)))
    expected = alone.generate([5, 6, 7], config)
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == len(expected.token_ids) == 4
    assert got["choices"][0]["text"] == expected.text


def test_a_reasoning_budget_needs_a_reasoning_template(tiny_server, alone, tiny_batch_package):
    """The tiny package's ChatML template has no reasoning: thinking_token_budget is a 400
    naming that, the Messages API's thinking budget is left out with thinking itself (the
    answer is the one without it), and `serve --reasoning-budget` stops at start."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    url = f"{tiny_server.url}/v1/chat/completions"
    r = httpx.post(url, json=chat | {"thinking_token_budget": 4}, timeout=60)
    assert r.status_code == 400 and "has no reasoning" in r.json()["error"]["message"], r.text
    url = f"{tiny_server.url}/v1/messages"
    plain = httpx.post(url, json=chat, timeout=60).json()
    thinking = {"type": "enabled", "budget_tokens": 4}
    got = httpx.post(url, json=chat | {"thinking": thinking}, timeout=60).json()
    assert got["content"] == plain["content"] and got["content"][0]["type"] == "text"
    with pytest.raises(RuntimeError, match="--reasoning-budget: this package's chat template"):
        Server(tiny_batch_package, "--reasoning-budget", "4")


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def test_metrics_count_what_the_answers_say(tiny_server):
    """/metrics (Prometheus text): over a few requests, the token counters grow by the sums
    of the answers' usage, requests are counted by finish reason, each histogram by one per
    request, and the gauges read the scheduler (idle: nothing running or waiting)."""
    before = _metrics(tiny_server.url)
    answers = []
    for i, max_tokens in enumerate([3, 5, 1]):
        body = {"prompt": _ids(i, 6 + i), "max_tokens": max_tokens, "temperature": 0}
        answers.append(httpx.post(f"{tiny_server.url}/v1/completions", json=body).json())
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": ["zzz"]}
    answers.append(httpx.post(f"{tiny_server.url}/v1/chat/completions", json=chat).json())
    after = _metrics(tiny_server.url)
    usages = [answer["usage"] for answer in answers]
    reasons = Counter(answer["choices"][0]["finish_reason"] for answer in answers)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("aotgen:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew("aotgen:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert grew("aotgen:prompt_tokens_cached_total") == cached
    for reason in ("length", "stop"):  # the sampled chat answer may end on eos
        assert grew(f"aotgen:request_success_total{{finished_reason={reason}}}") == reasons[reason]
    assert reasons["length"] >= 3
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"aotgen:{histogram}_count") == 4 and grew(f"aotgen:{histogram}_sum") > 0
    assert grew("aotgen:time_per_output_token_seconds_count") == 3  # answers of 2+ tokens
    assert after["aotgen:num_requests_running"] == after["aotgen:num_requests_waiting"] == 0


def test_tokenize_and_detokenize_as_the_endpoints_count(tiny_server, alone):
    """/tokenize gives the ids the completion and chat endpoints run (their usage counts
    them) and the engine's tokenizer gives; /detokenize gives the text back."""
    url = tiny_server.url
    text = "The quick brown fox"
    got = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()
    assert got["tokens"] == alone.tokenizer.prompt_ids(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == alone.max_seq_len
    done = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == got["count"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == alone.tokenizer.encode_chat(messages)
    answer = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}
    ).json()
    assert answer["usage"]["prompt_tokens"] == chat["count"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back["prompt"] == alone.tokenizer.decode(chat["tokens"])
    for path, body in [
        ("/tokenize", {"prompt": text, "messages": messages}),
        ("/tokenize", {}),
        ("/detokenize", {"tokens": [alone.target.vocab_size]}),
    ]:
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, r.text)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", "{not json", None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, None),
        ("/v1/completions", {"prompt": "hi", "n": 5}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "suffix": "in the middle"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, None),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, None),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, None),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, None),
        ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
            "messages.1.content",
        ),
        ("/tokenize", {"messages": [{"role": "system", "content": None}]}, "messages.0.content"),
        # The tiny package's template takes no tools (tests/test_chat_answers.py: one that does).
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tools",
        ),
    ],
)
def test_bad_requests_get_openai_shaped_errors(tiny_server, path, body, param):
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(
        f"{tiny_server.url}{path}", headers={"content-type": "application/json"}, **kwargs
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param
    # ... and the server keeps serving
    ok = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_an_api_key_guards_every_endpoint_but_health_and_metrics(tiny_batch_package):
    """`--api-key` (or AOTGEN_API_KEY): without the bearer token, or with another, a 401 in
    OpenAI's shape; with it (the openai client's api_key), answers; the key in x-api-key too
    (Anthropic's clients), a wrong one a 401 in Anthropic's shape on /v1/messages; /health
    and /metrics stay open for probes and scrapers."""
    openai = pytest.importorskip("openai")
    server = Server(tiny_batch_package, "--api-key", "sekrit")
    try:
        body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sekrit"}):
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        for path in ("/tokenize", "/v1/models"):
            assert (
                httpx.request(
                    "GET" if "models" in path else "POST",
                    f"{server.url}{path}",
                    json={"prompt": "hi"},
                ).status_code
                == 401
            )
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit")
        answer = client.completions.create(model=tiny_batch_package.name, **body)
        assert answer.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").models.list()
        # Anthropic's clients send the key in x-api-key, and hear Anthropic's error shape.
        ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for key, status in (("sekrit", 200), ("nope", 401)):
            r = httpx.post(f"{server.url}/v1/messages", json=ask, headers={"x-api-key": key})
            assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == "authentication_error" and r.json()["type"] == "error"
    finally:
        server.close()


def test_allowed_origins_let_a_browser_page_call_the_api(tiny_server, tiny_batch_package):
    """`--allowed-origin`: a page of that origin passes the browser's preflight (which carries
    no key, so it comes before `--api-key`) and reads the answers, a 401 included; another
    origin's preflight is refused and its answers carry no CORS header; without the option no
    answer carries one."""
    page, other = "http://localhost:3000", "http://elsewhere.example"
    preflight = {"Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization,content-type"
    url, body = "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    server = Server(tiny_batch_package, "--allowed-origin", page, "--api-key", "sekrit")
    try:
        r = httpx.options(f"{server.url}{url}", headers={"Origin": page, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        key = {"Origin": page, "Authorization": "Bearer sekrit"}
        r = httpx.post(f"{server.url}{url}", json=body, headers=key)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.post(f"{server.url}{url}", json=body, headers={"Origin": page})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == page
        r = httpx.options(f"{server.url}{url}", headers={"Origin": other, **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.post(f"{server.url}{url}", json=body, headers={**key, "Origin": other})
        assert "access-control-allow-origin" not in r.headers
    finally:
        server.close()
    r = httpx.post(f"{tiny_server.url}{url}", json=body, headers={"Origin": page})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_full_queue_answers_429_with_retry_after(tiny_batch_package):
    server = Server(tiny_batch_package, "--max-queue", "1")
    # A request of 150 tokens takes ~40 ms on the tiny model: a burst of 32 from one shared
    # client, released together by a barrier, arrives well inside that (a client per thread
    # spread twelve requests over 50-90 ms, and all could be served one after another).
    burst = 32
    start = threading.Barrier(burst)
    try:
        limits = httpx.Limits(max_connections=burst)
        with httpx.Client(base_url=server.url, timeout=60, limits=limits) as client:

            def ask(i: int) -> httpx.Response:
                body = {"prompt": _ids(i, 4), "max_tokens": 150, "temperature": 0}
                start.wait()
                return client.post("/v1/completions", json=body)

            with ThreadPoolExecutor(burst) as pool:
                responses = list(pool.map(ask, range(burst)))
        refused = [r for r in responses if r.status_code == 429]
        assert refused and all(r.headers["retry-after"] == "1" for r in refused)
        assert refused[0].json()["error"]["type"] == "rate_limit_error"
        assert all(r.status_code == 200 for r in responses if r.status_code != 429)
        assert len(refused) <= burst - 5  # four slots and one queue place were there to take
    finally:
        server.close()


def test_load_test_reports_throughput_and_percentiles(tiny_server):
    sys.path.insert(0, str(REPO / "scripts"))
    import load_test

    report = load_test.main(
        [tiny_server.url, "--requests", "24", "--concurrency", "6", "--max-tokens", "8", "--json"]
    )
    assert report["ok"] == 24 and report["failed"] == 0
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p99_ms"]
    assert report["latency_p50_ms"] <= report["latency_p99_ms"]
    assert report["tokens_per_s"] > 0


# ---- the real package ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_server(smollm2_serve_package):
    server = Server(smollm2_serve_package)
    yield server
    server.close()


def test_openai_client_chat_equals_aotgen_run(smollm2_server, smollm2_serve_package):
    openai = pytest.importorskip("openai")
    question = "What is the capital of France?"
    run = subprocess.run(
        [*AOTGEN, "run", str(smollm2_serve_package), "--chat", question, "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    want = json.loads(run.stdout)["text"]
    assert want == "The capital of France is Paris."
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(
        model=smollm2_serve_package.name, messages=messages, temperature=0
    )
    assert reply.choices[0].message.content == want
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=smollm2_serve_package.name, messages=messages, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_anthropic_client_message_equals_aotgen_run(smollm2_server, smollm2_serve_package):
    """Anthropic's client on the real package: the message is the answer `aotgen run` gives
    (the test above), ended by end_turn, whole and streamed."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ask = {"model": smollm2_serve_package.name, "max_tokens": 64, "messages": question}
    ask["extra_body"] = {"temperature": 0}
    message = client.messages.create(**ask)
    assert [b.text for b in message.content] == ["The capital of France is Paris."]
    assert message.stop_reason == "end_turn" and message.usage.output_tokens > 0
    with client.messages.stream(**ask) as stream:
        assert "".join(stream.text_stream) == "The capital of France is Paris."


def test_openai_client_json_schema_equals_aotgen_run(smollm2_server, smollm2_serve_package):
    """`response_format: json_schema` through the official client: JSON with the schema's
    keys, equal to `aotgen run --json-schema` (streamed too)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    question = "Which city is the capital of France? Answer as JSON."
    run = subprocess.run(
        [*AOTGEN, "run", str(smollm2_serve_package), "--chat", question, "--json"]
        + ["--json-schema", json.dumps(schema), "--max-new-tokens", "60"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    want = json.loads(run.stdout)["text"]
    assert set(json.loads(want)) == {"city", "country"}
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}
    kwargs = {"model": smollm2_serve_package.name, "temperature": 0, "max_tokens": 60}
    messages = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(messages=messages, response_format=fmt, **kwargs)
    assert reply.choices[0].message.content == want
    stream = client.chat.completions.create(
        messages=messages, response_format=fmt, stream=True, **kwargs
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_completion_logprobs_place_each_token_in_the_text(smollm2_server):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    got = httpx.post(f"{smollm2_server.url}/v1/completions", json={**body, "logprobs": 1})
    choice = got.json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert choice["text"][offset : offset + len(token)] == token
    assert all(v <= 0 for v in lp["token_logprobs"])


def test_client_leaving_mid_stream_frees_its_slot(smollm2_server):
    before = smollm2_server.health()["finished"].get("cancelled", 0)
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{smollm2_server.url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break  # one piece of text, then hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = smollm2_server.health()
        if health["running"] == 0 and health["finished"].get("cancelled", 0) > before:
            break
        time.sleep(0.2)
    assert health["running"] == 0
    assert health["finished"].get("cancelled", 0) == before + 1


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(
    tiny_batch_package, alone, tmp_path
):
    """As vLLM's `--generation-config auto`: a request without top_k or max_tokens gets the
    model's (top_k 1: greedy; 5 tokens); one that gives them keeps its own; a value no request
    could send (temperature 3) is left out with a warning; `--generation-config none` serves
    OpenAI's defaults (temperature 1, 16 tokens)."""
    values = {"top_k": 1, "max_new_tokens": 5, "temperature": 3.0}
    package = with_generation_config(tiny_batch_package, tmp_path / "pkg", values)
    prompt = _ids(4, 7)
    greedy = alone.generate(prompt, GenerationConfig(5, ignore_eos=True))

    def sampled(n: int) -> str:
        sampling = SamplingParams(temperature=1.0, seed=7)
        return alone.generate(prompt, GenerationConfig(n, sampling=sampling, ignore_eos=True)).text

    assert sampled(5) != greedy.text  # the test tells the two apart
    body = {"prompt": prompt, "seed": 7, "ignore_eos": True}
    server = Server(package)
    try:
        url = f"{server.url}/v1/completions"
        got = httpx.post(url, json=body, timeout=60).json()
        assert got["choices"][0]["text"] == greedy.text
        assert got["usage"]["completion_tokens"] == 5
        own = httpx.post(url, json=body | {"top_k": 0, "max_tokens": 5}, timeout=60).json()
        assert own["choices"][0]["text"] == sampled(5)
        chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
        assert answer["usage"]["completion_tokens"] <= 5
    finally:
        server.close()
    log = server.proc.stdout.read()
    assert "temperature=3.0 (" in log and "top_k=1, max_tokens=5" in log
    server = Server(package, "--generation-config", "none")
    try:
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == sampled(16)
    finally:
        server.close()


def test_lookup_cache_is_learnt_and_written_at_shutdown(tiny_batch_package, alone, tmp_path):
    """`serve --lookup ngram --lookup-cache FILE`: every answered request's text (prompt and
    answer, as served alone) is in the file written when the server stops."""
    path = tmp_path / "cache.bin"
    server = Server(tiny_batch_package, "--lookup", "ngram", "--lookup-cache", str(path))
    prompts = [_ids(1, 9), _ids(2, 12)]
    try:
        for ids in prompts:
            body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        server.close()
    want = LookupCache()
    for ids in prompts:
        want.add(ids + alone.generate(ids, GenerationConfig(max_new_tokens=10)).token_ids)
    want.save(tmp_path / "want.bin")
    assert path.read_bytes() == (tmp_path / "want.bin").read_bytes()
    assert f"aotgen:lookup_cache_ngrams {float(len(want))}" in metrics


def test_lookup_cache_is_written_while_serving(tiny_batch_package, alone, tmp_path):
    """`--lookup-cache-every 0.2`: the file holds every answered request's text a moment
    later, so a server killed without a shutdown (SIGKILL) keeps what it learnt."""
    path = tmp_path / "cache.bin"
    args = ("--lookup", "ngram", "--lookup-cache", str(path), "--lookup-cache-every", "0.2")
    server = Server(tiny_batch_package, *args)
    want = LookupCache()
    try:
        for ids in (_ids(3, 9), _ids(4, 12)):
            body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
            want.add(ids + alone.generate(ids, GenerationConfig(max_new_tokens=10)).token_ids)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            written = LookupCache.load(path, alone.target.vocab_size) if path.exists() else None
            if written is not None and written.table == want.table:
                break
            time.sleep(0.1)
    finally:
        server.proc.kill()
        server.proc.wait(10)
    assert LookupCache.load(path, alone.target.vocab_size).table == want.table
