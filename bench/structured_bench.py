"""Structured-output benchmark: what a JSON schema costs and gains on a ring, mode by mode.

    .venv/bin/python -m bench.structured_bench                 # the operating point, below
    .venv/bin/python -m bench.structured_bench --target qwen2.5-coder-0.5b \
        --draft qwen2.5-coder-0.5b --stages 2 --hop-ms 0 --reps 1 --prompts 1 \
        --max-tokens 64 --out /tmp/structured_smoke.json       # a few minutes
    .venv/bin/python -m bench.structured_bench --smoke         # seconds: tiny models

Three parts (``--parts``, default all):

- ``ring``: one ``Ring.local`` (``--stages`` node processes on loopback, one llama.cpp thread
  each; with ``--hop-ms`` every link through its own ``bench.linkemu`` proxy,
  ``bench.ring_bench.Links``): the 1.5B Q4_K_M target, the 0.5B draft model, greedy.
  ``--prompts`` chat prompts (``PROMPTS``), each with a JSON schema of its own; per prompt,
  the constrained answer (``json_schema=``) in every ``--modes`` mode and the same prompt as
  free text in every ``--free-modes`` mode, back to back, each from an empty cache, for
  ``--reps`` turns, the order reversed on odd turns so that the host's drift falls on every
  mode alike. Per mode: decode tokens/s (generated tokens / decode time, the generation's
  statistics; prefill excluded), flow/none per turn, whether every constrained answer
  ``json.loads`` and is valid against its schema (``jsonschema`` when installed, else a check of
  the keywords ``PROMPTS`` use), and whether the constrained answers are token-identical
  across modes (greedy; where they part: the token index and the text around it). In the tree
  modes the head's ``ConstrainedDrafter`` is timed in place (this benchmark substitutes
  ``runner.constrained_drafter`` with a subclass that times itself and the drafter it wraps):
  the tokens it drafted because the grammar forced them (``forced_drafted``, jump-forward; a
  token drafted again in a later step counts again) and the head's time it adds per drafted
  node (its own time minus the wrapped drafter's).
- ``forced``: every constrained answer replayed through an ``llguidance.LLMatcher`` of its
  grammar on the target's vocabulary: per token, whether the mask allowed exactly one token
  (``mask_single``), whether it is the first of the matcher's fast-forward tokens
  (``ff_first``: what jump-forward drafts), and whether all its bytes were forced
  (``bytes_forced``: the grammar left no choice of text, only perhaps of tokenization).
- ``micro``: the last stage's per-row cost of a grammar: ``RequestSampler.draw`` (greedy)
  with the grammar (the chain masks each row along its own path) and without, on
  random float32 logits of [rows, n_vocab], for 1 row (a plain lap) and trees of 16 and 64
  rows, rooted at successive places of a real constrained answer (the ring part's, else a
  fixed one). A tree is grown best-first like the draft model's (4 children a node: the
  answer's next token first, the rest tokens the grammar allows there, scored by rank), so
  every path stays inside the grammar as the ``ConstrainedDrafter`` leaves it; the places
  advance along the answer so the stage's matcher moves as it does in a generation.

Prints one JSON object (machine, command, per-run records, summary) and writes it to
``--out`` (default ``bench/results/structured_bench.json``), with a Markdown summary beside it
(same name, ``.md``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from bench.ring_bench import Links, first_divergence, machine_info  # noqa: E402


def _model_path(name: str) -> Path:
    from edgespec.llm import models

    return Path(models.resolve(name))


# --------------------------------------------------------------------------- prompts, schemas

_STR = {"type": "string", "maxLength": 48}

PROMPTS: list[dict[str, Any]] = [
    {"name": "person",
     "prompt": "Make up a customer record for a fictional person living in Lisbon: full name, "
               "age, email address, whether they are a premium member, and up to three "
               "interests.",
     "schema": {"type": "object", "properties": {
         "name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120},
         "email": _STR, "premium": {"type": "boolean"},
         "interests": {"type": "array", "items": _STR, "maxItems": 3}},
         "required": ["name", "age", "email", "premium", "interests"],
         "additionalProperties": False}},
    {"name": "todos",
     "prompt": "List three tasks for preparing a small team offsite next week, each with a "
               "short title, a priority (low, medium or high) and whether it is done already.",
     "schema": {"type": "object", "properties": {
         "todos": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
             "type": "object", "properties": {
                 "title": _STR, "priority": {"enum": ["low", "medium", "high"]},
                 "done": {"type": "boolean"}},
             "required": ["title", "priority", "done"], "additionalProperties": False}}},
         "required": ["todos"], "additionalProperties": False}},
    {"name": "config",
     "prompt": "Write the configuration of a web service for production: the server (host, "
               "port, number of workers), the database (url, pool size, timeout in seconds) "
               "and logging (level and whether to log as JSON).",
     "schema": {"type": "object", "properties": {
         "server": {"type": "object", "properties": {
             "host": _STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
             "workers": {"type": "integer", "minimum": 1, "maximum": 64}},
             "required": ["host", "port", "workers"], "additionalProperties": False},
         "database": {"type": "object", "properties": {
             "url": _STR, "pool_size": {"type": "integer", "minimum": 1, "maximum": 100},
             "timeout_s": {"type": "number", "minimum": 0}},
             "required": ["url", "pool_size", "timeout_s"], "additionalProperties": False},
         "logging": {"type": "object", "properties": {
             "level": {"enum": ["debug", "info", "warning", "error"]},
             "json": {"type": "boolean"}},
             "required": ["level", "json"], "additionalProperties": False}},
         "required": ["server", "database", "logging"], "additionalProperties": False}},
    {"name": "product",
     "prompt": "Describe a product for an online shop: a wireless ergonomic keyboard. Give its "
               "SKU, name, price, currency, whether it is in stock, its dimensions in "
               "centimetres and its average rating out of 5.",
     "schema": {"type": "object", "properties": {
         "sku": _STR, "name": _STR, "price": {"type": "number", "minimum": 0},
         "currency": {"enum": ["USD", "EUR", "GBP"]}, "in_stock": {"type": "boolean"},
         "dimensions": {"type": "object", "properties": {
             "width_cm": {"type": "number"}, "depth_cm": {"type": "number"},
             "height_cm": {"type": "number"}},
             "required": ["width_cm", "depth_cm", "height_cm"], "additionalProperties": False},
         "rating": {"type": "number", "minimum": 0, "maximum": 5}},
         "required": ["sku", "name", "price", "currency", "in_stock", "dimensions", "rating"],
         "additionalProperties": False}},
]

#: The micro part's answer when the ring part did not run (valid against PROMPTS[3]).
FALLBACK_ANSWER = ('{"sku": "KB-ERGO-2024", "name": "ErgoFlow Wireless Keyboard", '
                   '"price": 89.99, "currency": "USD", "in_stock": true, "dimensions": '
                   '{"width_cm": 45.5, "depth_cm": 15.2, "height_cm": 3.1}, "rating": 4.6}')


# --------------------------------------------------------------------------- schema checking

def schema_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """What is wrong with ``value`` against ``schema``: ``jsonschema`` when installed, else a
    check of the keywords ``PROMPTS`` use (type, properties, required, additionalProperties,
    enum, items, minItems/maxItems, minimum/maximum, maxLength)."""
    try:
        import jsonschema
    except ImportError:
        return _check(value, schema, "$")
    v = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '$'}: {e.message}"
            for e in v.iter_errors(value)]


def _check(value: Any, schema: dict[str, Any], at: str) -> list[str]:
    errs: list[str] = []
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool,
             "null": type(None)}
    if kind in types and not isinstance(value, types[kind]):
        return [f"{at}: not {kind}"]
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return [f"{at}: not integer"]
    if kind == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return [f"{at}: not number"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{at}: {value!r} not in enum")
    if "minimum" in schema and value < schema["minimum"]:
        errs.append(f"{at}: below minimum")
    if "maximum" in schema and value > schema["maximum"]:
        errs.append(f"{at}: above maximum")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errs.append(f"{at}: longer than maxLength")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{at}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errs += [f"{at}: extra key {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errs += _check(v, props[k], f"{at}.{k}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errs.append(f"{at}: fewer than minItems")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errs.append(f"{at}: more than maxItems")
        for i, v in enumerate(value):
            errs += _check(v, schema.get("items", {}), f"{at}[{i}]")
    return errs


def validity(text: str, schema: dict[str, Any]) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return {"json_ok": False, "schema_ok": False, "error": f"json: {e}"}
    errs = schema_errors(value, schema)
    return {"json_ok": True, "schema_ok": not errs, **({"error": errs[:3]} if errs else {})}


# --------------------------------------------------------------------------- drafter timing

class _TimedInner:
    """The drafter a ``ConstrainedDrafter`` wraps, with its proposal time summed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def propose(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return self._inner.propose(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t

    def propose_under(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return self._inner.propose_under(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t


def install_drafter_timing(made: list[Any]) -> None:
    """Make the engine's constrained drafters (``runner.constrained_drafter``) time
    themselves; each one made is appended to ``made``."""
    from edgespec.drafters.constrained import ConstrainedDrafter
    from edgespec.grammar import Follower, vocab_tokenizer
    from edgespec.head.engine import runner

    class Timed(ConstrainedDrafter):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.seconds = 0.0
            self.calls = 0
            self.nodes = 0

        def _timed(self, fn: Any, *a: Any) -> Any:
            t = time.perf_counter()
            tree = fn(*a)
            self.seconds += time.perf_counter() - t
            self.calls += 1
            self.nodes += len(tree)
            return tree

        def propose(self, root: int, budget: int, max_depth: int) -> Any:
            return self._timed(super().propose, root, budget, max_depth)

        def propose_under(self, path: Sequence[int], budget: int, max_depth: int) -> Any:
            return self._timed(super().propose_under, path, budget, max_depth)

    def make(inner: Any, vocab: Any, grammar: str, text: Sequence[int]) -> Any:
        d = Timed(_TimedInner(inner), Follower(vocab_tokenizer(vocab), grammar), text)
        made.append(d)
        return d

    runner.constrained_drafter = make


# --------------------------------------------------------------------------- part: ring

def run_ring(args: argparse.Namespace, prompts: list[dict[str, Any]], log) -> list[dict]:
    from edgespec import Ring

    made: list[Any] = []
    install_drafter_timing(made)
    links = Links(args.hop_ms) if args.hop_ms > 0 else None
    kwargs: dict[str, Any] = {"proxy": links.proxy} if links else {}
    items = ([("json", m) for m in args.modes.split(",") if m]
             + [("free", m) for m in args.free_modes.split(",") if m])
    out: list[dict[str, Any]] = []
    try:
        with Ring.local(str(_model_path(args.target)), stages=args.stages,
                        draft=str(_model_path(args.draft)) if args.draft else None,
                        threads=1, spec="none", **kwargs) as ring:
            def chat(p: dict[str, Any], kind: str, mode: str, n: int) -> Any:
                ring.engine.reset()  # every run from an empty cache: prefill alike
                msgs = [{"role": "user", "content": p["prompt"]}]
                schema = p["schema"] if kind == "json" else None
                return ring.chat(msgs, max_tokens=n, spec=mode, json_schema=schema)

            for kind, mode in items:  # warm-up: page in weights, give the cost model laps
                chat(prompts[0], kind, mode, 8)
            for rep in range(args.reps):
                for p in prompts:
                    order = items if rep % 2 == 0 else items[::-1]
                    for kind, mode in order:
                        n_made = len(made)
                        g = chat(p, kind, mode, args.max_tokens)
                        st = g.stats.as_dict()
                        rec: dict[str, Any] = {
                            "prompt": p["name"], "kind": kind, "mode": mode,
                            "prompt_tokens": ring.tokenizer.chat_tokens(
                                [{"role": "user", "content": p["prompt"]}],
                                add_generation_prompt=True),
                            "resolved": st["mode"], "rep": rep, "n_tokens": len(g.tokens),
                            "decode_s": g.stats.decode_s, "prefill_s": g.stats.prefill_s,
                            "tokens_per_s": st["tokens_per_s"],
                            "finish_reason": g.finish_reason, "text": g.text,
                            "tokens": g.tokens, "stats": st,
                            "load_avg_1m": round(os.getloadavg()[0], 2)}
                        if kind == "json":
                            rec.update(validity(g.text, p["schema"]))
                        if len(made) > n_made:  # this generation's constrained drafter
                            d = made[-1]
                            rec["drafter"] = {
                                "forced_drafted": d.forced_drafted, "calls": d.calls,
                                "nodes": d.nodes, "ms": round(d.seconds * 1e3, 3),
                                "inner_ms": round(d.inner.seconds * 1e3, 3),
                                "overhead_us_per_node": round(
                                    (d.seconds - d.inner.seconds) * 1e6 / max(1, d.nodes), 1)}
                        out.append(rec)
                        log(f"  r{rep} {p['name']:<8} {kind:<4} {mode:<4} "
                            f"{st['tokens_per_s']:7.2f} tok/s  {len(g.tokens):3d} tok  "
                            f"steps {st['steps']} acc/step {st['mean_accepted_per_step']:.2f}"
                            + (f"  valid {rec['schema_ok']}" if kind == "json" else "")
                            + (f"  forced drafted {rec['drafter']['forced_drafted']}"
                               if "drafter" in rec else "")
                            + f"  (load {rec['load_avg_1m']})")
    finally:
        if links:
            links.close()
    return out


def _rate(rs: list[dict[str, Any]]) -> float:
    s = sum(r["decode_s"] for r in rs)
    return sum(r["n_tokens"] for r in rs) / s if s else 0.0


def summarize_ring(runs: list[dict[str, Any]], decode: Any, target: Path, hop_ms: float,
                   log) -> dict[str, Any]:
    reps = sorted({r["rep"] for r in runs})
    rows = []
    for kind in ("json", "free"):
        mine = [r for r in runs if r["kind"] == kind]
        for mode in dict.fromkeys(r["mode"] for r in mine):
            rs = [r for r in mine if r["mode"] == mode]
            row: dict[str, Any] = {
                "kind": kind, "mode": mode, "runs": len(rs),
                "tokens": sum(r["n_tokens"] for r in rs),
                "tokens_per_s": round(_rate(rs), 2),
                "tokens_per_s_per_rep": [round(_rate([r for r in rs if r["rep"] == k]), 2)
                                         for k in reps],
                "tokens_per_s_per_prompt": {
                    p: round(_rate([r for r in rs if r["prompt"] == p]), 2)
                    for p in dict.fromkeys(r["prompt"] for r in rs)},
                "mean_accepted_per_step": round(
                    sum(r["n_tokens"] for r in rs) / max(1, sum(r["stats"]["steps"]
                                                                for r in rs)), 2),
                "rows_sent": sum(r["stats"]["rows_sent"] for r in rs),
                "draft_ms_per_token": round(sum(r["stats"]["draft_ms"] for r in rs)
                                            / max(1, sum(r["n_tokens"] for r in rs)), 2),
                "finish": dict(sorted(_count(r["finish_reason"] for r in rs).items()))}
            none = [r for r in mine if r["mode"] == "none"]
            if none and mode != "none":
                per_rep = [round(_rate([r for r in rs if r["rep"] == k])
                                 / _rate([r for r in none if r["rep"] == k]), 3) for k in reps]
                row["x_none"] = round(_rate(rs) / _rate(none), 3)
                row["x_none_per_rep"] = per_rep
            if kind == "json":
                row["json_ok"] = f"{sum(r['json_ok'] for r in rs)}/{len(rs)}"
                row["schema_ok"] = f"{sum(r['schema_ok'] for r in rs)}/{len(rs)}"
                ds = [r["drafter"] for r in rs if "drafter" in r]
                if ds:
                    nodes = sum(d["nodes"] for d in ds)
                    row["forced_drafted"] = sum(d["forced_drafted"] for d in ds)
                    row["drafted_nodes"] = nodes
                    row["constrained_drafter_ms_per_token"] = round(
                        sum(d["ms"] for d in ds) / max(1, row["tokens"]), 3)
                    row["constraint_overhead_us_per_node"] = round(
                        sum(d["ms"] - d["inner_ms"] for d in ds) * 1e3 / max(1, nodes), 1)
            rows.append(row)
    ident = identity(runs, decode)
    gaps = logit_gaps(runs, target, hop_ms, log)
    for x in ident:
        for part in x["parted"]:
            part.update(gaps.get((x["kind"], x["prompt"], part["mode"], part["rep"]), {}))
    return {"modes": rows, "identity": ident}


def logit_gaps(runs: list[dict[str, Any]], target: Path, hop_ms: float, log
               ) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    """Where a run parts from its reference (the first ``none`` run of its prompt and kind):
    the unsplit target's logit gap between the two tokens there, by ``bench.ring_bench``'s
    ``identity`` (under 0.5: a near-tie batch shapes may flip, docs/design.md 3.9). A
    grammar's mask leaves both tokens' logits as they are (each was drawn under it), so the
    unmasked gap is the constrained one."""
    from bench import ring_bench

    keys = list(dict.fromkeys((r["kind"], r["prompt"]) for r in runs))
    pseudo = [{"mode": r["mode"], "drafter": "-" if r["mode"] == "none" else "model",
               "budget": f"r{r['rep']}", "link": f"{hop_ms:g}ms", "tokens": r["tokens"],
               "prompt": keys.index((r["kind"], r["prompt"]))} for r in runs]
    # The reference is the first none run of each (kind, prompt): put those first.
    first = {}
    for i, r in enumerate(pseudo):
        if r["mode"] == "none":
            first.setdefault(r["prompt"], i)
    order = sorted(range(len(pseudo)), key=lambda i: i != first.get(pseudo[i]["prompt"]))
    prompts = [next(r["prompt_tokens"] for r in runs if (r["kind"], r["prompt"]) == k)
               for k in keys]
    got = ring_bench.identity([pseudo[i] for i in order], target, prompts, log)
    out = {}
    for key, entries in got["per_config"].items():
        mode, _drafter, rep = key.split("/")[:3]  # mode/drafter/budget(= rep)/...
        for e in entries:
            if "logit_gap" in e:
                kind, prompt = keys[e["prompt"]]
                out[(kind, prompt, mode, int(rep[1:]))] = {"logit_gap": e["logit_gap"],
                                                           "near_tie": e["near_tie"]}
    return out


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def identity(runs: list[dict[str, Any]], decode: Any) -> list[dict[str, Any]]:
    """Per prompt and kind: every run's tokens against the first ``none`` run's; where one
    differs, the token index and both texts from 3 tokens before it (``decode``: ids ->
    text)."""
    out = []
    for kind in ("json", "free"):
        for p in dict.fromkeys(r["prompt"] for r in runs):
            rs = [r for r in runs if r["kind"] == kind and r["prompt"] == p]
            ref = next((r for r in rs if r["mode"] == "none"), rs[0] if rs else None)
            if ref is None:
                continue
            parts = []
            for r in rs:
                if r is ref:
                    continue
                a, b = r["tokens"], ref["tokens"]
                i = first_divergence(a, b)
                if i is None and len(a) == len(b):
                    continue
                i = min(len(a), len(b)) if i is None else i
                parts.append({"mode": r["mode"], "rep": r["rep"], "index": i,
                              "lengths": [len(a), len(b)],
                              "this": decode(a[max(0, i - 3):i + 8]),
                              "reference": decode(b[max(0, i - 3):i + 8])})
            out.append({"kind": kind, "prompt": p, "reference": f"{ref['mode']} r{ref['rep']}",
                        "identical": f"{len(rs) - 1 - len(parts)}/{len(rs) - 1}",
                        "parted": parts})
    return out


# --------------------------------------------------------------------------- part: forced

def load_vocab(target: str) -> Any:
    from edgespec.llm.llamacpp import load_model

    return load_model(_model_path(target), vocab_only=True)


def forced_share(vocab: Any, grammar_text: str, tokens: Sequence[int]) -> dict[str, Any]:
    """Replay ``tokens`` through a matcher of the grammar: per token, what the grammar left."""
    import llguidance
    import numpy as np

    from edgespec.grammar import vocab_tokenizer

    tok = vocab_tokenizer(vocab)
    m = llguidance.LLMatcher(tok, grammar_text)
    single = ff_first = bytes_forced = forced_bytes = total_bytes = 0
    for t in tokens:
        mask = np.frombuffer(m.compute_bitmask(), np.uint8)
        if int(np.unpackbits(mask).sum()) == 1:
            single += 1
        ff = m.compute_ff_tokens()
        if ff and ff[0] == t:
            ff_first += 1
        fb = m.compute_ff_bytes()
        tb = tok.decode_bytes([int(t)])
        k = 0
        while k < min(len(tb), len(fb)) and tb[k] == fb[k]:
            k += 1
        forced_bytes += k
        total_bytes += len(tb)
        if tb and k == len(tb):
            bytes_forced += 1
        if not m.consume_token(int(t)):
            return {"error": f"token {t} refused by the grammar: {m.get_error()}"}
    n = max(1, len(tokens))
    return {"tokens": len(tokens), "mask_single": single, "ff_first": ff_first,
            "bytes_forced": bytes_forced, "share_mask_single": round(single / n, 3),
            "share_ff_first": round(ff_first / n, 3),
            "share_bytes_forced": round(bytes_forced / n, 3),
            "share_forced_bytes": round(forced_bytes / max(1, total_bytes), 3)}


def run_forced(vocab: Any, runs: list[dict[str, Any]], prompts: list[dict[str, Any]]
               ) -> dict[str, Any]:
    from edgespec.grammar import Grammar

    grammar = {p["name"]: Grammar.json_schema(p["schema"]).text for p in prompts}
    per: list[dict[str, Any]] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for r in runs:
        if r["kind"] != "json":
            continue
        key = (r["prompt"], tuple(r["tokens"]))
        if key in seen:  # identical answers replay alike
            continue
        seen.add(key)
        per.append({"prompt": r["prompt"], "from": f"{r['mode']} r{r['rep']}",
                    **forced_share(vocab, grammar[r["prompt"]], r["tokens"])})
    ok = [x for x in per if "error" not in x]
    total = sum(x["tokens"] for x in ok) or 1
    return {"answers": per, "summary": {
        "answers": len(ok), "tokens": sum(x["tokens"] for x in ok),
        **{f"share_{k}": round(sum(x[k] for x in ok) / total, 3)
           for k in ("mask_single", "ff_first", "bytes_forced")}}}


# --------------------------------------------------------------------------- part: micro

def grow_tree(follower: Any, n_vocab: int, text: list[int], truth: list[int], rows: int,
              rng: Any, width: int = 4, max_depth: int = 8) -> tuple[list[int], list[int]]:
    """(parents, tokens) of a tree of ``rows`` nodes, node 0 the root (``text``'s last
    token), grown best-first like the draft model's: each node's ``width`` children are the
    answer's next token (where the node lies on the answer) and then tokens the grammar
    allows there, log-probabilities by rank; every path stays inside the grammar."""
    import numpy as np

    parents, tokens, paths = [-1], [text[-1]], [[]]
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def children(node: int, score: float) -> None:
        nonlocal seq
        path = paths[node]
        if len(path) >= max_depth:
            return
        if follower.move(text + path) < len(text) + len(path):
            return
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(
            follower.matcher.compute_bitmask(), np.uint8), bitorder="little"))
        on_answer = truth[:len(path)] == path and len(path) < len(truth)
        picks: list[int] = [truth[len(path)]] if on_answer else []
        others = [int(t) for t in allowed if t < n_vocab and int(t) not in picks]
        if others:
            for t in rng.choice(others, size=min(width - len(picks), len(others)),
                                replace=False).tolist():
                picks.append(int(t))
        lps = [-0.1, -2.0, -3.0, -4.0] if on_answer else [-0.7, -2.0, -3.0, -4.0]
        for rank, t in enumerate(picks[:width]):
            heapq.heappush(heap, (-(score + lps[rank]), seq, node, t))
            seq += 1

    children(0, 0.0)
    score = {0: 0.0}
    while len(tokens) < rows and heap:
        neg, _, parent, t = heapq.heappop(heap)
        node = len(tokens)
        parents.append(parent)
        tokens.append(t)
        paths.append(paths[parent] + [t])
        score[node] = -neg
        children(node, -neg)
    return parents, tokens


def run_micro(vocab: Any, answer: list[int], grammar_text: str, sizes: list[int],
              places: int, reps: int, log) -> dict[str, Any]:
    import numpy as np

    from edgespec.batch import SamplerRef
    from edgespec.grammar import Follower, vocab_tokenizer
    from edgespec.node.sampler import RequestSampler
    from edgespec.sampling import SamplerSettings

    n_vocab = vocab.n_vocab
    rng = np.random.default_rng(0)
    helper = Follower(vocab_tokenizer(vocab), grammar_text)
    settings = SamplerSettings(grammar=grammar_text)
    free = RequestSampler(SamplerSettings())
    out: dict[str, Any] = {"answer_tokens": len(answer), "n_vocab": n_vocab, "sizes": []}
    for rows in sizes:
        # Places along the answer: the root is the answer's token k - 1; step so that the
        # places cover the answer and the stage's matcher moves forward between them.
        step = max(1, (len(answer) - 2) // places)
        ks = list(range(1, len(answer) - 1, step))[:places]
        cases = []
        for k in ks:
            text = answer[:k]
            if rows == 1:
                parents, tokens = [-1], [text[-1]]
            else:
                parents, tokens = grow_tree(helper, n_vocab, text, answer[k:], rows, rng)
            # The root's token is the text's last: the tree's paths start below it.
            ref = SamplerRef(1, None, len(text), (), (tuple(parents), tuple(tokens)))
            nodes = np.arange(len(tokens), dtype=np.int32)
            cases.append((ref, text, nodes, len(tokens)))
        logits = (rng.standard_normal((rows, n_vocab), dtype=np.float32) * 3).astype(np.float32)
        # The last stage's sampler of one request, its matcher following the answer.
        sampler = RequestSampler(settings, Follower(vocab_tokenizer(vocab), grammar_text))
        t_con: list[float] = []
        t_free: list[float] = []
        t_apply: list[float] = []
        t_mask: list[float] = []
        real_rows = []
        for rep in range(reps + 1):  # rep 0 warms up (compiles the grammar, pages in)
            for ref, text, nodes, n in cases:
                sampler.text = list(text)
                lg = logits[:n]
                pos = np.arange(n, dtype=np.int32)
                t = time.perf_counter()
                sampler.draw(lg, pos, nodes, ref)
                a = time.perf_counter() - t
                t = time.perf_counter()
                free.draw(lg, pos, nodes, SamplerRef())
                b = time.perf_counter() - t
                paths = ref.paths(text, nodes.tolist())
                t = time.perf_counter()
                sampler.shape(lg, paths, len(text))
                c = time.perf_counter() - t
                buf = np.array(lg, dtype=np.float32, copy=True)
                t = time.perf_counter()
                sampler._mask(buf, paths, len(text))  # noqa: SLF001
                d = time.perf_counter() - t
                if rep:
                    t_con.append(a / n)
                    t_free.append(b / n)
                    t_apply.append(c / n)
                    t_mask.append(d / n)
                    real_rows.append(n)
        row = {"rows": rows, "trees": len(cases), "mean_rows": round(statistics.mean(real_rows),
                                                                     1),
               "calls": len(t_con),
               "us_per_row_constrained": round(statistics.median(t_con) * 1e6, 1),
               "us_per_row_unconstrained": round(statistics.median(t_free) * 1e6, 1),
               "us_per_row_apply": round(statistics.median(t_apply) * 1e6, 1),
               "us_per_row_matcher_mask": round(statistics.median(t_mask) * 1e6, 1),
               "us_per_row_added": round((statistics.median(t_con)
                                          - statistics.median(t_free)) * 1e6, 1),
               "us_per_row_constrained_p90": round(_p(t_con, 0.9) * 1e6, 1)}
        out["sizes"].append(row)
        log(f"  micro {rows:3d} rows: constrained {row['us_per_row_constrained']} us/row, "
            f"unconstrained {row['us_per_row_unconstrained']} us/row "
            f"(apply {row['us_per_row_apply']})")
    return out


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# --------------------------------------------------------------------------- report

def markdown(result: dict[str, Any]) -> str:
    lines = ["# structured_bench", "", f"`{result['command']}`", "",
             f"machine: {result['machine'].get('cpu')}, {result['machine'].get('logical_cpus')} "
             f"CPUs, load {result['machine'].get('load_avg')} at start, "
             f"{result.get('load_avg_end')} at end; git {result['machine'].get('git')}"
             f"{' (uncommitted changes)' if result['machine'].get('edgespec_uncommitted_changes') else ''}",
             ""]
    setup = result.get("setup", {})
    if "ring" in result:
        lines += [f"Ring: target {setup['target']}, draft {setup['draft']}, {setup['stages']} "
                  f"stages, {setup['hop_ms']} ms per hop, greedy, max_tokens "
                  f"{setup['max_tokens']}, {setup['reps']} reps x {setup['prompts']} prompts.",
                  "", "| kind | mode | tok/s | per rep | x none | x none per rep | tok/step | "
                  "json ok | schema ok | forced drafted | constraint us/drafted node |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["ring"]["modes"]:
            lines.append(
                f"| {r['kind']} | {r['mode']} | {r['tokens_per_s']} | "
                f"{r['tokens_per_s_per_rep']} | {r.get('x_none', '')} | "
                f"{r.get('x_none_per_rep', '')} | {r['mean_accepted_per_step']} | "
                f"{r.get('json_ok', '')} | {r.get('schema_ok', '')} | "
                f"{r.get('forced_drafted', '')} | "
                f"{r.get('constraint_overhead_us_per_node', '')} |")
        lines += ["", "Identity (against the first `none` run of each prompt):", ""]
        for x in result["ring"]["identity"]:
            lines.append(f"- {x['kind']} {x['prompt']}: {x['identical']} identical"
                         + "".join(f"; {p['mode']} r{p['rep']} parts at token {p['index']} "
                                   f"(logit gap {p.get('logit_gap', '?')}: "
                                   f"{json.dumps(p['this'])} vs {json.dumps(p['reference'])})"
                                   for p in x["parted"]))
    if "forced" in result:
        s = result["forced"]["summary"]
        lines += ["", f"Forced tokens over {s['answers']} distinct constrained answers "
                      f"({s['tokens']} tokens): mask allows one token "
                      f"{s['share_mask_single']:.1%}, first fast-forward token "
                      f"{s['share_ff_first']:.1%}, all bytes forced "
                      f"{s['share_bytes_forced']:.1%}.", "",
                  "| prompt | from | tokens | mask single | ff first | bytes forced | "
                  "forced byte share |", "|---|---|---|---|---|---|---|"]
        for a in result["forced"]["answers"]:
            if "error" in a:
                lines.append(f"| {a['prompt']} | {a['from']} | error: {a['error']} |||||")
                continue
            lines.append(f"| {a['prompt']} | {a['from']} | {a['tokens']} | "
                         f"{a['share_mask_single']} | {a['share_ff_first']} | "
                         f"{a['share_bytes_forced']} | {a['share_forced_bytes']} |")
    if "micro" in result:
        m = result["micro"]
        lines += ["", f"Last stage, per row (`draw`, greedy; n_vocab {m['n_vocab']}; median "
                      f"over {m['sizes'][0]['calls'] if m['sizes'] else 0} calls):", "",
                  "| rows | constrained us/row | unconstrained us/row | added us/row | "
                  "bias + penalties + mask (shape) us/row | of which matcher + mask us/row | "
                  "constrained p90 |", "|---|---|---|---|---|---|---|"]
        for r in m["sizes"]:
            lines.append(f"| {r['rows']} | {r['us_per_row_constrained']} | "
                         f"{r['us_per_row_unconstrained']} | {r['us_per_row_added']} | "
                         f"{r['us_per_row_apply']} | {r['us_per_row_matcher_mask']} | "
                         f"{r['us_per_row_constrained_p90']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="ring,forced,micro")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--hop-ms", type=float, default=10.0)
    ap.add_argument("--modes", default="none,sync,flow", help="constrained answers' modes")
    ap.add_argument("--free-modes", default="none,flow", help="free text answers' modes")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--micro-rows", default="1,16,64")
    ap.add_argument("--micro-places", type=int, default=24,
                    help="tree roots along the answer per size")
    ap.add_argument("--micro-reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/structured_bench.json")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: tiny models (unless --target/--draft; their answers never "
                         "close a schema, the real 0.5B's do), 2 stages, no delay, 1 prompt, "
                         "24 tokens, 1 rep, trees of 1 and 16 rows at 2 places; writes into "
                         "the temporary folder (unless --out)")
    args = ap.parse_args(argv)
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, target=smoke.tiny_model,
                    draft=lambda: smoke.tiny_model("draft"),
                    stages=2, hop_ms=0.0, prompts=1, max_tokens=24, reps=1, micro_rows="1,16",
                    micro_places=2, micro_reps=1,
                    out=str(smoke.scratch_path("structured_bench.json")))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    parts = args.parts.split(",")
    prompts = PROMPTS[:args.prompts]
    result: dict[str, Any] = {
        "command": ("python -m bench.structured_bench "
                    + " ".join(map(shlex.quote, argv if argv is not None else sys.argv[1:]))
                    ).rstrip(),
        "machine": machine_info(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": {"target": args.target, "draft": args.draft, "stages": args.stages,
                  "hop_ms": args.hop_ms, "max_tokens": args.max_tokens, "reps": args.reps,
                  "prompts": len(prompts), "modes": args.modes, "free_modes": args.free_modes,
                  "schema_check": "jsonschema" if _has("jsonschema") else "by hand"},
        "prompts": prompts}
    from edgespec.grammar import Grammar
    from edgespec.llm.tokenizer import Tokenizer

    vocab = load_vocab(args.target)  # vocabulary only: decoding, matchers, the micro part
    runs: list[dict[str, Any]] = []
    try:
        if "ring" in parts:
            runs = run_ring(args, prompts, log)
            result["runs"] = runs
            result["ring"] = summarize_ring(runs, Tokenizer(vocab).decode,
                                            _model_path(args.target), args.hop_ms, log)
        if "forced" in parts and runs:
            result["forced"] = run_forced(vocab, runs, prompts)
        if "micro" in parts:
            done = [r for r in runs if r["kind"] == "json" and r.get("schema_ok")]
            if done:
                src = max(done, key=lambda r: r["n_tokens"])
                answer = list(src["tokens"])
                schema = next(p["schema"] for p in prompts if p["name"] == src["prompt"])
                origin = f"{src['prompt']} {src['mode']} r{src['rep']}"
            else:
                answer = Tokenizer(vocab).encode(FALLBACK_ANSWER, add_special=False)
                schema, origin = PROMPTS[3]["schema"], "FALLBACK_ANSWER (product)"
            result["micro"] = run_micro(vocab, answer, Grammar.json_schema(schema).text,
                                        [int(x) for x in args.micro_rows.split(",")],
                                        args.micro_places, args.micro_reps, log)
            result["micro"]["answer_from"] = origin
    finally:
        vocab.close()
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1)
    out.write_text(text + "\n")
    md = markdown(result)
    out.with_suffix(".md").write_text(md)
    print(text)
    log(md)
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    raise SystemExit(main())
