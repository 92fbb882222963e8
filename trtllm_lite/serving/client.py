"""Python clients of ``trtllm_lite.v1.LLMService``: :class:`LLMClient` (blocking) and
:class:`AsyncLLMClient` (``grpc.aio``).

    with LLMClient("127.0.0.1:50051") as client:
        for delta in client.generate("The capital of France is", max_tokens=16, temperature=0):
            print(delta.outputs[0].text, end="", flush=True)
        result = client.complete("Hello", max_tokens=8)      # one final GenerateResponse

Errors arrive as ``grpc.RpcError`` with the server's status code and message.
"""
from __future__ import annotations

from typing import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .grpc_servicer import sampling_message
from .protos import llm_service_pb2 as pb
from .protos import llm_service_pb2_grpc as pb_grpc

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def make_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
                 stream: bool = True, request_id: str = "", cache_salt: str | None = None,
                 **sampling) -> pb.GenerateRequest:
    """A ``GenerateRequest``: ``prompt`` as text or token ids, or chat ``messages``
    (``[{"role", "content"}]``); ``cache_salt`` isolates the request's prefix cache;
    ``sampling`` as vLLM ``SamplingParams`` keyword arguments."""
    req = pb.GenerateRequest(request_id=request_id, stream=stream, sampling_params=sampling_message(**sampling),
                             cache_salt=cache_salt)
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(int(t) for t in prompt)
    else:
        raise ValueError("give a prompt (text or token ids) or messages")
    return req


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _credentials(tls_root_cert: str | None):
    if tls_root_cert is None:
        return None
    with open(tls_root_cert, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


class LLMClient:
    """Blocking client.

    Args:
        target: ``host:port`` of the server.
        api_key: sent as ``authorization: Bearer KEY`` when set.
        tls_root_cert: PEM file of the CA (or self-signed cert) to trust; enables TLS.
        timeout: default deadline per call (seconds; None: none).
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls_root_cert: str | None = None, timeout: float | None = None):
        creds = _credentials(tls_root_cert)
        self.channel = (grpc.secure_channel(target, creds, _OPTIONS) if creds
                        else grpc.insecure_channel(target, _OPTIONS))
        self.stub = pb_grpc.LLMServiceStub(self.channel)
        self.metadata = _metadata(api_key)
        self.timeout = timeout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    def generate(self, prompt=None, *, messages=None, request_id: str = "", timeout: float | None = None,
                 **sampling) -> Iterator[pb.GenerateResponse]:
        """Stream deltas; the last response has ``finished``, usage and timing. Closing
        the iterator early cancels the call (the server aborts the request)."""
        req = make_request(prompt, messages=messages, stream=True, request_id=request_id, **sampling)
        call = self.stub.Generate(req, timeout=self._t(timeout), metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt=None, *, messages=None, request_id: str = "", timeout: float | None = None,
                 **sampling) -> pb.GenerateResponse:
        """Run to the end without streaming; return the one final response."""
        req = make_request(prompt, messages=messages, stream=False, request_id=request_id, **sampling)
        responses = list(self.stub.Generate(req, timeout=self._t(timeout), metadata=self.metadata))
        return responses[-1]

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._t(None),
                               metadata=self.metadata).found

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(None), metadata=self.metadata)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(req, timeout=self._t(None), metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        req = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(req, timeout=self._t(None), metadata=self.metadata).text

    def health(self, service: str = "") -> str:
        """The health service's status name for ``service`` ("" = the server): SERVING, ..."""
        resp = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=self._t(None))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


class AsyncLLMClient:
    """``grpc.aio`` client with the same methods as :class:`LLMClient` (awaitable; use it
    inside a running event loop)."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls_root_cert: str | None = None, timeout: float | None = None):
        creds = _credentials(tls_root_cert)
        self.channel = (grpc.aio.secure_channel(target, creds, _OPTIONS) if creds
                        else grpc.aio.insecure_channel(target, _OPTIONS))
        self.stub = pb_grpc.LLMServiceStub(self.channel)
        self.metadata = _metadata(api_key)
        self.timeout = timeout

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompt=None, *, messages=None, request_id: str = "", timeout: float | None = None,
                       **sampling) -> AsyncIterator[pb.GenerateResponse]:
        req = make_request(prompt, messages=messages, stream=True, request_id=request_id, **sampling)
        call = self.stub.Generate(req, timeout=self.timeout if timeout is None else timeout, metadata=self.metadata)
        try:
            async for resp in call:
                yield resp
        finally:
            call.cancel()

    async def complete(self, prompt=None, *, messages=None, request_id: str = "", timeout: float | None = None,
                       **sampling) -> pb.GenerateResponse:
        req = make_request(prompt, messages=messages, stream=False, request_id=request_id, **sampling)
        call = self.stub.Generate(req, timeout=self.timeout if timeout is None else timeout, metadata=self.metadata)
        last = None
        async for resp in call:
            last = resp
        return last

    async def abort(self, request_id: str) -> bool:
        return (await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout,
                                      metadata=self.metadata)).found

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self.stub.Tokenize(req, timeout=self.timeout, metadata=self.metadata)).token_ids)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        req = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(req, timeout=self.timeout, metadata=self.metadata)).text

    async def health(self, service: str = "") -> str:
        """The health service's status name for ``service`` ("" = the server): SERVING, ..."""
        resp = await health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
