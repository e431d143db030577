"""OpenAI's completion endpoints: a request checked at the edge and run through the ring
(``runs``, every door's one path), and the answer as one JSON body or as server-sent events
(OpenAI's chunk format)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from edgespec.api import Generation
from edgespec.head.output import TokenLogprob
from edgespec.server.chat_input import Deltas, answer_message, finish_reason
from edgespec.server.replies import _error, _failure, _failure_message
from edgespec.server.requests import _BadRequest, parse_request
from edgespec.server.runs import Runs, Started, cut_off


class Completions:
    """``POST /v1/completions`` and ``/v1/chat/completions``: a request is checked and
    tokenized off the event loop, takes its place in the ring's queue, runs in a thread of its
    own once the scheduler gives it a slot (up to ``Ring.parallel`` at once), and answers as
    one body or as server-sent events; a client that hangs up stops it (or withdraws it from
    the queue)."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs
        self.ring, self.model_name = runs.ring, runs.model_name

    async def completions(self, request: Request) -> Any:
        return await self._run(request, chat=False)

    async def chat_completions(self, request: Request) -> Any:
        return await self._run(request, chat=True)

    def _usage(self, gen: Generation) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": gen.stats.prompt_tokens,
                                 "completion_tokens": gen.stats.tokens,
                                 "total_tokens": gen.stats.prompt_tokens + gen.stats.tokens}
        ttft = getattr(gen.stats, "ttft_ms", None)
        if ttft is not None:  # the ring's own figure: request start to first token
            usage["time_to_first_token_ms"] = round(float(ttft), 1)
        return usage

    async def _run(self, request: Request, chat: bool) -> Any:
        raw = await self.runs.read_body(request)
        run = await self.runs.start(lambda: parse_request(raw, chat),
                                    "chatcmpl-" if chat else "cmpl-")
        req, rid, created = run.req, run.rid, run.created
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._sse(run, chat, include_usage), media_type="text/event-stream")
        try:
            gen = await self.runs.collect(request, run)
        except _BadRequest:
            raise
        except Exception as failure:
            status, kind, code, param = _failure(failure)
            return _error(status, _failure_message(failure), kind, code=code, param=param)
        names = run.names
        scores = gen.logprobs
        if chat:
            message, called = answer_message(gen.text, names)
            choice = {"index": 0, "finish_reason": finish_reason(gen.finish_reason, called),
                      "message": message,
                      "logprobs": None if scores is None else
                      {"content": self._chat_logprobs(scores), "refusal": None}}
        else:
            choice = {"index": 0, "finish_reason": gen.finish_reason, "text": gen.text,
                      "logprobs": None if scores is None else
                      self._completion_logprobs(scores, 0)}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": self.model_name, "choices": [choice],
                "usage": self._usage(gen)}

    def _token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.ring.tokenizer.piece(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, scores: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat's ``logprobs.content``: per token its text, bytes, log probability and the
        most likely tokens' (``top_logprobs``)."""
        out = []
        for s in scores:
            text, raw = self._token_text(s.token)
            top = []
            for t, lp in s.top:
                t_text, t_raw = self._token_text(t)
                top.append({"token": t_text, "logprob": lp, "bytes": t_raw})
            out.append({"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": top})
        return out

    def _completion_logprobs(self, scores: Sequence[TokenLogprob], offset: int
                             ) -> dict[str, Any]:
        """Completions' ``logprobs``: tokens, their log probabilities, the most likely
        tokens' as ``{text: logprob}`` and each token's offset in the text (from
        ``offset``)."""
        tokens, offsets = [], []
        for s in scores:
            offsets.append(offset)
            text = self._token_text(s.token)[0]
            offset += len(text)
            tokens.append(text)
        return {"tokens": tokens, "token_logprobs": [s.logprob for s in scores],
                "top_logprobs": [{self._token_text(t)[0]: lp for t, lp in s.top}
                                 for s in scores],
                "text_offset": offsets}

    async def _sse(self, run: Started, chat: bool, include_usage: bool
                   ) -> AsyncIterator[bytes]:
        rid, created = run.rid, run.created
        obj = "chat.completion.chunk" if chat else "text_completion"
        offset = 0  # completions' text_offset: characters of text before a chunk's tokens
        deltas = Deltas(run.names)  # chat: the text as content, or content and tool calls

        def event(payload: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(payload)}\n\n".encode()

        def chunk(delta: str | dict[str, Any] | None, finish: str | None,
                  first: bool = False, scores: Sequence[TokenLogprob] = ()) -> bytes:
            nonlocal offset
            if chat:
                d: dict[str, Any] = {"role": "assistant"} if first else {}
                d.update(delta or {})
                choice = {"index": 0, "delta": d, "finish_reason": finish,
                          "logprobs": {"content": self._chat_logprobs(scores), "refusal": None}
                          if scores else None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish,
                          "logprobs": self._completion_logprobs(scores, offset)
                          if scores else None}
                offset += len(delta or "")
            return event({"id": rid, "object": obj, "created": created, "model": self.model_name,
                          "choices": [choice]})

        try:
            if chat:
                yield chunk(None, None, first=True)
            async for item in self.runs.items(run):
                if isinstance(item, Exception):
                    _, kind, code, param = _failure(item)
                    yield event({"error": {"message": _failure_message(item), "type": kind,
                                           "param": param, "code": code}})
                    continue
                if isinstance(item, Generation):
                    if include_usage:  # the usage so far, also for an answer cut off
                        usage = event({"id": rid, "object": obj, "created": created,
                                       "model": self.model_name, "choices": [],
                                       "usage": self._usage(item)})
                    if item.finish_reason == "cancelled":
                        # Cut off by a shutdown: the usage, then an error event and no [DONE],
                        # so the client knows the text it has is not the whole answer.
                        if include_usage:
                            yield usage
                        yield event({"error": {
                            "message": cut_off(item),
                            "type": "server_error", "param": None, "code": "shutting_down"}})
                        return
                    if chat:
                        for d in deltas.finish():
                            yield chunk(d, None)
                    yield chunk(None, finish_reason(item.finish_reason, deltas.called > 0))
                    if include_usage:
                        yield usage
                    continue
                if not chat:
                    yield chunk(item.text, None, scores=item.scores)
                    continue
                # A piece's log probabilities ride with its first delta (or an empty one
                # while its text is held back as the possible start of a call).
                scores = item.scores
                for d in deltas.feed(item.text) or ([{}] if scores else []):
                    yield chunk(d, None, scores=scores)
                    scores = ()
            yield b"data: [DONE]\n\n"
        finally:
            # On a hang-up mid-stream this stops the generation (harmless after its end).
            run.cancel.set()

