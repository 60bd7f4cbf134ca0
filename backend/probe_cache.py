"""A small on-disk cache of values measured on this machine (the row counts ``row_tiles`` probes).

Probing which row counts a oneDNN matmul may be called with (``backend.models.llama.row_tiles``) runs
thousands of matmuls: about 10 s of a backend start on 2 cores for SmolLM2-135M, paid again by every
process. The answer depends only on the library build, the CPU and the call's shape, dtype and thread
count, so it is kept in one JSON file, keyed by all of those:

    ``$LLM_GATEWAY_CACHE_DIR/probes.json`` (default ``$XDG_CACHE_HOME/llm-gateway``, else
    ``~/.cache/llm-gateway``)

The file's top-level key is a fingerprint of torch's version, oneDNN's version and the CPU's model name
and flags (``/proc/cpuinfo``), so a cache carried to another machine or another torch build is not
read. Writes go to a temporary file moved into place (``os.replace``), merged with what another process
wrote meanwhile; a missing, unreadable or corrupt file is a cache miss, never an error, and a cache that
cannot be written is skipped (logged once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_fingerprint: str | None = None
_memory: dict[str, list[int]] = {}
_warned = False


def cache_file() -> Path:
    """The JSON file's path (see the module docstring); not created here."""
    root = os.environ.get("LLM_GATEWAY_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "llm-gateway")
    return Path(root) / "probes.json"


def fingerprint() -> str:
    """A hash of torch's and oneDNN's versions and the CPU's model name and flags."""
    global _fingerprint
    if _fingerprint is None:
        cpu = ""
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))]
            cpu = "\n".join(sorted(set(lines)))
        except OSError:
            pass
        onednn = getattr(torch._C, "_get_mkldnn_version", lambda: "?")()
        text = f"{torch.__version__}|{onednn}|{torch.backends.cpu.get_cpu_capability()}|{cpu}"
        _fingerprint = hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
    return _fingerprint


def _read() -> dict:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def get(key: str) -> list[int] | None:
    """The list of ints stored under ``key`` for this machine, or None."""
    if key in _memory:
        return _memory[key]
    entry = _read().get(fingerprint())
    value = entry.get(key) if isinstance(entry, dict) else None
    if isinstance(value, list) and value and all(isinstance(v, int) and v > 0 for v in value):
        _memory[key] = value
        return value
    return None


def put(key: str, value: list[int]) -> None:
    """Store ``value`` under ``key`` for this machine (merged into the file; errors logged, not raised)."""
    global _warned
    _memory[key] = list(value)
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read()
        entry = data.get(fingerprint())
        if not isinstance(entry, dict):
            entry = data[fingerprint()] = {}
        entry[key] = list(value)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".probes-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        if not _warned:
            log.warning("probe cache %s not written: %s", path, e)
            _warned = True
