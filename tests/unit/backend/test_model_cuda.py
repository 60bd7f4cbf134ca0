"""The model runner on CUDA (skipped without a GPU): a random llama in an HF directory, CUDA vs CPU float32.

The default model cannot travel to the GPU machine (98 MB), so these tests build a small random
``LlamaForCausalLM`` directory and compare ``ModelRunner.execute`` on CUDA (float32 and bfloat16)
with the CPU float32 run, including chunked prefill and a mixed decode/prefill batch.

Run: ``python -m pytest tests/unit/backend/test_model_cuda.py`` on a CUDA machine.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from backend.batch import SeqChunk
from backend.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def write_random_llama(
    path,
    *,
    vocab=1000,
    hidden=256,
    inter=512,
    layers=4,
    heads=8,
    kv_heads=2,
    seed=0,
    dtype=torch.float32,
    tie=True,
    std=0.05,
) -> None:
    """Write a random LlamaForCausalLM directory (config.json + model.safetensors) at ``path``."""
    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads

    def r(*shape, base=0.0):
        return (base + torch.randn(*shape, generator=g) * std).to(dtype)

    t = {
        "model.embed_tokens.weight": r(vocab, hidden, base=0.0) * 20,
        "model.norm.weight": r(hidden, base=1.0),
    }
    if not tie:
        t["lm_head.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = r(hidden, base=1.0)
        t[p + "post_attention_layernorm.weight"] = r(hidden, base=1.0)
        t[p + "self_attn.q_proj.weight"] = r(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = r(kv_heads * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = r(kv_heads * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = r(hidden, heads * hd)
        t[p + "mlp.gate_proj.weight"] = r(inter, hidden)
        t[p + "mlp.up_proj.weight"] = r(inter, hidden)
        t[p + "mlp.down_proj.weight"] = r(hidden, inter)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": vocab,
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": tie,
                "eos_token_id": 2,
                "bos_token_id": 1,
                "torch_dtype": str(dtype).replace("torch.", ""),
            }
        )
    )
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rand") / "rand-llama"
    write_random_llama(d)
    return d


def _run(r: ModelRunner, ids, decode_tokens):
    bt = list(range(40))
    out = [r.execute([SeqChunk(ids, 0, bt, True)])[0].float().cpu()]
    for j, t in enumerate(decode_tokens):
        out.append(r.execute([SeqChunk([t], len(ids) + j, bt, True)])[0].float().cpu())
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 0.1)])
def test_cuda_matches_cpu(model_dir, dtype, tol) -> None:
    ids = [(i * 13) % 1000 for i in range(300)]
    dec = [5, 77, 300, 999, 4]
    ref = _run(ModelRunner(str(model_dir), num_kv_blocks=64), ids, dec)
    cu = ModelRunner(str(model_dir), device="cuda", dtype=dtype, num_kv_blocks=64)
    assert cu.card.device.startswith("cuda") and cu.card.dtype == dtype
    got = _run(cu, ids, dec)
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= tol * max(1.0, scale), f"{dtype}: max err {err} (logit scale {scale})"
    if dtype == "float32":
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_cuda_mixed_batch_and_chunks(model_dir) -> None:
    r = ModelRunner(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=128)
    a = [(i * 7) % 1000 for i in range(50)]
    b = [(i * 11) % 1000 for i in range(90)]
    whole_b = r.execute([SeqChunk(b, 0, list(range(0, 6)), True)])[0]
    whole_a = r.execute([SeqChunk(a, 0, list(range(10, 14)), True)])[0]
    dec_a = r.execute([SeqChunk([3], 50, list(range(10, 14)), True)])[0]
    # batched: a prefills then decodes while b prefills in chunks, shuffled block tables
    ta, tb = [60, 55, 70, 41], [99, 80, 81, 120, 7, 33]
    o1 = r.execute([SeqChunk(a, 0, ta, True), SeqChunk(b[:37], 0, tb, False)])
    o2 = r.execute([SeqChunk([3], 50, ta, True), SeqChunk(b[37:], 37, tb, True)])
    assert o1.shape[0] == 1 and o2.shape[0] == 2
    assert (o1[0] - whole_a).abs().max().item() < 1e-3
    assert (o2[0] - dec_a).abs().max().item() < 1e-3
    assert (o2[1] - whole_b).abs().max().item() < 1e-3
