#!/usr/bin/env python3
"""Regenerate a golden fixture: prompt ids and greedy continuations from a numpy reference forward.

    python scripts/reference/forward_reference.py --model smollm2-135m --out tests/fixtures/golden/smollm2-135m.json
    python scripts/reference/forward_reference.py --model qwen2.5-coder-0.5b --check   # top-1 sanity only

Needs `pip install numpy gguf tokenizers jinja2` (venv: .venv-ref). The model is located with
`scripts/fetch-model NAME`. Prompt ids come from an independent tokenizer (the `tokenizers` package with a
BPE rebuilt from the GGUF vocab/merges in the HF layout of the family), so the Rust numerics test does
not depend on Specula's own tokenizer. The forward itself lives in gguf_llama.py.

Generation runs a fixed number of steps and does not stop at end-of-turn tokens: the fixture tests
numerics, and the Rust test runs the same fixed number of steps.

Validated against llama.cpp (llama-cpp-python 0.3.36): the prompt ids of every fixture prompt equal
llama.cpp's tokenization, and llama.cpp's quantized greedy decoding matches the first 16 reference
tokens on 10 of 12 prompts (SmolLM2 Q4_1 flips at steps 7 and 5 on the other two). Swapping the
rope layout of SmolLM2 changes the greedy output from the first token on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

# One BLAS thread: the matrices of a single decode step are small, and OpenBLAS threads that spin while
# cargo builds share the 2 cores made each token 5-10x slower. Set OPENBLAS_NUM_THREADS to override.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jinja2  # noqa: E402
import numpy as np  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_llama import GgufFile, Model  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# The pre-tokenizer regex of Qwen2's tokenizer.json.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Raw-text prompts and chat questions; the same five shapes for every model (brief: chat question, code to
# complete, story opening, list/numbers, summary request).
PROMPTS = [
    ("chat", "What is the capital of France? Answer in two sentences and mention one famous landmark there."),
    ("raw", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n"),
    ("raw", "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who"),
    ("chat", "List the first ten prime numbers, one per line, and then give their sum."),
    (
        "chat",
        "Summarize in one paragraph: The Great Wall of China is a series of fortifications built across the "
        "historical northern borders of ancient Chinese states to protect against nomadic groups. Several walls "
        "were built from as early as the 7th century BC, later joined by Qin Shi Huang.",
    ),
    ("raw", "Numbers in order: 1, 2, 3, 4, 5,"),
]


def build_tokenizer(f: GgufFile) -> Tokenizer:
    """A `tokenizers` BPE with the HF pre-tokenization of the family, from GGUF vocab and merges."""
    if f.meta("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"only gpt2-style BPE is supported, got {f.meta('tokenizer.ggml.model')!r}")
    tokens = f.meta("tokenizer.ggml.tokens")
    types = f.meta("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in f.meta("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = f.meta("tokenizer.ggml.pre")
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"unknown tokenizer.ggml.pre {pre!r}")
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole, before BPE.
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens(specials)
    return tok


def render_chat(f: GgufFile, question: str) -> str:
    """The GGUF chat template applied to one user message, with the assistant turn opened."""
    env = jinja2.Environment(loader=jinja2.BaseLoader(), trim_blocks=False, lstrip_blocks=False)
    tmpl = env.from_string(f.meta("tokenizer.chat_template"))
    return tmpl.render(messages=[{"role": "user", "content": question}], add_generation_prompt=True, tools=None)


def greedy(model: Model, prompt_ids: list[int], n_new: int):
    """KV-cached greedy decode: prefill once, then one token at a time. Returns ids, top2 gaps, top1 logits."""
    model.reset()
    logits = model.forward(prompt_ids)
    ids, gaps, top1 = [], [], []
    for step in range(n_new):
        # np.argmax breaks exact ties by the lowest id, like a first-max argmax in Rust.
        best = int(np.argmax(logits))
        second = float(np.max(np.delete(logits, best)))
        ids.append(best)
        gaps.append(float(logits[best]) - second)
        top1.append(float(logits[best]))
        if step + 1 < n_new:
            logits = model.forward([best])
    return ids, gaps, top1


def sha256_prefix(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:8]


def model_path(name: str) -> str:
    out = subprocess.run([os.path.join(ROOT, "scripts", "fetch-model"), name], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def check_capital(model: Model, tok: Tokenizer) -> str:
    """Top-1 continuation of a raw 'The capital of France is'; must be ' Paris' for a sane forward."""
    model.reset()
    logits = model.forward(tok.encode("The capital of France is").ids)
    return tok.decode([int(np.argmax(logits))])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="fetch-model name, e.g. smollm2-135m")
    ap.add_argument("--out", help="fixture path to write (JSON)")
    ap.add_argument("--new-tokens", type=int, default=40, help="greedy tokens per prompt (>= 32)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--check", action="store_true", help="only run the 'capital of France' sanity check")
    args = ap.parse_args()
    if args.new_tokens < 32:
        ap.error("--new-tokens must be at least 32")

    path = model_path(args.model)
    dtype = np.dtype(args.dtype)
    t0 = time.time()
    model = Model(path, dtype)
    tok = build_tokenizer(model.file)
    print(f"loaded {args.model} ({model.cfg.arch}, {model.cfg.n_layer} layers) in {time.time() - t0:.1f}s", file=sys.stderr)
    top1 = check_capital(model, tok)
    print(f"'The capital of France is' -> {top1!r}", file=sys.stderr)
    if top1 != " Paris":
        print("sanity check failed: expected ' Paris'", file=sys.stderr)
        return 1
    if args.check:
        return 0

    prompts = []
    for kind, text in PROMPTS:
        full = render_chat(model.file, text) if kind == "chat" else text
        prompt_ids = tok.encode(full).ids
        t0 = time.time()
        ids, gaps, top1 = greedy(model, prompt_ids, args.new_tokens)
        took = time.time() - t0
        print(
            f"[{kind}] {len(prompt_ids)} prompt ids, {took:.1f}s, min gap {min(gaps):.4f}: {tok.decode(ids)!r}",
            file=sys.stderr,
        )
        prompts.append(
            {
                "text": full,
                "prompt_ids": prompt_ids,
                "greedy_ids": ids,
                "top2_gap": [round(g, 5) for g in gaps],
                "top1_logit": [round(v, 4) for v in top1],
            }
        )
    fixture = {
        "model": args.model,
        "gguf_sha256_prefix": sha256_prefix(path),
        "reference": f"numpy forward on gguf-dequantized weights, {'f32' if dtype == np.float32 else 'f64'}",
        "generator": "scripts/reference/forward_reference.py",
        "prompts": prompts,
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(fixture, fh, indent=1)
            fh.write("\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
