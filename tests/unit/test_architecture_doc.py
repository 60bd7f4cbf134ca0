"""docs/architecture.md stays the true picture: every path its concern → module table names exists.

The table is the markdown table under "## Where each concern lives"; its second column names modules in
backticks (``gateway/app.py``, ``auth/``, ``backend/cpu_kernels.cpp`` + ``.py``). Each backticked token that
looks like a path (has a ``/`` or a file suffix) must exist relative to the repository root.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def table_paths() -> list[str]:
    text = DOC.read_text()
    section = text.split("## Where each concern lives", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")]
    paths: list[str] = []
    for row in rows[1:]:  # the header row names the columns
        cells = [c.strip() for c in row.strip("|").split("|")]
        for token in re.findall(r"`([^`]+)`", cells[-1]):
            if "/" in token and " " not in token:
                paths.append(token)
    return paths


def test_table_names_paths() -> None:
    paths = table_paths()
    assert len(paths) >= 40, paths  # the table was found and read


def test_every_table_path_exists() -> None:
    missing = [p for p in table_paths() if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
