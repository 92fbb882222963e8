"""trtllm-lite command line: build engines, generate, serve, benchmark.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; a module that is not installed (e.g. the builder without its extra)
only fails when its subcommand is used.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .runners.tensorrt_runner import TensorRTUnavailable

COMMANDS = {
    "build": ("builder.cli", "export and compile a model into an engine directory"),
    "generate": ("trtllm_lite.commands.generate", "generate from a prompt with an engine"),
    "info": ("trtllm_lite.commands.info", "show an engine's manifest summary"),
    "serve": ("trtllm_lite.serving.cli", "serve an engine over gRPC (and HTTP)"),
    "client": ("trtllm_lite.serving.client_cli", "send a prompt to a running server"),
    "triton-repo": ("trtllm_lite.triton.cli", "write a Triton Inference Server model repository"),
    "bench": ("trtllm_lite.commands.bench", "run the benchmark suite"),
}


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            return None  # the subcommand's module is not part of this install
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="trtllm-lite", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and not argv[0].startswith("-") else None
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            try:
                module = _module(module_name)
            except ModuleNotFoundError as e:
                print(f"trtllm-lite {name}: missing dependency {e.name!r} "
                      "(install the extra, e.g. pip install 'trtllm-lite[builder]')", file=sys.stderr)
                return 2
            if module is None:
                print(f"trtllm-lite {name}: not available in this install", file=sys.stderr)
                return 2
            module.add_arguments(p)
            modules[name] = module
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except (ValueError, OSError, TensorRTUnavailable) as e:   # bad input, a busy port, a path that
        if isinstance(e, BrokenPipeError):  # `trtllm-lite generate ... | head`    cannot be written,
            return 0                        # a backend's package not installed
        print(f"trtllm-lite {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"trtllm-lite {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
