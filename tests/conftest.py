"""Shared test fixtures: paths of the default model and of ../shared fixtures.

Area-specific fixtures live in ``tests/plugins/`` and are registered below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.model_path import default_model_path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def chat_fixtures() -> list[dict]:
    return json.loads((SHARED / "fixtures" / "smollm2_chats.json").read_text())["chats"]


@pytest.fixture(scope="session")
def tokenizer_fixtures() -> list[dict]:
    return json.loads((SHARED / "fixtures" / "smollm2_tokenizer.json").read_text())["texts"]

# Area plugins (tests/ is on sys.path through this rootdir conftest).
pytest_plugins = ["plugins.gateway_server"]
