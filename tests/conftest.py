"""Session fixtures: the default model's path and the reference data in ``tests/fixtures/``.

``tests/fixtures/`` holds outputs of an implementation independent of this project (chat template,
prompt ids, top logits, greedy continuations, tokenizer cases) and its README gives the tolerances.

Area-specific fixtures live in ``tests/plugins/`` and are registered below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.model_path import default_model_path

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

# Area plugins (tests/ is on sys.path through this rootdir conftest).
pytest_plugins = ["plugins.gateway_server"]
