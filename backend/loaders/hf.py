"""Load a Hugging Face llama-family directory (llama, mistral, qwen2, qwen3, phi3) into float32 ``LlamaWeights`` + a ``ModelCard``.

Files read: ``config.json``; the weights, ``model.safetensors.index.json``'s shards when the index is there
(every listed shard must exist), else every ``*.safetensors``; optionally ``tokenizer_config.json``
(``chat_template``, or a ``chat_template.jinja`` file) and ``generation_config.json`` (extra
``eos_token_id`` values). ``tokenizer.json`` is the gateway's (``templating/``), not read here. A missing
file is a one-line ``FileNotFoundError`` naming it and what to pass.

The family comes from ``architectures`` (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Phi3ForCausalLM``) or ``model_type``; the differences become ``LlamaConfig`` flags:
q/k/v biases (``self_attn.{q,k,v}_proj.bias``: qwen2) -> ``qkv_bias``, ``self_attn.{q,k}_norm.weight``
(qwen3) -> ``qk_norm``; phi3's fused ``self_attn.qkv_proj.weight`` and ``mlp.gate_up_proj.weight`` (gate rows
first, as ``Phi3MLP`` chunks them) are split into the llama q/k/v and gate/up tensors. Refused with one
line: any other bias (``attention_bias`` on llama/qwen3 adds an ``o_proj`` bias, ``mlp_bias``), a rope type
other than default/linear/llama3/longrope (``yarn``, ``dynamic``). LongRoPE (phi3 ``longrope``/``su``):
``short_factor`` becomes ``LlamaWeights.rope_freqs`` (frequency divisors) and its attention factor
``LlamaConfig.rope_attention_factor``, with the context capped at ``original_max_position_embeddings``,
where transformers uses the short factors (it switches to ``long_factor`` past it). A sliding window in use
(``sliding_window`` with ``use_sliding_window`` on qwen2/qwen3, or set on mistral/phi3) caps the context at
the window, where it changes nothing.

Config keys read: ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta``
(or ``rope_parameters.rope_theta``, transformers >= 5), ``rope_scaling`` / ``rope_parameters``
(``linear``, ``llama3``), ``partial_rotary_factor`` (phi3; top level or in ``rope_parameters``),
``max_position_embeddings``, ``tie_word_embeddings``, ``bos_token_id``, ``eos_token_id`` (int or list).

Source followed: transformers ``Llama/Mistral/Qwen2/Qwen3/Phi3Config`` and ``modeling_*.py`` naming.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from backend.loaders.gguf import check_tensors
from backend.loaders.memory import LazyTensors, LoadSize, MemoryBudget
from backend.models.llama import LlamaConfig, LlamaWeights
from backend.protocol import ModelCard

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
_WINDOW_FLAG = {"qwen2": "use_sliding_window", "qwen3": "use_sliding_window"}
_ROPE_TYPES = (None, "default", "none", "linear", "llama3")
_LONGROPE = ("longrope", "su")
_PASS = "pass a Hugging Face model directory (config.json + *.safetensors) or a .gguf file"


def _ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


def model_family(cfg: dict) -> str:
    """``config.json`` dict -> ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"`` or ``"phi3"``.

    Raises:
        ValueError: none of the supported architectures.
    """
    for a in cfg.get("architectures") or []:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    mt = cfg.get("model_type") or ("llama" if not cfg.get("architectures") else None)
    if mt in ARCHITECTURES.values():
        return mt
    raise ValueError(
        f"unsupported architectures {cfg.get('architectures')} / model_type {cfg.get('model_type')!r} in "
        f"config.json (supported: {', '.join(ARCHITECTURES)})"
    )


def read_hf_config(cfg: dict) -> LlamaConfig:
    """``config.json`` dict -> ``LlamaConfig`` (``qkv_bias``/``qk_norm`` are set from the tensors by ``load_hf``).

    Raises:
        ValueError: not a supported family, an unsupported rope type, or a required key missing.
    """
    family = model_family(cfg)
    try:
        hidden = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        rp = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
        scaling = dict(_scaling(cfg)) or None
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind not in _ROPE_TYPES + _LONGROPE:
            raise ValueError(
                f"rope type {kind!r} (config.json rope_scaling/rope_parameters) is not supported "
                "(default, linear, llama3, longrope)"
            )
        head_dim = int(cfg.get("head_dim") or hidden // n_head)
        partial = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        context = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window")
        if window and cfg.get(_WINDOW_FLAG.get(family, ""), family in ("mistral", "phi3")):
            context = min(context, int(window))
        attention_factor = 1.0
        if kind in _LONGROPE:
            attention_factor, orig = longrope_attention(cfg, scaling)
            context, scaling = min(context, orig), None  # the short factors go to LlamaWeights.rope_freqs
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
            rope_dim=int(head_dim * partial),
            context_length=context,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_attention_factor=attention_factor,
            architecture="llama" if family == "mistral" else family,
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks {exc.args[0]!r}") from None


def _scaling(cfg: dict) -> dict:
    rp = cfg.get("rope_parameters") or {}
    return cfg.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else {})


def longrope_attention(cfg: dict, scaling: dict) -> tuple[float, int]:
    """LongRoPE's ``(attention_factor, original_max_position_embeddings)`` as transformers'
    ``_compute_longrope_parameters`` computes them: the given ``attention_factor``, else
    ``sqrt(1 + ln(factor) / ln(original))`` with ``factor = max_position_embeddings / original`` (1.0 when
    ``factor <= 1``).

    Raises:
        ValueError: no ``original_max_position_embeddings`` or no ``short_factor``.
    """
    orig = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not orig or not scaling.get("short_factor"):
        raise ValueError("longrope in config.json needs original_max_position_embeddings and short_factor")
    factor = scaling.get("factor") or int(cfg.get("max_position_embeddings", orig)) / int(orig)
    af = scaling.get("attention_factor")
    if af is None:
        af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(orig)))
    return float(af), int(orig)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of an HF directory: the shards ``model.safetensors.index.json`` lists, else every
    ``*.safetensors``.

    Raises:
        FileNotFoundError: a listed shard is missing, or there is no ``*.safetensors`` file.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        for name in shards:
            if not (path / name).is_file():
                raise FileNotFoundError(
                    f"{name} (listed in {index.name}) not found in {path}: download every shard"
                )
        if shards:
            return [path / name for name in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}: {_PASS}")
    return files


def _fused_names(cfg: LlamaConfig, name: str, rows: int) -> list[tuple[str, int]]:
    """phi3's ``self_attn.qkv_proj`` / ``mlp.gate_up_proj`` as the llama q/k/v and gate/up names and their row
    counts; any other tensor as it is.

    Raises:
        ValueError: a fused tensor of the wrong row count.
    """
    hd = cfg.head_dim
    if name.endswith("self_attn.qkv_proj.weight"):
        sizes = [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]
        new, old = ["q_proj", "k_proj", "v_proj"], "qkv_proj"
    elif name.endswith("mlp.gate_up_proj.weight"):
        sizes, new, old = [cfg.intermediate_size] * 2, ["gate_proj", "up_proj"], "gate_up_proj"
    else:
        return [(name, rows)]
    if rows != sum(sizes):
        raise ValueError(f"tensor '{name}' has {rows} rows, expected {sum(sizes)}")
    return [(name.replace(old, n), r) for n, r in zip(new, sizes)]


def load_hf(path: str | Path, *, budget: MemoryBudget | None = None) -> tuple[LlamaWeights, ModelCard]:
    """Read an HF llama-family directory.

    Args:
        path: the directory.
        budget: checked against the tensors' sizes (from the safetensors headers) before any is read.

    Returns:
        ``(weights, card)``: float32 CPU tensors in HF llama naming (a ``LazyTensors``: each read from its
        safetensors file when first taken) and a ``ModelCard`` (name = directory
        name, architecture = the family, quantization = the checkpoint's ``torch_dtype``/``dtype``, e.g.
        ``"bfloat16"``).

    Raises:
        FileNotFoundError: no ``config.json``, no ``*.safetensors`` file or a shard of the index missing.
        ValueError: unsupported architecture, rope type or bias, missing or misshapen tensors, weights over
            the memory budget.
    """
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"config.json not found in {path}: {_PASS}")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise ValueError(f"{cfg_file.name} is not valid JSON: {exc}") from None
    cfg = read_hf_config(raw)
    files = safetensors_files(path)
    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                shapes[k] = (f, tuple(fh.get_slice(k).get_shape()))
    if budget is not None:
        sizes = {k: math.prod(shape) for k, (_, shape) in shapes.items()}
        kept = [sizes[n] for n in ("model.embed_tokens.weight", "lm_head.weight") if n in sizes]
        layer = [v for k, v in sizes.items() if k.startswith("model.layers.")]
        size = LoadSize(
            params=sum(sizes.values()),
            head_params=kept[-1] if kept else 0,
            kept=sum(kept),
            largest=max(layer, default=0),
            file_bytes=sum(f.stat().st_size for f in files),
        )
        budget.check(size)
    tensors = LazyTensors()
    for k, (f, shape) in shapes.items():
        parts = _fused_names(cfg, k, shape[0] if shape else 0)

        def make(f=f, k=k, parts=parts) -> dict[str, dict]:
            with safe_open(str(f), framework="pt") as fh:
                ten = fh.get_tensor(k).to(torch.float32)
            if len(parts) == 1:
                return {"w": {k: ten}}
            return {"w": {n: p.contiguous() for (n, _), p in zip(parts, ten.split([r for _, r in parts], 0))}}

        LazyTensors.defer(make, {"w": (tensors, {n: (r, *shape[1:]) for n, r in parts})})
    for name in tensors:
        if name.endswith(".bias") and not name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            raise ValueError(
                f"tensor '{name}' is not supported (biases are read on q_proj/k_proj/v_proj only)"
            )
    cfg.qkv_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    cfg.qk_norm = "model.layers.0.self_attn.q_norm.weight" in tensors
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
        architecture=cfg.architecture,
        context_length=cfg.context_length,
        vocab_size=cfg.vocab_size,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos,
        chat_template=template,
        quantization=raw.get("torch_dtype") or raw.get("dtype"),
        model_path=str(path),
    )
    meta = {"architecture": cfg.architecture, "chat_template": template, "eos_token_ids": eos}
    sc = _scaling(raw)
    short = sc.get("short_factor") if sc.get("rope_type", sc.get("type")) in _LONGROPE else None
    rope_freqs = torch.tensor(short, dtype=torch.float32) if short else None
    return LlamaWeights(config=cfg, tensors=tensors, rope_freqs=rope_freqs, meta=meta), card
