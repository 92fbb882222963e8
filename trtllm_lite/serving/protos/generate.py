"""Regenerate the Python stubs of ``llm_service.proto`` (run after editing the .proto).

``python -m trtllm_lite.serving.protos.generate [--check]`` runs ``grpc_tools.protoc``
(package ``grpcio-tools``, a development tool only: the stubs are committed, so a fresh
install needs no code generation) and records the .proto's sha256 in ``PROTO_SHA256``.
``--check`` regenerates into a temporary directory and fails if the committed stubs differ.
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # holds trtllm_lite/
PROTO = "trtllm_lite/serving/protos/llm_service.proto"
OUTPUTS = ("llm_service_pb2.py", "llm_service_pb2.pyi", "llm_service_pb2_grpc.py")


def proto_sha256() -> str:
    with open(os.path.join(ROOT, PROTO), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def generate(out_root: str) -> None:
    """Write the stubs under ``out_root/trtllm_lite/serving/protos``.

    Raises:
        ModuleNotFoundError: grpcio-tools is not installed.
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc

    os.makedirs(os.path.join(out_root, os.path.dirname(PROTO)), exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", os.path.join(ROOT, PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed stubs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        made = os.path.join(tmp, os.path.dirname(PROTO))
        if args.check:
            differ = [n for n in OUTPUTS if not filecmp.cmp(os.path.join(made, n), os.path.join(HERE, n),
                                                             shallow=False)]
            if differ:
                print(f"stale stubs: {', '.join(differ)}; run python -m trtllm_lite.serving.protos.generate")
                return 1
            return 0
        for name in OUTPUTS:
            shutil.copyfile(os.path.join(made, name), os.path.join(HERE, name))
    with open(os.path.join(HERE, "PROTO_SHA256"), "w") as f:
        f.write(proto_sha256() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
