"""Anthropic's Messages door as Anthropic's official Python client (``anthropic``) sees it,
over HTTPS with ``x-api-key``, against a real `edgespec serve` on the real 0.5B model
(``doors_server``): a message, a streamed one (the SDK assembles the event sequence), a
JSON-schema answer (a forced tool whose input is the schema, Anthropic's way), a tool round
trip (tool_use, tool_result, final answer), stop sequences, and errors in Anthropic's
shape."""

from __future__ import annotations

import json

import pytest
from doors_server import (
    CAT,
    KEY,
    MODEL,
    RAINING,
    RESULT,
    WEATHER_PARAMS,
    is_cat,
    shared,
    uses_result,
)

from edgespec.server.anthropic import _openai_body, _Request
from edgespec.server.requests import _BadRequest

anthropic = pytest.importorskip("anthropic")

# The SDK no longer takes sampling settings; the API still does (older clients send them).
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": WEATHER_PARAMS}


def test_blocks_become_the_openai_conversation():
    req = _Request.model_validate({
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
        "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather",
                                            "disable_parallel_tool_use": True},
        "stop_sequences": ["\n"], "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather", "input": {"city": "P"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "sunny"}]}]})
    body = _openai_body(req)
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool"]
    assert body["messages"][2]["tool_calls"][0]["id"] == "toolu_1"
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1",
                                   "content": "sunny"}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False and body["stop"] == ["\n"]
    with pytest.raises(_BadRequest, match=r"'messages\[0\].content\[0\].text' is required"):
        _openai_body(_Request.model_validate({"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": [{"type": "text"}]}]}))
    with pytest.raises(_BadRequest, match="thinking"):
        _openai_body(_Request.model_validate({
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}}))


@pytest.fixture(scope="module")
def client():
    srv = shared()  # the SDK sends the key as x-api-key
    return anthropic.Anthropic(base_url=srv.base, api_key=KEY, max_retries=0,
                               http_client=anthropic.DefaultHttpxClient(verify=srv.tls()))


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.real_model
def test_a_message_streamed_and_not(client):
    kw = {"model": MODEL, "max_tokens": 8, "extra_body": GREEDY,
          "messages": _ask("What is the capital of Japan?")}
    r = client.messages.create(**kw)
    assert r.type == "message" and r.role == "assistant" and r.content[0].type == "text"
    assert r.stop_reason in ("end_turn", "max_tokens") and 0 < r.usage.output_tokens <= 8
    with client.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == r.content[0].text == final.content[0].text
    assert final.stop_reason == r.stop_reason and final.usage.output_tokens == \
        r.usage.output_tokens and final.usage.input_tokens == r.usage.input_tokens


@pytest.mark.real_model
def test_stop_sequences_name_the_one_met(client):
    r = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                               stop_sequences=["Tokyo"],
                               messages=_ask("What is the capital of Japan?"))
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Tokyo"
    assert "Tokyo" not in r.content[0].text


@pytest.mark.real_model
def test_json_schema_answers_validate(client):
    """Structured output (``output_config.format``), and the older way: a forced tool whose
    input is the schema."""
    r = client.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY,
                               messages=_ask("Describe a cat in JSON."),
                               output_config={"format": {"type": "json_schema",
                                                         "schema": CAT}})
    assert is_cat(json.loads(r.content[0].text)), r.content
    r = client.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY,
                               messages=_ask("Describe a cat."),
                               tools=[{"name": "record_cat", "description": "Record a cat",
                                       "input_schema": CAT}],
                               tool_choice={"type": "tool", "name": "record_cat"})
    assert r.stop_reason == "tool_use" and r.content[-1].type == "tool_use"
    assert r.content[-1].name == "record_cat" and is_cat(r.content[-1].input)


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, stream):
    """tool_use forced with tool_choice, the tool_result sent back, the final answer in
    text (tool_choice none: the tools are not offered then)."""
    kw = {"model": MODEL, "max_tokens": 64, "extra_body": GREEDY, "tools": [WEATHER]}
    ask = _ask(RAINING)
    forced = {"type": "tool", "name": "get_weather"}
    if stream:
        with client.messages.stream(messages=ask, tool_choice=forced, **kw) as s:
            r = s.get_final_message()
    else:
        r = client.messages.create(messages=ask, tool_choice=forced, **kw)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
    assert uses[0].input == {"city": "Paris"}
    turn2 = [*ask, {"role": "assistant", "content": r.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                           "content": RESULT}]}]
    final = client.messages.create(messages=turn2, tool_choice={"type": "none"}, **kw)
    text = "".join(b.text for b in final.content if b.type == "text")
    assert final.stop_reason in ("end_turn", "max_tokens") and uses_result(text), text


@pytest.mark.real_model
def test_errors_in_anthropics_shape_never_reach_the_ring(client):
    srv = shared()
    before = srv.http("GET", "/health")[1]["completed"]
    cases = [({"extra_body": {"temperature": 1.5}}, "temperature"),
             ({"messages": [{"role": "user", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": "aGk="}}]}]}, "image"),
             ({"tool_choice": {"type": "any"}}, "tool_choice"),
             ({"extra_body": {"container": "x"}}, "container")]
    for kw, named in cases:
        args = {"model": MODEL, "max_tokens": 8, "messages": _ask("hi"), **kw}
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**args)
        err = e.value.body
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert named in err["error"]["message"], err
    bad = anthropic.Anthropic(base_url=srv.base, api_key="wrong", max_retries=0,
                              http_client=anthropic.DefaultHttpxClient(verify=srv.tls()))
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=8, messages=_ask("hi"))
    assert e.value.body["error"]["type"] == "authentication_error"
    assert srv.http("GET", "/health")[1]["completed"] == before
