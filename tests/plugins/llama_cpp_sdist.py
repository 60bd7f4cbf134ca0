"""Third-party reference data from PyPI: the ``llama-cpp-python`` sdist, which carries llama.cpp itself.

What the tests read from it:

* ``vendor/llama.cpp/models/ggml-vocab-*.gguf`` -- vocab-only GGUFs of about 25 model families, each with
  ``.gguf.inp`` / ``.gguf.out`` files: llama.cpp's expected token ids for tricky strings;
* ``vendor/llama.cpp/models/templates/*.jinja`` -- real chat templates, many with tool use.

The sdist is fetched once with ``pip download --no-binary :all: --no-deps`` into a cache folder outside the
repository (``$LLM_GATEWAY_CACHE`` or ``~/.cache/llm-gateway``) and those two parts are extracted next to it.
A test that needs it calls :func:`llama_cpp_models` and is skipped with the reason only when the tarball is
absent and no package index answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
_WANTED = ("vendor/llama.cpp/models/ggml-vocab-", "vendor/llama.cpp/models/templates/")


def cache_dir() -> Path:
    """The cache folder (created): ``$LLM_GATEWAY_CACHE`` or ``~/.cache/llm-gateway``."""
    folder = Path(os.environ.get("LLM_GATEWAY_CACHE") or Path.home() / ".cache" / "llm-gateway")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _download(folder: Path) -> Path:
    tarball = folder / SDIST
    if tarball.exists():
        return tarball
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps"]
    cmd += ["-d", str(folder), f"llama-cpp-python=={VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not tarball.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"llama-cpp-python=={VERSION} sdist not cached and pip could not fetch it: {tail[0]}")
    return tarball


def llama_cpp_models() -> Path:
    """The sdist's ``vendor/llama.cpp/models`` folder, extracted in the cache (vocab GGUFs with their
    ``.inp``/``.out`` files, and ``templates/``). Skips the calling test when it cannot be had."""
    folder = cache_dir()
    root = folder / f"llama-cpp-python-{VERSION}"
    models = root / "vendor" / "llama.cpp" / "models"
    done = root / ".extracted"
    if done.exists():
        return models
    tarball = _download(folder)
    prefix = f"llama_cpp_python-{VERSION}/"
    tmp = folder / f".extract-{os.getpid()}"
    with tarfile.open(tarball) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.isfile() and rel.startswith(_WANTED):
                m.name = rel
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    tmp.mkdir(exist_ok=True)
    if root.exists():  # a partial extraction of an earlier run
        shutil.rmtree(root)
    tmp.rename(root)
    done.touch()
    return models


@pytest.fixture(scope="session")
def llama_cpp_models_dir() -> Path:
    """Session fixture form of :func:`llama_cpp_models`."""
    return llama_cpp_models()
