"""Load a Hugging Face ``LlamaForCausalLM`` directory into float32 ``LlamaWeights`` + a ``ModelCard``.

Expected files: ``config.json``, one or more ``*.safetensors`` (sharded files are all read; an
index file is not needed), optionally ``tokenizer_config.json`` (``chat_template``, or a
``chat_template.jinja`` file), ``generation_config.json`` (extra ``eos_token_id`` values).

Config keys read: ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta``
(or ``rope_parameters.rope_theta``, transformers >= 5), ``rope_scaling`` / ``rope_parameters``
(``linear``, ``llama3``), ``max_position_embeddings``, ``tie_word_embeddings``, ``bos_token_id``,
``eos_token_id`` (int or list).

Source followed: transformers ``LlamaConfig`` and ``modeling_llama.py`` naming.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backend.loaders.gguf import check_tensors
from backend.models.llama import LlamaConfig, LlamaWeights
from backend.protocol import ModelCard

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def _ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


def read_hf_config(cfg: dict) -> LlamaConfig:
    """``config.json`` dict -> ``LlamaConfig``.

    Raises:
        ValueError: not a llama model, or a required key missing.
    """
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and cfg.get("model_type") != "llama":
        raise ValueError(f"unsupported architectures {archs} (supported: {SUPPORTED_ARCHITECTURES})")
    try:
        hidden = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        rp = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rp and rp.get("rope_type", "default") != "default":
            scaling = dict(rp)
        head_dim = int(cfg.get("head_dim") or hidden // n_head)
        return LlamaConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=n_head,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_dim=head_dim,
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks {exc.args[0]!r}") from None


def load_hf(path: str | Path) -> tuple[LlamaWeights, ModelCard]:
    """Read an HF llama directory.

    Returns:
        ``(weights, card)``: float32 CPU tensors in HF naming and a ``ModelCard`` (name = directory name,
        quantization = the checkpoint's ``torch_dtype``/``dtype``, e.g. ``"bfloat16"``).

    Raises:
        FileNotFoundError: no ``config.json`` or no ``*.safetensors`` file.
        ValueError: unsupported architecture, missing or misshapen tensors.
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found")
    raw = json.loads(cfg_file.read_text())
    cfg = read_hf_config(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            tensors[k] = v.to(torch.float32)
    if "lm_head.weight" in tensors:
        if cfg.tie_word_embeddings and torch.equal(
            tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
        ):
            del tensors["lm_head.weight"]
        else:
            cfg.tie_word_embeddings = False
    else:
        cfg.tie_word_embeddings = True
    check_tensors(cfg, tensors)

    tok_cfg = {}
    if (path / "tokenizer_config.json").is_file():
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    eos = _ids(raw.get("eos_token_id"))
    if (path / "generation_config.json").is_file():
        gen = json.loads((path / "generation_config.json").read_text())
        for i in _ids(gen.get("eos_token_id")):
            if i not in eos:
                eos.append(i)
    bos = raw.get("bos_token_id")
    card = ModelCard(
        name=path.name,
        architecture="llama",
        context_length=cfg.context_length,
        vocab_size=cfg.vocab_size,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos,
        chat_template=template,
        quantization=raw.get("torch_dtype") or raw.get("dtype"),
        model_path=str(path),
    )
    meta = {"architecture": "llama", "chat_template": template, "eos_token_ids": eos}
    return LlamaWeights(config=cfg, tensors=tensors, meta=meta), card
