"""``trtllm-lite triton-repo``: write a Triton model repository serving an engine."""
from __future__ import annotations

import argparse
import sys

from ..commands.arg_types import at_least
from .repository import ENGINE_OPTIONS, MODEL_OPTIONS, write_model_repository


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="engine directory (from `trtllm-lite build`)")
    p.add_argument("--output", required=True, help="model repository directory (created if missing)")
    p.add_argument("--model-name", default="trtllm_lite", help="Triton model name (default: %(default)s)")
    p.add_argument("--copy-engine", action="store_true",
                   help="copy the engine into the repository (NAME/1/engine) so it can be moved")
    group = p.add_argument_group("engine and model options (config.pbtxt parameters; unset: defaults)")
    for option in ENGINE_OPTIONS + MODEL_OPTIONS:
        flag = "--" + option.name.replace("_", "-")
        if option.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=option.help)
        elif option.type is int:
            group.add_argument(flag, type=at_least(option.minimum) if option.minimum is not None else int,
                               default=None, help=option.help)
        else:
            group.add_argument(flag, type=option.type, default=None, help=option.help)


def run(args: argparse.Namespace) -> int:
    options = {o.name: getattr(args, o.name) for o in ENGINE_OPTIONS + MODEL_OPTIONS}
    model_dir = write_model_repository(args.engine, args.output, args.model_name, options, args.copy_engine)
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/1/model.py", file=sys.stderr)
    print(f"serve it: tritonserver --model-repository {args.output}  "
          f"(or python -m trtllm_lite.triton.server --model-repository {args.output}; see docs/triton.md)",
          file=sys.stderr)
    return 0
