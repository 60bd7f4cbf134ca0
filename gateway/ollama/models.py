"""The served models in Ollama's listing shapes: /api/tags, /api/ps and /api/show, from each model's name
(a served name or an alias: each is one entry, as in ``/v1/models``), its backends' ``ModelCard`` and its
context length (``gateway.catalog.ServedModel.context_length``).

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
    """Ollama's ``details`` object: format (gguf or safetensors), family, quantization level. A card without
    a model file (an upstream model's) has neither format nor quantization: both are empty."""
    path = card.model_path
    return {
        "parent_model": "",
        "format": ("gguf" if path.endswith(".gguf") else "safetensors") if path else "",
        "family": card.architecture,
        "families": [card.architecture],
        "parameter_size": "",
        "quantization_level": (card.quantization or card.dtype) if path else "",
    }


Listed = tuple[str, ModelCard, int]
"""One entry of a listing: (name, the model's card, its context length in tokens)."""


def entry(name: str, card: ModelCard) -> dict[str, Any]:
    """One model of /api/tags under ``name``: name, model, modified_at, size (bytes), digest, details."""
    path = card.model_path
    try:
        st = os.stat(path)
        size, mtime = st.st_size, st.st_mtime
    except OSError:
        size, mtime = 0, time.time()
    digest = hashlib.sha256(f"{card.name}\0{path}\0{size}\0{mtime}".encode()).hexdigest()
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
        "size": size,
        "digest": digest,
        "details": details(card),
    }


def tags(listed: list[Listed]) -> dict[str, Any]:
    """GET /api/tags: every listed name (a model none of whose backends was ready yet is not listed)."""
    return {"models": [entry(name, card) for name, card, _ in listed]}


def running(listed: list[Listed]) -> dict[str, Any]:
    """GET /api/ps: every listed name, always loaded (``size_vram`` 0 on CPU, the file size on a GPU)."""
    out = []
    for name, card, context_length in listed:
        e = entry(name, card)
        e.update(
            {
                "expires_at": NEVER,
                "size_vram": 0 if card.device == "cpu" else e["size"],
                "context_length": context_length,
            }
        )
        out.append(e)
    return {"models": out}


def show(name: str, card: ModelCard, context_length: int, *, native: bool = True) -> dict[str, Any]:
    """POST /api/show of ``name``: details, model_info (architecture, context length, quantization when
    known; for a model with this gateway's backends, ``native``, their device, attention backend and dtype:
    an upstream's are not known here), the chat template, capabilities."""
    arch = card.architecture
    e = entry(name, card)
    info: dict[str, Any] = {"general.architecture": arch, f"{arch}.context_length": context_length}
    if card.quantization:
        info["general.quantization"] = card.quantization
    if native:
        info |= {
            "gateway.device": card.device,
            "gateway.attention_backend": card.attention_backend,
            "gateway.dtype": card.dtype,
            "gateway.weights": card.weights,
        }
    return {
        "modified_at": e["modified_at"],
        "details": e["details"],
        "model_info": info,
        "template": card.chat_template or "",
        "parameters": "",
        "license": "",
        "capabilities": ["completion"],
    }
