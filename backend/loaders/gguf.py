"""Load a llama-family GGUF file (``llama``, ``qwen2``, ``qwen3``, ``phi3``) into float32 ``LlamaWeights`` + a ``ModelCard``.

The file is read with ``GGUFFile`` (one pass over a memory map; ``gguf.GGUFReader`` took 12 s for a Qwen2
vocabulary's metadata). Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (every type
it handles: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, the IQ types,
TQ1_0/TQ2_0, MXFP4, NVFP4) when the model takes it (``LazyTensors``), under its Hugging Face
``LlamaForCausalLM`` name. llama.cpp's converter permutes the rows of ``attn_q``/``attn_k``
of ``llama`` files for its interleaved (GPT-J style) RoPE; we un-permute them back to HF's rotate-half
layout (the inverse of ``convert_hf_to_gguf.LlamaModel.permute``, as transformers' GGUF loader does).
``qwen2``/``qwen3``/``phi3`` files are written unpermuted (their llama.cpp RoPE is the NEOX, rotate-half kind).

Per architecture (tensor names as in ``gguf.constants.MODEL_TENSORS``):

* ``qwen2``: ``blk.N.attn_{q,k,v}.bias`` -> ``LlamaConfig.qkv_bias``;
* ``qwen3``: ``blk.N.attn_{q,k}_norm.weight`` -> ``LlamaConfig.qk_norm``;
* ``phi3``: the fused ``blk.N.attn_qkv.weight`` (``[(nh + 2 nkv) hd, H]``) is split into q/k/v, and the
  fused ``blk.N.ffn_up.weight`` (``[2 I, H]``: gate rows, then up rows) into gate and up;
  ``rope.dimension_count < head_dim`` is partial rotary. LongRoPE (Phi-3.5, Phi-3 128k, Phi-4-mini):
  ``rope_factors_short.weight`` divides the frequencies and ``rope.scaling.attn_factor`` scales cos/sin,
  with the context capped at ``rope.scaling.original_context_length``, where llama.cpp and transformers
  both use the short factors (``rope_factors_long.weight`` is not read).

A file's other biases (``attn_output.bias``, ``ffn_*.bias``) are refused by name. A sliding window
(``{arch}.attention.sliding_window``) shorter than the context caps the context length at the window, so
no position ever attends past it.

Every hyperparameter is read from the metadata (``{arch}.*`` keys): block count, widths, head counts,
``attention.key_length`` (head dim), RMS eps, ``rope.freq_base``, ``rope.dimension_count``,
``rope.scaling.{type,factor,original_context_length}``; a ``rope_freqs.weight`` tensor (llama3 scaling
as llama.cpp writes it) is kept as per-frequency divisors. ``output.weight`` is used when present,
otherwise the embedding is tied.

Sources followed: GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), llama.cpp
``convert_hf_to_gguf.py`` and ``conversion/{llama,qwen,phi}.py``, gguf-py ``gguf/constants.py`` and
``gguf/quants.py``, transformers ``integrations/ggml.py`` / ``modeling_gguf_pytorch_utils.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from backend.loaders.gguf_file import GGUFFile
from backend.loaders.memory import LazyTensors, LoadSize, MemoryBudget
from backend.models.llama import LlamaConfig, LlamaWeights
from backend.protocol import ModelCard

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3")
#: architectures whose ``attn_q``/``attn_k`` rows llama.cpp's converter permutes (``LlamaModel.permute``)
PERMUTED_ARCHS = ("llama",)
_BIASED = ("attn_q", "attn_k", "attn_v")


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
    """Raw 4-bit codes of a Q4_0/Q4_1/Q4_K tensor, for the int4 matmul path (``LlamaModel`` ``int4``).

    Args:
        data: the tensor's bytes as ``GGUFFile`` (and ``gguf.GGUFReader``) give them, ``[N, K/QK * block_bytes] uint8``.
        qtype: its ``gguf.GGMLQuantizationType``.

    Returns:
        ``(codes [N, K] uint8 in 0..15, scale [N, K/32] float32, zero [N, K/32] float32)`` with
        ``w = (code - 8) * scale + zero`` (torch's int4pack convention; Q4_1: ``d*q + m`` gives
        ``scale = d, zero = m + 8d``; Q4_0: ``d*(q-8)`` gives ``zero = 0``; Q4_K, per 32-weight sub-block
        ``j`` of a 256-weight super-block: ``d*sc_j*q - dmin*m_j`` gives ``scale = d*sc_j``,
        ``zero = 8*scale - dmin*m_j``, with the 6-bit ``sc``/``m`` unpacked as ``gguf.quants.Q4_K`` does), or
        None for other types.
    """
    import gguf

    Q = gguf.GGMLQuantizationType
    n = data.shape[0]
    if qtype == Q.Q4_K:
        blocks = np.ascontiguousarray(data).reshape(-1, 144)  # d, dmin (f16), scales[12], qs[128]
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [B, 8] each
        scale = d * sc.astype(np.float32)
        zero = 8.0 * scale - dmin * m.astype(np.float32)
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(n, -1)
        return (
            torch.from_numpy(np.ascontiguousarray(codes)),
            torch.from_numpy(scale.reshape(n, -1).copy()),
            torch.from_numpy(zero.reshape(n, -1).copy()),
        )
    if qtype not in (Q.Q4_0, Q.Q4_1):
        return None
    bb = 20 if qtype == Q.Q4_1 else 18
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


def _field(reader: GGUFFile, key: str, default=None):
    v = reader.metadata.get(key)
    return default if v is None else v


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


def read_gguf_config(reader: GGUFFile) -> tuple[LlamaConfig, dict]:
    """Build a ``LlamaConfig`` from a ``GGUFFile``'s metadata (and its tensor names, for the flags).

    Returns:
        ``(config, meta)`` where ``meta`` holds the tokenizer / card fields.

    Raises:
        ValueError: an unsupported architecture, rope scaling (phi3 LongRoPE, yarn) or bias tensor, or
            required metadata missing.
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

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
    for name in names:
        parts = name.split(".")
        if parts[-1] == "bias" and not (len(parts) == 4 and parts[0] == "blk" and parts[2] in _BIASED):
            raise ValueError(
                f"tensor '{name}' is not supported (biases are read on attn_q/attn_k/attn_v only)"
            )
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        toks = reader.metadata.get("tokenizer.ggml.tokens")
        vocab = len(toks) if toks is not None else int(names["token_embd.weight"].shape[1])
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
    context = int(_field(reader, f"{arch}.context_length", 2048))
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    if 0 < window < context:
        context = window
    attention_factor = 1.0
    if "rope_factors_short.weight" in names:  # LongRoPE: the short factors, within the original context
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if not orig:
            raise ValueError(
                f"LongRoPE file without GGUF metadata {arch}.rope.scaling.original_context_length"
            )
        context = min(context, int(orig))
        attention_factor = float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0))
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
        context_length=context,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_attention_factor=attention_factor,
        architecture=arch,
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


def _dequantize(t) -> torch.Tensor:
    """A ``GGUFTensor`` as a float32 CPU tensor (``gguf.quants.dequantize``; torch shape = GGUF dims reversed).

    Raises:
        ValueError: a type gguf cannot dequantize.
    """
    import gguf

    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"tensor '{t.name}' has type {t.tensor_type.name}, which gguf cannot dequantize"
        ) from None
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr)


def _fused_rows(cfg: LlamaConfig, kind: str, rows: int) -> list[tuple[str, int]]:
    """The ``(kind, rows)`` parts a file tensor of ``rows`` rows gives (see ``_split_fused``)."""
    if kind == "attn_qkv":
        return [("attn_q", cfg.num_heads * cfg.head_dim)] + [
            (k, cfg.num_kv_heads * cfg.head_dim) for k in ("attn_k", "attn_v")
        ]
    if kind == "ffn_up" and rows == 2 * cfg.intermediate_size:
        return [("ffn_gate", cfg.intermediate_size), ("ffn_up", cfg.intermediate_size)]
    return [(kind, rows)]


def _split_fused(
    cfg: LlamaConfig, kind: str, ten: torch.Tensor, raw
) -> Iterator[tuple[str, torch.Tensor, tuple]]:
    """phi3's fused matrices as their llama parts: ``attn_qkv`` -> ``attn_q``/``attn_k``/``attn_v``,
    ``ffn_up [2 I, H]`` -> ``ffn_gate`` (first ``I`` rows) and ``ffn_up``; any other tensor as it is.
    ``raw`` (the ``q4_groups`` triple or None) is split along the same rows."""
    if kind == "attn_qkv":
        sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        kinds = ("attn_q", "attn_k", "attn_v")
    elif kind == "ffn_up" and ten.shape[0] == 2 * cfg.intermediate_size:
        sizes, kinds = [cfg.intermediate_size] * 2, ("ffn_gate", "ffn_up")
    else:
        yield kind, ten, raw
        return
    if ten.shape[0] != sum(sizes):
        raise ValueError(f"fused tensor '{kind}' has {ten.shape[0]} rows, expected {sum(sizes)}")
    parts = ten.split(sizes, 0)
    raws = list(zip(*(r.split(sizes, 0) for r in raw))) if raw is not None else [None] * len(sizes)
    yield from zip(kinds, parts, raws)


def load_gguf(
    path: str | Path, *, keep_q4: bool = False, budget: MemoryBudget | None = None
) -> tuple[LlamaWeights, ModelCard]:
    """Read and dequantize a llama-family GGUF file.

    Args:
        path: the ``.gguf`` file.
        keep_q4: also keep the raw 4-bit codes of every Q4_0/Q4_1/Q4_K layer matrix in ``weights.q4``
            (see ``q4_groups``; Q/K rows un-permuted like the float weights).
        budget: checked against the tensors' sizes (from their shapes) before anything is dequantized.

    Returns:
        ``(weights, card)``: float32 CPU tensors in HF naming (see ``LlamaWeights``; a ``LazyTensors``: each
        is read and dequantized when first taken, the errors of that step too) and a ``ModelCard``
        (name = the file's stem, architecture, context length, vocab size, BOS, stop ids = eos + eot + eom,
        ``tokenizer.chat_template``, quantization = the file type name, e.g. ``"Q4_1"``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file (magic), a truncated or corrupt one, no tensors (a vocab-only file),
            unsupported architecture, missing metadata or tensors, a tensor of the wrong shape (the
            message names the GGUF tensor: ``tensor 'blk.0.attn_q.weight' missing``), a tensor type
            ``gguf`` cannot dequantize, or weights over the memory budget.
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
        reader = GGUFFile(path)
    except (IndexError, KeyError, OverflowError, MemoryError) as exc:
        # garbage where a header field should be (a huge count or length)
        raise ValueError(f"truncated or corrupt GGUF file: {type(exc).__name__}: {exc}") from None
    if not reader.tensors:
        raise ValueError("no tensors in the file (a vocab-only GGUF?): tensor 'token_embd.weight' missing")
    cfg, meta = read_gguf_config(reader)
    Q = gguf.GGMLQuantizationType
    if budget is not None:
        names_ = {t.name: t for t in reader.tensors}
        n4 = sum(int(t.n_elements) for t in reader.tensors if t.tensor_type in (Q.Q4_0, Q.Q4_1, Q.Q4_K))
        kept = [names_[n].n_elements for n in ("token_embd.weight", "output.weight") if n in names_]
        layer = [t.n_elements for t in reader.tensors if t.name.startswith("blk.")]
        size = LoadSize(
            params=sum(int(t.n_elements) for t in reader.tensors),
            q4_params=n4 if keep_q4 else 0,
            head_params=kept[-1] if kept else 0,
            kept=sum(kept),
            largest=max(layer, default=0),
            file_bytes=path.stat().st_size,
        )
        budget.check(size)
    permuted = cfg.architecture in PERMUTED_ARCHS
    tensors, q4 = LazyTensors(), LazyTensors()
    rope_freqs = None
    four_bit = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
    for t in reader.tensors:
        if t.name in ("rope_freqs.weight", "rope_factors_short.weight"):
            rope_freqs = _dequantize(t).reshape(-1)
            continue
        shape = tuple(reversed(t.shape))  # torch order: [rows, row length]
        if t.name in _GLOBAL_MAP:
            LazyTensors.defer(
                lambda t=t: {"w": {_GLOBAL_MAP[t.name]: _dequantize(t)}},
                {"w": (tensors, {_GLOBAL_MAP[t.name]: shape})},
            )
            continue
        parts = t.name.split(".")
        if not (len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias")):
            continue  # other tensors (e.g. rope caches of old files) are ignored
        i, leaf = int(parts[1]), parts[3]
        names = {}
        for kind, rows in _fused_rows(cfg, parts[2], shape[0]):
            if kind in _LAYER_MAP:
                names[f"model.layers.{i}.{_LAYER_MAP[kind]}.{leaf}"] = (kind, (rows, *shape[1:]))
        with_q4 = keep_q4 and len(shape) == 2 and t.tensor_type in four_bit

        def make(t=t, kind=parts[2], i=i, leaf=leaf, with_q4=with_q4) -> dict[str, dict]:
            ten = _dequantize(t)
            raw = q4_groups(t.data, t.tensor_type) if with_q4 else None
            out: dict[str, dict] = {"w": {}, "q4": {}}
            for part_kind, part, part_raw in _split_fused(cfg, kind, ten, raw):
                if part_kind not in _LAYER_MAP:
                    continue
                heads = (
                    {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(part_kind) if permuted else None
                )
                name = f"model.layers.{i}.{_LAYER_MAP[part_kind]}.{leaf}"
                out["w"][name] = (unpermute_qk(part, heads) if heads else part).contiguous()
                if part_raw is not None:
                    out["q4"][name] = (
                        tuple(unpermute_qk(r, heads).contiguous() for r in part_raw) if heads else part_raw
                    )
            return out

        shapes = {name: shp for name, (_, shp) in names.items()}
        parts_ = {"w": (tensors, shapes)}
        if with_q4:
            parts_["q4"] = (q4, dict.fromkeys(shapes, ()))
        LazyTensors.defer(make, parts_)
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
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[-1] in ("weight", "bias"):
        module = ".".join(parts[3:-1])
        for g, h in _LAYER_MAP.items():
            if h == module:
                return f"blk.{parts[2]}.{g}.{parts[-1]}"
    return hf_name


def check_tensors(
    cfg: LlamaConfig, tensors: dict[str, torch.Tensor] | LazyTensors, *, display: Callable[[str], str] = str
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
        if cfg.qkv_bias:
            want[p + "self_attn.q_proj.bias"] = (cfg.num_heads * hd,)
            want[p + "self_attn.k_proj.bias"] = (cfg.num_kv_heads * hd,)
            want[p + "self_attn.v_proj.bias"] = (cfg.num_kv_heads * hd,)
        if cfg.qk_norm:
            want[p + "self_attn.q_norm.weight"] = (hd,)
            want[p + "self_attn.k_norm.weight"] = (hd,)
    for name, shape in want.items():
        if name not in tensors:
            raise ValueError(f"tensor '{display(name)}' missing")
        have = tensors.shape(name) if isinstance(tensors, LazyTensors) else tuple(tensors[name].shape)
        if have != shape:
            raise ValueError(f"tensor '{display(name)}' has shape {have}, expected {shape}")
