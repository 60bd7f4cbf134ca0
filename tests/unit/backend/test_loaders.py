"""Loaders: HF directory == GGUF (real weights), Q/K permutation round trip, llama3 RoPE in both formats.

Run: ``.venv/bin/python -m pytest tests/unit/backend/test_loaders.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from backend.batch import SeqChunk
from backend.loaders.gguf import load_gguf, permute_qk, unpermute_qk
from backend.model_runner import ModelRunner
from backend.models.llama import LlamaConfig, rope_inv_freq


def _write_hf_dir(path, weights, card, *, max_pos: int, tie: bool) -> None:
    cfg = weights.config
    path.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie,
        "bos_token_id": card.bos_token_id,
        "eos_token_id": card.eos_token_ids[0],
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": card.chat_template}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [card.eos_token_ids[0], 7]}))
    tensors = {k: v.contiguous() for k, v in weights.tensors.items()}
    names = sorted(tensors)
    half = len(names) // 2  # two shards
    save_file({k: tensors[k] for k in names[:half]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(path / "model-00002-of-00002.safetensors"))


def test_hf_dir_matches_gguf(tmp_path, model_path, chat_fixtures) -> None:
    """An HF directory (two safetensors shards, tied embeddings) written from the GGUF's un-permuted
    float32 weights gives bit-identical logits to the GGUF, within 1e-3 of the fixtures."""
    weights, card = load_gguf(model_path)
    hf_dir = tmp_path / "smollm2-hf"
    _write_hf_dir(hf_dir, weights, card, max_pos=card.context_length, tie=True)
    del weights
    hf = ModelRunner(str(hf_dir), num_kv_blocks=64)
    assert hf.card.name == "smollm2-hf"
    assert hf.card.eos_token_ids == [2, 7]
    assert hf.card.chat_template == card.chat_template
    assert hf.card.quantization == "float32"
    gg = ModelRunner(model_path, num_kv_blocks=64)
    for case in chat_fixtures[:2]:
        ids = case["prompt_ids"]
        bt = list(range(-(-len(ids) // 16)))
        a = hf.execute([SeqChunk(ids, 0, bt, True)])[0]
        b = gg.execute([SeqChunk(ids, 0, bt, True)])[0]
        assert torch.equal(a, b)
        ref_ids = torch.tensor([i for i, _ in case["last_logits_top50"]])
        ref = torch.tensor([v for _, v in case["last_logits_top50"]])
        assert (a[ref_ids] - ref).abs().max().item() < 1e-3


def test_permute_round_trip() -> None:
    w = torch.randn(3 * 64, 10)
    assert torch.equal(unpermute_qk(permute_qk(w, 3), 3), w)
    assert not torch.equal(permute_qk(w, 3), w)


def _tiny_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    t = {
        "model.embed_tokens.weight": r(cfg.vocab_size, H),
        "model.norm.weight": 1 + r(H),
        "lm_head.weight": r(cfg.vocab_size, H),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + r(H)
        t[p + "post_attention_layernorm.weight"] = 1 + r(H)
        t[p + "self_attn.q_proj.weight"] = r(cfg.num_heads * hd, H)
        t[p + "self_attn.k_proj.weight"] = r(cfg.num_kv_heads * hd, H)
        t[p + "self_attn.v_proj.weight"] = r(cfg.num_kv_heads * hd, H)
        t[p + "self_attn.o_proj.weight"] = r(H, cfg.num_heads * hd)
        t[p + "mlp.gate_proj.weight"] = r(inter, H)
        t[p + "mlp.up_proj.weight"] = r(inter, H)
        t[p + "mlp.down_proj.weight"] = r(H, inter)
    return t


def test_tiny_gguf_with_output_and_llama3_rope(tmp_path) -> None:
    """A random llama (untied output.weight, llama3 RoPE) written as GGUF (F32, permuted Q/K,
    ``rope_freqs.weight``) and as an HF directory (``rope_scaling: llama3``): same logits."""
    gguf = pytest.importorskip("gguf")
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        context_length=512,
        rope_scaling=scaling,
    )
    t = _tiny_weights(cfg)
    # HF directory
    hf_dir = tmp_path / "tiny-hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 97,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "rms_norm_eps": 1e-6,
                "rope_theta": 500000.0,
                "rope_scaling": scaling,
                "max_position_embeddings": 512,
                "tie_word_embeddings": False,
                "eos_token_id": [5, 6],
                "bos_token_id": 4,
            }
        )
    )
    save_file(t, str(hf_dir / "model.safetensors"))
    # GGUF file, as llama.cpp's converter writes it
    plain = LlamaConfig(**{**cfg.__dict__, "rope_scaling": None})
    factors = rope_inv_freq(plain) / rope_inv_freq(cfg)
    gpath = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(gpath), "llama")
    w.add_name("tiny")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(97)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_bos_token_id(4)
    w.add_eos_token_id(5)
    w.add_eot_token_id(6)
    w.add_chat_template("{{ messages }}")
    np32 = lambda x: x.numpy().astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", np32(t["model.embed_tokens.weight"]))
    w.add_tensor("output_norm.weight", np32(t["model.norm.weight"]))
    w.add_tensor("output.weight", np32(t["lm_head.weight"]))
    w.add_tensor("rope_freqs.weight", np32(factors))
    for i in range(2):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", np32(t[p + "input_layernorm.weight"]))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np32(t[p + "post_attention_layernorm.weight"]))
        w.add_tensor(f"blk.{i}.attn_q.weight", np32(permute_qk(t[p + "self_attn.q_proj.weight"], 4)))
        w.add_tensor(f"blk.{i}.attn_k.weight", np32(permute_qk(t[p + "self_attn.k_proj.weight"], 2)))
        w.add_tensor(f"blk.{i}.attn_v.weight", np32(t[p + "self_attn.v_proj.weight"]))
        w.add_tensor(f"blk.{i}.attn_output.weight", np32(t[p + "self_attn.o_proj.weight"]))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", np32(t[p + "mlp.gate_proj.weight"]))
        w.add_tensor(f"blk.{i}.ffn_up.weight", np32(t[p + "mlp.up_proj.weight"]))
        w.add_tensor(f"blk.{i}.ffn_down.weight", np32(t[p + "mlp.down_proj.weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    a = ModelRunner(str(gpath), num_kv_blocks=32, block_size=8)
    b = ModelRunner(str(hf_dir), num_kv_blocks=32, block_size=8)
    assert a.card.eos_token_ids == [5, 6] and a.card.bos_token_id == 4 and a.card.quantization == "F32"
    assert b.card.eos_token_ids == [5, 6]
    assert not a.config.tie_word_embeddings
    ids = [(i * 7) % 97 for i in range(150)]  # past original_max_position_embeddings
    bt = list(range(19))
    la = a.execute([SeqChunk(ids, 0, bt, True)])
    lb = b.execute([SeqChunk(ids, 0, bt, True)])
    assert (la - lb).abs().max().item() < 1e-4
    # and the scaling matters (a model without it differs)
    assert not torch.allclose(rope_inv_freq(plain), rope_inv_freq(cfg))
