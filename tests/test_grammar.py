"""Constrained output and penalties below the ring: a ``Grammar`` refuses what cannot compile
naming the field it came from; the last stage's sampler chain gives each tree row the
mask and penalties of its own path, exactly as a plain row with that text would get them; a
batch's ``SamplerRef`` (registration, text added, tree) survives the wire and a hostile one is
refused; the head's
``ConstrainedDrafter`` drafts forced tokens first and never a token the grammar refuses.
Real vocabulary (the 0.5B's, loaded vocabulary-only), synthetic logits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgespec.batch import SamplerRef
from edgespec.drafters import RetrievalDrafter
from edgespec.drafters.constrained import ConstrainedDrafter
from edgespec.errors import RequestError
from edgespec.grammar import Follower, Grammar, vocab_tokenizer
from edgespec.node.sampler import SamplerStates, penalize
from edgespec.params import GenerationParams
from edgespec.sampling import SamplerSettings

pytestmark = pytest.mark.real_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab(real_model_path):
    from edgespec.llm.llamacpp import load_model

    model = load_model(real_model_path, vocab_only=True)
    yield model
    model.close()


@pytest.fixture(scope="module")
def tok(vocab):
    from edgespec.llm.tokenizer import Tokenizer

    return Tokenizer(vocab)


def _draw(vocab, settings: SamplerSettings, logits, text, tree=((), ()), nodes=None):
    """The targets a last stage draws for ``logits`` (rows of tree ``nodes``, positions
    0..k-1) of a request with ``settings`` whose generated text so far is ``text``."""
    states = SamplerStates(lambda: vocab_tokenizer(vocab))
    nodes = np.zeros(len(logits), np.int32) if nodes is None else nodes
    ref = SamplerRef(1, settings, len(text), tuple(text), tree)
    sampler = states.sampler(ref)
    return sampler.draw(logits, np.arange(len(logits), dtype=np.int32), nodes, ref)[0]


@pytest.mark.parametrize(("make", "param"), [
    (lambda: Grammar.json_schema("{not json"), "json_schema"),
    (lambda: Grammar.json_schema([1, 2]), "json_schema"),
    (lambda: Grammar.json_schema({"type": "objectx"}), "json_schema"),
    (lambda: Grammar.regex("[a-z]+("), "regex"),
    (lambda: Grammar.lark("start: missing_rule"), "grammar"),
    (lambda: Grammar.from_response_format({"type": "xml"}), "response_format"),
    (lambda: Grammar.from_response_format({"type": "json_schema"}), "response_format"),
    (lambda: Grammar.from_response_format({"type": "json_object", "schema": {}}),
     "response_format"),
    (lambda: GenerationParams.of(json_schema=SCHEMA, regex="a+"), "regex"),
    (lambda: GenerationParams(frequency_penalty=2.5), "frequency_penalty"),
    (lambda: GenerationParams(repeat_penalty=0), "repeat_penalty"),
])
def test_a_bad_grammar_or_penalty_is_refused_naming_its_field(make, param):
    with pytest.raises(RequestError) as err:
        make()
    assert err.value.param == param


def test_response_format_maps_to_a_grammar():
    assert Grammar.from_response_format({"type": "text"}) is None
    assert Grammar.from_response_format({"type": "json_object"}).kind == "json_object"
    g = Grammar.from_response_format({"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}})
    assert g.kind == "json_schema" and json.loads(g.source) == SCHEMA
    p = GenerationParams.of(json_schema=SCHEMA, max_tokens=5)
    assert p.grammar == Grammar.json_schema(SCHEMA) and p.sampling.grammar == p.grammar.text
    assert p.sampling.follows_text and not GenerationParams().sampling.follows_text


def test_sampler_ref_survives_meta_and_a_hostile_one_is_refused():
    settings = GenerationParams(grammar=Grammar.regex("[0-9]+"), frequency_penalty=0.5,
                                repeat_penalty=1.1, min_p=0.05).sampling
    ref = SamplerRef(7, settings, 2, (5, 6), ((-1, 0, 1), (6, 7, 8)))
    back = SamplerRef.from_meta(json.loads(json.dumps(ref.as_meta())))
    assert back == ref and back.paths([5, 6], [0, 2, 1, 40]) == [
        [5, 6], [5, 6, 7, 8], [5, 6, 7], [5, 6]]
    assert SamplerRef.from_meta({}) == SamplerRef()  # key 0: the plain greedy draw
    for bad in ({"register": {"grammar": 5}}, {"register": {"repeat_penalty": 0}},
                {"register": {"frequency_penalty": 3}}, {"register": {"min_p": 2}},
                {"register": {"nope": 1}}, {"added": [-1]}, {"added": "abc"},
                {"n": 1, "added": [1, 2]}, {"key": -1}, {"key": 0}, {"tree": [[0], [1]]},
                {"tree": [[-1, 5], [1, 2]]}, {"tree": [[-1], [1, 2]]}):
        with pytest.raises(ValueError):
            SamplerRef.from_meta({**ref.as_meta(), **bad})


def test_penalties_match_their_definitions():
    def penalized(text, **fields):
        row = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
        penalize(row, text, SamplerSettings(tuple(fields.items())))
        return row.tolist()

    assert penalized([0, 0, 1], frequency_penalty=0.25, presence_penalty=0.5) == [
        2.0 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 1.0, 0.5]
    # repetition: positive divided, negative times
    assert penalized([0, 1], repeat_penalty=2.0) == [1.0, -4.0, 1.0, 0.5]
    # only the last repeat_last_n tokens count; -1: all of them
    assert penalized([0, 0, 1], frequency_penalty=1.0, repeat_last_n=2) == [1.0, -3.0, 1.0, 0.5]
    assert penalized([0, 0, 1], frequency_penalty=1.0, repeat_last_n=-1) == [0.0, -3.0, 1.0, 0.5]


def test_each_tree_row_gets_the_mask_and_penalties_of_its_own_path(vocab, tok):
    """A tree row's target distribution is the one a plain row with the same text gets: the
    constrained draw of a tree equals the draws of its paths one by one (mask and penalties
    both), and every target is a token the grammar allows there."""
    grammar = Grammar.json_schema(SCHEMA)
    text = tok.encode('{"name": "Al', add_special=False)
    a, b = tok.encode('ice"', add_special=False)[0], tok.encode('"', add_special=False)[0]
    # root (text's last token), then two branches: [a] and [b, ", "] (b closes the string)
    comma = tok.encode(', "', add_special=False)[0]
    parents, tokens = [-1, 0, 0, 2], [text[-1], a, b, comma]
    settings = GenerationParams(grammar=grammar, frequency_penalty=0.7,
                                repeat_penalty=1.2).sampling
    tree = (tuple(parents), tuple(tokens))
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, vocab.n_vocab)).astype(np.float32) * 3
    nodes = np.arange(4, dtype=np.int32)
    got = _draw(vocab, settings, logits, text, tree, nodes)
    follower = Follower(vocab_tokenizer(vocab), grammar.text)
    paths = SamplerRef(tree=tree).paths(text, nodes.tolist())
    for i, path in enumerate(paths):
        want = _draw(vocab, settings, logits[i:i + 1], path)
        assert got[i] == want[0], i
        assert follower.move([*path, int(got[i])]) == len(path) + 1, (i, tok.decode(path))
    # unconstrained, the same logits draw tokens the grammar refuses
    free = _draw(vocab, SamplerSettings(), logits, text, tree, nodes)
    assert not all(follower.move([*p, int(t)]) == len(p) + 1
                   for p, t in zip(paths, free, strict=True))


def test_the_drafter_drafts_forced_tokens_first_and_only_what_the_grammar_allows(vocab, tok):
    grammar = Grammar.json_schema(SCHEMA)
    follower = Follower(vocab_tokenizer(vocab), grammar.text)
    inner = RetrievalDrafter()
    drafter = ConstrainedDrafter(inner, follower)
    # A prompt whose retrieval continuation after `{"` is text outside the grammar.
    prompt = tok.encode('say {"nope": 1} then {"name": "x", "ok": true} {"', add_special=False)
    drafter.begin(prompt)
    start = tok.encode('{"', add_special=False)
    drafter.accept(start)  # the text so far: {"  -> the schema forces the key "name"
    tree = drafter.propose(start[-1], 16, 8)
    assert len(tree) and tree.parents[0] == -1
    assert tok.decode([int(tree.tokens[0])]) == "name" and tree.logprobs[0] == 0.0
    assert drafter.forced_drafted >= 1
    for path in tree.paths():
        assert follower.move([*start, *path]) == len(start) + len(path), tok.decode(list(path))


def test_a_vocabularys_tokenizer_goes_with_its_model(real_model_path, tok):
    """llguidance's tokenizer calls into the llama.cpp vocabulary it was made from: another
    load of the same file gets its own, and a closed model's is dropped (a tokenizer kept by
    file once outlived its model and crashed the next ring's first mask)."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from edgespec.llm.llamacpp import load_model

    grammar = Grammar.json_schema(SCHEMA)
    first = load_model(real_model_path, vocab_only=True)
    made = vocab_tokenizer(first)
    assert vocab_tokenizer(first) is made
    first.close()
    assert first.guidance is None
    with pytest.raises(ValueError, match="closed"):
        vocab_tokenizer(first)
    second = load_model(real_model_path, vocab_only=True)
    try:
        fresh = vocab_tokenizer(second)
        assert fresh is not made
        follower = Follower(fresh, grammar.text)
        text = tok.encode('{"name": "x", "ok": ', add_special=False)
        assert follower.move(text) == len(text)
        mask = allocate_token_bitmask(1, second.n_vocab)
        fill_next_token_bitmask(follower.matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        assert {tok.decode([int(t)]) for t in allowed} >= {"true", "false"}
    finally:
        second.close()


def test_a_generated_text_the_grammar_cannot_follow_fails_the_batch(vocab, tok):
    """The generated text was drawn under the mask, so a grammar that cannot follow it is a
    fault (one of llguidance's limits): the stage refuses the batch instead of answering
    unconstrained. A drafted row outside the grammar is no fault (it is never accepted)."""
    settings = GenerationParams(grammar=Grammar.regex("[0-9]+")).sampling
    digits, word = tok.encode("12", add_special=False), tok.encode("cat", add_special=False)
    logits = np.zeros((2, vocab.n_vocab), np.float32)
    # the draft row (node 1, the word) is unmasked: no fault
    _draw(vocab, settings, logits, digits, ((-1, 0), (digits[-1], word[0])),
          np.arange(2, dtype=np.int32))
    with pytest.raises(ValueError, match="cannot follow the generated text"):
        _draw(vocab, settings, logits[:1], word)
