"""The ``trtllm_lite.v1.LLMService`` servicer (``protos/llm_service.proto``) on ``grpc.aio``."""
from __future__ import annotations

import json
import uuid
from contextlib import ExitStack

import grpc

from ..async_llm import tokenizing_size
from .engine_service import Accumulator, EngineService, ErrorKind, classify, position_logprobs
from .params import SAMPLING_FIELDS
from .protos import llm_service_pb2 as pb
from .protos import llm_service_pb2_grpc as pb_grpc

_MAP_FIELDS = {"logit_bias"}
_REPEATED_FIELDS = {"stop", "stop_token_ids", "bad_words"}


def sampling_values(msg: pb.SamplingParams) -> dict:
    """The fields a client set in a ``SamplingParams`` message, under vLLM names."""
    values = {}
    for name in SAMPLING_FIELDS:
        if name in _MAP_FIELDS:
            if len(getattr(msg, name)):
                values[name] = dict(getattr(msg, name))
        elif name in _REPEATED_FIELDS:
            if len(getattr(msg, name)):
                values[name] = list(getattr(msg, name))
        elif msg.HasField(name):
            values[name] = getattr(msg, name)
    return values


def check_seed(values: dict) -> dict:
    """``values`` (from :func:`sampling_values`), with a negative ``seed`` refused in the terms
    of our proto: its ``seed`` is an int64, so of the seeds ``SamplingParams`` takes, [0, 2**64),
    a gRPC client can send [0, 2**63); ``SamplingParams``' own message would name uint64.

    Raises:
        ValueError: ``seed`` is negative (the message names it and that range).
    """
    seed = values.get("seed")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be an integer in [0, 2**63) (the non-negative values of the int64 field), "
                         f"got {seed}")
    return values


def sampling_message(**values) -> pb.SamplingParams:
    """A ``SamplingParams`` message from vLLM-named keyword arguments (None: unset).

    Raises:
        ValueError: an unknown parameter name, or a value the message's field cannot hold
            (its type or range, e.g. ``max_tokens`` past int32), naming the parameter.
    """
    msg = pb.SamplingParams()
    for name, value in values.items():
        if value is None:
            continue
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"unknown sampling parameter {name!r}")
        try:
            if name in _MAP_FIELDS:
                getattr(msg, name).update({int(k): float(v) for k, v in value.items()})
            elif name in _REPEATED_FIELDS:
                getattr(msg, name).extend([value] if isinstance(value, str) else value)
            else:
                setattr(msg, name, value)
        except (TypeError, ValueError, AttributeError) as e:   # protobuf's own messages name no field
            raise ValueError(f"sampling parameter {name}={value!r:.100}: {e}") from None
    return msg


def _logprobs_pb(token_ids, entries) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=k, logprob=v.logprob) for k, v in top])
            for t, lp, top in position_logprobs(token_ids, entries)]


def _completion_pb(o, with_logprobs: bool) -> pb.CompletionOutput:
    msg = pb.CompletionOutput(index=o.index, text=o.text, token_ids=o.token_ids,
                              finish_reason=o.finish_reason or "")
    if isinstance(o.stop_reason, str):
        msg.stop_string = o.stop_reason
    elif o.stop_reason is not None:
        msg.stop_token_id = int(o.stop_reason)
    if with_logprobs and o.logprobs:
        msg.logprobs.extend(_logprobs_pb(o.token_ids, o.logprobs))
    return msg


def _final_fields(resp: pb.GenerateResponse, acc: Accumulator) -> None:
    resp.usage.CopyFrom(pb.Usage(prompt_tokens=acc.num_prompt_tokens,
                                 completion_tokens=acc.num_completion_tokens,
                                 cached_tokens=acc.num_cached_tokens))
    resp.timing.CopyFrom(pb.Timing(**acc.timing_ms()))


class LLMServicer(pb_grpc.LLMServiceServicer):
    """Generate / Abort / GetModelInfo / Tokenize / Detokenize over an :class:`EngineService`."""

    def __init__(self, service: EngineService):
        self.service = service

    async def _fail(self, context, error: BaseException, record: bool = False):
        kind = classify(error)
        if record:
            self.service.metrics.record_failed(kind.name.lower())
        await context.abort(grpc.StatusCode[kind.name], str(error) or type(error).__name__)

    def _prompt(self, request: pb.GenerateRequest):
        which = request.WhichOneof("prompt")
        if which == "text":
            return request.text
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which == "chat":
            chat = request.chat
            add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
            return self.service.chat_prompt([{"role": m.role, "content": m.content} for m in chat.messages], add)
        raise ValueError("prompt is missing: set text, token_ids or chat")

    async def Generate(self, request: pb.GenerateRequest, context):
        with ExitStack() as held:
            try:
                # taken now: a drain waits while the chat's template is tokenized (AsyncLLM.admit)
                admission = held.enter_context(self.service.llm.admit())
                if request.WhichOneof("prompt") == "chat":   # the template's text is tokenized
                    prompt = await self.service.prepare(self._prompt, request, timeout=context.time_remaining(),
                                                        admission=admission,
                                                        size=tokenizing_size(v for m in request.chat.messages
                                                                             for v in (m.role, m.content)))
                else:   # text is tokenized by generate; token ids need no thread
                    prompt = self._prompt(request)
                params = self.service.sampling_params(check_seed(sampling_values(request.sampling_params)))
            except Exception as e:  # noqa: BLE001 - every request error becomes a status
                await self._fail(context, e, record=True)
            rid = request.request_id or uuid.uuid4().hex
            acc = Accumulator()
            first = True
            try:
                salt = request.cache_salt if request.HasField("cache_salt") else None
                async for out in self.service.generate(prompt, params, rid, context.time_remaining(), salt,
                                                       admission=admission):
                    acc.add(out)
                    if not request.stream and not out.finished:
                        continue
                    resp = self._response(out, acc, request.stream, first, params.logprobs is not None)
                    first = False
                    yield resp
            except Exception as e:  # noqa: BLE001
                await self._fail(context, e)

    def _response(self, out, acc: Accumulator, stream: bool, first: bool, logprobs: bool) -> pb.GenerateResponse:
        outputs = out.outputs if stream else acc.results()
        resp = pb.GenerateResponse(request_id=out.request_id, finished=out.finished,
                                   outputs=[_completion_pb(o, logprobs) for o in outputs])
        if first:
            resp.prompt_token_ids.extend(out.prompt_token_ids)
            if out.prompt_logprobs:
                resp.prompt_logprobs.extend(_logprobs_pb(out.prompt_token_ids, out.prompt_logprobs))
        if out.finished:
            _final_fields(resp, acc)
        return resp

    async def Abort(self, request: pb.AbortRequest, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        return pb.AbortResponse(found=await self.service.llm.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        info = self.service.model_info()
        config = json.dumps({"model": info.pop("model"), "build": info.pop("build")})
        return pb.ModelInfo(engine_config_json=config, **info)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            which = request.WhichOneof("input")
            if which is None:   # as Generate without a prompt and HTTP /tokenize without one
                raise ValueError("input is missing: set text or chat")
            if which == "chat":
                chat = request.chat
                add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
                messages = [{"role": m.role, "content": m.content} for m in chat.messages]
                ids = await self.service.llm.tokenizing(self.service.chat_prompt, messages, add,
                                                        size=self.service.chat_size(messages))
            else:
                special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await self.service.llm.tokenizing(self.service.tokenize_text, request.text, special,
                                                        size=tokenizing_size([request.text]))
        except Exception as e:  # noqa: BLE001
            await self._fail(context, e)
        return pb.TokenizeResponse(token_ids=ids, max_seq_len=self.service.llm.engine.scheduler_config.max_seq_len)

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        try:
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            text = self.service.detokenize(request.token_ids, skip)
        except Exception as e:  # noqa: BLE001
            await self._fail(context, e)
        return pb.DetokenizeResponse(text=text)


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LLMService"].full_name
__all__ = ["LLMServicer", "SERVICE_NAME", "check_seed", "sampling_message", "sampling_values", "ErrorKind"]
