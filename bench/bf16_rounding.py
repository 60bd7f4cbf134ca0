"""Where the bfloat16 mode's logit error comes from: a float32 forward pass of the default model with bf16
rounding switched on at one place at a time, against the float32 reference logits of the fixtures.

Each place rounds float32 values to bfloat16 and back (``t.to(torch.bfloat16).float()``): ``weights`` (every
layer matrix and the embedding), ``inputs`` (a matmul's input rows), ``outputs`` (a matmul's result),
``attention`` (q, k, v after RoPE and the attention output), ``head_weights`` / ``head_output`` (the LM head),
``silu`` (the SiLU(gate) * up product). Printed: the largest absolute error over the 50 reference logits of
each fixture chat, for float32 alone, for all places on, for each place alone, and for all places but one.

Run: ``.venv/bin/python bench/bf16_rounding.py`` (about a minute on 2 cores). Source followed for the forward
pass: Hugging Face transformers' ``LlamaForCausalLM`` (RMSNorm and RoPE in float32, grouped-query attention).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.loaders.gguf import load_gguf
from backend.model_path import default_model_path
from backend.models.llama import rope_inv_freq

PLACES = ("weights", "inputs", "outputs", "attention", "head_weights", "head_output", "silu")
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2_chats.json"


def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


class Forward:
    """The model's forward pass in float32, over ``load_gguf``'s dequantized weights."""

    def __init__(self) -> None:
        weights, _ = load_gguf(default_model_path())
        self.cfg = weights.config
        self.w = {k: weights.tensors[k].float() for k in weights.tensors.keys()}
        self.inv_freq = rope_inv_freq(self.cfg, weights.rope_freqs)

    def last_logits(self, ids: list[int], on: set[str]) -> torch.Tensor:
        """``[V] float32`` logits at the last position of ``ids``, rounding at the places in ``on``."""
        cfg, w = self.cfg, self.w

        def r(t: torch.Tensor, place: str) -> torch.Tensor:
            return _bf(t) if place in on else t

        def mm(x: torch.Tensor, name: str, head: bool = False) -> torch.Tensor:
            wt = r(w[name], "head_weights" if head else "weights")
            return r(r(x, "inputs") @ wt.t(), "head_output" if head else "outputs")

        h_size, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n = len(ids)
        x = r(w["model.embed_tokens.weight"][torch.tensor(ids)], "weights")
        freqs = torch.outer(torch.arange(n).float(), self.inv_freq)
        cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]

        def rope(t: torch.Tensor) -> torch.Tensor:
            return t * cos + torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1) * sin

        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = F.rms_norm(x, (h_size,), w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = rope(mm(h, p + "self_attn.q_proj.weight").view(n, nh, hd))
            k = rope(mm(h, p + "self_attn.k_proj.weight").view(n, nkv, hd))
            v = mm(h, p + "self_attn.v_proj.weight").view(n, nkv, hd)
            q, k, v = (r(t, "attention") for t in (q, k, v))
            k, v = (t.repeat_interleave(nh // nkv, 1).transpose(0, 1)[None] for t in (k, v))
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True)
            x = x + mm(
                r(o[0].transpose(0, 1).reshape(n, nh * hd), "attention"), p + "self_attn.o_proj.weight"
            )
            h = F.rms_norm(x, (h_size,), w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            a = F.silu(mm(h, p + "mlp.gate_proj.weight")) * mm(h, p + "mlp.up_proj.weight")
            x = x + mm(r(a, "silu"), p + "mlp.down_proj.weight")
        h = F.rms_norm(x[-1:], (h_size,), w["model.norm.weight"], cfg.rms_norm_eps)
        head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
        return mm(h, head, head=True)[0]


def main() -> None:
    chats = json.loads(FIXTURES.read_text())["chats"]
    fwd = Forward()

    def errors(on: set[str]) -> list[float]:
        out = []
        for c in chats:
            logits = fwd.last_logits(c["prompt_ids"], on)
            ids = torch.tensor([i for i, _ in c["last_logits_top50"]])
            ref = torch.tensor([v for _, v in c["last_logits_top50"]])
            out.append((logits[ids] - ref).abs().max().item())
        return out

    def show(label: str, on: set[str]) -> None:
        e = errors(on)
        print(f"{label:28s} max {max(e):.3f}  per chat {' '.join(f'{x:.3f}' for x in e)}")

    show("float32", set())
    show("all bf16", set(PLACES))
    for place in PLACES:
        show(f"only {place}", {place})
    for place in PLACES:
        show(f"all but {place}", set(PLACES) - {place})
    show("all but outputs, head_output", set(PLACES) - {"outputs", "head_output"})


if __name__ == "__main__":
    main()
