"""Run the ``tritonserver`` installed by :mod:`trtllm_lite.triton.install` on a model repository.

The Python-backend stub embeds libpython and finds its interpreter through ``python3`` on
``PATH``, so :func:`server_env` puts the stub environment's ``bin`` first on ``PATH`` (then
the stub's ``sys.path`` is that environment's, which reaches trtllm-lite) and the
interpreter's ``LIBDIR`` first on ``LD_LIBRARY_PATH`` (otherwise another libpython of the
same version may be loaded).

Usage::

    with TritonServer("repo") as server:          # binds 127.0.0.1 on free ports
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

or from a shell: ``python -m trtllm_lite.triton.server --model-repository repo``.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from ..commands.arg_types import port_number
from .install import TritonInstall

def server_env(python: str | os.PathLike, base: dict | None = None) -> dict[str, str]:
    """Environment for ``tritonserver`` whose Python-backend stub runs ``python``'s environment.

    ``python`` must be a venv's interpreter path (not a resolved symlink), so that its
    ``bin`` holds that venv's ``python3``. ``LIBDIR`` is this interpreter's (the stub
    environment is a venv of it).
    """
    env = dict(os.environ if base is None else base)
    bin_dir = os.path.dirname(os.path.abspath(python))
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p])
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [libdir] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    env.pop("PYTHONHOME", None)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TritonServer:
    """A ``tritonserver`` process serving ``model_repository`` on loopback.

    Args:
        model_repository: directory made by ``trtllm-lite triton-repo``.
        install: the server install (default: :meth:`TritonInstall.locate`).
        host: address the gRPC, HTTP and metrics endpoints bind to.
        grpc_port, http_port, metrics_port: ports (default: free ones picked now).
        log_file: server log path (default: inherit stdout/stderr).
        extra_args: more ``tritonserver`` flags.

    Each server gets its own Python-backend shared-memory prefix, so several can run on one
    machine.
    """

    def __init__(self, model_repository: str | os.PathLike, *, install: TritonInstall | None = None,
                 host: str = "127.0.0.1", grpc_port: int | None = None, http_port: int | None = None,
                 metrics_port: int | None = None, log_file: str | os.PathLike | None = None,
                 extra_args: list[str] | tuple[str, ...] = ()):
        self.model_repository = Path(model_repository).resolve()
        self.install = install or TritonInstall.locate()
        self.host = host
        self.grpc_port = grpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.log_file = log_file
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        """The ``tritonserver`` command line."""
        return [str(self.install.binary),
                f"--model-repository={self.model_repository}",
                f"--backend-directory={self.install.backend_dir}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
                f"--backend-config=python,shm-region-prefix-name=trtllm_lite_{uuid.uuid4().hex[:8]}",
                *self.extra_args]

    def start(self, timeout: float = 180.0) -> "TritonServer":
        """Start the server and wait until it reports ready (every model loaded).

        Raises:
            RuntimeError: the server exited or was not ready within ``timeout`` seconds;
                the message carries the end of its log when there is one.
        """
        out = None
        if self.log_file is not None:
            out = self._log = open(self.log_file, "ab")
        self.process = subprocess.Popen(self.command(), env=server_env(self.install.stub_python), stdout=out,
                                        stderr=subprocess.STDOUT if out else None,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"tritonserver exited with code {self.process.returncode}"
                                       f"{self._log_tail()}")
                if self.is_ready():
                    return self
                time.sleep(0.25)
            raise RuntimeError(f"tritonserver was not ready within {timeout:.0f} s{self._log_tail()}")
        except BaseException:  # never leave a half-started server behind
            self.stop()
            raise

    def is_ready(self) -> bool:
        """Whether ``/v2/health/ready`` answers 200 (server up, every model loaded)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the server (models' ``finalize`` runs), SIGKILL after ``timeout`` s; then
        SIGKILL any process left in its session (a stub orphaned by a crash).

        Returns the server's exit code (None if it was never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self.process.wait()
        self._kill_group()  # backend stubs that outlived the server (they ignore SIGTERM)
        self._close_log()
        return self.process.returncode

    def _kill_group(self) -> None:
        """SIGKILL what is left of the session the server leads (it and its stubs only)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self, n: int = 4000) -> str:
        if self.log_file is None or not os.path.exists(self.log_file):
            return ""
        with open(self.log_file, "rb") as f:
            return "; log ends:\n" + f.read()[-n:].decode(errors="replace")

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m trtllm_lite.triton.server --model-repository REPO``: serve until Ctrl-C or
    SIGTERM (either stops ``tritonserver`` and its backend stubs). Arguments it does not know
    go to ``tritonserver`` as they are (e.g. ``--log-verbose=1``)."""
    p = argparse.ArgumentParser(prog="python -m trtllm_lite.triton.server", description=main.__doc__)
    p.add_argument("--model-repository", required=True, help="a directory made by trtllm-lite triton-repo")
    p.add_argument("--prefix", default=None, help="where tools/setup_triton.sh installed the server "
                   "(default: $TRTLLM_LITE_TRITON_HOME or ~/.cache/trtllm-lite/triton)")
    p.add_argument("--host", default="127.0.0.1", help="address of the three endpoints (default: %(default)s)")
    p.add_argument("--grpc-port", type=port_number, default=8001, help="(default: %(default)s)")
    p.add_argument("--http-port", type=port_number, default=8000, help="(default: %(default)s)")
    p.add_argument("--metrics-port", type=port_number, default=8002, help="(default: %(default)s)")
    args, extra = p.parse_known_args(argv)
    if not os.path.isdir(args.model_repository):
        p.error(f"--model-repository {args.model_repository!r} is not a directory")

    def on_sigterm(signum, frame):   # a supervisor's stop: end as Ctrl-C does, stopping the server
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    server = None
    try:
        server = TritonServer(args.model_repository, install=TritonInstall.locate(args.prefix),
                              host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                              metrics_port=args.metrics_port, extra_args=extra)
        print(" ".join(server.command()), file=sys.stderr)
        server.start()
        print(f"ready: gRPC {server.grpc_url}, HTTP {server.http_url}, metrics {server.metrics_url}",
              file=sys.stderr)
        server.process.wait()
    except KeyboardInterrupt:
        pass
    except (RuntimeError, OSError) as e:   # no server install, a server that would not start
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        # a second SIGTERM or Ctrl-C must not cut the stop short and leave the server running (QA)
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if server is not None:
                server.stop()
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, interrupt)
    return (server.process.returncode or 0) if server is not None and server.process is not None else 0


if __name__ == "__main__":
    sys.exit(main())
