"""End-to-end test of `atlas serve` with the official `openai` Python client.

Run by scripts/test_serve.sh, which starts the server on the tiny random fixture model
(tests/fixtures/models/chat_tiny) and sets:
  ATLAS_BASE_URL   the server's API root, e.g. http://127.0.0.1:8080/v1
  ATLAS_SERVER_LOG the server's stderr, to see that a dropped stream cancelled its generation
  ATLAS_BIN        the atlas binary and ATLAS_MODEL the model, to start other servers with other flags
The model answers random text, so the tests check the plumbing: shapes, statuses, that streamed
and whole answers agree, that requests queue in order, that a vanished client cancels generation
and that a client that stops reading its stream is given up on.
Prints "N passed, M failed" (", K skipped") last and exits non-zero on any failure.
"""

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request

import openai

BASE_URL = os.environ.get("ATLAS_BASE_URL", "http://127.0.0.1:8080/v1")
ROOT_URL = BASE_URL.rsplit("/v1", 1)[0]
MODEL = "chat_tiny"

client = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=120)

HELLO = [{"role": "user", "content": "Hello! Tell me about the sea."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
TOOL_NAMES = {t["function"]["name"] for t in TOOLS}

TESTS = []


class Skip(Exception):
    """A test that cannot run here."""


def test(fn):
    TESTS.append(fn)
    return fn


def http(method, path, body=None, headers=None):
    """A raw request: (status, headers, body text)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(ROOT_URL + path, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def check_usage(usage, max_completion):
    assert usage is not None, "no usage"
    assert usage.prompt_tokens > 0, usage
    assert 1 <= usage.completion_tokens <= max_completion, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage


def check_error(err, status, code=None):
    assert err.status_code == status, (err.status_code, err)
    body = err.body
    assert isinstance(body, dict), body
    assert isinstance(body.get("message"), str) and body["message"], body
    assert body.get("type") == "invalid_request_error", body
    if code is not None:
        assert body.get("code") == code, body


def check_tool_call(call):
    assert isinstance(call.id, str) and call.id, call
    assert call.type == "function", call
    assert call.function.name in TOOL_NAMES, call
    assert isinstance(call.function.arguments, str), call
    json.loads(call.function.arguments)  # arguments are a JSON text


@test
def health():
    status, headers, body = http("GET", "/health")
    assert status == 200, (status, body)
    assert headers.get("content-type", headers.get("Content-Type", "")).startswith("application/json"), headers
    assert json.loads(body) == {"status": "ok"}, body


@test
def models_list():
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL], ids
    m = models.data[0]
    assert m.object == "model" and m.owned_by == "atlas" and m.created > 0, m
    status, _, body = http("GET", "/v1/models")
    raw = json.loads(body)
    assert status == 200 and raw["object"] == "list", raw


@test
def plain_chat():
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=16)
    assert r.object == "chat.completion", r
    assert r.id.startswith("chatcmpl-"), r.id
    assert r.model == MODEL, r.model
    assert len(r.choices) == 1, r.choices
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant", choice.message
    assert isinstance(choice.message.content, str) and choice.message.content, choice.message
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    check_usage(r.usage, 16)
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 16, r.usage
    # Greedy decoding is deterministic: the same request gives the same answer.
    again = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=16)
    assert again.choices[0].message.content == choice.message.content


@test
def streaming_matches_whole():
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=16)
    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len(chunks) >= 3, chunks
    ids = {c.id for c in chunks}
    assert len(ids) == 1, ids
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content, (text, whole.choices[0].message.content)
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason], finishes
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and not usage_chunks[0].choices, usage_chunks
    assert usage_chunks[0].usage.completion_tokens == whole.usage.completion_tokens


@test
def sse_wire_format():
    body = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 4, "stream": True}
    status, headers, text = http("POST", "/v1/chat/completions", body)
    assert status == 200, (status, text)
    ctype = {k.lower(): v for k, v in headers.items()}["content-type"]
    assert ctype.startswith("text/event-stream"), ctype
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]
    for e in events[:-2]:
        assert e.startswith("data: "), e
        assert json.loads(e[len("data: "):])["object"] == "chat.completion.chunk"
    # The unprefixed path answers too.
    status, _, text = http("POST", "/chat/completions", dict(body, stream=False))
    assert status == 200 and json.loads(text)["object"] == "chat.completion", (status, text)


@test
def tool_call_round_trip():
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{
                "id": "call_abc123",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
            }],
        },
        {"role": "tool", "tool_call_id": "call_abc123", "content": json.dumps({"temperature_c": 18, "sky": "clear"})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls"), choice.finish_reason
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            check_tool_call(call)
    else:
        assert isinstance(choice.message.content, str), choice.message
    check_usage(r.usage, 24)
    # The prompt holds the whole conversation: more tokens than the user question alone.
    short = client.chat.completions.create(model=MODEL, messages=messages[:2], tools=TOOLS, temperature=0, max_tokens=1)
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 10, (r.usage, short.usage)


@test
def tool_choice_required():
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=48,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls"), choice.finish_reason
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls", choice.finish_reason
        for call in choice.message.tool_calls:
            check_tool_call(call)
    else:
        # The random model may not finish a parseable call; the answer is then text.
        assert isinstance(choice.message.content, str), choice.message
    check_usage(r.usage, 48)

    # Streamed, the same request gives the same answer, tool-call deltas included.
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=48,
        stream=True,
    )
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                call["id"] = d.id
            if d.function and d.function.name:
                call["name"] = d.function.name
            if d.function and d.function.arguments:
                call["arguments"] += d.function.arguments
        finish = c.finish_reason or finish
    assert finish == choice.finish_reason, (finish, choice.finish_reason)
    assert content == (choice.message.content or ""), (content, choice.message.content)
    whole_calls = choice.message.tool_calls or []
    assert len(calls) == len(whole_calls), (calls, whole_calls)
    for i, call in enumerate(whole_calls):
        assert calls[i]["name"] == call.function.name and calls[i]["arguments"] == call.function.arguments


@test
def bad_requests_are_400():
    cases = [
        (dict(n=17), "invalid_request"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "invalid_request"),
        (dict(temperature="hot"), "invalid_request"),
        (dict(tool_choice="required"), "invalid_request"),  # without tools
        (dict(max_tokens=100000), "context_length_exceeded"),
        (dict(max_tokens=100000, stream=True), "context_length_exceeded"),
        (dict(n=0, stream=True), "invalid_request"),
    ]
    for extra, code in cases:
        kwargs = dict(model=MODEL, messages=HELLO)
        kwargs.update(extra)
        try:
            client.chat.completions.create(**kwargs)
        except openai.BadRequestError as e:
            check_error(e, 400, code)
        else:
            raise AssertionError(f"{extra} was accepted")
    # Not JSON at all.
    status, _, text = http("POST", "/v1/chat/completions", b"{not json")
    assert status == 400, (status, text)
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"], err


@test
def several_choices():
    kwargs = dict(model=MODEL, messages=HELLO, temperature=1.0, seed=21, max_tokens=12)
    lone = [client.chat.completions.create(**dict(kwargs, seed=21 + i)).choices[0].message.content for i in range(3)]
    r = client.chat.completions.create(n=3, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2], r
    assert [c.message.content for c in r.choices] == lone, (r, lone)
    # Streamed, each choice's deltas come under its index and add up to its answer.
    texts = {}
    for c in client.chat.completions.create(n=3, stream=True, **kwargs):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert [texts[i] for i in range(3)] == lone, (texts, lone)


@test
def unknown_endpoint_is_404():
    status, _, text = http("GET", "/v1/nothing")
    assert status == 404, status
    assert json.loads(text)["error"]["type"] == "not_found_error", text


@test
def text_completions():
    r = client.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-"), r
    text = r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 8, r
    # Streamed pieces add up to the whole answer; echo puts the prompt first.
    pieces = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The sea is", temperature=0, max_tokens=8, stream=True) if c.choices)
    assert pieces == text, (pieces, text)
    echoed = client.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=8, echo=True)
    assert echoed.choices[0].text == "The sea is" + text, echoed
    # Token ids as the prompt, logprobs with alternatives.
    ids = client.completions.create(model=MODEL, prompt=[72, 101, 108], temperature=0, max_tokens=4, logprobs=2)
    lp = ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == ids.usage.completion_tokens, lp
    assert all(len(t) <= 2 for t in lp.top_logprobs), lp
    # Streamed, each token's entry comes in a chunk of its own, offsets running on.
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=[72, 101, 108], temperature=0, max_tokens=4, logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert all(len(s.tokens) == 1 for s in streamed), streamed
    assert [t for s in streamed for t in s.tokens] == lp.tokens, (streamed, lp)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset, (streamed, lp)
    # Several choices, each under its index, as the same request with seed + index alone.
    two = client.completions.create(model=MODEL, prompt="The sea is", temperature=1.0, seed=8, max_tokens=6, n=2)
    alone = client.completions.create(model=MODEL, prompt="The sea is", temperature=1.0, seed=9, max_tokens=6)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[1].text == alone.choices[0].text, (two, alone)
    # A JSON schema holds here too.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=1.0, seed=4,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert json.loads(r.choices[0].text)["ok"] in (True, False), r
    # The chat-only fields and a fill-in-the-middle suffix without FIM tokens are 400s.
    for extra, code in [(dict(extra_body={"messages": HELLO}), "invalid_request"), (dict(suffix="end"), "unsupported")]:
        try:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **extra)
        except openai.BadRequestError as e:
            check_error(e, 400, code)
        else:
            raise AssertionError(f"{extra} was accepted")


@test
def concurrent_requests_queue():
    expected = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=32)

    def one(i):
        kwargs = dict(model=MODEL, messages=HELLO, temperature=0, max_tokens=32)
        if i % 2:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return client.chat.completions.create(**kwargs).choices[0].message.content

    results = on_threads(one, 4, timeout=120)
    assert results == [expected.choices[0].message.content] * 4, results


def on_threads(fn, n, timeout):
    """fn(0) .. fn(n - 1), each on a thread of its own, all at once: their results, in order
    (any exception fails the caller's test)."""
    results, errors = [None] * n, []

    def one(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors
    return results


def agent_conversation(api, agent, turns=4):
    """One agent's conversation, each turn re-sending the history with the previous answer:
    [(answer, prompt_tokens, completion_tokens, cached_tokens)] per turn."""
    messages = [{"role": "system", "content": "You are a coding agent: plan, call tools, check, answer."}]
    out = []
    for turn in range(turns):
        task = f"Agent {agent}, step {turn}: the test {agent * 7 + turn} fails with this log. " * 3
        messages.append({"role": "user", "content": task})
        r = api.chat.completions.create(model=MODEL, messages=messages, temperature=0.7, seed=agent * 10 + turn, max_tokens=16)
        answer = r.choices[0].message.content
        messages.append({"role": "assistant", "content": answer})
        out.append((answer, r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens))
    return out


@test
def eight_agents_at_once_answer_as_alone():
    """8 threads x 4 turns on a server decoding 8 at once: each conversation's answers equal
    those it gets alone on a server of one slot without a prefix cache, and each turn resumes
    from the previous history's 256-token blocks whoever ran in between."""
    with other_server("--prefix-cache", "0", "--parallel", "1") as (url, _):
        alone = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        expected = [[t[0] for t in agent_conversation(alone, agent)] for agent in range(8)]
    with other_server("--parallel", "8") as (url, read_log):
        assert "(8 at once)" in read_log(), read_log()
        shared = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        results = on_threads(lambda agent: agent_conversation(shared, agent), 8, timeout=300)
    for agent, turns in enumerate(results):
        assert [t[0] for t in turns] == expected[agent], (agent, turns, expected[agent])
        assert turns[2][1] >= 512, f"agent {agent}: histories too short to fill blocks"
        for before, after in zip(turns, turns[1:]):
            history = before[1] + before[2] - 1
            assert after[3] >= history // 256 * 256, f"agent {agent}: {after[3]} cached of {history}"


def log_count(pattern):
    path = os.environ.get("ATLAS_SERVER_LOG")
    if not path:
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return len(re.findall(pattern, f.read()))


@test
def dropped_stream_cancels_generation():
    before = log_count(r"cancelled after")
    # Greedy decoding on this model runs to the end of the context (about a thousand tokens).
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    if before is not None:
        deadline = time.time() + 10
        while log_count(r"cancelled after") == before and time.time() < deadline:
            time.sleep(0.05)
        assert log_count(r"cancelled after") == before + 1, "the server did not log a cancelled generation"
    # The engine is free again.
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=4)
    assert r.choices[0].message.content is not None


@test
def model_name_over_256_bytes_is_400():
    # The name is echoed in every streamed chunk: a long one would multiply the stream's size.
    for stream in (False, True):
        try:
            client.chat.completions.create(model="m" * 257, messages=HELLO, max_tokens=2, stream=stream)
        except openai.BadRequestError as e:
            check_error(e, 400, "invalid_request")
            assert "257 bytes" in e.body["message"], e.body
        else:
            raise AssertionError(f"a 257-byte model name was accepted (stream={stream})")
    r = client.chat.completions.create(model="m" * 256, messages=HELLO, max_tokens=2)
    assert r.model == "m" * 256


def read_response_head(sock):
    """The status code of the HTTP response on a raw socket (its head only is read)."""
    head = b""
    while b"\r\n\r\n" not in head:
        byte = sock.recv(1)
        assert byte, f"the connection closed after {head!r}"
        head += byte
    return int(head.split(b" ", 2)[1])


def raw_post(url, body, length=None, sock=None):
    """Sends POST /v1/chat/completions on a raw socket (a new one unless given) and returns the
    socket. `length` is the Content-Length to declare (by default the body's), or "chunked" to send
    the body as the first chunk of a chunked body."""
    address = urllib.parse.urlsplit(url)
    if sock is None:
        sock = socket.socket()
    sock.settimeout(30)
    sock.connect((address.hostname, address.port))
    if length == "chunked":
        framing, body = b"Transfer-Encoding: chunked", b"%x\r\n%s\r\n" % (len(body), body)
    else:
        framing = b"Content-Length: %d" % (len(body) if length is None else length)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: atlas\r\nContent-Type: application/json\r\n%s\r\n\r\n%s"
        % (framing, body)
    )
    return sock


@test
def request_over_the_size_limit_is_413():
    # The default limit is 8 MiB: a larger body is refused from its Content-Length, unread.
    with contextlib.closing(raw_post(ROOT_URL, b"{", length=9 << 20)) as sock:
        assert read_response_head(sock) == 413
    with other_server("--max-request-bytes", "20000") as (url, _):
        small = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
        with contextlib.closing(raw_post(url, small)) as sock:
            assert read_response_head(sock) == 200
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 20000}], "max_tokens": 2}).encode()
        with contextlib.closing(raw_post(url, big)) as sock:
            assert read_response_head(sock) == 413
        # A chunked body declares no length: it is refused once it passes the limit.
        with contextlib.closing(raw_post(url, big, length="chunked")) as sock:
            assert read_response_head(sock) == 413


def endless_model(directory):
    """A copy of the fixture model with a long context whose end-of-sequence token never comes:
    greedy decoding answers for as long as it is asked to."""
    model = os.path.join(directory, "endless")
    shutil.copytree(os.environ["ATLAS_MODEL"], model)
    for name, eos in (("config.json", 270), ("generation_config.json", [270])):
        path = os.path.join(model, name)
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config["eos_token_id"] = eos
        if name == "config.json":
            config["max_position_embeddings"] = 65536
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
    return model


@test
def stalled_stream_is_cancelled():
    if not os.environ.get("ATLAS_BIN") or not os.environ.get("ATLAS_MODEL"):
        raise Skip("ATLAS_BIN or ATLAS_MODEL not set")
    timeout = 2
    with tempfile.TemporaryDirectory() as tmp, \
            other_server("--stream-timeout", str(timeout), "-c", "65536", model=endless_model(tmp)) as (url, log):
        # A client that asks for a long stream and reads nothing of it. Its small receive buffer and
        # segment size keep the server's send buffer small too (Linux sizes it by the segment), so
        # that its stream fills up after a few hundred KB; the long model name (echoed in every
        # chunk) makes that sooner still.
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        request = {"model": "m" * 256, "messages": HELLO, "temperature": 0, "max_tokens": 60000, "stream": True}
        with contextlib.closing(raw_post(url, json.dumps(request).encode(), sock=stalled)):
            assert read_response_head(stalled) == 200  # it is generating
            start = time.time()

            # Requests queued behind it, 0.1 s apart, are answered once it is given up on, first come
            # first served (their max_tokens, which this model always reaches, tell them apart in the
            # log); one whose client leaves while queued is not run at all.
            quick = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=timeout + 10)
            waited, errors = {}, []

            def one(n):
                try:
                    r = quick.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=n)
                    assert r.usage.completion_tokens == n, r.usage
                    waited[n] = time.time() - start
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(repr(e))

            threads = []
            for n in (1, 7, 2, 3):
                if n == 7:
                    leaving = raw_post(url, json.dumps({"messages": HELLO, "max_tokens": n}).encode())
                    time.sleep(0.1)
                    leaving.close()
                    continue
                threads.append(threading.Thread(target=one, args=(n,)))
                threads[-1].start()
                time.sleep(0.1)
            for t in threads:
                t.join(timeout=60)
            assert not errors, errors
            # Well under the client's own timeout: the stream filled and then stalled for `timeout`.
            assert max(waited.values()) < timeout + 8, waited

            text = log()
            stall = re.search(rf"cancelled after \d+ ms: the client took nothing from its stream for {timeout} s", text)
            assert stall, "the server did not log the stalled stream's cancellation"
            served = [int(n) for n in re.findall(r"(\d+) generated", text[stall.end():])]
            assert served == [1, 2, 3], served

            # The stalled client finds its stream ended without [DONE]: its answer is incomplete.
            stalled.settimeout(30)
            rest = bytearray()
            while not rest.endswith(b"\r\n0\r\n\r\n"):
                data = stalled.recv(65536)
                assert data, "the stalled stream was closed without its end"
                rest += data
            assert b"[DONE]" not in rest

        # And the server serves as before.
        chunks = list(quick.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length", chunks[-1]


@contextlib.contextmanager
def other_server(*flags, model=None):
    """Another `atlas serve` with other flags (on ATLAS_MODEL unless `model` is given): yields its API
    root and a function that returns its log so far; it must stop cleanly on SIGTERM."""
    binary = os.environ.get("ATLAS_BIN")
    model = model or os.environ.get("ATLAS_MODEL")
    if not binary or not model:
        raise Skip("ATLAS_BIN or ATLAS_MODEL not set")
    with tempfile.NamedTemporaryFile("w+", encoding="utf-8", suffix=".log") as log:
        proc = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", *flags], stderr=log)

        def read_log():
            with open(log.name, encoding="utf-8", errors="replace") as f:
                return f.read()

        try:
            url = None
            deadline = time.time() + 60
            while url is None and time.time() < deadline:
                if proc.poll() is not None:
                    raise AssertionError(f"the other server exited:\n{read_log()}")
                m = re.search(r"ready: .* at (http://\S+/v1)", read_log())
                url = m and m.group(1)
                time.sleep(0.05)
            assert url, f"the other server did not get ready:\n{read_log()}"
            yield url, read_log
        finally:
            if proc.poll() is None:
                proc.terminate()
                assert proc.wait(timeout=20) == 0, f"the other server did not stop cleanly on SIGTERM:\n{read_log()}"


@test
def api_key_required():
    with other_server("--api-key", "s3cret") as (url, _):
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        r = good.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert r.choices[0].message.role == "assistant"
        for call in (lambda: bad.models.list(), lambda: bad.chat.completions.create(model=MODEL, messages=HELLO)):
            try:
                call()
            except openai.AuthenticationError as e:
                assert e.status_code == 401 and e.body["code"] == "invalid_api_key", e.body
            else:
                raise AssertionError("a wrong key was accepted")
        status, _, _ = http_at(url, "/models")
        assert status == 401, status
        status, _, _ = http_at(url.rsplit("/v1", 1)[0], "/health")
        assert status == 200, status


def http_at(root, path):
    try:
        with urllib.request.urlopen(root + path, timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def main():
    passed = failed = skipped = 0
    for fn in TESTS:
        start = time.time()
        try:
            fn()
        except Skip as why:
            skipped += 1
            print(f"skip {fn.__name__}: {why}")
        except Exception:  # noqa: BLE001 - every failure is reported
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc()
        else:
            passed += 1
            print(f"ok   {fn.__name__} ({time.time() - start:.2f} s)")
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
