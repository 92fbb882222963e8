"""OpenAI-compatible HTTP front end (FastAPI on uvicorn), beside the gRPC server in the same
process and event loop, on the same :class:`EngineService` (one engine for both).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as
server-sent events in OpenAI's chunk format, ending ``data: [DONE]``;
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
``POST /tokenize``, ``POST /detokenize``. Errors are OpenAI error objects: 400 bad parameter
or prompt too long, 401 without the API key (``Authorization: Bearer KEY``, on ``/v1/*``
and the tokenizer routes), 404 unknown model, 429 waiting queue full, 503 shutting down,
504 past ``--request-timeout``. A client that disconnects aborts its request.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import logging
import math
import re
import socket
import time
import uuid
from contextlib import ExitStack, nullcontext

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_llm import Admission, QueueFullError, tokenizing_size
from . import openai_protocol as oa
from .auth import bearer_token, key_matches
from .engine_service import Accumulator, EngineService, ErrorKind, RequestBatch, classify, position_logprobs

log = logging.getLogger("trtllm_lite.serving")
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")
_GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


MAX_LOGGED_FIELDS, MAX_LOGGED_NAME = 16, 64


def ignored_fields_text(names: list[str]) -> str:
    """Unknown request field names for the log: each as a Python literal (``repr``: a newline
    or control character in a client's name cannot forge a log line), the literal cut to
    ``MAX_LOGGED_NAME`` characters, at most ``MAX_LOGGED_FIELDS`` of them, so a 16 MB name or
    thousands of fields give one line of at most ~1.1 KB."""
    names = sorted(names)
    shown = [_cut(repr(n[:MAX_LOGGED_NAME + 1]), MAX_LOGGED_NAME) for n in names[:MAX_LOGGED_FIELDS]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def union_member_error(errors: list[dict]) -> dict:
    """The error to report from pydantic's ``errors`` for a request: the first, except where
    a field of several forms (a chat message's ``content``: a string or a list of parts) failed
    as a string on input that is not one: then the error of the next form at the same field
    (a part without ``type`` is reported as that, not as "Input should be a valid string")."""
    first = errors[0]
    if first.get("type") != "string_type" or isinstance(first.get("input"), str) or len(first.get("loc", ())) < 2:
        return first
    field = tuple(first["loc"][:-1])   # (..., field, member tag "str")
    return next((e for e in errors[1:] if tuple(e.get("loc", ())[:len(field)]) == field
                 and len(e["loc"]) > len(field) and e["loc"][len(field)] != first["loc"][-1]), first)


class NotFound(LookupError):
    pass


class ClientDisconnected(Exception):
    """The client went away before its response was ready (its requests were aborted)."""


_EMPTY_BODY = "the body is empty: send a JSON object of the request's fields"


def _json_media_type(content_type: str) -> bool:
    """Whether a Content-Type is JSON's, as FastAPI reads a body as JSON: ``application/json``
    or ``application/*+json`` (parameters such as ``charset`` aside; ``text/json`` is not)."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# nginx's "client closed request": the status of a response no client reads (the server keeps
# no access log; the request counts as "cancelled" in the request outcomes)
CLIENT_CLOSED_REQUEST = 499


def error_response(e: BaseException, prompt_field: str = "prompt") -> JSONResponse:
    """The OpenAI error object and HTTP status of an exception raised serving a request;
    ``prompt_field``: the request field a "prompt ..." error names (a chat request's is
    ``messages``)."""
    status = 404 if isinstance(e, NotFound) else CLIENT_CLOSED_REQUEST if isinstance(e, ClientDisconnected) \
        else classify(e).http
    message = str(e) or type(e).__name__
    first = message.split(" ", 1)[0].rstrip(":,")
    # a bad parameter's message starts with its name, or a part of it ("messages[1].content":
    # the request field is "messages"); others ("the engine is shutting down") name none (a
    # 503's param was "the")
    field = re.match(r"[a-z_][a-z0-9_]*(?=$|\[|\.)", first)
    param = field[0] if status == 400 and field else None
    param = prompt_field if param == "prompt" else param
    return JSONResponse(oa.error_body(status, message, param), status_code=status)


class Guard:
    """ASGI middleware: API key on protected routes; 503 while shutting down; 413 for a request
    body over ``max_body_bytes`` (the gRPC message limit: ``ServerConfig.max_message_bytes``),
    refused before it is parsed (the body is read here, then handed to the route)."""

    def __init__(self, app, service: EngineService, api_key: str | None, max_body_bytes: int | None = None):
        self.app, self.service, self.api_key, self.max_body_bytes = app, service, api_key, max_body_bytes

    def _too_large(self) -> JSONResponse:
        return JSONResponse(oa.error_body(413, f"request body is larger than {self.max_body_bytes} bytes "
                                               "(--max-message-bytes)"), 413)

    async def _bounded(self, scope, receive, send):
        """Read the body up to the limit (413 past it), then replay it to the app."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large()(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":   # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._too_large()(scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()   # later: the disconnect, for streaming routes

        return await self.app(scope, replay, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        denied = None
        if self.api_key and path.startswith(_PROTECTED):
            # one Authorization header (RFC 9110 section 5.3: a repeated one is malformed; the
            # last one decided before)
            auths = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
            if len(auths) != 1 or not key_matches(bearer_token(auths[0]), self.api_key):
                denied = JSONResponse(oa.error_body(401, "missing or wrong API key (Authorization: Bearer KEY)"), 401)
        if denied is None and path != "/metrics" and not self.service.llm.accepting:
            denied = JSONResponse(oa.error_body(503, "the server is shutting down"), 503)
        if denied is not None:
            return await denied(scope, receive, send)
        if self.max_body_bytes is not None and scope.get("method") == "POST":
            return await self._bounded(scope, receive, send)
        return await self.app(scope, receive, send)


def served(error: BaseException) -> bool:
    """Whether a request that ended with ``error`` had been taken by the engine (it timed out,
    its client left, or a step failed), not refused (a bad parameter, a full queue, shutdown)."""
    return isinstance(error, ClientDisconnected) or classify(error) in (ErrorKind.DEADLINE_EXCEEDED,
                                                                        ErrorKind.INTERNAL)


async def until_disconnected(request: Request, coro):
    """Await ``coro``; if the client disconnects first, cancel it (aborting its requests: the
    engine frees their blocks), wait for it to end, and raise :class:`ClientDisconnected`."""
    work = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected("the client disconnected")
    return work.result()


async def merged(gens: list, batch: RequestBatch | None = None):
    """Items of several async generators as they come: ``(generator index, item)``; the first
    error ends them all (``batch`` is marked failed first)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - hand the error to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                if batch is not None:
                    batch.end(item)
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(obj) -> str:
    import json

    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServer:
    """The routes, over one :class:`EngineService`."""

    def __init__(self, service: EngineService, api_key: str | None = None, max_body_bytes: int | None = None):
        self.service = service
        app = FastAPI(title="trtllm-lite", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(RequestValidationError, self._invalid)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_middleware(Guard, service=service, api_key=api_key, max_body_bytes=max_body_bytes)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        self.app = app

    async def _invalid(self, request, exc: RequestValidationError):
        if request.url.path in _GENERATION_ROUTES:   # a malformed generation request
            self.service.metrics.record_failed("invalid_argument")
        errors = exc.errors() or [{}]
        err = union_member_error(errors)
        msg = err.get("msg", "invalid request")
        if err.get("type") == "json_invalid":
            if isinstance(exc.body, str) and not exc.body.strip():   # (FastAPI's body here: the text it decoded)
                return JSONResponse(oa.error_body(400, _EMPTY_BODY), status_code=400)
            loc = [x for x in err.get("loc", ()) if x != "body"]
            at = f" at character {loc[0]}" if loc else ""
            return JSONResponse(oa.error_body(400, f"the body is not valid JSON{at}: {msg}"), status_code=400)
        content_type = request.headers.get("content-type", "").lower()   # (media types are case-insensitive)
        if list(err.get("loc", ())) == ["body"] and err.get("type") == "missing" and "json" in content_type:
            return JSONResponse(oa.error_body(400, _EMPTY_BODY), status_code=400)
        if list(err.get("loc", ())) == ["body"] and not _json_media_type(content_type):   # e.g. curl -d: a form body
            return JSONResponse(oa.error_body(400, f"the body must be a JSON object sent as application/json "
                                                   f"(Content-Type here: {content_type or 'none'})"), status_code=400)
        # loc is (body, field, [index | nested field | pydantic's union member tag]...): the
        # top-level field is the parameter; a union member tag ("str", "list[str]") is dropped
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        path = [loc[0]] + [x for x in loc[1:] if x.isdigit() or x in oa.FIELD_NAMES] if loc else []
        message = f"{'.'.join(path) or 'body'}: {msg}"
        forms = {"prompt": oa.PROMPT_FORMS, "stop": oa.STOP_FORMS}
        if loc and loc[0] in forms and len(loc) > 1 and not loc[1].isdigit():   # no member of the union fits
            message = f"{loc[0]}: {forms[loc[0]]}"
        kind = err.get("type")
        if len(loc) == 4 and loc[0] == "messages" and loc[2] == "content" and not loc[3].isdigit() \
                and kind in ("string_type", "list_type"):   # content neither a string nor a list
            message = f"{'.'.join(path)}: {oa.CONTENT_FORMS}"
        elif loc[:1] == ["messages"] and "content" in loc and kind in ("model_type", "model_attributes_type"):
            message = f"{'.'.join(path)}: {oa.CONTENT_PART_FORM}"   # a part that is not an object
        return JSONResponse(oa.error_body(400, message, loc[0] if loc else None), status_code=400)

    @staticmethod
    async def _http_error(request, exc: StarletteHTTPException):
        """Unknown route (404), wrong method (405), ...: the OpenAI error shape too. A body
        FastAPI cannot decode (its generic 400 "There was an error parsing the body") is
        named: bytes that are not UTF-8 (RFC 8259 section 8.1; Python's JSON reader also takes
        UTF-16 and UTF-32 with their byte order marks), or what Python's JSON reader refused
        (a number past its 4,300 digits, nesting past its recursion limit)."""
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            body = await request.body()
            try:
                json.loads(body)
            except UnicodeDecodeError as e:
                # (the encoding Python's reader took: UTF-8, or UTF-16/32 from a byte order mark)
                encoding = e.encoding.upper().removesuffix("-LE").removesuffix("-BE")
                message = f"the body is not valid {encoding}: byte {e.start}: {e.reason}"
            except RecursionError:   # (Python's own message names its interpreter, not the body)
                message = "the body could not be read as JSON: its arrays and objects nest too deeply"
            except ValueError as e:
                message = f"the body could not be read as JSON: {str(e)[:200]}"
        return JSONResponse(oa.error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    def _check_body(self, body) -> list[str]:
        """Raise :class:`NotFound` for another model's name; return the body's unknown fields.

        Unknown fields are ignored, as vLLM and OpenAI tolerate the extras client libraries
        send; like vLLM, the server logs their names once per request it serves
        (:meth:`_log_ignored`: a stream's once every prompt's first output came, a whole
        answer's once it is ready, or when a request the engine took times out, fails or loses
        its client; a request refused, for its parameters or by the engine's own checks, logs
        none: its error says what was wrong), so a misspelt option (``max_token``) is visible
        in the log rather than silently served at its default."""
        if body.model is not None and body.model != self.service.model_name:
            raise NotFound(f"model {body.model!r} does not exist; this server serves {self.service.model_name!r}")
        checked = getattr(body, "checked_extras", ())   # (sampling requests read some extras)
        ignored = [name for name in body.model_extra or () if name not in checked]
        options = getattr(body, "stream_options", None)
        if options is not None and options.model_extra:
            ignored += [f"stream_options.{name}" for name in options.model_extra]
        for i, message in enumerate(getattr(body, "messages", None) or ()):   # (the template gets role, content)
            ignored += [f"messages[{i}].{name}" for name in message.model_extra or ()]
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if part.type == "text":   # other parts (image_url, ...) are refused, their fields with them
                    ignored += [f"messages[{i}].content[{j}].{name}" for name in part.model_extra or ()]
        return ignored

    @staticmethod
    def _log_ignored(ignored: list[str]) -> None:
        if ignored:
            log.warning("request fields ignored (not part of the API): %s", ignored_fields_text(ignored))

    # -- simple routes --------------------------------------------------------------------
    async def health(self):
        return Response(status_code=200 if self.service.llm.accepting and not self.service.llm.dead else 503)

    async def metrics(self):
        return Response(self.service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self):
        return {"object": "list", "data": [{
            "id": self.service.model_name, "object": "model", "created": int(time.time()), "owned_by": "trtllm-lite",
            "max_model_len": self.service.llm.engine.max_model_len}]}

    async def tokenize(self, body: oa.TokenizeRequest):
        try:
            ignored = self._check_body(body)
            if body.messages is not None and body.prompt is not None:
                raise ValueError("prompt and messages: send one or the other, not both")
            if body.messages is not None:
                messages = oa.message_dicts(body.messages)
                ids = await self.service.llm.tokenizing(self.service.chat_prompt, messages, body.add_generation_prompt,
                                                        size=self.service.chat_size(messages))
            elif body.prompt is not None:
                ids = await self.service.llm.tokenizing(self.service.tokenize_text, body.prompt,
                                                        body.add_special_tokens, size=tokenizing_size([body.prompt]))
            else:
                raise ValueError("prompt or messages is required")
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        self._log_ignored(ignored)
        # encoded on a worker thread, as a generation's answer: text within the character limit
        # can be ~1.8M token ids, and FastAPI's jsonable_encoder held the event loop ~5 s on them
        # after the tokenizing had been moved off it (QA 15)
        body = {"tokens": ids, "count": len(ids), "max_model_len": self.service.llm.engine.max_model_len}
        return await asyncio.to_thread(JSONResponse, body)

    async def detokenize(self, body: oa.DetokenizeRequest):
        try:
            ignored = self._check_body(body)
            text = self.service.detokenize(body.tokens, body.skip_special_tokens, name="tokens")
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        self._log_ignored(ignored)
        return {"prompt": text}

    # -- generation -----------------------------------------------------------------------
    async def _start(self, prompts: list, params: list, rid: str, cache_salt: str | None, batch: RequestBatch,
                     admission: Admission):
        """Start one request per prompt (``params[i]`` for ``prompts[i]``) and wait for each
        one's first delta, so that bad input, a full queue or a shutdown is an HTTP error before
        any byte is streamed."""
        gens = [self.service.generate(p, params[i], f"{rid}-{i}", cache_salt=cache_salt, batch=batch,
                                      admission=admission)
                for i, p in enumerate(prompts)]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        try:
            firsts = await asyncio.gather(*tasks)
        except BaseException as e:
            batch.end(e)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                await g.aclose()
            raise
        batch.commit()   # every prompt started: the call's outputs go to the client
        return gens, firsts

    async def _run(self, request: Request, body, prompts: list, params: list, kind: str, prompt_texts: list,
                   admission: Admission, ignored: list[str]):
        """Serve ``prompts`` (one ``SamplingParams`` each, in ``params``) as one response, the
        request taken by ``admission`` (AsyncLLM.admit) when it came; ``ignored`` (its unknown
        fields) are logged once the request is served: a stream's once every prompt's first
        output came, a whole answer's once it is ready (the engine's own checks, e.g. of the
        prompt's length, refuse a request as it is added, before any output)."""
        rid = ("cmpl-" if kind == "text" else "chatcmpl-") + uuid.uuid4().hex
        created = int(time.time())
        fmt = ResponseFormat(self.service, body, kind, rid, created, params[0].n, prompt_texts)
        batch = RequestBatch()
        if body.stream:   # a client that leaves during the prompt is noticed then, not at its first token
            gens, firsts = await until_disconnected(
                request, self._start(prompts, params, rid, body.cache_salt, batch, admission))
            self._log_ignored(ignored)
            return StreamingResponse(fmt.stream(gens, firsts, batch), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def run_all():
            tasks = [asyncio.ensure_future(self.service.generate_all(p, params[i], f"{rid}-{i}",
                                                                      cache_salt=body.cache_salt, batch=batch,
                                                                      admission=admission))
                     for i, p in enumerate(prompts)]
            try:
                results = await asyncio.gather(*tasks)
                batch.commit()
                return results
            except BaseException as e:
                batch.end(e)   # one prompt failed (or the client left): end every prompt of the batch
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        accs = await until_disconnected(request, run_all())
        self._log_ignored(ignored)
        # built and encoded on a worker thread (pure Python, but the GIL passes to the event loop
        # every 5 ms there): 4 x 2,000 tokens with 20 logprobs each (4.4 MB of JSON) held the loop
        # ~1.5 s (QA D: up to 6.2 s); a JSONResponse skips FastAPI's jsonable_encoder (~half of it)
        return await asyncio.to_thread(lambda: JSONResponse(fmt.whole(accs)))

    def _rejected(self, e: BaseException, prompt_field: str = "prompt") -> JSONResponse:
        """A generation request refused before it reached the engine (its model, prompt or
        parameters): counted in the request outcomes as gRPC's are, then the HTTP error
        (:func:`error_response`)."""
        self.service.metrics.record_failed("invalid_argument" if isinstance(e, NotFound)
                                           else classify(e).name.lower())
        return error_response(e, prompt_field)

    async def completions(self, body: oa.CompletionRequest, request: Request):
        with ExitStack() as held:   # admitted: a drain waits for it while its text is tokenized
            try:
                ignored = self._check_body(body)
                admission = held.enter_context(self.service.llm.admit())
                prompts = body.prompts()
                limit = self.service.llm.max_waiting_requests
                if limit is not None and len(prompts) > max(limit, 1):
                    # one request per prompt, all queued at once: more than the queue holds is never
                    # taken whole, and starting each (20,000 of them) held the event loop ~14 s
                    raise ValueError(f"prompt has {len(prompts)} prompts: more than max_waiting_requests "
                                     f"({limit}) can queue at once")
                if limit is not None and len(prompts) > 1 and len(prompts) * body.n > limit:
                    # each prompt runs n sequences: 256 prompts x n 64 (a 2 KB body) queued 16,384
                    # sequences, and a request behind them waited 87 s (QA). A batch may hold at
                    # most what the queue holds, counted in sequences
                    raise ValueError(f"prompt has {len(prompts)} prompts x n {body.n} = {len(prompts) * body.n} "
                                     f"sequences: more than max_waiting_requests ({limit}) can queue at once")
                waiting = self.service.llm.num_waiting_requests()
                if limit is not None and len(prompts) > 1 and waiting + len(prompts) > limit:
                    # all or none: queueing the prompts that fit, then ending them with the batch,
                    # held places in the queue that other clients were refused meanwhile (QA)
                    raise QueueFullError(f"waiting queue has room for {max(limit - waiting, 0)} requests, "
                                         f"and prompt has {len(prompts)} prompts")
                # a token-id prompt echoed with its special tokens' text, as vLLM echoes it and as
                # its logprobs' text_offset counts them (QA: skipped, every offset after one drifted)
                texts = [p if isinstance(p, str) else self.service.tokenizer.decode(p, skip_special_tokens=False)
                         for p in prompts] if body.echo else None
                rooms = [None] * len(prompts)
                if body.max_tokens is None:   # a null max_tokens: what is left after each prompt (vLLM)
                    prompts = [await self.service.prepare(self.service.tokenize_text, p, size=tokenizing_size([p]),
                                                          admission=admission)
                               if isinstance(p, str) else p for p in prompts]
                    rooms = [self.service.llm.engine.max_model_len - len(p) for p in prompts]
                params = [self.service.sampling_params(body.sampling_values(room)) for room in rooms]
            except Exception as e:  # noqa: BLE001
                return self._rejected(e)
            try:   # errors from here on are counted where the engine raises them (engine_service)
                return await self._run(request, body, prompts, params, "text", texts, admission, ignored)
            except Exception as e:  # noqa: BLE001 - every request error becomes an HTTP status
                if served(e):   # it ran, then timed out, failed or lost its client: say what was ignored
                    self._log_ignored(ignored)
                return error_response(e)

    async def chat(self, body: oa.ChatCompletionRequest, request: Request):
        with ExitStack() as held:   # admitted: a drain waits for it while its text is tokenized
            try:
                ignored = self._check_body(body)
                admission = held.enter_context(self.service.llm.admit())
                messages = body.message_dicts()
                ids = await self.service.prepare(self.service.chat_prompt, messages, body.add_generation_prompt,
                                                 size=self.service.chat_size(messages), admission=admission)
                engine = self.service.llm.engine
                values = body.sampling_values(engine.max_model_len - len(ids))
                if body.max_completion_tokens is not None:   # the engine's check, naming the field as sent
                    engine.scheduler.check_room(len(ids), body.max_completion_tokens, "max_completion_tokens")
                params = self.service.sampling_params(values)
            except Exception as e:  # noqa: BLE001
                return self._rejected(e, "messages")
            try:
                return await self._run(request, body, [ids], [params], "chat", None, admission, ignored)
            except Exception as e:  # noqa: BLE001
                if served(e):   # it ran, then timed out, failed or lost its client: say what was ignored
                    self._log_ignored(ignored)
                return error_response(e, "messages")


class ResponseFormat:
    """OpenAI response and chunk objects for one request (``kind``: "text" or "chat")."""

    def __init__(self, service, body, kind, rid, created, n, prompt_texts):
        self.service, self.body, self.kind, self.rid, self.created, self.n = service, body, kind, rid, created, n
        self.prompt_texts = prompt_texts
        # echo with max_tokens 0: the prompt alone; the one token generated is left out
        self.echo_only = kind == "text" and getattr(body, "echo_only", False)
        self._text_offsets: dict[int, TextOffsets] = {}   # choice index -> its logprobs' text so far (streaming)
        self.object = "text_completion" if kind == "text" else "chat.completion"

    def _base(self, chunk: bool) -> dict:
        obj = self.object + (".chunk" if chunk and self.kind == "chat" else "")
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.service.model_name}

    def usage(self, accs: list[Accumulator]) -> dict:
        p = sum(a.num_prompt_tokens for a in accs)
        c = 0 if self.echo_only else sum(a.num_completion_tokens for a in accs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(a.num_cached_tokens for a in accs)}}

    def _logprobs(self, o, index: int, echoed=None):
        """``o``'s logprobs in the route's shape, or None when none were asked for.
        ``echoed``: the ``RequestOutput`` whose prompt a completion echoes in this piece of the
        choice; with it, the prompt's tokens come first (the first with a null logprob and
        top_logprobs, as vLLM). ``text_offset`` goes on from the choice's previous piece."""
        if getattr(o, "logprobs", None) is None:
            return None
        tok = self.service.llm.tokenizer

        def text(t, lp):
            if lp is not None and lp.decoded_token is not None:
                return lp.decoded_token
            # the token's own bytes as text (a SentencePiece token keeps its space, which decoding
            # it alone strips; QA): the tokens join to the text, and text_offset follows it
            return tok.token_bytes(t).decode("utf-8", "replace") if tok else str(t)

        positions = [] if self.echo_only else position_logprobs(o.token_ids, o.logprobs)
        if self.kind == "chat":
            def raw(t, s):   # the token's own bytes: part of a character where its text is U+FFFD
                return list(tok.token_bytes(t)) if tok else list(s.encode())
            content = []
            for t, lp, top in positions:
                s = text(t, dict(top).get(t))
                alts = [{"token": text(k, v), "logprob": _num(v.logprob), "bytes": raw(k, text(k, v))}
                        for k, v in top][:self.body.top_logprobs or 0]
                content.append({"token": s, "logprob": _num(lp), "bytes": raw(t, s), "top_logprobs": alts})
            return {"content": content}
        generated = len(positions)
        if echoed is not None and echoed.prompt_logprobs is not None:
            positions = position_logprobs(echoed.prompt_token_ids, echoed.prompt_logprobs) + positions
        # generated special tokens the text leaves out (skip_special_tokens) take no room in it
        skipped = tok.special_token_ids if tok and self.body.skip_special_tokens is not False else frozenset()
        tokens, lps, tops, offsets = [], [], [], []
        counter = self._text_offsets.setdefault(index, TextOffsets())
        for position, (t, lp, top) in enumerate(positions):
            s = text(t, dict(top).get(t))
            # the top `logprobs: N` plus the chosen token, as vLLM caps them: an echoed prompt
            # token holds the top `prompt_logprobs`, which may be more
            top = [(k, v) for i, (k, v) in enumerate(top) if i < self.body.logprobs or k == t]
            offsets.append(counter.offset)
            in_text = not (t in skipped and position >= len(positions) - generated)
            counter.advance((tok.token_bytes(t) if tok else s.encode()) if in_text else b"")
            tokens.append(s)
            lps.append(_num(lp))
            tops.append({text(k, v): _num(v.logprob) for k, v in top} if top else None)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, index: int, text: str, o, chunk: bool, echoed=None) -> dict:
        finish = "length" if self.echo_only and o.finish_reason else o.finish_reason
        choice = {"index": index}
        if self.kind == "text":
            choice["text"] = text
        elif chunk:   # (the role went first, in a chunk of its own)
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice.update(logprobs=self._logprobs(o, index, echoed), finish_reason=finish,
                      stop_reason=o.stop_reason if finish == "stop" else None)
        return choice

    def whole(self, accs: list[Accumulator]) -> dict:
        """The non-streamed answer. The prompt's logprobs, when the engine computed them
        (``prompt_logprobs``, or completions' ``echo`` with ``logprobs``), go where vLLM puts
        them: each completion choice's ``prompt_logprobs``, the chat response's own."""
        choices = []
        for i, acc in enumerate(accs):
            for s in acc.results():
                text = (self.prompt_texts[i] + ("" if self.echo_only else s.text)) if self.prompt_texts else s.text
                choice = self._choice(i * self.n + s.index, text, s, chunk=False,
                                      echoed=acc.last if self.prompt_texts else None)
                if self.kind == "text":
                    choice["prompt_logprobs"] = prompt_logprobs_json(acc.last)
                choices.append(choice)
        extra = {"prompt_logprobs": prompt_logprobs_json(accs[0].last)} if self.kind == "chat" else {}
        return {**self._base(False), "choices": choices, "usage": self.usage(accs), **extra}

    async def stream(self, gens, firsts, batch: RequestBatch | None = None):
        accs = [Accumulator() for _ in gens]
        started: set[int] = set()
        try:
            for i, out in enumerate(firsts):
                for chunk in self._chunks(i, out, accs, started):
                    yield chunk
            async with _closing_all(gens):
                async for i, out in merged(gens, batch):
                    for chunk in self._chunks(i, out, accs, started):
                        yield chunk
            if self.body.include_usage:
                yield _sse({**self._base(True), "choices": [], "usage": self.usage(accs)})
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            yield _sse(oa.error_body(classify(e).http, str(e) or type(e).__name__))
        yield "data: [DONE]\n\n"

    def _chunks(self, i: int, out, accs: list[Accumulator], started: set[int]):
        """The SSE chunks of prompt ``i``'s output ``out``; ``accs``: every prompt's counts so far."""
        accs[i].add(out)
        options = self.body.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats
        for o in out.outputs:
            index = i * self.n + o.index
            first = index not in started
            if first and self.kind == "chat":   # vLLM's first chunk of a choice: the role alone
                started.add(index)
                role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None, "stop_reason": None}
                chunk = {**self._base(True), "choices": [role]}
                if continuous:   # vLLM's role chunk: no completion tokens sent yet (QA: it counted them)
                    usage = self.usage(accs)
                    chunk["usage"] = dict(usage, completion_tokens=0, total_tokens=usage["prompt_tokens"])
                yield _sse(chunk)
                first = False
            text = "" if self.echo_only else o.text
            if first and self.prompt_texts:
                text = self.prompt_texts[i] + text
            # a token whose text is held back (it may begin a stop string, or ends inside a
            # character) still gets a chunk when it has logprobs: they would be lost otherwise
            if not text and not o.finish_reason and (not o.logprobs or self.echo_only):
                continue
            started.add(index)
            echoed = out if first and self.prompt_texts else None
            chunk = {**self._base(True), "choices": [self._choice(index, text, o, chunk=True, echoed=echoed)]}
            if continuous:
                chunk["usage"] = self.usage(accs)   # vLLM's: the counts so far on every chunk
            yield _sse(chunk)


class TextOffsets:
    """Completions' ``text_offset``: where each token starts in the choice's text, in characters.
    The tokens' bytes are decoded incrementally, so a token that holds part of a character
    starts at that character, and the tokens after it where they are in the text (QA: counting
    each token's own text, U+FFFD for part of a character, drifted past such tokens)."""

    def __init__(self):
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, token_bytes: bytes) -> None:
        """Past a token's bytes: the characters they complete."""
        self.offset += len(self._decoder.decode(token_bytes))


def _num(x):
    """A logprob for JSON, which has no -Infinity: NaN (none) is null; -inf (a token that
    top_k, top_p or min_p ruled out of the distribution sampled from) is -9999.0, as vLLM and
    OpenAI write it."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return max(x, -9999.0)


def prompt_logprobs_json(out) -> list | None:
    """``out.prompt_logprobs`` in vLLM's JSON shape: per prompt token, null for the first, else
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token and the
    top-N (-inf as -9999.0, as vLLM clamps it); None when none were computed."""
    if out is None or out.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": _num(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()}
            for entry in out.prompt_logprobs]


class _closing_all:
    """Close every generator on exit (aborting unfinished requests at once)."""

    def __init__(self, gens):
        self.gens = gens

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for g in self.gens:
            try:
                await g.aclose()
            except RuntimeError:  # still running in a cancelled task: it closes itself
                pass


class HttpFrontEnd:
    """The HTTP server's life: :meth:`start` binds and serves; :meth:`stop` drains."""

    def __init__(self, service: EngineService, config):
        import uvicorn

        self.config = config
        self.openai = OpenAIServer(service, config.api_key, config.max_message_bytes)
        self.uvicorn_config = uvicorn.Config(
            self.openai.app, log_level="warning", access_log=False, lifespan="off",
            ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
            timeout_graceful_shutdown=1)

        class _Server(uvicorn.Server):
            def capture_signals(self):  # the serving process owns SIGTERM / SIGINT
                return nullcontext()

        self.server = _Server(self.uvicorn_config)
        self.task: asyncio.Task | None = None

    async def start(self) -> str:
        """Bind ``host:http_port`` (0: a free port), serve; return ``host:port``."""
        c = self.config
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((c.host, c.http_port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot listen on {c.host}:{c.http_port} for HTTP (--http-port in use?): "
                          f"{e.strerror}") from None
        sock.set_inheritable(True)
        self.task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return f"{c.host}:{sock.getsockname()[1]}"

    async def stop(self, grace: float) -> None:
        """Keep listening, answering 503, while in-flight requests (of every front end)
        finish, for at most ``grace`` seconds; then close (cancelling what is left)."""
        await self.openai.service.llm.drain(grace)
        self.server.should_exit = True
        if self.task is not None:
            try:
                await asyncio.wait_for(self.task, grace + 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass


__all__ = ["HttpFrontEnd", "OpenAIServer"]
