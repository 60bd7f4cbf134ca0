"""Tiny random-weight models of each supported family, written as GGUF (``gguf.GGUFWriter``) and as Hugging Face
directories (``config.json`` + safetensors), for tests that need a model other than the default one.

Families (``TinySpec.arch``): ``llama`` (tied or untied embeddings), ``mistral``, ``qwen2`` (q/k/v biases),
``qwen3`` (per-head q/k RMSNorm), ``phi3`` (fused ``qkv_proj`` / ``gate_up_proj``; ``partial_rotary_factor``).
The weights are drawn from ``torch.Generator().manual_seed(spec.seed)``, so the same spec gives the same
weights in both formats.

* :func:`tiny_tensors` -- the family's own HF tensors (float32; phi3's fused);
* :func:`write_tiny_hf` -- ``config.json`` (+ optional ``model.safetensors.index.json`` with 2 shards);
* :func:`write_tiny_gguf` -- a GGUF as llama.cpp's converter writes it (llama Q/K rows permuted, phi3 fused,
  per-family metadata); ``vocab=`` copies every ``tokenizer.*`` key of another GGUF (e.g.
  ``ggml-vocab-qwen2.gguf`` of the llama-cpp-python sdist) and sizes the embedding to its token list, so
  the file can be served with a real tokenizer.

Usage::

    from plugins.tiny_models import TinySpec, write_tiny_gguf, write_tiny_hf
    path = write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", vocab=models_dir / "ggml-vocab-qwen2.gguf")

Sources followed: transformers ``modeling_{llama,qwen2,qwen3,phi3}.py`` names, gguf-py ``constants.py``
(``MODEL_TENSORS``), llama.cpp ``conversion/{llama,qwen,phi}.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backend.loaders.gguf import permute_qk

HF_CLASSES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
#: HF llama-style module -> GGUF tensor kind (gguf.constants TENSOR_NAMES)
_GGUF_KIND = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
#: encode(gguf_name, float32 array) -> (data, type) for GGUFWriter.add_tensor
Encoder = Callable[[str, np.ndarray], tuple[np.ndarray, object]]


@dataclass(frozen=True)
class TinySpec:
    """A tiny model's shape (defaults: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, vocab 300)."""

    arch: str = "qwen2"
    tied: bool = True
    vocab_size: int = 300
    hidden_size: int = 64
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    context_length: int = 256
    partial_rotary_factor: float = 1.0
    bos_token_id: int = 1
    eos_token_id: int = 2
    seed: int = 0
    #: HF ``rope_parameters`` beyond the default (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``); a llama3
    #: one is written to GGUF as llama.cpp does, as a ``rope_freqs.weight`` tensor of per-frequency divisors; a
    #: phi3 ``{"rope_type": "longrope", "long_factor", "short_factor", "original_max_position_embeddings"}`` as
    #: Phi-3.5 files have it (``rope_factors_long/short.weight`` and ``rope.scaling.*`` in GGUF)
    rope_scaling: dict | None = None

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def tiny_tensors(spec: TinySpec) -> dict[str, torch.Tensor]:
    """The family's HF tensors, float32, weights ``N(0, 0.2)`` and norm weights ``1 + N(0, 0.2)``."""
    g = torch.Generator().manual_seed(spec.seed)
    H, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    t = {"model.embed_tokens.weight": r(spec.vocab_size, H), "model.norm.weight": 1 + r(H)}
    if not spec.tied:
        t["lm_head.weight"] = r(spec.vocab_size, H)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + r(H)
        t[p + "post_attention_layernorm.weight"] = 1 + r(H)
        if spec.arch == "phi3":
            t[p + "self_attn.qkv_proj.weight"] = r(q + 2 * kv, H)
            t[p + "mlp.gate_up_proj.weight"] = r(2 * inter, H)
        else:
            t[p + "self_attn.q_proj.weight"] = r(q, H)
            t[p + "self_attn.k_proj.weight"] = r(kv, H)
            t[p + "self_attn.v_proj.weight"] = r(kv, H)
            t[p + "mlp.gate_proj.weight"] = r(inter, H)
            t[p + "mlp.up_proj.weight"] = r(inter, H)
        if spec.arch == "qwen2":
            t[p + "self_attn.q_proj.bias"] = r(q)
            t[p + "self_attn.k_proj.bias"] = r(kv)
            t[p + "self_attn.v_proj.bias"] = r(kv)
        if spec.arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = 1 + r(hd)
            t[p + "self_attn.k_norm.weight"] = 1 + r(hd)
        t[p + "self_attn.o_proj.weight"] = r(H, q)
        t[p + "mlp.down_proj.weight"] = r(H, inter)
    return t


def hf_config(spec: TinySpec) -> dict:
    """The ``config.json`` transformers reads for ``spec`` (its ``AutoModelForCausalLM`` builds the same model)."""
    cls, model_type = HF_CLASSES[spec.arch]
    cfg = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.context_length,
        "tie_word_embeddings": spec.tied,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }
    if spec.arch == "phi3":
        cfg["partial_rotary_factor"] = spec.partial_rotary_factor
        cfg["original_max_position_embeddings"] = spec.context_length
        cfg["sliding_window"] = None
    if spec.rope_scaling and spec.rope_scaling.get("rope_type") == "longrope":
        # as Phi-3.5's config.json writes it: rope_scaling + top-level original_max_position_embeddings
        sc = dict(spec.rope_scaling)
        cfg["original_max_position_embeddings"] = sc.pop("original_max_position_embeddings")
        cfg["rope_scaling"] = {"type": sc.pop("rope_type"), **sc}
    elif spec.rope_scaling:
        cfg["rope_parameters"] = {"rope_theta": spec.rope_theta, **spec.rope_scaling}
    if spec.arch == "mistral":
        cfg["sliding_window"] = None
    return cfg


def write_tiny_hf(path: str | Path, spec: TinySpec, *, shards: int = 1) -> Path:
    """Write ``spec`` as an HF directory: ``config.json``, ``generation_config.json`` and ``model.safetensors``
    (or ``shards`` files with a ``model.safetensors.index.json``). Returns the directory."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(spec), indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": spec.eos_token_id}))
    tensors = {k: v.contiguous() for k, v in tiny_tensors(spec).items()}
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k] for k in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return path


def gguf_name(hf_name: str) -> str:
    """HF tensor name -> GGUF name (``model.layers.0.self_attn.q_proj.bias`` -> ``blk.0.attn_q.bias``)."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_GGUF_KIND['.'.join(parts[3:-1])]}.{parts[-1]}"


def default_encoder(qtype=None) -> Encoder:
    """Matrices in ``qtype`` (``gguf.GGMLQuantizationType``; F32 when None, F16/BF16, or any type
    ``gguf.quants.quantize`` implements), vectors in F32, as llama.cpp keeps norms and biases."""
    import gguf

    Q = gguf.GGMLQuantizationType

    def encode(name: str, arr: np.ndarray) -> tuple[np.ndarray, object]:
        if qtype in (None, Q.F32) or arr.ndim < 2:
            return arr.astype(np.float32), Q.F32
        if qtype == Q.F16:
            return arr.astype(np.float16), Q.F16
        return gguf.quants.quantize(arr.astype(np.float32), qtype), qtype

    return encode


def _rope_freqs(spec: TinySpec) -> np.ndarray:
    """llama.cpp's ``rope_freqs.weight`` for ``spec.rope_scaling``: default / scaled inverse frequencies."""
    from backend.models.llama import LlamaConfig, rope_inv_freq

    shape = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rope_theta=spec.rope_theta,
        rope_dim=spec.rope_dim,
    )
    plain, scaled = LlamaConfig(**shape), LlamaConfig(**shape, rope_scaling=spec.rope_scaling)
    return (rope_inv_freq(plain) / rope_inv_freq(scaled)).numpy().astype(np.float32)


def _copy_vocab(writer, vocab: Path) -> int:
    """Copy every ``tokenizer.*`` key of the GGUF ``vocab`` into ``writer``; returns its token count."""
    import gguf

    from backend.loaders.gguf_file import GGUFFile, StringArray

    src = GGUFFile(vocab)
    for key, value in src.metadata.items():
        if not key.startswith("tokenizer."):
            continue
        vtype, item = src.value_types[key]
        if isinstance(value, StringArray):
            value = src.strings(key)
        elif isinstance(value, np.ndarray):
            value = value.tolist()
        sub = gguf.GGUFValueType(item) if item is not None else None
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=sub)
    return len(src.metadata.get("tokenizer.ggml.tokens") or ())


def write_tiny_gguf(
    path: str | Path,
    arch: str = "qwen2",
    *,
    spec: TinySpec | None = None,
    vocab: str | Path | None = None,
    qtype=None,
    encode: Encoder | None = None,
    chat_template: str | None = None,
    extra: dict[str, np.ndarray] | None = None,
    **overrides,
) -> Path:
    """Write a tiny ``arch`` model as a GGUF file; returns ``path``.

    Args:
        path: the file to write.
        arch: ``llama``, ``qwen2``, ``qwen3`` or ``phi3`` (GGUF ``general.architecture``; a ``mistral`` spec is
            written as ``llama``, as llama.cpp does).
        spec: the shape (default ``TinySpec(arch=arch, **overrides)``).
        vocab: a GGUF whose ``tokenizer.*`` keys are copied; the vocabulary size becomes its token count
            (BOS/EOS ids then come from it too).
        qtype: the type of the matrices (see ``default_encoder``), ignored when ``encode`` is given.
        encode: ``(gguf_name, float32 array) -> (data, GGMLQuantizationType)`` for every tensor.
        chat_template: written as ``tokenizer.chat_template`` when given.
        extra: more tensors, GGUF name -> array, written as they are (e.g. a tensor the loader must refuse).
        overrides: ``TinySpec`` fields (when ``spec`` is None).
    """
    import gguf

    spec = spec or TinySpec(arch=arch, **overrides)
    path = Path(path)
    file_arch = "llama" if spec.arch == "mistral" else spec.arch
    writer = gguf.GGUFWriter(str(path), file_arch)
    n_vocab = _copy_vocab(writer, Path(vocab)) if vocab is not None else 0
    if n_vocab:
        spec = dataclasses.replace(spec, vocab_size=n_vocab)
    writer.add_name(f"tiny-{spec.arch}")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_block_count(spec.num_layers)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.rope_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_vocab_size(spec.vocab_size)
    ftype = "ALL_F32" if qtype in (None, gguf.GGMLQuantizationType.F32) else f"MOSTLY_{qtype.name}"
    writer.add_file_type(getattr(gguf.LlamaFileType, ftype, gguf.LlamaFileType.GUESSED))
    if not n_vocab:
        writer.add_bos_token_id(spec.bos_token_id)
        writer.add_eos_token_id(spec.eos_token_id)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    encode = encode or default_encoder(qtype)
    if spec.rope_scaling and spec.rope_scaling.get("rope_type") == "longrope":
        # llama.cpp conversion/phi.py: both factor sets as tensors, the attention factor and original context
        sc, orig = spec.rope_scaling, spec.rope_scaling["original_max_position_embeddings"]
        scale = spec.context_length / orig
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        )
        writer.add_rope_scaling_orig_ctx_len(orig)
        writer.add_tensor("rope_factors_long.weight", np.array(sc["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(sc["short_factor"], dtype=np.float32))
    elif spec.rope_scaling:
        writer.add_tensor("rope_freqs.weight", _rope_freqs(spec))
    for name, ten in tiny_tensors(spec).items():
        if file_arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            ten = permute_qk(ten, spec.num_heads if "q_proj" in name else spec.num_kv_heads)
        gname = gguf_name(name)
        data, dtype = encode(gname, ten.numpy())
        writer.add_tensor(gname, data, raw_dtype=dtype)
    for gname, data in (extra or {}).items():
        writer.add_tensor(gname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
