"""Session fixtures: the default model's path and the reference data in ``tests/fixtures/``.

``tests/fixtures/`` holds outputs of an implementation independent of this project (chat template,
prompt ids, top logits, greedy continuations, tokenizer cases) and its README gives the tolerances.

Area-specific fixtures live in ``tests/plugins/`` and are registered below.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from backend import cpu_isa

cpu_isa.apply()  # LLM_GATEWAY_CPU_ISA=avx2 caps ATen/oneDNN before any test imports torch

from backend.model_path import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def chat_fixtures() -> list[dict]:
    return json.loads((FIXTURES / "smollm2_chats.json").read_text())["chats"]


@pytest.fixture(scope="session")
def tokenizer_fixtures() -> list[dict]:
    return json.loads((FIXTURES / "smollm2_tokenizer.json").read_text())["texts"]


def _missing_system_packages() -> list[str]:
    """The system programs some tests run for real (installed by ``scripts/sysdeps.sh``) that are absent."""
    missing = [] if shutil.which("redis-server") else ["redis-server"]
    if not os.access("/usr/bin/chromium", os.X_OK):
        missing.append("chromium")
    if not (shutil.which("nginx") or os.access("/usr/sbin/nginx", os.X_OK)):
        missing.append("nginx")
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        missing.append("postgresql")
    return missing


def pytest_sessionstart(session: pytest.Session) -> None:
    """With ``LLM_GATEWAY_REQUIRE_SYSDEPS=1`` (``make test`` sets it) a missing system package stops the run:
    the Redis, browser and proxy tests would otherwise be skipped and the suite pass without them."""
    if os.environ.get("LLM_GATEWAY_REQUIRE_SYSDEPS") == "1" and (missing := _missing_system_packages()):
        pytest.exit(f"system packages missing: {', '.join(missing)} (run scripts/sysdeps.sh)", returncode=3)
    # the suite's own probe cache (backend.probe_cache), shared by every backend it starts: the first
    # probes for real, the rest read the answers; a user's ~/.cache is neither read nor written
    _probe_dirs.append(tempfile.mkdtemp(prefix="llm-gateway-probes-"))
    os.environ["LLM_GATEWAY_CACHE_DIR"] = _probe_dirs[-1]


_probe_dirs: list[str] = []  # the probe cache directories this run created (removed at its end)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the suite's probe cache (see ``pytest_sessionstart``); never a directory it did not create."""
    for path in _probe_dirs:
        shutil.rmtree(path, ignore_errors=True)


# Area plugins (tests/ is on sys.path through this rootdir conftest).
pytest_plugins = [
    "plugins.gateway_server",
    "plugins.llama_cpp_sdist",
    "plugins.postgres_server",
    "plugins.tiny_smollm2",
]
