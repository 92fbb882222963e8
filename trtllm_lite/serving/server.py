"""The serving process: one engine, a ``grpc.aio`` server with our API, KServe v2, health
and reflection, Prometheus metrics over HTTP, and graceful shutdown.

Security defaults: binds 127.0.0.1 unless ``host`` says otherwise; optional TLS
(``tls_cert`` + ``tls_key``, PEM files); optional API key, sent as metadata
``authorization: Bearer KEY`` (or ``x-api-key: KEY``). Without it every call is
UNAUTHENTICATED except the health service, which load balancers must reach.

Shutdown (SIGTERM / SIGINT): health turns NOT_SERVING, new requests are refused, in-flight
ones get ``shutdown_grace`` seconds to finish, the rest are aborted, and :func:`serve`
returns 0.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..async_llm import AsyncLLM
from . import grpc_servicer, kserve
from .auth import bearer_token, key_is_sendable, key_matches
from .engine_service import EngineService
from .metrics import Metrics
from .protos import llm_service_pb2_grpc

log = logging.getLogger("trtllm_lite.serving")
API_KEY_ENV = "TRTLLM_LITE_API_KEY"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass
class ServerConfig:
    """How to serve an engine.

    Args:
        engine_dir: the engine directory.
        host: interface to bind (127.0.0.1: this machine only).
        port: gRPC port (0: pick a free one; the chosen port is printed).
        metrics_port: Prometheus HTTP port (None: off; 0: pick one).
        http_port: OpenAI-compatible HTTP port (None: off; 0: pick one).
        served_model_name: the model's name for clients (default: the engine directory's name).
        api_key: required from clients when set.
        tls_cert, tls_key: PEM files; both or neither.
        max_waiting_requests: requests waiting to be scheduled at most (RESOURCE_EXHAUSTED beyond).
        max_message_bytes: largest gRPC message received or sent (bytes).
        request_timeout: seconds a request may run at most (> 0; None: no limit).
        shutdown_grace: seconds the server takes to stop on SIGTERM / SIGINT, all told (>= 0):
            in-flight requests get ``shutdown_grace`` less up to 2 s kept for the final
            flush to finish, then the rest are aborted (at once on a second signal).
        engine_options: ``LLMEngine`` keyword arguments (max_num_seqs, num_threads, ...).

    Raises:
        ValueError: a value out of its range (named), TLS files not given together, an API
            key no client could send.
    """

    engine_dir: str
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    http_port: int | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_waiting_requests: int | None = 256
    max_message_bytes: int = 16 << 20
    request_timeout: float | None = None
    shutdown_grace: float = 30.0
    stream_queue_size: int = 64
    engine_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key (--tls-cert, --tls-key) must be given together")
        if self.tls_cert:
            _check_tls_pair(self.tls_cert, self.tls_key)
        if self.api_key is not None and not key_is_sendable(self.api_key):   # "" too: no open server by mistake
            raise ValueError("api_key must be printable ASCII without spaces, and not empty (gRPC metadata and "
                             "HTTP headers carry it as is): a key with other characters could never be sent")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        # (QA, session 34: a negative grace was taken, and acted as 0)
        if not (math.isfinite(self.shutdown_grace) and self.shutdown_grace >= 0):
            raise ValueError(f"shutdown_grace must be a finite number of seconds >= 0, got {self.shutdown_grace}")
        if self.request_timeout is not None and not (math.isfinite(self.request_timeout) and self.request_timeout > 0):
            raise ValueError(f"request_timeout must be a finite number of seconds > 0, got {self.request_timeout}")
        if self.served_model_name is None:
            self.served_model_name = os.path.basename(os.path.normpath(self.engine_dir))


def _key_ok(metadata, api_key: str) -> bool:
    """One ``authorization: Bearer KEY`` or one ``x-api-key: KEY`` entry holds the key (a name
    given twice counts for nothing, as HTTP refuses two Authorization headers)."""
    values = {"authorization": [], "x-api-key": []}
    for key, value in metadata or ():
        if key in values:
            values[key].append(value)
    auth, keys = values["authorization"], values["x-api-key"]
    return (len(auth) == 1 and key_matches(bearer_token(auth[0]), api_key)) or \
        (len(keys) == 1 and key_matches(keys[0], api_key))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the API key, except health checks."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES) or _key_ok(details.invocation_metadata,
                                                                                    self.api_key):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key (send 'authorization: Bearer KEY')")

        async def deny_stream(request, context):
            await deny(request, context)
            yield  # pragma: no cover - never reached

        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny, **kw)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.unary_unary_rpc_method_handler(deny, **kw)


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """A request that is not a valid message of its method gets INVALID_ARGUMENT naming the
    method (grpcio's own handling answers UNKNOWN and logs a traceback). The method's request
    bytes reach its handler undecoded and are parsed here, for our two services (health and
    reflection are left as they are)."""

    PREFIXES = ("/trtllm_lite.", "/inference.")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or not details.method.startswith(self.PREFIXES):
            return handler
        parse, method = handler.request_deserializer, details.method

        async def decode(raw: bytes, context):
            try:
                return parse(raw)
            except Exception as e:   # protobuf's DecodeError (or any parse failure)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is not a valid {method} message ({e}): malformed bytes, or a "
                                    f"string field that is not valid UTF-8 (protobuf strings must be)")

        async def decoded_stream(raws, context):
            async for raw in raws:
                yield await decode(raw, context)

        kw = dict(request_deserializer=None, response_serializer=handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            async def stream_stream(raws, context):
                async for response in handler.stream_stream(decoded_stream(raws, context), context):
                    yield response
            return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
        if handler.request_streaming:
            async def stream_unary(raws, context):
                return await handler.stream_unary(decoded_stream(raws, context), context)
            return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
        if handler.response_streaming:
            async def unary_stream(raw, context):
                async for response in handler.unary_stream(await decode(raw, context), context):
                    yield response
            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)

        async def unary_unary(raw, context):
            return await handler.unary_unary(await decode(raw, context), context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


def _check_tls_pair(cert: str, key: str) -> None:
    """Load the PEM certificate chain and private key now with Python's ``ssl`` (a missing
    file, garbage, or a key that is not the certificate's), naming the flags: gRPC reported
    these as a port it could not bind."""
    import ssl

    for path, name in ((cert, "tls_cert (--tls-cert)"), (key, "tls_key (--tls-key)")):
        if not os.path.isfile(path):
            raise ValueError(f"{name} {path!r}: no such file")
    def no_passphrase():   # an encrypted key: OpenSSL would prompt on the terminal (QA: it hung)
        raise ValueError("tls_key (--tls-key) is encrypted: give an unencrypted PEM private key")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=no_passphrase)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"tls_cert / tls_key (--tls-cert, --tls-key): not a PEM certificate chain and its "
                         f"private key: {e}") from None


def _credentials(config: ServerConfig):
    if not config.tls_cert:
        return None
    with open(config.tls_key, "rb") as f:
        key = f.read()
    with open(config.tls_cert, "rb") as f:
        cert = f.read()
    return grpc.ssl_server_credentials([(key, cert)])


class Server:
    """A running serving process's parts; :meth:`start` and :meth:`stop` (graceful)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        opts = dict(config.engine_options)
        self.llm = AsyncLLM(config.engine_dir, max_waiting_requests=config.max_waiting_requests,
                            stream_queue_size=config.stream_queue_size, **opts)
        self.metrics = Metrics()
        self.service = EngineService(self.llm, config.served_model_name, self.metrics, config.request_timeout)
        self.health = health.aio.HealthServicer()
        self.grpc_server: grpc.aio.Server | None = None
        self.http = None
        self.addresses: dict[str, str] = {}
        self._metrics_http = None

    async def start(self) -> dict[str, str]:
        """Start every listener; return ``{"grpc": "host:port", "metrics": ..., "http": ...}``."""
        c = self.config
        options = [("grpc.max_receive_message_length", c.max_message_bytes),
                   ("grpc.max_send_message_length", c.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        interceptors = ([ApiKeyInterceptor(c.api_key)] if c.api_key else []) + [DecodeErrorInterceptor()]
        server = grpc.aio.server(options=options, interceptors=interceptors)
        llm_service_pb2_grpc.add_LLMServiceServicer_to_server(grpc_servicer.LLMServicer(self.service), server)
        kserve.kpb_grpc.add_GRPCInferenceServiceServicer_to_server(kserve.KServeServicer(self.service), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (grpc_servicer.SERVICE_NAME, kserve.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address = f"{c.host}:{c.port}" if ":" not in c.host else f"[{c.host}]:{c.port}"
        creds = _credentials(c)
        try:
            port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        except RuntimeError as e:       # grpc: "Failed to bind to address ..."
            raise OSError(f"cannot listen on {address} for gRPC (--port in use, or --host not an address "
                          f"of this machine?): {e}") from None
        await server.start()
        self.grpc_server = server
        self.addresses["grpc"] = f"{c.host}:{port}"
        for name in ("", grpc_servicer.SERVICE_NAME, kserve.SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if c.metrics_port is not None:
            from prometheus_client import start_http_server

            try:
                self._metrics_http, _ = start_http_server(c.metrics_port, addr=c.host, registry=self.metrics.registry)
            except OSError as e:
                raise OSError(f"cannot listen on {c.host}:{c.metrics_port} for metrics (--metrics-port in use?): "
                              f"{e.strerror}") from None
            self.addresses["metrics"] = f"{c.host}:{self._metrics_http.server_address[1]}"
        if c.http_port is not None:
            from .http import HttpFrontEnd

            self.http = HttpFrontEnd(self.service, c)
            self.addresses["http"] = await self.http.start()
        return self.addresses

    async def stop(self, cut_short: asyncio.Event | None = None) -> None:
        """Graceful: NOT_SERVING, refuse new requests, let in-flight ones finish within the
        grace period (or until ``cut_short`` is set: :func:`serve`'s second signal), abort the
        rest, stop the engine."""
        await self.health.enter_graceful_shutdown()
        self.llm.stop_accepting()
        grace = self.config.shutdown_grace
        flush = min(2.0, grace)
        # the front ends stay up (health answers NOT_SERVING) while in-flight requests finish;
        # what is left at the deadline is aborted in the engine, so every stream still gets
        # its final response (finish reason 'abort') before the front ends stop
        await self.llm.drain(max(grace - flush, 0.0), cut_short)
        self.llm.abort_all()
        await self.llm.drain(flush)
        waits = []
        if self.grpc_server is not None:
            waits.append(self.grpc_server.stop(flush))
        if self.http is not None:
            waits.append(self.http.stop(flush))
        await asyncio.gather(*waits)
        self.llm.shutdown()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()


async def serve(config: ServerConfig, ready_file=None) -> int:
    """Run until SIGTERM / SIGINT, then shut down gracefully; return the exit code (0). A
    second SIGTERM / SIGINT during the grace period ends it: the requests still in flight are
    aborted at once (each stream still gets its final response), as a second Ctrl-C stops
    vLLM's and uvicorn's servers without waiting.

    Prints one line ``trtllm-lite serving {json of addresses}`` to ``ready_file`` (default
    stdout) once every listener is up.
    """
    server = Server(config)
    stop, cut_short = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if not stop.is_set():
            stop.set()
        elif not cut_short.is_set():
            log.warning("a second signal: aborting the requests still in flight now")
            cut_short.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        addresses = await server.start()
        print(f"trtllm-lite serving {json.dumps(addresses)}", file=ready_file or sys.stdout, flush=True)
        log.info("serving %s as %r on %s", config.engine_dir, config.served_model_name, addresses)
        engine = server.service.llm.engine
        if engine.max_model_len < engine.scheduler_config.max_seq_len:
            log.warning("the KV pool holds %d tokens, fewer than max_seq_len %d: requests are limited "
                        "to %d tokens (prompt + output); give more --kv-cache-memory-bytes or "
                        "--num-kv-blocks", engine.max_model_len, engine.scheduler_config.max_seq_len,
                        engine.max_model_len)
        await stop.wait()
        log.info("shutting down (grace %.0f s)", config.shutdown_grace)
    finally:
        await server.stop(cut_short)
    return 0
