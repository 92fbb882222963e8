"""Install a real Triton Inference Server for trtllm-lite models, apart from our environment.

``python -m trtllm_lite.triton.install [PREFIX]`` (what ``tools/setup_triton.sh`` runs) puts
three things under ``PREFIX`` (default :func:`default_prefix`):

1. ``pytriton/tritonserver``: the ``tritonserver`` 2.51 binary, the Python backend and its
   stubs, from the ``nvidia-pytriton`` wheel installed with ``--no-deps`` (the wheel's
   Python dependencies pin numpy<2; the server binary needs none of them).
2. ``pytriton/tritonserver/backends/python/triton_python_backend_stub``: the stub built for
   this interpreter's Python version. It must sit next to ``libtriton_python.so`` because
   both find their bundled libraries through an RPATH relative to themselves.
3. ``envs/<key>``: the *stub environment*, the Python the stub embeds to run ``model.py``.
   It is a venv of this same interpreter holding only ``numpy<2`` and a ``.pth`` file that
   appends this environment's site-packages, so the model imports trtllm-lite, ONNX
   Runtime and tokenizers from here. numpy<2 is needed because the stub's pybind11 predates
   numpy 2: under numpy 2 it reads a dtype's item size from the wrong field, so every BYTES
   input (``text_input``) arrives as garbage. ``<key>`` is derived from this
   environment's site-packages path, so several venvs can share one prefix.

Nothing here is needed at serving time except the files it writes; it needs the network
(PyPI) once.
"""
from __future__ import annotations

import filecmp
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

#: nvidia-pytriton 0.7.0 bundles tritonserver 2.51 (release 24.10) with stubs for Python 3.8-3.13.
PYTRITON_VERSION = "0.7.0"
#: numpy for the stub environment: our floor, below the ABI the stub's pybind11 understands.
STUB_NUMPY = "numpy>=1.26,<2"
SETUP_SCRIPT = "tools/setup_triton.sh"


def default_prefix() -> Path:
    """``$TRTLLM_LITE_TRITON_HOME``, else ``$XDG_CACHE_HOME/trtllm-lite/triton`` (``~/.cache``)."""
    env = os.environ.get("TRTLLM_LITE_TRITON_HOME")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "trtllm-lite" / "triton"


def python_version() -> str:
    return "%d.%d" % sys.version_info[:2]


def site_packages() -> str:
    """This environment's site-packages (where trtllm-lite is installed)."""
    return sysconfig.get_paths()["purelib"]


@dataclass(frozen=True)
class TritonInstall:
    """The layout under ``prefix`` (see the module docstring)."""

    prefix: Path

    @property
    def root(self) -> Path:
        return self.prefix / "pytriton" / "tritonserver"

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def backend_dir(self) -> Path:
        """The ``--backend-directory`` (holds ``python/libtriton_python.so`` and the stub)."""
        return self.root / "backends"

    @property
    def stub(self) -> Path:
        return self.backend_dir / "python" / "triton_python_backend_stub"

    def stub_env(self, parent_site_packages: str | None = None) -> Path:
        """The stub environment layered over ``parent_site_packages`` (default: ours)."""
        parent = parent_site_packages or site_packages()
        key = hashlib.sha256(f"{parent}|{python_version()}".encode()).hexdigest()[:12]
        return self.prefix / "envs" / key

    @property
    def stub_python(self) -> Path:
        """The interpreter the stub runs for this environment (its ``bin`` goes first on PATH)."""
        return self.stub_env() / "bin" / "python3"

    @classmethod
    def locate(cls, prefix: str | os.PathLike | None = None) -> "TritonInstall":
        """The install under ``prefix`` (default :func:`default_prefix`), checked for this
        interpreter.

        Raises:
            FileNotFoundError: the server, the stub for this Python version or the stub
                environment of this venv is missing; the message says what to run.
        """
        install = cls(Path(prefix) if prefix is not None else default_prefix())
        fix = f"run `bash {SETUP_SCRIPT} {install.prefix}` with this environment's python3 first"
        if not install.binary.is_file() or not install.stub.is_file():
            raise FileNotFoundError(f"no Triton server under {install.prefix}: {fix}")
        marker = install.stub.parent / "PYTHON_VERSION"
        have = marker.read_text().strip() if marker.is_file() else "?"
        if have != python_version():
            raise FileNotFoundError(f"the Python-backend stub under {install.prefix} is for Python {have}, "
                                    f"not {python_version()}: {fix}")
        if not install.stub_python.exists():
            raise FileNotFoundError(f"no stub environment for {site_packages()} under {install.prefix}: {fix}")
        return install


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-deps", *args], check=True, stdout=sys.stderr)


def install(prefix: str | os.PathLike | None = None, pytriton_version: str = PYTRITON_VERSION) -> TritonInstall:
    """Install (or complete) the server, the stub and this venv's stub environment.

    Idempotent: each part already in place is kept.

    Raises:
        subprocess.CalledProcessError: pip failed (e.g. no network).
        FileNotFoundError: the wheel has no stub for this Python version.
    """
    inst = TritonInstall(Path(prefix) if prefix is not None else default_prefix())
    if not inst.binary.is_file():
        inst.prefix.mkdir(parents=True, exist_ok=True)
        _pip("--upgrade", "--target", str(inst.prefix), f"nvidia-pytriton=={pytriton_version}")
    stub = inst.root / "python_backend_stubs" / python_version() / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton {pytriton_version} has no Python-backend stub "
                                f"for Python {python_version()}")
    if not (inst.stub.is_file() and filecmp.cmp(stub, inst.stub, shallow=False)):
        # a running server may be executing the old stub: replace the file, never write into it
        tmp = inst.stub.with_suffix(".tmp")
        shutil.copy2(stub, tmp)
        os.replace(tmp, inst.stub)
    (inst.stub.parent / "PYTHON_VERSION").write_text(python_version() + "\n")
    _make_stub_env(inst.stub_env())
    return inst


def _make_stub_env(env: Path) -> None:
    purelib = env / "lib" / f"python{python_version()}" / "site-packages"
    done = purelib / "_trtllm_lite_parent.pth"
    if done.is_file() and (env / "bin" / "python3").exists():
        return
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(env)], check=True)
    _pip("--target", str(purelib), STUB_NUMPY)
    # site.addsitedir (not a bare path line) so the parent's own .pth files, such as an
    # editable install's, are processed too. Appended: the stub env's numpy comes first.
    done.write_text(f"import site; site.addsitedir({site_packages()!r})\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m trtllm_lite.triton.install [PREFIX]``: install and print PREFIX."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    inst = install(argv[0] if argv else None)
    print(inst.prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
