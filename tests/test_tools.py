"""Tool calls and structured output at the edge, without a ring: the model's text parsed into
OpenAI's content and tool calls (whole, and streamed split at every character boundary, to
the same outcome), malformed calls left as content, the messages and tools the chat template
renders, the tool grammars checked against the real Qwen2.5-Coder vocabulary (what they let
through, token by token), and the chat CLI's ``--json-schema`` file.
"""

from __future__ import annotations

import itertools
import json

import pytest

from edgespec.errors import RequestError
from edgespec.head.tools import (
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
    template_messages,
    template_takes_tools,
    template_tools,
    tool_grammar,
)
from edgespec.server.chat_input import Deltas, answer_message, finish_reason

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, TIME]
NAMES = ["get_weather", "get_time"]
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'  # a call without the tags


def call(name: str, args: dict | str) -> str:
    """A call as the Qwen template writes it."""
    a = args if isinstance(args, str) else json.dumps(args)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {a}}}\n</tool_call>'


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


# ------------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, content, calls", [
    ("Paris is sunny.", "Paris is sunny.", []),
    ("", "", []),
    ("  keep\n  my whitespace \n", "  keep\n  my whitespace \n", []),
    ("a < b and <tool> x", "a < b and <tool> x", []),
    (call("get_weather", {"city": "Paris"}), None,
     [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n" + call("get_weather", {"city": "Paris"}), "Let me look.",
     [("get_weather", '{"city": "Paris"}')]),
    (call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {}) + "\n", None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (call("get_weather", {"city": "Zürich"}), None, [("get_weather", '{"city": "Zürich"}')]),
    # Arguments written as JSON text are taken as the object they encode.
    (call("get_weather", json.dumps(json.dumps({"city": "Oslo"}))), None,
     [("get_weather", '{"city": "Oslo"}')]),
    # Bare: the call's JSON without the tags, as small models answer.
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('\n{ "name" : "get_time", "arguments": {}}\n{"name": "get_weather", "arguments": '
     '{"city": "Rome"}}\n', None, [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]),
    ('{"answer": 5}', '{"answer": 5}', []),
    # In a Markdown code block, as the model often writes JSON.
    ("```json\n" + BARE + "\n```", None, [("get_weather", '{"city": "Paris"}')]),
    ('```\n{\n  "name": "get_time",\n  "arguments": {}\n}\n' + BARE + "\n```\n", None,
     [("get_time", "{}"), ("get_weather", '{"city": "Paris"}')]),
    ('```json\n{"answer": 5}\n```', '```json\n{"answer": 5}\n```', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    # Bare JSON followed by a tagged call: only the tagged one is a call.
    (BARE + "\n" + call("get_time", {}), BARE, [("get_time", "{}")]),
    ('{"name": "Ada", "arguments": {}}', '{"name": "Ada", "arguments": {}}', []),
])
def test_answers_parse_into_content_and_calls(text, content, calls):
    got_content, got = parse_tool_calls(text, NAMES, ids())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert [c.id for c in got] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not offered
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {}, "extra": 1}\n</tool_call>',
    '<tool_call>\n["get_weather"]\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    "Sure <tool_call",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} and more text',
    '{"name": "get_weather", "arguments": {"city": "Par',
])
def test_malformed_calls_stay_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_malformed_block_beside_a_good_call_stays_content_tags_included():
    bad = "<tool_call>\n{oops}\n</tool_call>"
    content, calls = parse_tool_calls(
        "Two tries:\n" + bad + "\n" + call("get_time", {}), NAMES, ids())
    assert content == "Two tries:\n" + bad
    assert [c.name for c in calls] == ["get_time"]


def test_any_name_is_a_call_without_a_list_of_names():
    assert parse_tool_calls(call("anything", {"x": 1}))[1][0].name == "anything"


def test_call_ids_and_openai_shapes():
    content, calls = parse_tool_calls(call("get_time", {}), NAMES)
    c = calls[0]
    assert c.id.startswith("call_") and len(c.id) == 29 and c.id[5:].isalnum()
    assert c.as_dict() == {"id": c.id, "type": "function",
                           "function": {"name": "get_time", "arguments": "{}"}}
    assert c.as_dict(3)["index"] == 3
    assert parse_tool_calls(call("get_time", {}), NAMES)[1][0].id != c.id


STREAMED = [
    "Paris is sunny today, 21 degrees.",
    "x <tool_cal y <tool_call z",
    "Let me check.\n\n" + call("get_weather", {"city": "Paris"}),
    call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {}),
    call("get_weather", {"city": "Rome"}) + "\nDone: two calls.\n" + call("get_time", {}),
    "<tool_call>\n{oops}\n</tool_call> then " + call("get_time", {}) + "  ",
    "text\n" + call("get_weather", {"city": "Paris"})[:-5],  # cut off inside the close tag
    "<tool_call>\n" + call("get_time", {}) + "\n</tool_call>",  # a tag inside a block
    ' {"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_time"}',
    '{"name": "Ada", "age": 36}',
    '{"nam',
    "```json\n" + BARE + "\n```",
    "```js",
    "``",
    "```python\nx = {'name': 1}\n```",
    "```json\n" + BARE + "\n``` and text",
    '{ "x": "<tool_call>"} ' + call("get_time", {}),
]


def _streamed(text: str, cuts: list[int]) -> tuple[list[str], list[ToolCall], list[str]]:
    """Feed ``text`` cut at ``cuts``; (content pieces, calls, content so far after each
    feed)."""
    parser = ToolCallParser(NAMES, ids())
    pieces: list[str] = []
    seen: list[str] = []
    bounds = [0, *cuts, len(text)]
    for a, b in itertools.pairwise(bounds):
        for e in parser.feed(text[a:b]):
            if isinstance(e, str):
                pieces.append(e)
        seen.append("".join(pieces))
    pieces += [e for e in parser.finish() if isinstance(e, str)]
    return pieces, parser.calls, seen


@pytest.mark.parametrize("text", STREAMED)
def test_streaming_split_anywhere_gives_the_whole_answers_outcome(text):
    """At every character boundary, in two pieces and in pieces of one character: the same
    content and calls as the whole text, and never a piece of a tag shown as content."""
    whole_content, whole_calls = parse_tool_calls(text, NAMES, ids())
    splits = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    for cuts in splits:
        pieces, calls, seen = _streamed(text, cuts)
        assert ("".join(pieces) or None) == (whole_content if whole_calls else
                                             whole_content or None), cuts
        assert calls == whole_calls, cuts
        if whole_calls and "{oops}" not in text and "<tool_call>\n<" not in text:
            # Nothing of a call's tags ever reached the content, not even for a while.
            assert all("<" not in s for s in seen), (cuts, seen)


def test_text_that_may_open_a_call_is_held_back_until_it_cannot():
    parser = ToolCallParser(NAMES)
    assert parser.feed("Hello <tool") == ["Hello"]  # " <tool" may open a call
    assert parser.feed("s> are") == [" <tools> are"]
    assert parser.feed("\n\n") == []  # whitespace before a possible call waits too
    assert parser.feed("x") == ["\n\nx"]
    assert parser.finish() == []


def test_deltas_and_messages_in_openais_shape():
    text = "Checking.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {})
    message, called = answer_message(text, NAMES)
    assert called and message["content"] == "Checking."
    assert [c["function"]["name"] for c in message["tool_calls"]] == NAMES
    assert all(c["type"] == "function" and c["id"].startswith("call_")
               for c in message["tool_calls"])
    assert finish_reason("stop", called) == "tool_calls"
    assert finish_reason("length", called) == "length"  # a call cut off is no call
    assert answer_message(text, None) == ({"role": "assistant", "content": text}, False)
    deltas = Deltas(NAMES)
    out = [d for i in range(0, len(text), 7) for d in deltas.feed(text[i:i + 7])]
    out += deltas.finish()
    assert "".join(d.get("content", "") for d in out) == "Checking."
    items = [d["tool_calls"][0] for d in out if "tool_calls" in d]
    assert [(i["index"], i["type"], i["function"]["name"]) for i in items] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    assert json.loads(items[0]["function"]["arguments"]) == {"city": "Paris"}
    assert deltas.called == 2
    plain = Deltas(None)
    assert plain.feed("<tool_call>") == [{"content": "<tool_call>"}] and plain.finish() == []


# ---------------------------------------------------------------------- template input

#: A turn that called a tool, and the tool's answer, as an OpenAI client sends them.
CALLED = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]

def test_messages_and_tools_as_the_template_reads_them():
    msgs = template_messages(CALLED)
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert template_tools([TIME, WEATHER])[0] == {
        "type": "function", "function": {"name": "get_time", "description": "The time now"}}
    assert not template_takes_tools(None) and not template_takes_tools("{{ messages }}")


# ------------------------------------------------------------------------------ grammars

def test_no_grammar_where_the_model_is_free():
    assert tool_grammar([], "required") is None
    assert tool_grammar(TOOLS, "none") is None
    assert tool_grammar(TOOLS, "auto") is None  # parallel calls, no answer schema


def test_grammar_errors_name_the_field():
    with pytest.raises(RequestError) as e:
        tool_grammar(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(RequestError) as e:
        tool_grammar(TOOLS, "required", answer={"type": "object"})
    assert e.value.param == "response_format"
    with pytest.raises(RequestError) as e:
        tool_grammar([{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "minProperties": "x"}}}], "required")
    assert e.value.param == "tools"


@pytest.fixture(scope="module")
def vocab(real_model_path):
    from edgespec.grammar import vocab_tokenizer
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    model = load_model(real_model_path, vocab_only=True)
    yield Tokenizer(model), vocab_tokenizer(model)
    model.close()


def _matches(lltok, grammar, tokens: list[int]) -> bool:
    """Whether the grammar takes ``tokens`` whole and may end after them."""
    import llguidance

    m = llguidance.LLMatcher(lltok, grammar.text)
    return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


ONE = call("get_weather", {"city": "Paris"})
TWO = ONE + "\n" + call("get_time", {})
BARE2 = BARE + '\n{"name": "get_time", "arguments": {}}'


@pytest.mark.real_model
@pytest.mark.parametrize("choice, parallel, answer, takes, refuses", [
    ("required", True, None, [ONE, TWO, call("get_time", {}), BARE, BARE2],
     ["Paris is sunny.", call("get_weather", {"town": "Paris"}),
      call("get_weather", {"city": 5}), call("rm", {}), "", '{"city": "Paris"}',
      ONE + "\n" + BARE]),
    ("required", False, None, [ONE, BARE], [TWO, BARE2, "hi"]),
    ({"type": "function", "function": {"name": "get_time"}}, True, None,
     [call("get_time", {}), '{"name": "get_time", "arguments": {}}'], [ONE, BARE, "hi"]),
    ("auto", False, None, ["Paris is sunny.", "Let me see.\n" + ONE, ONE, BARE],
     [TWO, BARE2, call("get_weather", {"city": 5}), '{"a": 1}']),
    ("auto", True, {"type": "object", "properties": {"temp": {"type": "number"}},
                    "required": ["temp"]},
     ['{"temp": 21.5}', ONE, TWO, BARE, BARE2], ["Paris is sunny.", '{"temp": "warm"}']),
])
def test_tool_grammars_on_the_real_vocabulary(vocab, choice, parallel, answer, takes,
                                              refuses):
    tok, lltok = vocab
    grammar = tool_grammar(TOOLS, choice, parallel=parallel, answer=answer)
    grammar.check(lltok)  # compiles for Qwen's vocabulary
    for text in takes:
        ids = tok.encode(text, add_special=False, parse_special=True)
        assert _matches(lltok, grammar, ids), text
    for text in refuses:
        ids = tok.encode(text, add_special=False, parse_special=True)
        assert not _matches(lltok, grammar, ids), text


@pytest.mark.real_model
def test_the_call_tags_match_the_special_token_or_the_same_text(vocab):
    """``<tool_call>`` is one added token (151657) in Qwen's vocabulary, the one the model
    writes; the grammar also takes the same text spelt in ordinary tokens."""
    tok, lltok = vocab
    assert tok.encode("<tool_call>", add_special=False, parse_special=True) == [151657]
    assert tok.encode("</tool_call>", add_special=False, parse_special=True) == [151658]
    grammar = tool_grammar(TOOLS, "required", parallel=False)
    special = tok.encode(ONE, add_special=False, parse_special=True)
    assert special[0] == 151657 and special[-1] == 151658
    spelt = []
    for piece in ("<", "tool", "_call", ">"):
        spelt += tok.encode(piece, add_special=False)
    body = tok.encode(ONE[len("<tool_call>"):-len("</tool_call>")], add_special=False)
    closing = []
    for piece in ("</", "tool", "_call", ">"):
        closing += tok.encode(piece, add_special=False)
    assert 151657 not in spelt
    assert _matches(lltok, grammar, special)
    assert _matches(lltok, grammar, spelt + body + closing)
    assert parse_tool_calls(tok.decode(spelt + body + closing), NAMES)[1][0].name == \
        "get_weather"


@pytest.mark.real_model
def test_the_models_template_renders_tools_calls_and_results(vocab):
    tok, _ = vocab
    assert template_takes_tools(tok.model.chat_template())
    msgs = template_messages(CALLED)
    prompt = tok.chat_prompt(msgs, tools=template_tools(TOOLS))
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt
    assert "<|im_start|>assistant\n" + ONE + "<|im_end|>" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "# Tools" not in tok.chat_prompt(msgs)  # tool_choice "none": not offered


# ---------------------------------------------------------------------- --json-schema

def test_chat_json_schema_file(tmp_path):
    from edgespec.cli.run import json_schema_file

    good = tmp_path / "s.json"
    good.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert json_schema_file(str(good))["properties"] == {"a": {"type": "integer"}}
    assert json_schema_file(None) is None
    cases = {"missing.json": None, "bad.json": "{nope", "list.json": "[1, 2]",
             "wrong.json": '{"type": "object", "minProperties": "x"}'}
    says = {"missing.json": "no such file", "bad.json": "not valid JSON",
            "list.json": "must be an object", "wrong.json": "minProperties"}
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(ValueError) as e:
            json_schema_file(str(path))
        assert str(e.value).startswith(f"--json-schema {path}") and says[name] in str(e.value)


def test_chat_command_refuses_a_bad_schema_file_before_starting_a_ring(tmp_path):
    # As a user runs it: its own process (main() configures the process's logging).
    import subprocess
    import sys

    missing = tmp_path / "none.json"
    done = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--json-schema",
                           str(missing)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == f"edgespec: --json-schema {missing}: no such file"
