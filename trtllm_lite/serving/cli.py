"""``trtllm-lite serve``: serve an engine over gRPC (our API + KServe v2), with optional
Prometheus metrics and OpenAI-compatible HTTP, until SIGTERM / SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os

from ..commands.arg_types import at_least, json_object, non_empty, port_number
from .server import API_KEY_ENV, ServerConfig, serve


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The ``LLMEngine`` options, shared by the server and the benchmark."""
    g = p.add_argument_group("engine")
    g.add_argument("--engine", required=True, help="engine directory (trtllm-lite build)")
    g.add_argument("--max-num-seqs", type=at_least(1), default=None, help="sequences per step (default: build value)")
    g.add_argument("--max-num-batched-tokens", type=at_least(1), default=None, help="tokens per step (default: the build value; on the CPU backend at most 512)")
    g.add_argument("--max-seq-len", type=at_least(2), default=None, help="prompt + output tokens (default: build value)")
    g.add_argument("--kv-cache-memory-bytes", type=at_least(1), default=None,
                   help="K and V pool memory (bytes; default 1 GiB, capped by the machine's memory)")
    g.add_argument("--num-kv-blocks", type=at_least(1), default=None, help="KV pool size in blocks (overrides memory)")
    g.add_argument("--no-kv-cache-prefault", action="store_true",
                   help="commit the KV pool's memory as blocks are first used, not at start (CPU)")
    g.add_argument("--num-threads", type=at_least(1), default=None, help="backend threads (default: all cores)")
    g.add_argument("--no-chunked-prefill", action="store_true", help="never cut prompts into chunks")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks between prompts")
    g.add_argument("--seed", type=at_least(0), default=None, help="seed for unseeded sampled requests")
    g.add_argument("--no-verify-checksums", action="store_true", help="skip the sha256 check of engine files")
    g.add_argument("--speculative-config", type=json_object, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def engine_options(args: argparse.Namespace) -> dict:
    opts = {k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len",
                                          "kv_cache_memory_bytes", "num_kv_blocks", "num_threads", "seed")
            if getattr(args, k) is not None}
    if args.no_chunked_prefill:
        opts["enable_chunked_prefill"] = False
    if args.no_prefix_caching:
        opts["enable_prefix_caching"] = False
    if args.no_verify_checksums:
        opts["verify_checksums"] = False
    if args.no_kv_cache_prefault:
        opts["kv_cache_prefault"] = False
    if getattr(args, "speculative_config", None):
        opts["speculative_config"] = args.speculative_config
    return opts


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=port_number, default=50051, help="gRPC port (default 50051; 0: pick a free one)")
    g.add_argument("--metrics-port", type=port_number, default=None, help="Prometheus metrics HTTP port (0: pick one)")
    g.add_argument("--http-port", type=port_number, default=None, help="OpenAI-compatible HTTP port (0: pick one)")
    g.add_argument("--served-model-name", type=non_empty, default=None, help="model name for clients (default: engine dir name)")
    g.add_argument("--api-key", default=None, help=f"require this key from clients (default: ${API_KEY_ENV})")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key)")
    g.add_argument("--tls-key", default=None, help="PEM private key (with --tls-cert)")
    g.add_argument("--max-waiting-requests", type=at_least(1), default=256,
                   help="requests waiting to be scheduled at most; more get RESOURCE_EXHAUSTED / 429 (default 256)")
    g.add_argument("--max-message-bytes", type=at_least(1024, maximum=(1 << 31) - 1), default=16 << 20,
                   help="largest gRPC message and HTTP request body (bytes; default 16 MiB)")
    g.add_argument("--request-timeout", type=at_least(0, float, strict=True), default=None, help="seconds a request may run at most")
    g.add_argument("--shutdown-grace", type=at_least(0, float), default=30.0,
                   help="seconds the server takes to stop on SIGTERM / SIGINT (it exits within them): "
                        "in-flight requests get the grace less up to 2 s kept for the final flush, "
                        "then the rest are aborted; a second signal aborts them at once (default 30)")
    g.add_argument("--stream-queue-size", type=at_least(1), default=64,
                   help="deltas held per request before merging (a slow client never blocks the engine; default 64)")
    g.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="logging level (default INFO)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        engine_dir=args.engine, host=args.host, port=args.port, metrics_port=args.metrics_port,
        http_port=args.http_port, served_model_name=args.served_model_name,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV), tls_cert=args.tls_cert,
        tls_key=args.tls_key, max_waiting_requests=args.max_waiting_requests,
        max_message_bytes=args.max_message_bytes, request_timeout=args.request_timeout,
        shutdown_grace=args.shutdown_grace, stream_queue_size=args.stream_queue_size,
        engine_options=engine_options(args))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(config_from_args(args)))
