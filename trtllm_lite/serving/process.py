"""Run ``trtllm-lite serve`` as a child process (tests, benchmarks, notebooks).

    with ServerProcess(engine_dir, "--num-threads", "2") as server:
        client = LLMClient(server.grpc)

The server binds 127.0.0.1 on free ports (``--port 0``) and reports them on its first
stdout line; :meth:`ServerProcess.stop` sends SIGTERM and returns the exit code.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

READY_PREFIX = "trtllm-lite serving "


class ServerProcess:
    """A ``trtllm-lite serve`` child process.

    Args:
        engine_dir: the engine to serve.
        *args: more ``serve`` options (``--port`` defaults to 0, i.e. a free port).
        metrics: also serve Prometheus metrics on a free port.
        env: extra environment variables.
        startup_timeout: seconds to wait for the ready line.

    Raises:
        RuntimeError: the server exited or did not get ready in time (its stderr tail is
            in the message).
    """

    def __init__(self, engine_dir: str, *args: str, metrics: bool = True, env: dict | None = None,
                 startup_timeout: float = 180.0):
        cmd = [sys.executable, "-m", "trtllm_lite.cli", "serve", "--engine", engine_dir, *args]
        if "--port" not in args:
            cmd += ["--port", "0"]
        if metrics and "--metrics-port" not in args:
            cmd += ["--metrics-port", "0"]
        self.stderr_lines: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.addresses = self._wait_ready(startup_timeout)

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)
            del self.stderr_lines[:-200]

    def _wait_ready(self, timeout: float) -> dict:
        result: dict = {}

        def read():
            for line in self.proc.stdout:
                if line.startswith(READY_PREFIX):
                    result.update(json.loads(line[len(READY_PREFIX):]))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not result:
            self.kill()
            raise RuntimeError("trtllm-lite serve did not get ready:\n" + "".join(self.stderr_lines[-30:]))
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        return result

    @property
    def grpc(self) -> str:
        return self.addresses["grpc"]

    @property
    def metrics(self) -> str | None:
        return self.addresses.get("metrics")

    @property
    def http(self) -> str | None:
        return self.addresses.get("http")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL after ``timeout`` seconds)."""
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.stop()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll ``predicate()`` until it returns a truthy value (returned) or ``timeout`` s pass
    (then the last value is returned)."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > end:
            return value
        time.sleep(interval)


def self_signed_cert(directory: str) -> tuple[str, str]:
    """Write a throwaway self-signed certificate for 127.0.0.1 / localhost (1 day, RSA 2048)
    with the ``openssl`` command; return ``(cert.pem, key.pem)`` paths. For tests and local
    trials of ``--tls-cert/--tls-key``, never for production.

    Raises:
        FileNotFoundError: ``openssl`` is not on PATH.
    """
    if shutil.which("openssl") is None:
        raise FileNotFoundError("openssl is not on PATH")
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key
