"""OpenAI's Responses door as the official ``openai`` client's responses API sees it, over
HTTPS, against a real `edgespec serve` on the real 0.5B model (``doors_server``): a response,
a streamed one (its event sequence), a ``text.format`` json_schema answer that validates, a
function-call round trip (call, output, final answer), and refusals in OpenAI's shape."""

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

from edgespec.server.requests import _BadRequest
from edgespec.server.responses import _messages, _openai_body, _Request

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city", "parameters": WEATHER_PARAMS}


def test_items_become_the_openai_conversation():
    req = _Request.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "P"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    msgs = _messages(req)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[2]["tool_calls"][0]["id"] == "c1" and msgs[3]["tool_call_id"] == "c1"
    with pytest.raises(_BadRequest, match="'store' is not supported"):
        _openai_body(_Request.model_validate({"input": "x", "store": True}))
    with pytest.raises(_BadRequest, match=r"'input\[0\].content' is required"):
        _messages(_Request.model_validate({"input": [{"role": "user"}]}))
    with pytest.raises(_BadRequest, match="web_search"):
        _messages(_Request.model_validate({"input": [{"type": "web_search_call"}]}))


@pytest.fixture(scope="module")
def client():
    srv = shared()
    return openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=srv.tls()))


@pytest.mark.real_model
def test_a_response_streamed_and_not(client):
    kw = {"model": MODEL, "max_output_tokens": 8, "temperature": 0,
          "input": "What is the capital of Japan?"}
    r = client.responses.create(**kw)
    assert r.object == "response" and r.output_text and r.usage.output_tokens <= 8
    assert r.status in ("completed", "incomplete")
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text


@pytest.mark.real_model
def test_text_format_json_schema_answer_validates(client):
    r = client.responses.create(model=MODEL, input="Describe a cat in JSON.",
                                instructions="Answer in JSON.", max_output_tokens=64,
                                temperature=0, text={"format": {
                                    "type": "json_schema", "name": "cat", "schema": CAT,
                                    "strict": True}})
    assert is_cat(json.loads(r.output_text)), r.output_text


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip(client, stream):
    """A call forced with tool_choice, its output sent back as an item, and the final
    answer (tool_choice none, the answer as {"reply": ...})."""
    kw = {"model": MODEL, "max_output_tokens": 64, "temperature": 0, "tools": [WEATHER]}
    ask = [{"role": "user", "content": RAINING}]
    forced = {"type": "function", "name": "get_weather"}
    if stream:
        events = list(client.responses.create(input=ask, tool_choice=forced, stream=True,
                                              **kw))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        r = events[-1].response
    else:
        r = client.responses.create(input=ask, tool_choice=forced, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    turn2 = [*ask, *r.output, {"type": "function_call_output", "call_id": calls[0].call_id,
                               "output": RESULT}]
    final = client.responses.create(input=turn2, tool_choice="none", text={"format": {
        "type": "json_schema", "name": "reply", "schema": REPLY}}, **kw)
    assert not [o for o in final.output if o.type == "function_call"]
    assert uses_result(json.loads(final.output_text)["reply"]), final.output_text


@pytest.mark.real_model
def test_refusals_in_openais_shape_never_reach_the_ring(client):
    srv = shared()
    before = srv.http("GET", "/health")[1]["completed"]
    for kw, named in (({"store": True}, "store"), ({"previous_response_id": "resp_1"},
                                                   "previous_response_id"),
                      ({"reasoning": {"effort": "low"}}, "reasoning"),
                      ({"tools": [{"type": "web_search"}]}, "tools"),
                      ({"temperature": 3}, "temperature")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", **kw)
        err = e.value.body
        assert named in err["message"] and err["type"] == "invalid_request_error", err
    assert srv.http("GET", "/health")[1]["completed"] == before
