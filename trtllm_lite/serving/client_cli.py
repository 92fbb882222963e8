"""``trtllm-lite client``: send a prompt to a running ``trtllm-lite serve`` and print the
answer (as it is generated with ``--stream``)."""
from __future__ import annotations

import argparse
import os
import sys

import grpc

from ..commands.arg_types import at_least
from .server import API_KEY_ENV


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user message)")
    p.add_argument("--server", default="127.0.0.1:50051", help="host:port of the gRPC server (default 127.0.0.1:50051)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--max-tokens", type=at_least(1), default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling's probability mass (default 1: all tokens)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--seed", type=int, default=None, help="the request's sampling seed (default: none)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--timeout", type=at_least(0, float, strict=True), default=None, help="deadline (seconds)")
    p.add_argument("--api-key", default=None, help=f"API key (default: ${API_KEY_ENV})")
    p.add_argument("--tls-root-cert", default=None, help="PEM certificate to trust (enables TLS)")
    p.add_argument("--stats", action="store_true", help="print usage and timing to stderr")
    p.add_argument("--request-id", default="", help="the request's id (default: the server picks one); "
                   "another client can abort it by this id")


def run(args: argparse.Namespace) -> int:
    """Send the request; print its text. Exit status 0 when it finished (any finish reason but
    ``abort``), 1 on an RPC error or when the server aborted it (a shutdown, an abort by its id):
    the text printed is then cut short, and stderr says so."""
    from .client import LLMClient

    if args.system is not None and not args.chat:   # (as generate: it was silently dropped)
        raise ValueError("--system is a chat message: it needs --chat")
    if args.tls_root_cert is not None and not os.path.isfile(args.tls_root_cert):
        raise ValueError(f"--tls-root-cert {args.tls_root_cert!r}: no such file")
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=args.stop)
    prompt, messages = args.prompt, None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = None
    client = LLMClient(args.server, api_key=args.api_key or os.environ.get(API_KEY_ENV),
                       tls_root_cert=args.tls_root_cert, timeout=args.timeout)
    try:
        if args.stream:
            last = None
            for last in client.generate(prompt, messages=messages, request_id=args.request_id, **sampling):
                for o in last.outputs:
                    sys.stdout.write(o.text)
                sys.stdout.flush()
        else:
            last = client.complete(prompt, messages=messages, request_id=args.request_id, **sampling)
            sys.stdout.write("".join(o.text for o in last.outputs))
        sys.stdout.write("\n")
        if args.stats and last is not None:
            u, t = last.usage, last.timing
            print(f"[finish {last.outputs[0].finish_reason if last.outputs else ''}, prompt {u.prompt_tokens}, "
                  f"completion {u.completion_tokens}, cached {u.cached_tokens} tokens; ttft {t.ttft_ms:.0f} ms, "
                  f"e2e {t.e2e_ms:.0f} ms, tpot {t.tpot_ms:.1f} ms]", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"trtllm-lite client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if last is not None and any(o.finish_reason == "abort" for o in last.outputs):
        print("trtllm-lite client: the server aborted the request (finish reason abort: it shut down, "
              "or the request was aborted by its id); the text above is cut short", file=sys.stderr)
        return 1
    return 0
