#!/usr/bin/env python3
"""A tiny random-weight Gemma 3 text model in the HF layout and its transformers logits.

    .venv-ref/bin/python scripts/reference/gemma3_tiny.py

Writes tests/fixtures/gemma3-tiny/{config.json, model.safetensors, logits.json}: transformers'
`Gemma3ForCausalLM` in float32 (eager), 4 layers [sliding x3, full] with a window of 3 keys, a
query_pre_attn_scalar that is not head_dim, a final logit softcap and norm weights far from 0 (HF
checkpoints store w of Gemma's (1 + w) norms; the GGUF path is tested on the real model).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemma4_tiny import IDS, randomize  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gemma3-tiny"


def main():
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=64, sliding_window=3, sliding_window_pattern=4,
                           query_pre_attn_scalar=24, final_logit_softcapping=8.0,
                           rope_local_base_freq=10_000.0, rope_theta=1_000_000.0,
                           tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    cfg._attn_implementation = "eager"
    model = Gemma3ForCausalLM(cfg).eval()
    randomize(model, 42)
    model.save_pretrained(OUT, safe_serialization=True)
    (OUT / "generation_config.json").unlink(missing_ok=True)
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0].float()
    (OUT / "logits.json").write_text(json.dumps({
        "reference": f"transformers {__import__('transformers').__version__} Gemma3ForCausalLM f32 eager",
        "ids": IDS, "logits": [[round(v, 6) for v in row] for row in logits.tolist()]}) + "\n")
    print(cfg.layer_types, logits[0, :4].tolist())


if __name__ == "__main__":
    main()
