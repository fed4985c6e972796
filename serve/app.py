"""The OpenAI-compatible HTTP routes of `ling-serve` (FastAPI) over a serving engine.

`create_app(engine, codec=..., model_name=..., api_key=...)` serves `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /v1/models`, `GET /health` and `GET /metrics` over any object
with the engine's surface (`config`, `max_len`, `submit`, `cancel`, `stats`: `ling_jax.engine`).

Requests: `model` (absent or the served name; another name is a 404), `max_tokens` (chat: also
`max_completion_tokens`), `temperature` (default 1; 0 = greedy), `top_p`, `seed`, `stop` (strings;
the text ends before the first match, finish_reason "stop"), `stream` (SSE chunks as OpenAI sends
them, ending in `data: [DONE]`; `stream_options.include_usage` adds a last chunk with `usage` and
no choices), `n` (1 only), `logprobs` (completions: top-n 0..5 -> `choices[i].logprobs` with
`tokens`, `token_logprobs`, `top_logprobs` (the top-n and the chosen token) and `text_offset`;
chat: `logprobs: true` and `top_logprobs` 0..5 in the chat format), `echo` (completions: the
prompt's text, and with `logprobs` its tokens, before the new ones; with `max_tokens` 0 only the
prompt is scored), and vLLM's extensions `top_k`, `ignore_eos`, `stop_token_ids` and
`return_token_ids` (`choices[i].token_ids`: the new tokens; completions also
`choices[i].prompt_token_ids`, chat a top-level `prompt_token_ids`; streamed: each chunk's new
tokens, the prompt's in the first chunk). Log-probabilities are of the model's unfiltered,
untempered distribution, floored at -9999.0 (JSON has no -inf).

Without a tokenizer (`codec` None) prompts must be token ids, the text of every output is empty,
`token_ids` carries the output (always, as if `return_token_ids` were set), logprob token strings
are "token_id:<id>", and chat and stop strings are refused (400).

Errors answer `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body (malformed
JSON and wrong field types included), 401 without the API key (every route but /health), 404 for
an unknown model or route, 503 while the engine's queue is full or the server drains, 500 where
the engine fails a request. A streamed request that fails after its first chunk ends with one
`data: {"error": ...}` event and `data: [DONE]`. A client that disconnects has its requests
cancelled (their slots freed): streamed ones when the stream's task is cancelled or closed,
others by a watcher of the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ling_jax.engine.request import MAX_LOGPROBS, QueueFull, RequestHandle, SamplingParams, TokenOutput
from serve.metrics import Metrics
from serve.protocol import APIError, ChatRequest, CompletionRequest
from serve.text import ChatTemplateError, OutputText, TextCodec

LOGPROB_FLOOR = -9999.0


@dataclasses.dataclass
class ServerState:
    """What the routes share. `draining`: new requests get 503 (set on SIGTERM); `inflight`: HTTP
    requests whose responses have not ended (streams included)."""

    engine: Any
    codec: TextCodec | None
    model_name: str
    api_key: str | None
    metrics: Metrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    draining: bool = False
    inflight: int = 0


# --- one choice: a handle's tokens as text pieces ---------------------------------------------
@dataclasses.dataclass
class _Piece:
    """New output since the last piece: text, tokens, their TokenOutputs and text offsets; the last
    piece of a choice has its finish_reason."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    outputs: list[TokenOutput] = dataclasses.field(default_factory=list)
    offsets: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    def extend(self, other: _Piece) -> None:
        self.text += other.text
        self.token_ids += other.token_ids
        self.outputs += other.outputs
        self.offsets += other.offsets
        self.finish_reason = other.finish_reason


class _Choice:
    """One submitted prompt: reads its handle, detokenizes, applies stop strings, reports metrics."""

    def __init__(self, state: ServerState, handle: RequestHandle, text: OutputText):
        self.state, self.handle, self.text = state, handle, text
        self.tokens: list[int] = []

    async def pieces(self) -> AsyncIterator[_Piece]:
        """Pieces as a stream may send them (one per token that completes text; every token without
        a tokenizer), then a last one with the finish reason. Cancels the request when a stop string
        matches and when the reader goes away first (cancelled or closed). APIError (503/500) where
        the engine cancelled or failed the request."""
        engine, handle = self.state.engine, self.handle
        reason = "cancelled"
        try:
            piece = _Piece()
            async for out in handle:
                piece.offsets.append(self.text.add(out.token_id))
                piece.token_ids.append(out.token_id)
                piece.outputs.append(out)
                self.tokens.append(out.token_id)
                if self.text.stopped:
                    break
                piece.text += self.text.take(final=False)
                if piece.text or self.text.codec is None:
                    yield piece
                    piece = _Piece()
            reason = "stop" if self.text.stopped else handle.finish_reason or "cancelled"
            if reason == "cancelled":
                raise APIError(503, f"the engine cancelled request {handle.id} (the server is shutting down)")
            if reason == "error":
                raise APIError(500, f"the engine failed request {handle.id}: {handle.error}")
            self.text.finish()
            piece.text += self.text.take(final=True)
            piece.finish_reason = reason
            yield piece
        finally:
            if not handle.finished:
                engine.cancel(handle)
            self.state.metrics.observe(handle, reason, len(self.tokens))

    async def collect(self) -> _Piece:
        whole = _Piece()
        async for piece in self.pieces():
            whole.extend(piece)
        return whole


async def _merge(choices: Sequence[_Choice]) -> AsyncIterator[tuple[int, _Piece]]:
    """(choice index, piece) of all choices as they come; the first APIError ends it (and the rest)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, c: _Choice) -> None:
        try:
            async for p in c.pieces():
                queue.put_nowait((i, p))
        except APIError as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:  # a choice still running: its pieces() cancels its request
            t.cancel()


async def _collect_all(request: Request, choices: Sequence[_Choice]) -> list[_Piece]:
    """Every choice's whole output; cancels them all if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def work() -> list[_Piece]:
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(c.collect()) for c in choices]
        except* APIError as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    job, watch = asyncio.create_task(work()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not job.done():
            job.cancel()
    if not job.done() or job.cancelled():
        raise APIError(499, "the client disconnected")
    return job.result()


# --- formats ------------------------------------------------------------------------------------
def _floor(x: float | None) -> float | None:
    return None if x is None else max(float(x), LOGPROB_FLOOR)


def _token_str(codec: TextCodec | None, token_id: int) -> str:
    return f"token_id:{token_id}" if codec is None else codec.token_text(token_id)


def _completion_logprobs(codec: TextCodec | None, ids: Sequence[int], outs: Sequence[TokenOutput | None],
                         offsets: Sequence[int]) -> dict[str, Any]:
    """OpenAI's completions logprobs. `outs[i]` None or without a logprob: null entries (a prompt's
    first token)."""
    tokens, lps, tops = [], [], []
    for t, out in zip(ids, outs, strict=True):
        s = _token_str(codec, t)
        tokens.append(s)
        if out is None or out.logprob is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(_floor(out.logprob))
        top = {_token_str(codec, a): _floor(lp) for a, lp in out.top_logprobs or ()}
        top.setdefault(s, _floor(out.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": list(offsets)}


def _chat_logprobs(codec: TextCodec | None, ids: Sequence[int], outs: Sequence[TokenOutput]) -> dict[str, Any]:
    def entry(t: int, lp: float | None) -> dict[str, Any]:
        s = _token_str(codec, t)
        return {"token": s, "logprob": _floor(lp), "bytes": list(s.encode())}

    return {"content": [entry(t, o.logprob) | {"top_logprobs": [entry(a, lp) for a, lp in o.top_logprobs or ()]}
                        for t, o in zip(ids, outs, strict=True)]}


def _usage(prompts: Sequence[Sequence[int]], choices: Sequence[_Choice]) -> dict[str, Any]:
    p, c = sum(map(len, prompts)), sum(len(ch.tokens) for ch in choices)
    cached = sum(ch.handle.cached_tokens for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chunker(head: dict[str, Any], usage_opt: bool) -> Callable[..., str]:
    """chunk(choices, **extra) -> one SSE event: `head` (id, object, created, model), the choices, and
    `usage` (null unless given in extra) where the request asked for usage in its stream."""

    def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> str:
        obj = {**head, "choices": choice_list, **extra}
        if usage_opt:
            obj.setdefault("usage", None)
        return _sse(obj)

    return chunk


class _SSEResponse(StreamingResponse):
    """A server-sent-events stream whose generator is closed however the response ends (a client
    gone mid-send included), so its requests are cancelled then."""

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


# --- request -> engine ------------------------------------------------------------------------
_SAMPLING_FIELD = re.compile(r"^(\w+)=")


def _check_common(state: ServerState, body: Any) -> list[str]:
    """The checks completions and chat share; returns the stop strings."""
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    if body.n != 1:
        raise APIError(400, f"n={body.n}: only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise APIError(400, f"{name} is not supported (only 0)", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(s == "" for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if stops and state.codec is None:
        raise APIError(400, "stop strings need a tokenizer (start ling-serve with --tokenizer); use stop_token_ids",
                       param="stop")
    return stops


def _submit(state: ServerState, prompts: Sequence[Sequence[int]], sampling: SamplingParams, stops: list[str],
            params: dict[str, str]) -> list[_Choice]:
    """Submits every prompt (all or none: a refused one cancels those before it). `params` maps
    SamplingParams field names to the request's names (for the error's param; "prompt" for the rest)."""
    engine = state.engine
    try:
        sampling.check(engine.config.vocab_size)
    except ValueError as e:
        field = m.group(1) if (m := _SAMPLING_FIELD.match(str(e))) else None
        raise APIError(400, str(e), param=params.get(field, field)) from None
    stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(engine.config.eos_token_id))
    choices: list[_Choice] = []
    try:
        for ids in prompts:
            handle = engine.submit(ids, sampling)
            choices.append(_Choice(state, handle, OutputText(state.codec, ids, stops, stop_ids)))
    except BaseException as e:
        for c in choices:
            engine.cancel(c.handle)
        if isinstance(e, QueueFull):
            raise APIError(503, f"the server is busy: {e}", code="queue_full") from None
        if isinstance(e, ValueError):
            raise APIError(400, str(e), param=params.get("prompt", "prompt")) from None
        if isinstance(e, RuntimeError):  # the engine stopped admitting (shutdown)
            raise APIError(503, f"the server is shutting down: {e}") from None
        raise
    return choices


def _completion_prompts(state: ServerState, prompt: Any) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) per prompt of a completions request."""
    items = [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)
    out = []
    for p in items:
        if isinstance(p, str):
            if state.codec is None:
                raise APIError(400, "text prompts need a tokenizer (start ling-serve with --tokenizer); send token "
                               "ids instead", param="prompt")
            out.append((state.codec.encode(p), p))
        else:
            out.append((list(p), None))
    return out


# --- the app --------------------------------------------------------------------------------------
class _Guard:
    """ASGI middleware: the API key, 503 while draining, and the count of HTTP requests in flight."""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, path = self.state, scope["path"]
        if st.api_key is not None and path != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), st.api_key.encode()):
                msg = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "incorrect API key"
                err = APIError(401, msg, code="invalid_api_key", type="authentication_error")
                return await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if st.draining and path != "/metrics":
            err = APIError(503, "the server is shutting down", code="shutting_down")
            return await JSONResponse(err.body(), 503)(scope, receive, send)
        st.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            st.inflight -= 1


_UNION_FIELDS = {  # fields of several accepted types: pydantic reports each alternative's failure
    "prompt": "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "stop must be a string or a list of strings",
}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in first.get("loc", ())][1:]  # drop "body"
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc:
        return APIError(400, f"the body must be a JSON object: {first['msg']}")
    if loc[0] in _UNION_FIELDS and first.get("type") != "missing":
        return APIError(400, _UNION_FIELDS[loc[0]], param=loc[0])
    return APIError(400, f"{'.'.join(loc)}: {first['msg']}", param=loc[0])


def create_app(engine: Any, *, codec: TextCodec | None = None, model_name: str = "ling",
               api_key: str | None = None) -> FastAPI:
    """The server's routes over `engine` (already started). `app.state.server` is the ServerState."""
    app = FastAPI(title="ling-serve", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServerState(engine, codec, model_name, api_key, Metrics(engine))
    app.state.server = state
    app.add_middleware(_Guard, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc)
        return JSONResponse(err.body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse(APIError(exc.status_code, msg).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), 500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state.created,
                                            "owned_by": "ling-jax", "max_model_len": engine.max_len}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        stops = _check_common(state, body)
        prompts = _completion_prompts(state, body.prompt)
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs={body.logprobs} must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        prompt_lp = body.logprobs if body.echo and body.logprobs is not None else 0 if body.max_tokens == 0 else None
        sampling = SamplingParams(
            max_tokens=body.max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
            seed=body.seed, stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos,
            logprobs=body.logprobs if body.max_tokens > 0 else None, prompt_logprobs=prompt_lp)
        choices = _submit(state, [ids for ids, _ in prompts], sampling, stops,
                          {"prompt_logprobs": "logprobs", "max_tokens": "max_tokens"})
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        with_ids = body.return_token_ids or codec is None

        def echo(i: int) -> tuple[str, dict[str, Any] | None]:
            """Choice i's prompt as echoed text and (with logprobs) its logprobs entries."""
            ids, text = prompts[i]
            lp = None
            if body.logprobs is not None:
                dec = OutputText(codec, [])
                offsets = [dec.add(t) for t in ids]
                outs = choices[i].handle.prompt_logprobs or [None] * len(ids)
                lp = _completion_logprobs(codec, ids, outs, offsets)
            return (text if text is not None else codec.decode(ids) if codec else ""), lp

        def choice(i: int, piece: _Piece, first: bool) -> dict[str, Any]:
            text, lp = piece.text, None
            if body.logprobs is not None and body.max_tokens > 0:
                lp = _completion_logprobs(codec, piece.token_ids, piece.outputs, piece.offsets)
            if body.echo and first:
                prompt_text, prompt_lp = echo(i)
                text = prompt_text + text
                if lp is not None:
                    shift = len(prompt_text)
                    lp["text_offset"] = [o + shift for o in lp["text_offset"]]
                if prompt_lp is not None:
                    lp = prompt_lp if lp is None else {k: prompt_lp[k] + lp[k] for k in prompt_lp}
            out: dict[str, Any] = {"index": i, "text": text, "logprobs": lp, "finish_reason": piece.finish_reason}
            if with_ids:
                out["token_ids"] = piece.token_ids
                if first:
                    out["prompt_token_ids"] = prompts[i][0]
            return out

        if not body.stream:
            pieces = await _collect_all(request, choices)
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                 "choices": [choice(i, p, True) for i, p in enumerate(pieces)],
                                 "usage": _usage([ids for ids, _ in prompts], choices)})

        usage_opt = body.stream_options is not None and body.stream_options.include_usage
        chunk = _chunker({"id": rid, "object": "text_completion", "created": created, "model": model_name}, usage_opt)

        async def events() -> AsyncIterator[str]:
            started = [False] * len(choices)
            try:
                async with contextlib.aclosing(_merge(choices)) as merged:
                    async for i, piece in merged:
                        yield chunk([choice(i, piece, not started[i])])
                        started[i] = True
                if usage_opt:
                    yield chunk([], usage=_usage([ids for ids, _ in prompts], choices))
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return _SSEResponse(events())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        stops = _check_common(state, body)
        if codec is None:
            raise APIError(400, "chat needs a tokenizer and its chat template (start ling-serve with --tokenizer); "
                           "use /v1/completions with token ids", param="messages")
        if not body.messages:
            raise APIError(400, "messages is empty", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={body.top_logprobs} must be in [0, {MAX_LOGPROBS}]",
                           param="top_logprobs")
        messages = []
        for m in body.messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                d["content"] = "".join(part.text for part in m.content)
            d.setdefault("content", "")
            messages.append(d)
        try:
            ids = codec.encode(codec.render_chat(messages), special=False)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = engine.max_len - len(ids)
            if max_tokens < 1:
                raise APIError(400, f"the messages take {len(ids)} tokens: the server's max_len {engine.max_len} "
                               "leaves no room for new tokens", param="messages")
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        (ch,) = _submit(state, [ids], sampling, stops,
                        {"max_tokens": max_name, "logprobs": "top_logprobs", "prompt": "messages"})
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(piece: _Piece, key: str, content: dict[str, Any]) -> dict[str, Any]:
            lp = body.logprobs and (piece.token_ids or key == "message")  # a stream's role chunk: null
            out = {"index": 0, key: content,
                   "logprobs": _chat_logprobs(codec, piece.token_ids, piece.outputs) if lp else None,
                   "finish_reason": piece.finish_reason}
            if body.return_token_ids:
                out["token_ids"] = piece.token_ids
            return out

        if not body.stream:
            (piece,) = await _collect_all(request, [ch])
            obj = {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                   "choices": [choice(piece, "message", {"role": "assistant", "content": piece.text})],
                   "usage": _usage([ids], [ch])}
            if body.return_token_ids:
                obj["prompt_token_ids"] = ids
            return JSONResponse(obj)

        usage_opt = body.stream_options is not None and body.stream_options.include_usage
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
        chunk = _chunker(head, usage_opt)

        async def events() -> AsyncIterator[str]:
            first = {"prompt_token_ids": ids} if body.return_token_ids else {}
            yield chunk([choice(_Piece(), "delta", {"role": "assistant", "content": ""})], **first)
            try:
                async with contextlib.aclosing(_merge([ch])) as merged:
                    async for _, piece in merged:
                        yield chunk([choice(piece, "delta", {"content": piece.text} if piece.text else {})])
                if usage_opt:
                    yield chunk([], usage=_usage([ids], [ch]))
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return _SSEResponse(events())

    return app
