"""The Ollama door as Ollama's official Python client (``ollama``) sees it, over HTTPS, against
a real `edgespec serve` on the real 0.5B model (``doors_server``): a chat, a streamed chat,
generate, an answer following a JSON schema, a tool round trip (the model's own call, the
tool's result, the final answer), the model endpoints, and options it cannot honour refused
with Ollama's error naming them before the ring sees them."""

from __future__ import annotations

import json

import pytest
from doors_server import (
    CAT,
    KEY,
    MODEL,
    RAINING,
    REPLY,
    RESULT,
    WEATHER_PARAMS,
    is_cat,
    shared,
    uses_result,
)

from edgespec.server.ollama import _Message, _messages, _options
from edgespec.server.requests import _BadRequest

ollama = pytest.importorskip("ollama")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": WEATHER_PARAMS}}
FAST = {"temperature": 0, "num_predict": 8}


def test_options_map_onto_the_openai_fields_and_the_rest_are_refused():
    assert _options({"temperature": 0.2, "num_predict": 5, "stop": ["x"], "seed": 3}) == \
        {"temperature": 0.2, "max_tokens": 5, "stop": ["x"], "seed": 3}
    assert _options({"num_predict": -1}) == {}  # until the answer ends: the default
    with pytest.raises(_BadRequest, match="option 'mirostat' is not supported"):
        _options({"mirostat": 2})


def test_calls_get_ids_and_results_answer_them():
    msgs = _messages([
        _Message(role="user", content="weather?"),
        _Message(role="assistant", tool_calls=[{"function": {"name": "get_weather",
                                                             "arguments": {"city": "P"}}}]),
        _Message(role="tool", content="sunny", tool_name="get_weather")])
    call = msgs[1]["tool_calls"][0]
    assert msgs[1]["content"] is None and json.loads(call["function"]["arguments"]) == \
        {"city": "P"}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": call["id"]}


@pytest.fixture(scope="module")
def client():
    srv = shared()
    return ollama.Client(host=srv.base, verify=srv.tls(),
                         headers={"Authorization": f"Bearer {KEY}"})


@pytest.mark.real_model
def test_chat_streamed_and_not(client):
    msgs = [{"role": "user", "content": "What is the capital of Japan?"}]
    r = client.chat(model=MODEL, messages=msgs, options=FAST)
    assert r.message.role == "assistant" and r.message.content
    assert r.done and r.done_reason in ("stop", "length") and 0 < r.eval_count <= 8
    assert r.prompt_eval_count > 5
    parts = list(client.chat(model=MODEL, messages=msgs, options=FAST, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == r.message.content


@pytest.mark.real_model
def test_generate_streamed_and_not(client):
    r = client.generate(model=MODEL, prompt="What is 2 + 3? Answer with the number only.",
                        options=FAST)
    assert "5" in r.response and r.done
    parts = list(client.generate(model=MODEL, prompt="What is 2 + 3? Answer with the "
                                 "number only.", options=FAST, stream=True))
    assert "".join(p.response for p in parts) == r.response and parts[-1].done
    raw = client.generate(model=MODEL, prompt="def add(a, b):\n", raw=True, options=FAST)
    assert raw.response and raw.eval_count <= 8


@pytest.mark.real_model
def test_format_json_schema_answer_validates(client):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Describe a cat in "
                                            "JSON."}], format=CAT,
                    options={"temperature": 0, "num_predict": 64})
    assert is_cat(json.loads(r.message.content)), r.message.content
    r = client.generate(model=MODEL, prompt="A cat as JSON.", format="json",
                        options={"temperature": 0, "num_predict": 48})
    assert isinstance(json.loads(r.response), dict)


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, stream):
    """The model's own call (Ollama has no tool_choice; asked this, the model calls the
    tool), the result sent back as a tool message, and the final answer using it (no tools
    offered then, and the answer as {"reply": ...}, since the 0.5B would call again)."""
    ask = [{"role": "user", "content": RAINING}]
    kw = {"model": MODEL, "tools": [WEATHER], "options": {"temperature": 0,
                                                           "num_predict": 64}}
    if stream:
        calls = [c for p in client.chat(messages=ask, stream=True, **kw)
                 for c in p.message.tool_calls or ()]
        said = {"role": "assistant", "content": "", "tool_calls": calls}
    else:
        said = client.chat(messages=ask, **kw).message
        calls = said.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    assert dict(calls[0].function.arguments) == {"city": "Paris"}
    turn2 = [*ask, said, {"role": "tool", "content": RESULT, "tool_name": "get_weather"}]
    r = client.chat(model=MODEL, messages=turn2, format=REPLY,
                    options={"temperature": 0, "num_predict": 64})
    assert not r.message.tool_calls and uses_result(json.loads(r.message.content)["reply"])


@pytest.mark.real_model
def test_model_endpoints(client):
    assert [m.model for m in client.list().models] == [MODEL]
    assert [m.model for m in client.ps().models] == [MODEL]
    shown = client.show(MODEL)
    assert "tools" in shown.capabilities and "<tool_call>" in shown.template
    status, body = shared().http("GET", "/api/version")
    assert status == 200 and body["version"]


@pytest.mark.real_model
def test_refusals_in_ollamas_shape_never_reach_the_ring(client):
    srv = shared()
    before = srv.http("GET", "/health")[1]["completed"]
    for kw, named in (({"options": {"mirostat": 1}}, "mirostat"),
                      ({"options": {"num_ctx": 8192}}, "num_ctx"),
                      ({"think": True}, "think"), ({"keep_alive": 0}, "keep_alive")):
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], **kw)
        assert e.value.status_code == 400 and named in e.value.error
    status, body = srv.http("POST", "/api/chat", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi", "images": ["aGk="]}]})
    assert status == 400 and set(body) == {"error"} and "images" in body["error"]
    status, body = srv.http("POST", "/api/chat", {"model": MODEL, "messages": [],
                                                  "frobnicate": 1})
    assert status == 400 and "frobnicate" in body["error"]
    assert srv.http("GET", "/api/nothing")[0] == 404
    assert srv.http("GET", "/api/tags", key=None) == (401, srv.http("GET", "/api/tags",
                                                                    key="wrong")[1])
    assert srv.http("GET", "/health")[1]["completed"] == before
