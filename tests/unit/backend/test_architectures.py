"""Architectures against transformers: tiny random-weight llama (tied, untied + llama3 RoPE), mistral, qwen2,
qwen3 and phi3 (partial rotary; LongRoPE) models, written as GGUF and as HF safetensors (``tests/plugins/tiny_models.py``),
loaded by the backend in float32, give the logits of transformers' own implementation on the same weights
(``AutoModelForCausalLM.from_pretrained`` of the HF directory) within 1e-4: at the end of the prefill and
for 16 decode steps through the paged KV cache (block size 8, a shuffled block table), with the C++ fused
layer ops and with plain torch ops.

Also: every GGUF tensor type ``gguf.quants.dequantize`` handles loads and gives its dequantized values
(the 4-bit types also as int4 codes); the memory budget refuses a model with one line; HF directories
with a file missing, and unsupported variants, fail with one line naming the file or the variant.

Run: ``.venv/bin/python -m pytest tests/unit/backend/test_architectures.py``.
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from plugins.tiny_models import TinySpec, gguf_name, tiny_tensors, write_tiny_gguf, write_tiny_hf

from backend.__main__ import main as backend_main
from backend.batch import SeqChunk
from backend.loaders.gguf import load_gguf, unpermute_qk
from backend.model_runner import ModelRunner
from backend.protocol import EXIT_MODEL_LOAD_FAILED

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

BS = 8
PROMPT, DECODE = 21, 16
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SPECS = {
    "llama-tied": TinySpec(arch="llama", tied=True),
    "llama-untied-llama3": TinySpec(arch="llama", tied=False, rope_theta=500000.0, rope_scaling=LLAMA3),
    "mistral": TinySpec(arch="mistral", tied=False, seed=5),
    "qwen2": TinySpec(arch="qwen2", tied=True, seed=1),
    "qwen3": TinySpec(arch="qwen3", tied=False, head_dim=32, seed=2),  # heads * head_dim != hidden, as Qwen3
    "phi3": TinySpec(arch="phi3", tied=False, partial_rotary_factor=0.5, seed=3),
    "phi3-longrope": TinySpec(
        arch="phi3",
        tied=False,
        seed=4,
        context_length=1024,
        rope_scaling={
            "rope_type": "longrope",
            "long_factor": [1.0 + i for i in range(8)],
            "short_factor": [1.0 + 0.3 * i for i in range(8)],
            "original_max_position_embeddings": 64,
        },
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core CPU a tiny model's step took 200 ms with two (OpenMP barriers
    waiting on a descheduled thread) and 2 ms with one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple]:
    """Per spec: ``(gguf path, hf dir, reference logits [PROMPT + DECODE, V] of transformers, token ids)``."""
    out = {}
    root = tmp_path_factory.mktemp("tiny")
    for key, spec in SPECS.items():
        hf_dir = write_tiny_hf(root / f"{key}-hf", spec, shards=2 if key == "qwen3" else 1)
        path = write_tiny_gguf(root / f"{key}.gguf", spec=spec)
        ids = random.Random(spec.seed).choices(range(spec.vocab_size), k=PROMPT + DECODE)
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(hf_dir), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0]
        out[key] = (path, hf_dir, ref, ids)
    return out


def _prefill_and_decode(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits ``[1 + DECODE, V]``: after the prompt (one prefill), then after each of DECODE one-token steps."""
    bt = list(range(-(-len(ids) // BS)))
    random.Random(len(ids)).shuffle(bt)
    rows = [runner.execute([SeqChunk(ids[:PROMPT], 0, bt, True)])[0]]
    for pos in range(PROMPT, PROMPT + DECODE):
        rows.append(runner.execute([SeqChunk([ids[pos]], pos, bt, True)])[0])
    return torch.stack(rows)


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
@pytest.mark.parametrize("key", list(SPECS))
def test_logits_match_transformers(key: str, fmt: str, written) -> None:
    path, hf_dir, ref, ids = written[key]
    spec = SPECS[key]
    runner = ModelRunner(
        str(path if fmt == "gguf" else hf_dir), dtype="float32", block_size=BS, num_kv_blocks=16
    )
    cfg = runner.config
    assert runner.card.architecture == ("llama" if spec.arch == "mistral" else spec.arch)
    assert cfg.tie_word_embeddings == spec.tied
    assert (cfg.qkv_bias, cfg.qk_norm) == (spec.arch == "qwen2", spec.arch == "qwen3")
    assert cfg.rope_dim == spec.rope_dim
    if key == "phi3-longrope":  # the short factors hold up to the original context: the cap
        assert runner.card.context_length == 64 and cfg.rope_attention_factor == pytest.approx(
            (1 + 2 / 3) ** 0.5
        )
    want = ref[PROMPT - 1 :]
    kern = runner.model.cpu_kernels
    modes = ["torch"] + (["fused"] if kern is not None else [])
    for mode in modes:
        runner.model.cpu_kernels = kern if mode == "fused" else None
        got = _prefill_and_decode(runner, ids)
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"{key} {fmt} {mode}: max logit error {err}"


@pytest.mark.parametrize("key", ["qwen2", "qwen3"])
def test_bfloat16_close_to_float32(key: str, written) -> None:
    """The default (bfloat16, oneDNN-prepacked) path with q/k/v biases and q/k norms: near the reference."""
    path, _, ref, ids = written[key]
    runner = ModelRunner(str(path), dtype="bfloat16", block_size=BS, num_kv_blocks=16)
    got = _prefill_and_decode(runner, ids)
    assert (got - ref[PROMPT - 1 :]).abs().max().item() < 0.15


# ---------------------------------------------------------------------------------------------- quant types
QSPEC = TinySpec(
    arch="llama",
    tied=False,
    vocab_size=64,
    hidden_size=256,
    intermediate_size=256,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    seed=7,
)


def _dequantizable() -> list:
    """Every tensor type ``gguf.quants.dequantize`` implements (probed on one zero block)."""
    out = []
    for qt in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        try:
            gguf.quants.dequantize(np.zeros((1, size * (256 // block)), dtype=np.uint8), qt)
        except (NotImplementedError, ValueError, KeyError):
            continue
        if 256 % block == 0 and qt not in (gguf.GGMLQuantizationType.F64,):
            out.append(qt)
    return out


def _encoder(qt):
    """Matrices in ``qt``: quantized by gguf where it can, else random blocks with small scales."""
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(int(qt))

    def encode(name: str, arr: np.ndarray):
        if arr.ndim < 2:
            return arr.astype(np.float32), Q.F32
        if qt == Q.F32:
            return arr.astype(np.float32), qt
        if qt == Q.F16:
            return arr.astype(np.float16), qt
        try:
            return gguf.quants.quantize(arr.astype(np.float32), qt), qt
        except NotImplementedError:
            pass
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(arr.shape[0], arr.shape[1] // block, size), dtype=np.uint8)
        if qt == Q.Q4_K:  # every bit of the 6-bit scales and codes; small f16 d / dmin
            raw[..., 0:4] = np.frombuffer(np.array([3e-4, 2e-4], dtype=np.float16).tobytes(), np.uint8)
        else:  # f16 fields below 0.25 and finite whatever the layout
            raw &= 0x33
        return raw.reshape(arr.shape[0], -1), qt

    return encode


@pytest.mark.parametrize("qt", _dequantizable(), ids=lambda q: q.name)
def test_every_quant_type_loads(qt, tmp_path) -> None:
    """Each type: the loaded float32 tensors equal ``gguf.quants.dequantize`` of the file's bytes (Q/K rows
    un-permuted), the 4-bit types' int4 codes give the same values, and a float32 step runs."""
    path = write_tiny_gguf(tmp_path / f"{qt.name}.gguf", spec=QSPEC, encode=_encoder(qt))
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    weights, _ = load_gguf(path, keep_q4=True)
    for name in tiny_tensors(QSPEC):
        t = raw[gguf_name(name)]
        want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            want = unpermute_qk(want, QSPEC.num_heads if "q_proj" in name else QSPEC.num_kv_heads)
        assert torch.equal(weights.tensors[name], want), name
        if name in weights.q4:
            codes, scale, zero = weights.q4[name]
            groups = (codes.float() - 8).reshape(codes.shape[0], -1, 32) * scale[..., None] + zero[..., None]
            assert torch.allclose(groups.reshape(want.shape), want, rtol=1e-5, atol=1e-6), name
    Q = gguf.GGMLQuantizationType
    assert bool(weights.q4) == (qt in (Q.Q4_0, Q.Q4_1, Q.Q4_K))
    runner = ModelRunner(str(path), dtype="float32", block_size=BS, num_kv_blocks=4)
    logits = runner.execute([SeqChunk([1, 2, 3], 0, [0], True)])
    assert logits.shape == (1, QSPEC.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_path_covers_4bit_types(name: str, tmp_path) -> None:
    """A Q4_0/Q4_1/Q4_K file's layer matrices take the packed int4 matmul for decode steps (with
    ``int4_max_rows``; off by default: the default is batch invariant, docs/kernels.md) and give the logits of the dense matmuls of the same dequantized weights: compared in
    float32, where the two differ by rounding only (measured 1.3e-5 at logits of about 10). A qwen2: the
    int4 matmul adds the q/k/v biases."""
    qt = gguf.GGMLQuantizationType[name]
    spec = dataclasses.replace(QSPEC, arch="qwen2")
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", spec=spec, encode=_encoder(qt))
    default = ModelRunner(str(path), dtype="bfloat16", block_size=BS, num_kv_blocks=4)
    assert default.model.int4_max_rows == 0 and default.model.layers[0][1].packed is None
    bf16_int4 = ModelRunner(str(path), dtype="bfloat16", block_size=BS, num_kv_blocks=4, int4_max_rows=4)
    assert bf16_int4.model.layers[0][1].packed is not None
    fast = ModelRunner(str(path), dtype="float32", block_size=BS, num_kv_blocks=4, int4_max_rows=4)
    dense = ModelRunner(str(path), dtype="float32", block_size=BS, num_kv_blocks=4)
    assert fast.model.layers[0][1].packed is not None and dense.model.int4_max_rows == 0
    ids = [3, 9, 27, 17]
    a = torch.cat([fast.execute([SeqChunk([t], i, [0], True)]) for i, t in enumerate(ids)])
    b = torch.cat([dense.execute([SeqChunk([t], i, [0], True)]) for i, t in enumerate(ids)])
    assert (a - b).abs().max().item() < 1e-4


# ---------------------------------------------------------------------------------------------- refusals
def test_memory_budget_refuses_in_one_line(tmp_path, written, monkeypatch, capsys) -> None:
    """Over the budget: ``ModelRunner`` raises one line naming the size and the budget; the backend's ``main``
    prints the one load-error line and exits 3 (the status the supervisor does not restart on)."""
    path = written["qwen2"][0]
    with pytest.raises(ValueError, match=r"model needs .* GiB .*over the memory budget of 0\.0 GiB") as exc:
        ModelRunner(str(path), dtype="float32", num_kv_blocks=4, memory_budget=1000)
    assert "\n" not in str(exc.value)
    ModelRunner(str(path), dtype="float32", num_kv_blocks=4, memory_budget=10**9)  # fits
    with pytest.raises(ValueError, match=r"model needs .* over the memory budget of 0\.0 GiB"):
        ModelRunner(str(written["qwen2"][1]), dtype="float32", num_kv_blocks=4, memory_budget=1000)  # HF dir
    monkeypatch.setenv("GATEWAY_MEMORY_BUDGET", "1KiB")
    status = backend_main(["--model", str(path), "--listen", f"unix:{tmp_path / 's'}", "--dtype", "float32"])
    assert status == EXIT_MODEL_LOAD_FAILED == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot load model {path}: model needs "), lines
    assert "over the memory budget of 0.0 GiB ($GATEWAY_MEMORY_BUDGET; pass --memory-budget" in lines[0]


def test_budget_estimate_of_a_1_5b_qwen2() -> None:
    """Qwen2.5-1.5B (28 layers, H 1536, I 8960, 12/2 heads of 128, vocab 151936, tied): its default-mode
    estimate (bfloat16 on CPU, every matrix 4-bit in a 0.6 byte-per-parameter file, 512 MiB KV; 9.6 GiB)
    is under 24 GiB."""
    from backend.loaders.memory import LoadSize, MemoryBudget

    H, inter, L, V = 1536, 8960, 28, 151936
    per_layer = H * (12 * 128) * 2 + H * (2 * 128) * 2 + 3 * H * inter + 2 * H + 2 * 128 * 2 + 12 * 128
    params = V * H + L * per_layer + H
    assert 1.5e9 < params < 1.6e9
    budget = MemoryBudget(limit=24 << 30, source="24 GiB", compute_bytes=2, extra_bytes=512 << 20)
    size = LoadSize(params, params, V * H, V * H, H * inter, int(0.6 * params))
    assert 9 << 30 < budget.need(size) < 10 << 30
    budget.check(size)


def test_hf_missing_files_name_the_file(tmp_path) -> None:
    spec = SPECS["qwen2"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json not found in .*: pass a Hugging Face model"):
        ModelRunner(str(empty), num_kv_blocks=4)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match="config.json lacks 'hidden_size'"):
        ModelRunner(str(no_weights), num_kv_blocks=4)
    sharded = write_tiny_hf(tmp_path / "sharded", spec, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors \(listed in model"):
        ModelRunner(str(sharded), num_kv_blocks=4)
    (sharded / "model.safetensors.index.json").unlink()
    (sharded / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file in"):
        ModelRunner(str(sharded), num_kv_blocks=4)


def _edit_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_variants_are_one_line(tmp_path) -> None:
    """A yarn rope type, an o_proj bias, an unknown architecture: one-line ValueErrors; a sliding
    window caps the context length at the window."""
    phi = write_tiny_hf(tmp_path / "phi", SPECS["phi3"])
    _edit_config(phi, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match=r"rope type 'yarn' .* is not supported"):
        ModelRunner(str(phi), num_kv_blocks=4)
    _edit_config(phi, rope_scaling=None, sliding_window=100)
    assert ModelRunner(str(phi), num_kv_blocks=4).card.context_length == 100
    _edit_config(phi, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"unsupported architectures \['GPTNeoXForCausalLM'\]"):
        ModelRunner(str(phi), num_kv_blocks=4)

    phi3 = SPECS["phi3"]
    o_bias = write_tiny_gguf(
        tmp_path / "o.gguf", spec=phi3, extra={"blk.0.attn_output.bias": np.zeros(64, np.float32)}
    )
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_output.bias' is not supported"):
        load_gguf(o_bias)


def test_gguf_file_reads_what_gguf_reader_reads(tmp_path, written) -> None:
    """``GGUFFile`` (the loader's reader) gives ``gguf.GGUFReader``'s metadata and tensor views, and a file cut
    anywhere is a one-line ``ValueError``."""
    from backend.loaders.gguf_file import GGUFFile, StringArray

    path = write_tiny_gguf(tmp_path / "t.gguf", spec=SPECS["qwen3"], qtype=gguf.GGMLQuantizationType.Q8_0)
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        if isinstance(value, StringArray):
            assert ours.strings(key) == field.contents()
        elif isinstance(value, np.ndarray):
            assert value.tolist() == field.contents()
        else:
            assert value == pytest.approx(field.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape, a.n_elements) == (
            b.tensor_type,
            tuple(b.shape.tolist()),
            b.n_elements,
        )
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    data = path.read_bytes()
    for cut in (10, 300, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated or corrupt GGUF file") as exc:
            load_gguf(tmp_path / "cut.gguf")
        assert "\n" not in str(exc.value)


def test_tensors_are_dequantized_when_taken(written, monkeypatch) -> None:
    """``load_gguf`` reads no weight: each tensor is dequantized when the model takes it (so the float32 copy
    of the whole model never exists at once), phi3's fused qkv once for its three parts."""
    import backend.loaders.gguf as loader

    made = []
    dequantize = loader._dequantize
    monkeypatch.setattr(loader, "_dequantize", lambda t: made.append(t.name) or dequantize(t))
    weights, _ = load_gguf(written["phi3"][0])
    t = weights.tensors
    assert made == [] and len(t) == 3 + 2 * 9  # embedding, norm, output; 9 per layer
    assert t.shape("model.layers.1.self_attn.k_proj.weight") == (2 * 16, 64) and made == []
    q = t.pop("model.layers.1.self_attn.q_proj.weight")
    k, v = t.pop("model.layers.1.self_attn.k_proj.weight"), t.pop("model.layers.1.self_attn.v_proj.weight")
    assert made == ["blk.1.attn_qkv.weight"] and q.shape == (64, 64) and k.shape == v.shape == (32, 64)
    assert "model.layers.1.self_attn.q_proj.weight" not in t and len(t) == 3 + 2 * 9 - 3
