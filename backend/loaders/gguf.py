"""Load a llama-architecture GGUF file into float32 ``LlamaWeights`` + a ``ModelCard``.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/...),
and renamed to Hugging Face ``LlamaForCausalLM`` names. llama.cpp's converter permutes the rows of
``attn_q``/``attn_k`` for its interleaved (GPT-J style) RoPE; we un-permute them back to HF's rotate-half
layout (the inverse of ``convert_hf_to_gguf.LlamaModel.permute``, as transformers' GGUF loader does).

Every hyperparameter is read from the metadata (``{arch}.*`` keys): block count, widths, head counts,
``attention.key_length`` (head dim), RMS eps, ``rope.freq_base``, ``rope.dimension_count``,
``rope.scaling.{type,factor,original_context_length}``; a ``rope_freqs.weight`` tensor (llama3 scaling
as llama.cpp writes it) is kept as per-frequency divisors. ``output.weight`` is used when present,
otherwise the embedding is tied.

Sources followed: GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), llama.cpp
``convert_hf_to_gguf.py``, transformers ``integrations/ggml.py`` / ``modeling_gguf_pytorch_utils.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from backend.models.llama import LlamaConfig, LlamaWeights
from backend.protocol import ModelCard

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_ARCHS = ("llama",)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: ``[n_head*hd, H]`` interleaved-RoPE order -> HF rotate-half order.

    llama.cpp: ``w.reshape(n_head, 2, hd/2, H).swapaxes(1, 2)``; the inverse is
    ``w.reshape(n_head, hd/2, 2, H).swapaxes(1, 2)``.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation (HF -> GGUF row order), the inverse of ``unpermute_qk``."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_groups(data: np.ndarray, qtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Raw 4-bit codes of a Q4_0/Q4_1 tensor, for the int4 matmul path (``LlamaModel`` ``int4``).

    Args:
        data: the tensor's bytes as ``GGUFReader`` gives them, ``[N, K/32 * block_bytes] uint8``.
        qtype: its ``gguf.GGMLQuantizationType``.

    Returns:
        ``(codes [N, K] uint8 in 0..15, scale [N, K/32] float32, zero [N, K/32] float32)`` with
        ``w = (code - 8) * scale + zero`` (torch's int4pack convention; Q4_1: ``d*q + m`` gives
        ``scale = d, zero = m + 8d``; Q4_0: ``d*(q-8)`` gives ``zero = 0``), or None for other types.
    """
    import gguf

    Q = gguf.GGMLQuantizationType
    if qtype not in (Q.Q4_0, Q.Q4_1):
        return None
    bb = 20 if qtype == Q.Q4_1 else 18
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, bb)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        zero = m + 8.0 * d
    else:
        qs = blocks[..., 2:]
        zero = np.zeros_like(d)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)  # [N, K]
    return torch.from_numpy(codes.copy()), torch.from_numpy(d.copy()), torch.from_numpy(zero.copy())


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _file_type_name(ft: int | None) -> str | None:
    """``general.file_type`` -> short name, e.g. 3 -> ``"Q4_1"``, 0 -> ``"F32"``."""
    if ft is None:
        return None
    import gguf

    try:
        name = gguf.LlamaFileType(int(ft)).name
    except ValueError:
        return f"type{ft}"
    for prefix in ("MOSTLY_", "ALL_"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def read_gguf_config(reader) -> tuple[LlamaConfig, dict]:
    """Build a ``LlamaConfig`` from a ``gguf.GGUFReader``'s metadata.

    Returns:
        ``(config, meta)`` where ``meta`` holds the tokenizer / card fields.

    Raises:
        ValueError: not a llama-architecture file, or required metadata missing.
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHS})")

    def req(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF metadata {arch}.{key} missing")
        return v

    hidden = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    names = {t.name: t for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        toks = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(toks.data) if toks is not None else int(names["token_embd.weight"].shape[1])
    scaling = None
    st = _field(reader, f"{arch}.rope.scaling.type")
    if st and st != "none":
        scaling = {"type": st, "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
        oc = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if oc:
            scaling["original_max_position_embeddings"] = int(oc)
        if st not in ("linear",) and "rope_freqs.weight" not in names:
            raise ValueError(f"unsupported GGUF rope scaling type {st!r}")
        if "rope_freqs.weight" in names:
            scaling = None  # the freq factors tensor carries the scaling
    cfg = LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int(_field(reader, f"{arch}.rope.dimension_count", head_dim)),
        context_length=int(_field(reader, f"{arch}.context_length", 2048)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
    )
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    stops: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = _field(reader, key)
        if v is not None and int(v) not in stops:
            stops.append(int(v))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    meta = {
        "architecture": arch,
        "general_name": _field(reader, "general.name"),
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_id": int(eos) if eos is not None else None,
        "eos_token_ids": stops,
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "quantization": _file_type_name(_field(reader, "general.file_type")),
    }
    return cfg, meta


def load_gguf(path: str | Path, *, keep_q4: bool = False) -> tuple[LlamaWeights, ModelCard]:
    """Read and dequantize a llama GGUF file.

    Args:
        path: the ``.gguf`` file.

    Returns:
        ``(weights, card)``: float32 CPU tensors in HF naming (see ``LlamaWeights``) and a ``ModelCard``
        (name = the file's stem, context length, vocab size, BOS, stop ids = eos + eot + eom,
        ``tokenizer.chat_template``, quantization = the file type name, e.g. ``"Q4_1"``).
        With ``keep_q4``, ``weights.q4`` also holds the raw 4-bit codes of every Q4_0/Q4_1 layer
        matrix (see ``q4_groups``; Q/K rows un-permuted like the float weights).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file (magic), a truncated or corrupt one, no tensors (a vocab-only file),
            unsupported architecture, missing metadata or tensors, or a tensor of the wrong shape (the
            message names the GGUF tensor: ``tensor 'blk.0.attn_q.weight' missing``).
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"not a GGUF file (starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        # numpy reshape / memmap errors of a file cut short, or garbage where a header field should be
        raise ValueError(f"truncated or corrupt GGUF file: {exc}") from exc
    if not reader.tensors:
        raise ValueError("no tensors in the file (a vocab-only GGUF?): tensor 'token_embd.weight' missing")
    cfg, meta = read_gguf_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    rope_freqs = None
    q4: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:
            arr = arr.copy()
        ten = torch.from_numpy(arr)
        if t.name == "rope_freqs.weight":
            rope_freqs = ten.reshape(-1)
            continue
        if t.name in _GLOBAL_MAP:
            tensors[_GLOBAL_MAP[t.name]] = ten
            continue
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_MAP and parts[3] == "weight":
            i, kind = int(parts[1]), parts[2]
            heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(kind)
            if heads:
                ten = unpermute_qk(ten, heads)
            name = f"model.layers.{i}.{_LAYER_MAP[kind]}.weight"
            tensors[name] = ten
            if keep_q4 and ten.dim() == 2:
                raw = q4_groups(t.data, t.tensor_type)
                if raw is not None:
                    if heads:
                        raw = tuple(unpermute_qk(r, heads) for r in raw)
                    q4[name] = raw
        # other tensors (e.g. rope caches of old files) are ignored
    check_tensors(cfg, tensors, display=gguf_tensor_name)
    card = ModelCard(
        name=path.stem,
        architecture=meta["architecture"],
        context_length=cfg.context_length,
        vocab_size=cfg.vocab_size,
        bos_token_id=meta["bos_token_id"],
        eos_token_ids=meta["eos_token_ids"],
        chat_template=meta["chat_template"],
        quantization=meta["quantization"],
        model_path=str(path),
    )
    return LlamaWeights(config=cfg, tensors=tensors, rope_freqs=rope_freqs, meta=meta, q4=q4), card


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of a Hugging Face tensor name (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``); a name with no GGUF counterpart is returned as it is."""
    for g, h in _GLOBAL_MAP.items():
        if h == hf_name:
            return g
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        module = ".".join(parts[3:-1])
        for g, h in _LAYER_MAP.items():
            if h == module:
                return f"blk.{parts[2]}.{g}.weight"
    return hf_name


def check_tensors(
    cfg: LlamaConfig, tensors: dict[str, torch.Tensor], *, display: Callable[[str], str] = str
) -> None:
    """Check presence and shapes of every tensor the model needs (HF names in ``tensors``).

    ``display`` maps a tensor name to the one the error message gives (the file's own naming:
    ``gguf_tensor_name`` for a GGUF file).

    Raises:
        ValueError: a tensor is missing (``tensor 'token_embd.weight' missing``) or has an unexpected shape.
    """
    H, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    want = {
        "model.embed_tokens.weight": (cfg.vocab_size, H),
        "model.norm.weight": (H,),
    }
    if not cfg.tie_word_embeddings:
        want["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        want[p + "input_layernorm.weight"] = (H,)
        want[p + "post_attention_layernorm.weight"] = (H,)
        want[p + "self_attn.q_proj.weight"] = (cfg.num_heads * hd, H)
        want[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * hd, H)
        want[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * hd, H)
        want[p + "self_attn.o_proj.weight"] = (H, cfg.num_heads * hd)
        want[p + "mlp.gate_proj.weight"] = (inter, H)
        want[p + "mlp.up_proj.weight"] = (inter, H)
        want[p + "mlp.down_proj.weight"] = (H, inter)
    for name, shape in want.items():
        if name not in tensors:
            raise ValueError(f"tensor '{display(name)}' missing")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"tensor '{display(name)}' has shape {tuple(tensors[name].shape)}, expected {shape}"
            )
