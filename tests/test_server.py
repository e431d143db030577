"""`edgespec serve` as clients see it: the official `openai` client (and raw HTTP for exact
shapes) against a server process over a local ring of two node processes, with the real
Qwen2.5-Coder-0.5B.

Checked: both endpoints streaming and not, usage counts, stop sequences, OpenAI-shaped
errors, structured output (response_format) in every speculative mode, forced tool calls and
a tool conversation (call, result, answer), every request field validated before the ring
sees it (a value the stages' sampler
refuses is a 400 and the ring serves on without a rebuild), the model names clients use, a
body limit answered from Content-Length, /health answering while a huge prompt is tokenized,
greedy answers equal to the unsplit model's, 8 concurrent clients x 5 requests equal to the
same requests served alone, and overload: a bounded queue, 429s in OpenAI's shape beyond it,
every accepted request completed, and a prompt, clean shutdown on SIGTERM with an answer in
flight.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from proc_helpers import alive, children
from ring_fixtures import NEAR_TIE, unsplit_greedy

from edgespec.errors import NodeLost, RequestError, RingBusy, RingError, StageFailure
from edgespec.server.app import _model_names
from edgespec.server.replies import _failure, _failure_message
from edgespec.server.requests import _BadRequest, generation_params, parse_request

openai = pytest.importorskip("openai")

MODEL = "qwen2.5-coder-0.5b-instruct"  # the served id: the GGUF file's stem
MAX_TOKENS = 8
# Greedy answers are compared across runs whose batch shapes differ (KV reuse, speculation
# trees); on the quantized model that rounding may flip a near-tie (ring_fixtures.NEAR_TIE).
# Without token ids in the API, the prompts are ones whose greedy path has no near-tie in
# its first MAX_TOKENS tokens (top-2 logit margin >= 0.98 here, NEAR_TIE is 0.5; checked by
# test_requests_have_no_near_tie). Many everyday prompts have one (margins of 0.01-0.3).
CHAT = [
    "What is 2 + 3? Answer with the number only.",
    "What is the capital of Japan?",
    "Write a JavaScript function that adds two numbers.",
    "Translate to French: good morning",
    "What does len([1, 2, 3]) return in Python?",
]
COMPLETE = [
    "def add(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "def factorial(n):\n    if n == 0:\n",
    "def fibonacci(n):\n    if n <= 1:\n        return n\n",
    "import math\n\ndef circle_area(r):\n",
]
REQUESTS = [("chat", p) for p in CHAT] + [("completion", p) for p in COMPLETE]


# --------------------------------------------------------------------- without a model

@pytest.mark.parametrize("body, param", [
    ({"temperature": 3}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": "0.7"}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"top_p": "x"}, "top_p"),
    # top_p 0 is what the stages' sampler refuses: it must never get that far.
    ({"temperature": 0.7, "top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"seed": "1"}, "seed"),
    ({"seed": 1 << 64}, "seed"), ({"stop": [1]}, "stop"), ({"stop": ["a"] * 5}, "stop"),
    ({"n": 2}, "n"), ({"max_tokens": True}, "max_tokens"), ({"stream": "yes"}, "stream"),
    ({"stream_options": "x"}, "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "stream_options"),
    ({"spec": "fast"}, "spec"), ({"model": 5}, "model"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_sampling_arguments_are_validated(body, param):
    for chat, base in ((False, {"prompt": "x"}),
                       (True, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(_BadRequest) as err:
            parse_request({**base, **body}, chat)
        assert err.value.param == param and err.value.status == 400
        assert param in str(err.value)


@pytest.mark.parametrize("body, chat, param", [
    (b"{not json", False, None), (b"[1, 2]", True, None), (b"", True, None),
    (b"{}", True, "messages"), (b"{}", False, "prompt"),
    (b'{"messages": []}', True, "messages"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', True, "messages"),
    (b'{"messages": [{"role": "user"}]}', True, "messages"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', True, "messages"),
    (b'{"messages": "hi"}', True, "messages"), (b'{"prompt": ""}', False, "prompt"),
    (b'{"prompt": 5}', False, "prompt"), (b'{"prompt": [1, 2]}', False, "prompt"),
    (b'{"prompt": ["a", "b"]}', False, "prompt"),
])
def test_request_shapes_are_validated(body, chat, param):
    with pytest.raises(_BadRequest) as err:
        parse_request(body, chat)
    assert err.value.param == param and err.value.status == 400


def test_valid_requests_and_defaults():
    from edgespec.params import GenerationParams

    p = generation_params({"max_completion_tokens": 7, "stop": "\n", "seed": -1}, 16)
    assert p == GenerationParams(max_tokens=7, temperature=1.0, top_p=1.0, top_k=0,
                                 seed=(1 << 64) - 1, stop=("\n",), ignore_eos=False)
    assert generation_params({}, 16).max_tokens == 16  # the endpoint's default
    # null means the default, as OpenAI treats it; integers are fine for float fields.
    p = generation_params({"temperature": None, "top_p": 1, "top_k": 40, "n": 1,
                           "stop": ["a", "b"], "user": "ignored", "max_tokens": 3}, 16)
    assert p == GenerationParams(max_tokens=3, temperature=1.0, top_p=1.0, top_k=40, seed=0,
                                 stop=("a", "b"))
    assert generation_params({"ignore_eos": True}, 16).ignore_eos is True
    req = parse_request(b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", '
                        b'"content": [{"type": "text", "text": "a"}, {"type": "text", '
                        b'"text": "b"}]}], "stream": true, '
                        b'"stream_options": {"include_usage": true}, "spec": "flow"}', True)
    assert [m.text() for m in req.messages] == ["s", "ab"]
    assert req.stream and req.stream_options.include_usage and req.spec == "flow"
    assert parse_request({"prompt": ["one"]}, False).text() == "one"


# OpenAI fields this server does not implement: (body, endpoints, param, name in the message).
_CHAT, _COMPLETION, _BOTH = (True,), (False,), (True, False)
UNSUPPORTED = [
    ({"n": 2}, _BOTH, "n", "'n'"), ({"n": True}, _BOTH, "n", "'n'"),
    ({"functions": [{"name": "f"}]}, _CHAT, "functions", "'functions'"),
    ({"function_call": {"name": "f"}}, _CHAT, "function_call", "'function_call'"),
    ({"modalities": ["text", "audio"]}, _CHAT, "modalities", "'modalities'"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, _CHAT, "audio", "'audio'"),
    ({"prediction": {"type": "content", "content": "x"}}, _CHAT, "prediction", "'prediction'"),
    ({"reasoning_effort": "low"}, _CHAT, "reasoning_effort", "'reasoning_effort'"),
    ({"verbosity": "low"}, _CHAT, "verbosity", "'verbosity'"),
    ({"web_search_options": {}}, _CHAT, "web_search_options", "'web_search_options'"),
    ({"store": True}, _CHAT, "store", "'store'"),
    ({"service_tier": "priority"}, _CHAT, "service_tier", "'service_tier'"),
    ({"best_of": 3}, _COMPLETION, "best_of", "'best_of'"),
    ({"echo": True}, _COMPLETION, "echo", "'echo'"),
    ({"suffix": "\n    return x"}, _COMPLETION, "suffix", "'suffix'"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, _BOTH,
     "stream_options", "'stream_options.include_obfuscation'"),
    ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, _CHAT, "messages",
     "'messages[0].name'"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": "y", "function_call": {"name": "f"}}]},
     _CHAT, "messages", "'messages[1].function_call'"),
    ({"messages": [{"role": "assistant", "content": "y", "refusal": "no"}]}, _CHAT,
     "messages", "'messages[0].refusal'"),
]


def _bases(chats):
    return [(c, {"messages": [{"role": "user", "content": "x"}]} if c else {"prompt": "x"})
            for c in chats]


@pytest.mark.parametrize("body, chats, param, name", UNSUPPORTED)
def test_unimplemented_fields_are_refused_naming_them(body, chats, param, name):
    """Never accepted and ignored: each is a 400 naming the field, raw JSON or parsed."""
    for chat, base in _bases(chats):
        for sent in ({**base, **body}, json.dumps({**base, **body}).encode()):
            with pytest.raises(_BadRequest) as err:
                parse_request(sent, chat)
            assert err.value.status == 400 and err.value.param == param
            assert err.value.code == "unsupported_parameter"
            assert f"{name} is not supported by this server" in str(err.value)


def test_every_sampler_field_reaches_the_params_and_a_bad_value_names_it():
    """Each field of the sampler table (``edgespec.sampling.FIELDS``) is honoured by the
    OpenAI body and by Ollama's options of the same name; a value outside its bounds is a
    400 naming it, in the table's words."""
    from edgespec.sampling import FIELDS
    from edgespec.server.ollama import _options
    from edgespec.server.requests import _BadRequest, generation_params, parse_request

    for k in FIELDS:
        good = k.kind(k.high if k.high < 1 << 20 else k.low + 3)
        if good == k.default:
            good = k.kind((k.low + k.high) / 2)
        for chat, base in _bases(_BOTH):
            params = generation_params(parse_request({**base, k.name: good}, chat), 16)
            assert getattr(params, k.name) == (good % (1 << 64) if k.name == "seed" else good)
        assert _options({k.name: good}) == {k.name: good}
        bad = k.low - 1 if k.low > -(1 << 62) else None
        if bad is None:
            continue
        for chat, base in _bases(_BOTH):
            with pytest.raises(_BadRequest) as err:
                parse_request({**base, k.name: k.kind(bad)}, chat)
            assert err.value.status == 400 and err.value.param == k.name
            assert str(err.value) == f"'{k.name}' must be {k.rule()}"


@pytest.mark.parametrize("bias, says", [
    ({"abc": 5}, "'abc' is not a token id"), ({"-3": 5}, "'-3' is not a token id"),
    ({"7": 101}, "logit_bias[7] must be in [-100, 100]"),
    ({"7": "x"}, "logit_bias[7] must be a number"), ({"7": True}, "must be a number"),
    ({str(i): 1 for i in range(301)}, "at most 300 tokens"),
])
def test_logit_bias_is_checked_naming_the_field(bias, says):
    for chat, base in _bases(_BOTH):
        with pytest.raises(_BadRequest) as err:
            generation_params(parse_request({**base, "logit_bias": bias}, chat), 16)
        assert err.value.status == 400 and err.value.param == "logit_bias"
        assert says in str(err.value)
    params = generation_params(parse_request({"prompt": "x", "logit_bias": {"7": -100,
                                                                             "3": 2.5}}, False), 16)
    assert params.logit_bias == ((3, 2.5), (7, -100.0))
    assert params.sampling.bias == params.logit_bias


@pytest.mark.parametrize("body, chats", [
    # What the official client, IDE plugins and agent frameworks send by default.
    ({"n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}}, _BOTH),
    ({"n": None, "frequency_penalty": None, "presence_penalty": None, "logit_bias": None},
     _BOTH),
    ({"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
      "parallel_tool_calls": True, "functions": [], "function_call": "none",
      "response_format": {"type": "text"}, "modalities": ["text"], "store": False,
      "service_tier": "auto", "audio": None, "prediction": None, "reasoning_effort": None,
      "verbosity": None, "web_search_options": None}, _CHAT),
    ({"tool_choice": "auto", "function_call": "auto", "service_tier": "default"}, _CHAT),
    ({"logprobs": None, "best_of": 1, "echo": False, "suffix": ""}, _COMPLETION),
    ({"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
     _BOTH),
    # Informational: they ask nothing of the generation.
    ({"user": "u-42"}, _BOTH),
    ({"safety_identifier": "s", "metadata": {"k": "v"}, "prompt_cache_key": "c"}, _CHAT),
    ({"messages": [{"role": "system", "content": "s", "name": None},
                   {"role": "user", "content": "x"},
                   {"role": "assistant", "content": "y", "tool_calls": [], "refusal": None,
                    "function_call": None, "audio": None}]}, _CHAT),
])
def test_neutral_values_of_unimplemented_fields_are_accepted(body, chats):
    """Accepted, and they change nothing: the generation is the one without them."""
    for chat, base in _bases(chats):
        plain = generation_params(parse_request(base, chat), 16)
        for sent in ({**base, **body}, json.dumps({**base, **body}).encode()):
            assert generation_params(parse_request(sent, chat), 16) == plain


@pytest.mark.parametrize("body, chats, param, name", [
    ({"dry_multiplier": 0.8}, _BOTH, "dry_multiplier", "'dry_multiplier'"),  # llama-server's
    ({"cache_prompt": True}, _BOTH, "cache_prompt", "'cache_prompt'"),
    ({"messages": [{"role": "x"}]}, _COMPLETION, "messages", "'messages'"),
    ({"prompt": "x"}, _CHAT, "prompt", "'prompt'"),
    ({"tools": []}, _COMPLETION, "tools", "'tools'"),  # chat's, not completions'
    ({"stream_options": {"include_usage": True, "chunk": 1}}, _BOTH, "stream_options",
     "'stream_options.chunk'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                  "cache_control": {"type": "ephemeral"}}]}]},
     _CHAT, "messages", "'messages[0].content[0].cache_control'"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": "c", "tool_name": "f"}]},
     _CHAT, "messages", "'messages[0].tool_name'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]}, _CHAT,
     "tools", "'tools[0].function.args'"),
    ({"tool_choice": {"type": "function", "name": "f"}}, _CHAT, "tool_choice",
     "'tool_choice.name'"),
])
def test_fields_outside_the_api_are_refused_naming_them(body, chats, param, name):
    for chat, base in _bases(chats):
        with pytest.raises(_BadRequest) as err:
            parse_request({**base, **body}, chat)
        assert err.value.status == 400 and err.value.param == param
        assert err.value.code == "unknown_parameter"
        assert f"unknown field {name}: not supported by this server" == str(err.value)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
_USER = {"messages": [{"role": "user", "content": "x"}]}


def test_penalties_reach_the_generation_params():
    for chat, base in _bases(_BOTH):
        p = generation_params(parse_request({**base, "frequency_penalty": 0.5,
                                             "presence_penalty": -2, "repeat_penalty": 1.1},
                                            chat), 16)
        assert (p.frequency_penalty, p.presence_penalty, p.repeat_penalty) == (0.5, -2.0, 1.1)
        plain = generation_params(parse_request(base, chat), 16)
        assert (plain.frequency_penalty, plain.presence_penalty, plain.repeat_penalty) == \
            (0.0, 0.0, 1.0)


@pytest.mark.parametrize("body, param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": False}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"repeat_penalty": 0}, "repeat_penalty"), ({"repeat_penalty": 11}, "repeat_penalty"),
])
def test_penalties_out_of_range_are_400s_naming_them(body, param):
    for chat, base in _bases(_BOTH):
        with pytest.raises(_BadRequest) as err:
            parse_request({**base, **body}, chat)
        assert err.value.param == param and err.value.status == 400
        assert param in str(err.value)


def test_response_format_becomes_the_grammar():
    def grammar(rf):
        return generation_params(parse_request({**_USER, "response_format": rf}, True),
                                 16).grammar

    assert grammar({"type": "text"}) is None and grammar(None) is None
    assert grammar({"type": "json_object"}).kind == "json_object"
    g = grammar({"type": "json_schema", "json_schema": {
        "name": "person", "strict": True,
        "schema": {"type": "object", "properties": {"age": {"type": "integer"}}}}})
    assert g.kind == "json_schema" and json.loads(g.source)["properties"] == {
        "age": {"type": "integer"}}


def test_regex_and_gbnf_grammar_fields_become_the_grammar():
    def params(chat: bool = True, **body):
        base = _USER if chat else {"prompt": "x"}
        return generation_params(parse_request({**base, **body}, chat), 16)

    assert params(regex=r"\d+").grammar.kind == "regex"
    g = params(False, grammar='root ::= "yes" | "no"').grammar
    assert g.kind == "gbnf" and g.source == 'root ::= "yes" | "no"'
    for body, param, says in [
            ({"grammar": "root ::= (("}, "grammar", "not a GBNF grammar"),
            ({"grammar": "root ::= missing"}, "grammar", "missing"),
            ({"regex": "[a-z"}, "regex", "regex"),
            ({"regex": "a", "grammar": 'root ::= "a"'}, "grammar", "one of"),
            ({"regex": "a", "response_format": {"type": "json_object"}}, "regex",
             "leave out"),
            ({"regex": 5}, "regex", "non-empty string")]:
        with pytest.raises(_BadRequest) as err:
            params(**body)
        assert err.value.param == param and says in str(err.value), (body, str(err.value))


@pytest.mark.parametrize("rf, says", [
    ({"type": "xml"}, "must be text, json_object or json_schema"),
    ({"type": "json_schema"}, "'response_format.json_schema' must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                    "minProperties": "x"}}},
     "minProperties"),
    ({"type": "json_object", "schema": {}}, "unexpected key 'schema'"),
    ("json", "must be an object with a 'type'"),
])
def test_bad_response_formats_are_400s_naming_the_field(rf, says):
    with pytest.raises(_BadRequest) as err:
        generation_params(parse_request({**_USER, "response_format": rf}, True), 16)
    assert err.value.param == "response_format" and err.value.status == 400
    assert says in str(err.value)


def test_tools_and_tool_choice_make_the_grammar():
    def params(**body):
        return generation_params(parse_request({**_USER, "tools": [WEATHER], **body}, True), 16)

    assert params().grammar is None  # auto: the model is free, its text is parsed
    assert params(tool_choice="none").grammar is None
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        g = params(tool_choice=choice).grammar
        assert g.kind == "lark" and '"get_weather"' in g.text and g.param == "tools"
    one = params(tool_choice="required", parallel_tool_calls=False).grammar
    assert "calls: tagged | body" in one.source
    auto_one = params(parallel_tool_calls=False).grammar
    assert auto_one.source.startswith("start: TEXT | TEXT? tagged | body")
    either = params(response_format={"type": "json_object"}).grammar
    assert either.source.startswith("start: answer | calls")
    # tool_choice "none": the response_format alone.
    assert params(tool_choice="none", response_format={"type": "json_object"}).grammar.kind \
        == "json_object"


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [WEATHER, WEATHER]}, "tools", "names function 'get_weather' twice"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools",
     "'tools' must be a list"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "'tools' must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "minProperties": "x"}}}], "tool_choice": "required"}, "tools",
     "minProperties"),
    ({"tool_choice": "required"}, "tool_choice", "there are no 'tools'"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "there are no 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "names function 'f', which is not in 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "'tool_choice' must be"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type":
                                                                          "json_object"}},
     "response_format", "cannot be combined"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages",
     "'messages[0].content' is required"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages",
     "'messages[0].tool_call_id' is required"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages",
     "'messages[0].tool_call_id' is required in a tool message and only there"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages", "belongs to assistant messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
     "messages", "'messages' must be"),
])
def test_tool_requests_are_checked_naming_the_field(body, param, says):
    with pytest.raises(_BadRequest) as err:
        generation_params(parse_request({**_USER, **body}, True), 16)
    assert err.value.param == param and err.value.status == 400
    assert says in str(err.value)


def test_a_tool_conversation_is_accepted_and_rendered_for_the_template():
    from edgespec.server.chat_input import chat_input

    req = parse_request({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text",
                                                                "text": "sunny"}]}],
        "tools": [WEATHER]}, True)
    msgs, tools = chat_input(req)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert tools[0]["function"]["name"] == "get_weather"
    assert chat_input(parse_request({**req.model_dump(exclude_none=True),
                                     "tool_choice": "none"}, True))[1] is None


def test_ring_failures_map_to_statuses():
    """What a client sees for each failure class the head tells apart."""
    assert _failure(RequestError("too long", "prompt")) == (400, "invalid_request_error",
                                                            None, "prompt")
    assert _failure(StageFailure("decode failed", code="decode_failed"))[:3] == \
        (500, "server_error", "decode_failed")
    assert _failure(RingBusy("held by head laptop"))[0] == 503
    assert "laptop" in _failure_message(RingBusy("held by head laptop"))
    assert _failure(NodeLost("lost node a"))[0] == 503
    assert _failure(RingError("no node reachable"))[0] == 503
    assert _failure(RuntimeError("bug"))[0] == 500


def test_model_names_include_registry_name_and_file_name():
    names = _model_names("served", "qwen2.5-coder-0.5b-instruct",
                         ["qwen2.5-coder-0.5b", "/m/qwen2.5-coder-0.5b-instruct.gguf"])
    assert {"served", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-0.5b-instruct.gguf", "/m/qwen2.5-coder-0.5b-instruct.gguf"} <= names


# ------------------------------------------------------------------- the server process

class ServerProcess:
    """`edgespec serve --local 2 --port 0` in a process of its own; the port is read from
    uvicorn's startup line (port 0: no race for a free port)."""

    def __init__(self, tmp: Path, *extra: str, api_key: str | None = None) -> None:
        self.api_key = api_key
        if api_key:
            extra = (*extra, "--api-key", api_key)
        self.log_path = tmp / "serve.log"
        env = dict(os.environ, OMP_WAIT_POLICY="passive", PYTHONUNBUFFERED="1")
        exe = str(Path(sys.executable).with_name("edgespec"))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([exe, "serve", "--local", "2", "--port", "0", *extra],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)
        self.base = self._wait_ready(180)
        self.nodes = children(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.log())
            if m:
                base = m.group(1)
                status, body = http("GET", base + "/v1/models", key=self.api_key)
                assert status == 200, body
                return base
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "unused",
                             **kw)

    def stop(self) -> int:
        """SIGTERM, as a service manager would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server ignored SIGTERM:\n{self.log()}") from None
        finally:
            for pid in self.nodes:  # never leave node processes behind, even on failure
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def http(method: str, url: str, body: object | bytes | None = None,
         key: str | None = None) -> tuple[int, dict]:
    """A raw request: (status, parsed JSON body); ``key``: sent as a bearer token."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ask(client: openai.OpenAI, kind: str, prompt: str, stream: bool, **kw) -> dict:
    """One request through the openai client; text, finish reason and usage as a dict."""
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    model = kw.pop("model", MODEL)
    if kind == "chat":
        msgs = [{"role": "user", "content": prompt}]
        if not stream:
            r = client.chat.completions.create(model=model, messages=msgs, **kw)
            return {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
                    "usage": r.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                         "total_tokens"})}
        parts, finish, usage = [], None, None
        for ch in client.chat.completions.create(model=model, messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}, **kw):
            if ch.usage is not None:
                usage = ch.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                     "total_tokens"})
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
        return {"text": "".join(parts), "finish": finish, "usage": usage}
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, **kw)
        return {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
                "usage": r.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                     "total_tokens"})}
    parts, finish = [], None
    for ch in client.completions.create(model=model, prompt=prompt, stream=True, **kw):
        parts.append(ch.choices[0].text)
        finish = ch.choices[0].finish_reason or finish
    return {"text": "".join(parts), "finish": finish, "usage": None}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alone(server):
    """Every request of REQUESTS served alone (one after another), non-streaming."""
    client = server.client()
    return {(kind, p): ask(client, kind, p, stream=False) for kind, p in REQUESTS}


# ------------------------------------------------------------------------------ tests

@pytest.mark.real_model
def test_requests_have_no_near_tie(real_model_path):
    """The precondition of comparing greedy texts across batch shapes (see CHAT)."""
    import numpy as np

    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer
    from edgespec.node.runtime import StageRuntime

    model = load_model(real_model_path, vocab_only=True)
    try:
        tok = Tokenizer(model)
        with StageRuntime(real_model_path, n_ctx=512, n_seq_max=1, n_threads=1) as rt:
            for kind, prompt in REQUESTS:
                ids = (tok.chat_tokens([{"role": "user", "content": prompt}]) if kind == "chat"
                       else tok.encode(prompt, add_special=True))
                rt.reset()
                rt.forward(np.asarray(ids[:-1], np.int32), 0)
                logits = rt.forward(np.asarray(ids[-1:], np.int32), len(ids) - 1)[-1]
                for pos in range(len(ids), len(ids) + MAX_TOKENS):
                    top2 = np.sort(logits)[-2:]
                    assert top2[1] - top2[0] >= NEAR_TIE, (prompt, pos - len(ids))
                    t = int(np.argmax(logits))
                    if tok.is_eog(t):
                        break
                    logits = rt.forward(np.array([t], np.int32), pos)[-1]
    finally:
        model.close()


@pytest.mark.real_model
def test_models_and_health(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    status, health = http("GET", server.base + "/health")
    assert status == 200 and health["status"] == "ok"
    assert health["queued"] == 0 and health["max_queue"] == 16


@pytest.mark.real_model
def test_chat_answer_is_the_unsplit_models_greedy_answer(server, alone, real_model_path):
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    model = load_model(real_model_path, vocab_only=True)
    try:
        tok = Tokenizer(model)
        for prompt in CHAT[:2]:
            ids = tok.chat_tokens([{"role": "user", "content": prompt}])
            ref = unsplit_greedy(real_model_path, ids, MAX_TOKENS)
            end = next((i for i, t in enumerate(ref) if tok.is_eog(t)), len(ref))
            got = alone[("chat", prompt)]
            assert got["text"] == tok.decode(ref[:end])
            assert got["finish"] == ("stop" if end < len(ref) else "length")
            assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": end,
                                    "total_tokens": len(ids) + end}
    finally:
        model.close()


@pytest.mark.real_model
def test_streaming_equals_non_streaming(server, alone):
    client = server.client()
    for kind, prompt in [REQUESTS[0], REQUESTS[5], REQUESTS[7]]:
        got = ask(client, kind, prompt, stream=True)
        ref = alone[(kind, prompt)]
        assert got["text"] == ref["text"] and got["finish"] == ref["finish"]
        if kind == "chat":  # stream_options.include_usage: a final usage chunk
            assert got["usage"] == ref["usage"]


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["none", "sync", "flow"])
def test_logprobs_align_with_the_text_in_every_mode(server, alone, mode):
    """Each answer token's log probability and the most likely tokens' there, from the last
    stage's distribution (greedy: the token is the most likely one), token by token with the
    text, streamed or not, chat and completions, in every mode."""
    client = server.client()
    prompt = CHAT[0]
    msgs = [{"role": "user", "content": prompt}]
    kw = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
          "extra_body": {"spec": mode}}
    r = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, **kw)
    text, content = r.choices[0].message.content, r.choices[0].logprobs.content
    assert text == alone[("chat", prompt)]["text"]
    assert "".join(e.token for e in content) == text
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token  # greedy: the most likely token
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    streamed = []
    for ch in client.chat.completions.create(messages=msgs, logprobs=True, stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content, strict=True)) < 0.05
    # Completions: logprobs is the number of alternatives; text_offset counts characters.
    cp = COMPLETE[0]
    c = client.completions.create(prompt=cp, logprobs=2, **kw).choices[0]
    assert c.text == alone[("completion", cp)]["text"]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    # Asked wrongly: a 400 naming the field; not asked: null.
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(messages=msgs, top_logprobs=2, **kw)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=21, **kw)
    assert client.chat.completions.create(messages=msgs, **kw).choices[0].logprobs is None


@pytest.mark.real_model
def test_completion_usage_and_stop_sequence(server, alone):
    client = server.client()
    prompt = COMPLETE[0]
    ref = alone[("completion", prompt)]
    assert ref["finish"] == "length" and ref["usage"]["completion_tokens"] == MAX_TOKENS
    assert "\n" in ref["text"].strip("\n")
    cut = ref["text"].index("\n", 1)  # the first line break after the first character
    for stream in (False, True):
        got = ask(client, "completion", prompt, stream, stop=["\n"])
        # Greedy: the same text, ended just before the stop sequence (never including it).
        assert got["text"] == ref["text"][:cut] and got["finish"] == "stop"
    # Omitted max_tokens: OpenAI's legacy default of 16 tokens.
    r = client.completions.create(model=MODEL, prompt=COMPLETE[2], temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


# Structured output and tools. The prompts are ones the model answers otherwise on its own:
# unconstrained, "Describe a cat in JSON." starts a Markdown code block of other keys, and
# "Hi! How are you?" calls nothing; the checks pass only where the grammar took effect.
CAT = {"type": "object", "additionalProperties": False, "required": ["name", "age", "indoor"],
       "properties": {"name": {"type": "string", "maxLength": 20},
                      "age": {"type": "integer", "minimum": 0, "maximum": 30},
                      "indoor": {"type": "boolean"}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
REPLY = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 100}},
         "required": ["reply"], "additionalProperties": False}


def _is_cat(obj) -> bool:
    """CAT checked by hand (jsonschema is not a dependency)."""
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "indoor"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 20
            and type(obj["age"]) is int and 0 <= obj["age"] <= 30
            and type(obj["indoor"]) is bool)


def _streamed_message(chunks) -> tuple[str | None, list[dict], str | None]:
    """(content, tool calls, finish reason) put together from streamed chunks, tool calls
    by their index, as clients do."""
    content, calls, finish = [], {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content.append(c.delta.content or "")
        for tc in c.delta.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["none", "sync", "flow"])
def test_response_format_answers_json_in_every_mode(server, mode):
    client = server.client()
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a cat in JSON."}],
          "max_tokens": 64, "temperature": 0, "extra_body": {"spec": mode}}
    r = client.chat.completions.create(response_format={"type": "json_object"}, **kw)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT,
                                                     "strict": True}}
    r = client.chat.completions.create(response_format=schema, **kw)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and _is_cat(json.loads(text)), text
    streamed, _, finish = _streamed_message(client.chat.completions.create(
        response_format=schema, stream=True, **kw))
    assert streamed == text and finish == "stop"


@pytest.mark.real_model
def test_regex_and_gbnf_constrain_the_answer(server):
    """edgespec's ``regex`` and llama-server's ``grammar`` (GBNF) through the openai client's
    extra_body, completions and chat, in a tree mode."""
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="The year the Eiffel Tower opened:",
                                  max_tokens=12, temperature=0,
                                  extra_body={"regex": r" [0-9]{4}\.", "spec": "flow"})
    assert re.fullmatch(r" [0-9]{4}\.", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Is Python a programming language?"}],
        extra_body={"grammar": 'root ::= ("yes" | "no") "."', "spec": "sync"})
    assert r.choices[0].message.content in ("yes.", "no."), r.choices[0].message.content


@pytest.mark.real_model
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_a_forced_tool_call_follows_the_functions_schema(server, choice):
    """A greeting calls nothing on its own; forced, the answer is calls whose arguments
    parse against the function's parameters (a named choice: that function only), streamed
    (flow) or not (none)."""
    client = server.client()
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Hi! How are you?"}],
          "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 64,
          "temperature": 0}
    names = {"get_time"} if isinstance(choice, dict) else {"get_weather", "get_time"}
    r = client.chat.completions.create(extra_body={"spec": "none"}, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls
    for c in msg.tool_calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names
        args = json.loads(c.function.arguments)
        assert isinstance(args, dict) and isinstance(args["city"], str)
    content, calls, finish = _streamed_message(client.chat.completions.create(
        stream=True, extra_body={"spec": "flow"}, **kw))
    assert content is None and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_conversation_call_result_answer(server, stream):
    """Turn 1 (tool_choice auto): the model calls get_weather on its own; turn 2 sends the
    call back with the tool's result (role tool) and gets the final answer, which uses it.
    The 0.5B model would call again rather than answer, so turn 2 asks for no call
    ("none": the tools are not offered) and for the answer as {"reply": ...}."""
    client = server.client()
    ask1 = [{"role": "user", "content": "Is it raining in Paris right now?"}]
    kw = {"model": MODEL, "max_tokens": 64, "temperature": 0, "tools": [WEATHER]}
    if stream:
        content, calls, finish = _streamed_message(client.chat.completions.create(
            messages=ask1, stream=True, **kw))
        said = {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]}
    else:
        r = client.chat.completions.create(messages=ask1, **kw)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in r.choices[0].message.tool_calls or ()]
        said = r.choices[0].message  # sent back as it came, as agents do
    assert finish == "tool_calls" and content is None
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    turn2 = [*ask1, said, {"role": "tool", "tool_call_id": calls[0]["id"],
                           "content": "Rain, 12 degrees Celsius."}]
    kw2 = {**kw, "messages": turn2, "tool_choice": "none", "response_format": {
        "type": "json_schema", "json_schema": {"name": "reply", "schema": REPLY}}}
    if stream:
        content, calls, finish = _streamed_message(client.chat.completions.create(
            stream=True, **kw2))
    else:
        r = client.chat.completions.create(**kw2)
        content, calls = r.choices[0].message.content, r.choices[0].message.tool_calls or []
        finish = r.choices[0].finish_reason
    assert finish == "stop" and not calls
    reply = json.loads(content)["reply"].lower()
    assert "rain" in reply or "12" in reply, reply


@pytest.mark.real_model
def test_chat_over_the_server_with_a_json_schema(server):
    """`edgespec chat --server URL --json-schema FILE`: the schema goes as response_format."""
    from edgespec.chat.server_backend import ServerBackend

    backend = ServerBackend(server.base, api_key=None, system=None, temperature=0.0,
                            max_tokens=64, json_schema=CAT)
    shown: list[str] = []
    reply = backend.answer("Describe a cat in JSON.", shown.append, threading.Event())
    assert _is_cat(json.loads(reply.text)) and "".join(shown) == reply.text


@pytest.mark.real_model
def test_errors_have_openais_shape(server):
    client = server.client(max_retries=0)
    model = MODEL
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x " * 5000, max_tokens=200)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user",
                                                               "content": "hi"}], n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "robot",
                                                               "content": "hi"}])
    assert e.value.param == "messages"
    # Never accepted and ignored: an unimplemented field or endpoint names itself.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"functions": [{"name": "f"}]})
    assert e.value.param == "functions" and e.value.code == "unsupported_parameter"
    assert "'functions' is not supported by this server" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model=model, input="hi")
    assert "POST /v1/embeddings is not supported by this server" in e.value.body["message"]
    shape = {"message", "type", "param", "code"}
    for method, path, body, want in [
            ("POST", "/v1/chat/completions", b"{not json", 400),
            ("POST", "/v1/completions", {"prompt": 5}, 400),
            ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
            ("POST", "/v1/completions", {"prompt": "x", "top_k": -1}, 400),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
            ("GET", "/v1/nowhere", None, 404),
            ("POST", "/v1/completions", {"prompt": "x", "best_of": 2}, 400),
            ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400),
            ("POST", "/v1/images/generations", {"prompt": "x"}, 404),
            ("GET", "/v1/completions", None, 405)]:
        status, got = http(method, server.base + path, body)
        assert status == want, (path, got)
        assert set(got) == {"error"} and set(got["error"]) == shape, got
        assert got["error"]["type"] == "invalid_request_error"
    # The ring is unharmed by the refused requests.
    status, health = http("GET", server.base + "/health")
    assert health["serving"] == 0 and health["queued"] == 0


@pytest.mark.real_model
def test_a_value_the_sampler_refuses_is_a_400_and_the_ring_serves_on(server, alone):
    """temperature 0.7 with top_p 0 used to reach the last stage, whose sampler refused it,
    and the head rebuilt the ring over and over: now it is the caller's 400, at once."""
    _, before = http("GET", server.base + "/health")
    for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": CHAT[0]}],
                                      "temperature": 0.7, "top_p": 0, "max_tokens": 8}),
            ("/v1/completions", {"prompt": COMPLETE[0], "temperature": 0.7, "top_p": 0,
                                 "max_tokens": 8, "stream": True})]:
        status, got = http("POST", server.base + path, body)
        assert status == 400, got
        assert got["error"]["param"] == "top_p" and "top_p" in got["error"]["message"]
    kind, prompt = REQUESTS[0]
    assert ask(server.client(), kind, prompt, stream=False) == alone[(kind, prompt)]
    _, after = http("GET", server.base + "/health")
    assert after["recoveries"] == before["recoveries"] == 0  # nothing was rebuilt
    assert after["completed"] == before["completed"] + 1


@pytest.mark.real_model
def test_model_names_clients_use_are_served(server, alone):
    """The registry name given to --model, the file's name, and (one model served) any
    other name, with a warning in the log."""
    client = server.client(max_retries=0)
    kind, prompt = REQUESTS[0]
    for name in ("qwen2.5-coder-0.5b", MODEL + ".gguf", "gpt-4"):
        assert ask(client, kind, prompt, stream=False, model=name) == alone[(kind, prompt)]
    log = server.log()
    assert "request for model 'gpt-4'" in log
    assert "request for model 'qwen2.5-coder-0.5b" not in log  # known names: no warning


@pytest.mark.real_model
def test_oversized_body_is_refused_before_it_is_read(server):
    """413 from the Content-Length alone: the test sends the headers of a 64 MiB body and
    none of it, and the answer still comes."""
    host, port = server.base.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n"
                     '{"prompt": "'.encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            reply += part
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:200]
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and set(err) == {"message", "type", "param",
                                                               "code"}
    _, health = http("GET", server.base + "/health")
    assert health["status"] == "ok"


@pytest.mark.real_model
def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    """A prompt just under the body limit takes about a second to tokenize; /health keeps
    answering meanwhile (tokenization runs off the event loop), and the prompt is then
    refused as too long for the context."""
    prompt = "def f(x): return x + 1\n" * ((4 << 20) // 24 - 100)  # 24 bytes in JSON
    sock = _raw_post(server.base, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    reply = bytearray()

    def read() -> None:
        while part := sock.recv(65536):
            reply.extend(part)
            if reply.rstrip().endswith(b"}"):
                break

    t = threading.Thread(target=read)
    t.start()
    answered_meanwhile = 0  # the whole body was sent before the first of these
    while t.is_alive():
        status, health = http("GET", server.base + "/health")
        if t.is_alive():
            answered_meanwhile += status == 200 and health["status"] == "ok"
    t.join()
    sock.close()
    head, _, body = bytes(reply).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert json.loads(body)["error"]["code"] == "context_length_exceeded"
    print("health answers during tokenization:", answered_meanwhile)
    # On the event loop, tokenization held every /health until it was done.
    assert answered_meanwhile >= 20


@pytest.mark.real_model
def test_eight_concurrent_clients_match_requests_served_alone(server, alone):
    def client_run(c: int) -> list[tuple[tuple[str, str], bool, dict]]:
        client = server.client(max_retries=0)
        out = []
        for j in range(5):
            kind, prompt = REQUESTS[(c + 3 * j) % len(REQUESTS)]
            stream = (c + j) % 2 == 1
            out.append(((kind, prompt), stream, ask(client, kind, prompt, stream)))
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(client_run, range(8)) for r in rs]
    assert len(results) == 40
    for key, stream, got in results:
        ref = alone[key]
        assert got["text"] == ref["text"], (key, stream)
        assert got["finish"] == ref["finish"], (key, stream)
        if got["usage"] is not None:
            assert got["usage"] == ref["usage"], (key, stream)
    assert {k for k, _, _ in results} == set(alone)  # every request kind was exercised


def _raw_post(base: str, path: str, body: dict) -> socket.socket:
    """Send a request on a socket of our own, so the test decides when it hangs up."""
    host, port = base.split("//")[1].split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait_health(base: str, done, what: str, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, h = http("GET", base + "/health")
        if done(h):
            return h
        time.sleep(0.05)
    raise AssertionError(f"server never reached: {what}; last health {h}")


@pytest.mark.real_model
def test_hung_up_clients_stop_their_generation(server, alone):
    """A client that leaves frees the ring: its generation stops at the next round (it
    asked for 1000 tokens; `abandoned` counts only generations that stopped short), and a
    request still queued when its client leaves is skipped."""
    base = server.base
    _, before = http("GET", base + "/health")
    sampling = {"max_tokens": 1000, "temperature": 0}
    long = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", **sampling}
    # Streaming: hang up after the first piece.
    sock = _raw_post(base, "/v1/completions", {**long, "stream": True})
    got = b""
    while b"data: " not in got:
        got += sock.recv(4096)
    sock.close()
    _wait_health(base, lambda h: h["serving"] == 0, "the streamed request ended")
    # Plain: one being served, one queued behind it; both clients leave.
    served = _raw_post(base, "/v1/completions", long)
    _wait_health(base, lambda h: h["serving"] == 1, "the plain request is served")
    queued = _raw_post(base, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": CHAT[0]}], **sampling})
    _wait_health(base, lambda h: h["queued"] == 1, "the second request is queued")
    queued.close()
    served.close()
    after = _wait_health(base, lambda h: h["serving"] == 0 and h["queued"] == 0,
                         "all requests ended")
    assert after["abandoned"] - before["abandoned"] == 3
    assert after["completed"] == before["completed"]
    # The ring serves the next request as if nothing had happened.
    kind, prompt = REQUESTS[5]
    assert ask(server.client(), kind, prompt, stream=False) == alone[(kind, prompt)]


@pytest.mark.real_model
def test_overload_bounded_queue_429_and_clean_shutdown(tmp_path):
    srv = ServerProcess(tmp_path, "--max-queue", "2")
    try:
        client = srv.client(max_retries=0)
        alone_chat = {p: ask(client, "chat", p, stream=False, max_tokens=8) for p in CHAT[:3]}

        # A long streaming request holds the ring while the burst arrives.
        holder_req = urllib.request.Request(
            srv.base + "/v1/completions", method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 120,
                             "temperature": 0, "stream": True}).encode())
        holder = urllib.request.urlopen(holder_req, timeout=300)
        first = holder.readline()
        assert first.startswith(b"data: ")

        peaks = {"queued": 0}
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                _, h = http("GET", srv.base + "/health")
                peaks["queued"] = max(peaks["queued"], h["queued"])
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        barrier = threading.Barrier(15)

        def burst(i: int) -> tuple[str, object]:
            prompt = CHAT[i % 3]
            barrier.wait()
            if i % 5 == 4:  # some through the openai client, the rest raw for exact shapes
                try:
                    return "ok", (prompt, ask(client, "chat", prompt, False, max_tokens=8))
                except openai.RateLimitError as e:
                    return "429", (e.status_code, {"error": e.body})
            status, body = http("POST", srv.base + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "temperature": 0})
            if status == 200:
                return "ok", (prompt, {"text": body["choices"][0]["message"]["content"]})
            return "429", (status, body)

        with ThreadPoolExecutor(15) as pool:
            outcomes = list(pool.map(burst, range(15)))
        rest = holder.read().decode()
        holder.close()
        watching.set()
        watcher.join()

        accepted = [v for k, v in outcomes if k == "ok"]
        rejected = [v for k, v in outcomes if k == "429"]
        assert len(accepted) + len(rejected) == 15
        # The ring was busy with the holder: the first two wait in the queue, and the burst
        # has more requests than the queue holds, so some are refused.
        assert len(accepted) >= 2 and len(rejected) >= 1
        for status, body in rejected:
            assert status == 429
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_exceeded"
            assert "retry" in err["message"]
        for prompt, got in accepted:  # every accepted request completed, correctly
            assert got["text"] == alone_chat[prompt]["text"]
        assert peaks["queued"] <= 2  # the queue never grew past --max-queue
        assert rest.rstrip().endswith("data: [DONE]")
        assert '"finish_reason": "length"' in rest  # the holder completed in full

        _, health = http("GET", srv.base + "/health")
        assert health["serving"] == 0 and health["queued"] == 0
        assert ask(client, "chat", CHAT[0], False, max_tokens=8)["text"] == \
            alone_chat[CHAT[0]]["text"]
        nodes = list(srv.nodes)
        assert len(nodes) == 2

        # SIGTERM with an answer in flight that asked for 3000 tokens: the answer ends at
        # the next round, cleanly, and the server exits, closes the ring and ends its node
        # processes (stop() allows 60 s; the full answer would take minutes).
        long_req = urllib.request.Request(
            srv.base + "/v1/completions", method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 3000,
                             "temperature": 0, "stream": True,
                             "stream_options": {"include_usage": True}}).encode())
        in_flight = urllib.request.urlopen(long_req, timeout=300)
        assert in_flight.readline().startswith(b"data: ")
    except BaseException:
        srv.stop()
        raise
    assert srv.stop() == 0, srv.log()
    events = [line[6:] for line in in_flight.read().decode().splitlines()
              if line.startswith("data: ")]
    # Cut off, and saying so: the usage so far, then an error event, never [DONE] or a
    # finish_reason that would pass for the whole answer.
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "shutting_down"
    usage = json.loads(events[-2])["usage"]
    assert 0 < usage["completion_tokens"] < 3000
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    deadline = time.monotonic() + 30
    while any(alive(p) for p in nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in nodes), "node processes outlived the server"
    assert "Traceback" not in srv.log()
