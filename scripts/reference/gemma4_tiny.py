#!/usr/bin/env python3
"""Tiny random-weight Gemma 4 text models and their transformers logits, for Specula's parity tests.

    python3 -m venv .venv-ref && .venv-ref/bin/pip install torch transformers safetensors numpy
    .venv-ref/bin/python scripts/reference/gemma4_tiny.py

Writes tests/fixtures/gemma4-tiny/<name>/{config.json, model.safetensors, logits.json}. The reference is
transformers' `Gemma4ForCausalLM` (`modeling_gemma4.py`) in float32, eager attention. Two configs:

  full:  per-layer embeddings (PLE), KV sharing (last 2 of 6 layers reuse the last non-shared layer of
         their type), attention_k_eq_v with one global K/V head, global_head_dim != head_dim,
         proportional RoPE on global layers (partial_rotary_factor 0.25), a sliding window of 4 keys,
         double-wide MLPs on the shared layers, a final logit softcap, random layer_scalar values.
  plain: none of the optional parts (no PLE, no sharing, separate V, no softcap), same window.

Every weight is drawn at a scale that keeps activations O(1) (norm weights around 1), so a wrong
norm, scale or mask moves the logits by far more than the 1e-4 tolerance. logits.json holds the ids
(longer than the window) and the logits of every position.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from transformers import Gemma4ForCausalLM, Gemma4TextConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "gemma4-tiny"

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
            sliding_window=4, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
            bos_token_id=2, eos_token_id=1,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention", "sliding_attention", "full_attention"])

CONFIGS = {
    "full": dict(BASE, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                 num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                 use_double_wide_mlp=True, final_logit_softcapping=5.0),
    "plain": dict(BASE, global_head_dim=32, attention_k_eq_v=False, num_kv_shared_layers=0,
                  hidden_size_per_layer_input=0, use_double_wide_mlp=False,
                  final_logit_softcapping=None),
}

IDS = [2, 17, 99, 5, 64, 33, 120, 7, 7, 81, 45, 3, 90, 12]


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("layer_scalar"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif "norm" in name or name.endswith(".scale"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif p.dtype.is_floating_point and "inv_freq" not in name and "embed_scale" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def main():
    torch.manual_seed(0)
    for i, (name, kw) in enumerate(CONFIGS.items()):
        cfg = Gemma4TextConfig(**kw)
        cfg._attn_implementation = "eager"
        model = Gemma4ForCausalLM(cfg).eval()
        randomize(model, 1000 + i)
        out = OUT / name
        model.save_pretrained(out, safe_serialization=True)
        with torch.no_grad():
            logits = model(torch.tensor([IDS])).logits[0].float()
        (out / "logits.json").write_text(json.dumps({
            "reference": f"transformers {__import__('transformers').__version__} Gemma4ForCausalLM f32 eager",
            "ids": IDS,
            "logits": [[round(v, 6) for v in row] for row in logits.tolist()],
        }) + "\n")
        for extra in ("generation_config.json",):
            (out / extra).unlink(missing_ok=True)
        print(name, "kv modes", cfg.kv_sharing_modes, "logits[0,:4]", logits[0, :4].tolist())


if __name__ == "__main__":
    main()
