#!/usr/bin/env python3
"""A tiny random-weight Gemma 4 assistant (KV-borrowing drafter) and its transformers outputs.

    .venv-ref/bin/python scripts/reference/gemma4_tiny.py        # the target it borrows from
    .venv-ref/bin/python scripts/reference/gemma4_assistant.py

Writes tests/fixtures/gemma4-assistant-tiny/{config.json, model.safetensors, reference.json}. The target
is tests/fixtures/gemma4-tiny/full (sliding and global layers, KV sharing, k_eq_v); the assistant has
2 layers [sliding, full] and no K/V projections: each reads the target's last non-shared layer of its
type (transformers' `shared_kv_states`).

Positions follow transformers' `Gemma4AssistantCandidateGenerator` (named reference for Specula): every
draft step of a round uses the position of the last committed token, P = len(ids) - 1, and the donor K/V
are those of the committed positions 0..P-1 (Specula's host has not run the pending token yet; this
script slices the target's K/V to that length, as the candidate generator slices to the current
length). Step 0's inputs are cat(embed_target(ids[P]) * sqrt(Hb), h) where h is the target's final-norm
hidden state at position P - 1; step k feeds the argmax of step k-1 and the assistant's projected state.

reference.json holds ids, P, the inputs of step 0, and per step the argmax, the logits and the
projected state, plus a second case with centroid masking (use_ordered_embeddings).
"""

import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM,  # noqa: E402
                          Gemma4ForCausalLM, Gemma4TextConfig)

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests" / "fixtures" / "gemma4-tiny" / "full"
OUT = ROOT / "tests" / "fixtures" / "gemma4-assistant-tiny"
STEPS = 3


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("layer_scalar"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("token_ordering"):
                p.copy_(torch.randperm(p.shape[0], generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def rows(t):
    return [[round(v, 6) for v in r] for r in t.reshape(-1, t.shape[-1]).tolist()]


def main():
    target = Gemma4ForCausalLM.from_pretrained(TARGET, dtype=torch.float32, attn_implementation="eager").eval()
    tcfg = target.config
    ids = json.loads((TARGET / "logits.json").read_text())["ids"]
    text = Gemma4TextConfig(
        vocab_size=tcfg.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, use_double_wide_mlp=False,
        sliding_window=tcfg.sliding_window, max_position_embeddings=tcfg.max_position_embeddings,
        layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6,
        final_logit_softcapping=None, tie_word_embeddings=True)
    out = {"target": str(TARGET.relative_to(ROOT)), "ids": ids, "cases": []}
    P = len(ids) - 1
    with torch.no_grad():
        t = target.model(torch.tensor([ids[:P]]), return_shared_kv_states=True, use_cache=False)
        kv = {k: (v[0][:, :, :P], v[1][:, :, :P]) for k, v in t.shared_kv_states.items()}
        h0 = t.last_hidden_state[:, -1:]
    for case, ordered in (("plain", False), ("centroids", True)):
        cfg = Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=tcfg.hidden_size,
                                    use_ordered_embeddings=ordered, num_centroids=16,
                                    centroid_intermediate_top_k=4)
        cfg._attn_implementation = "eager"
        model = Gemma4AssistantForCausalLM(cfg).eval()
        randomize(model, 7 if ordered else 3)
        model.save_pretrained(OUT / case, safe_serialization=True)
        (OUT / case / "generation_config.json").unlink(missing_ok=True)
        tok, h, steps = ids[P], h0, []
        with torch.no_grad():
            for _ in range(STEPS):
                e = target.model.embed_tokens(torch.tensor([[tok]]))
                o = model(inputs_embeds=torch.cat([e, h], dim=-1), position_ids=torch.tensor([[P]]),
                          shared_kv_states=kv)
                logits = o.logits[0, -1]
                tok = int(logits.argmax())
                h = o.last_hidden_state
                steps.append({"argmax": tok, "logits": [round(v, 6) for v in logits.tolist()],
                              "projected": rows(h)[0]})
        out["cases"].append({"name": case, "pending": P, "steps": steps})
        print(case, [s["argmax"] for s in steps])
    out["h0"] = rows(h0)[0]
    (OUT / "reference.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
