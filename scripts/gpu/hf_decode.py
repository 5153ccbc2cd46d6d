#!/usr/bin/env python3
"""The peer of `target-host bench` on a GPU: HF transformers plain greedy decode of the same
model shapes (Specula's random-weight presets), random bf16 weights, same prompt pattern.

Decode speed excludes prefill: (N - 1) / (time to generate N tokens - time to generate 1).
Also times a device-to-device copy in PyTorch, to cross-check the bandwidth Specula measured.

    python3 scripts/gpu/hf_decode.py --out hf.json [--context 512] [--decode-tokens 128]
"""
import argparse
import json
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

# The shapes of models/src/random.rs `preset`, from the published config.json files.
PRESETS = {
    "qwen2.5-1.5b": (Qwen2Config, dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen3-8b": (Qwen3Config, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
}


def prompt(n, vocab):
    """The prompt of target-host bench: a period-61 pattern of ids."""
    return [(i % 61) * 7919 % vocab for i in range(n)]


def timed_generate(model, ids, new_tokens):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - start


def decode(name, context, new_tokens, reps):
    cls, kw = PRESETS[name]
    cfg = cls(**kw)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    ids = torch.tensor([prompt(context, cfg.vocab_size)], device="cuda")
    with torch.inference_mode():
        timed_generate(model, ids, new_tokens)  # warm-up
        full = min(timed_generate(model, ids, new_tokens) for _ in range(reps))
        first = min(timed_generate(model, ids, 1) for _ in range(reps))
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return {
        "model": name,
        "parameters": params,
        "attn_implementation": cfg._attn_implementation,
        "decode_tokens_per_s": (new_tokens - 1) / (full - first),
        "generate_s": full,
        "prefill_and_first_token_s": first,
    }


def copy_bandwidth(mib=2048):
    src = torch.zeros(mib << 18, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for rep in range(12):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        if rep >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    moved = 2 * src.numel() * 4
    return {"bytes_moved": moved, "ms": times[len(times) // 2] * 1e3,
            "gb_per_s": moved / times[len(times) // 2] / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--models", default=",".join(PRESETS))
    args = ap.parse_args()
    report = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(),
        "copy": copy_bandwidth(),
        "decode": [],
    }
    for name in args.models.split(","):
        r = decode(name, args.context, args.decode_tokens, args.reps)
        print(json.dumps(r), flush=True)
        report["decode"].append(r)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
