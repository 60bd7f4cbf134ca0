"""The served model in Ollama's listing shapes: /api/tags, /api/ps and /api/show, from the backend's
``ModelCard``.

Shapes follow Ollama's docs/api.md (https://github.com/ollama/ollama/blob/main/docs/api.md), "List Local
Models", "List Running Models" and "Show Model Information", and what the official ``ollama`` Python client
parses (``ListResponse``, ``ProcessResponse``, ``ShowResponse``). Times are RFC 3339 UTC (``Z``); sizes are
bytes of the model file; ``digest`` is not the file's hash (too slow to compute per call) but a stable id of
(name, path, size, mtime).
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import UTC, datetime
from typing import Any

from backend.protocol import ModelCard

NEVER = "9999-12-31T23:59:59Z"  # /api/ps expires_at: the served model is never unloaded


def details(card: ModelCard) -> dict[str, Any]:
    """Ollama's ``details`` object: format (gguf or safetensors), family, quantization level."""
    return {
        "parent_model": "",
        "format": "gguf" if card.model_path.endswith(".gguf") else "safetensors",
        "family": card.architecture,
        "families": [card.architecture],
        "parameter_size": "",
        "quantization_level": card.quantization or card.dtype,
    }


def entry(card: ModelCard) -> dict[str, Any]:
    """One model of /api/tags: name, model, modified_at, size (bytes), digest, details."""
    path = card.model_path
    try:
        st = os.stat(path)
        size, mtime = st.st_size, st.st_mtime
    except OSError:
        size, mtime = 0, time.time()
    digest = hashlib.sha256(f"{card.name}\0{path}\0{size}\0{mtime}".encode()).hexdigest()
    return {
        "name": card.name,
        "model": card.name,
        "modified_at": datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
        "size": size,
        "digest": digest,
        "details": details(card),
    }


def tags(card: ModelCard | None) -> dict[str, Any]:
    """GET /api/tags: the served model (none before a backend is ready)."""
    return {"models": [entry(card)] if card is not None else []}


def running(card: ModelCard | None) -> dict[str, Any]:
    """GET /api/ps: the served model, always loaded (``size_vram`` 0 on CPU, the file size on a GPU)."""
    if card is None:
        return {"models": []}
    e = entry(card)
    e.update(
        {
            "expires_at": NEVER,
            "size_vram": 0 if card.device == "cpu" else e["size"],
            "context_length": card.context_length,
        }
    )
    return {"models": [e]}


def show(card: ModelCard) -> dict[str, Any]:
    """POST /api/show: details, model_info (architecture, context length, the gateway's device, attention
    backend and dtype), the chat template, capabilities."""
    arch = card.architecture
    e = entry(card)
    return {
        "modified_at": e["modified_at"],
        "details": e["details"],
        "model_info": {
            "general.architecture": arch,
            f"{arch}.context_length": card.context_length,
            "general.quantization": card.quantization,
            "gateway.device": card.device,
            "gateway.attention_backend": card.attention_backend,
            "gateway.dtype": card.dtype,
        },
        "template": card.chat_template or "",
        "parameters": "",
        "license": "",
        "capabilities": ["completion"],
    }
