#!/usr/bin/env python3
"""Greedy parity of the two-model drafter against plain decoding and against mlx-lm.

    scripts/setup-peers python          # .venv-ref with mlx, mlx-cpu, mlx-lm, torch, transformers
    cargo build --release -p target-host -p two-model
    .venv-ref/bin/python drafters/two-model/parity_mlx.py [--k 3] [--max-tokens 48] [--out FILE]

1. Dequantizes the two GGUFs (Qwen2.5-Coder 0.5B draft, 1.5B target) to float32 HF directories
   under models/cache/hf/ with transformers' GGUF loader (once; skipped when present).
2. For each prompt, the chat-templated text is tokenized by both sides (asserted equal), then
   greedy token ids come from:
     - mlx-lm plain (`generate_step`) and speculative (`speculative_generate_step`, draft k) on CPU,
     - Specula plain and two-model speculative on the same HF dirs (`--dtype f32`),
     - Specula plain and two-model speculative on the GGUFs dequantized to f32 at load.
3. Prints, per prompt, where each output first differs from mlx-lm plain, and at that position
   the gap between mlx-lm's top-2 log-probabilities (= logit gap): a gap near 0 is a near-tie
   that float summation order may flip; a large gap would be a real bug.

The law checked: Specula spec == Specula plain on the same weights, always. Cross-implementation
(Specula vs mlx-lm) equality holds up to near-ties: the two run different kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / "target/release/target-host"
CACHE = ROOT / "models/cache"
PAIR = {"draft": "qwen2.5-coder-0.5b", "target": "qwen2.5-coder-1.5b"}

PROMPTS = [
    "Write a Python function `is_prime(n)` with a docstring.",
    "Explain in two sentences what a hash map is.",
    "Rewrite with a for loop:\ndef total(xs):\n    i = 0\n    s = 0\n    while i < len(xs):\n"
    "        s += xs[i]\n        i += 1\n    return s\n",
    "Write a Rust function that reverses a string.",
    "What is the difference between a process and a thread?",
    "Write a SQL query that returns the ten most recent orders with their customer names.",
]


def hf_dir(name: str) -> Path:
    """The float32 HF directory of a fetched GGUF, converted on first use."""
    out = CACHE / "hf" / name
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = f"{name}.gguf"
    print(f"dequantizing {gguf} to float32 in {out.relative_to(ROOT)}", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(CACHE, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(CACHE, gguf_file=gguf, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained, so the
    # dequantized weights are written directly (a tied lm_head shares the embedding's storage).
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(out)
    return out


def specula(model: Path, text: str, max_tokens: int, extra: list[str]) -> list[int]:
    cmd = [str(HOST), "generate", "--model", str(model), "--dtype", "f32", "--json",
           "--max-tokens", str(max_tokens), "--prompt", text,
           "--draft-deadline-ms", "600000", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["token_ids"], res["stats"]


def specula_ids(model: Path, text: str) -> list[int]:
    cmd = [str(HOST), "tokenize", "--model", str(model), "--text", text]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def two_model(draft: Path, k: int) -> list[str]:
    return ["--drafter", "two-model", "--drafter-arg=--model", f"--drafter-arg={draft}",
            "--drafter-arg=--dtype", "--drafter-arg=f32", "--num-draft-tokens", str(k)]


def mlx_runs(target_dir: Path, draft_dir: Path, prompts_ids, k: int, max_tokens: int):
    """mlx-lm plain and speculative greedy ids, plus plain's per-step top-2 logprob gaps."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step, speculative_generate_step

    mx.set_default_device(mx.cpu)
    target, tok = load(str(target_dir))
    draft, _ = load(str(draft_dir))
    eos = set(tok.eos_token_ids)
    results = []
    for ids in prompts_ids:
        prompt = mx.array(ids)
        plain, gaps = [], []
        for token, logprobs in generate_step(prompt, target, max_tokens=max_tokens):
            token = int(token)
            top2 = mx.topk(logprobs, 2).tolist()
            gaps.append(abs(top2[1] - top2[0]))
            if token in eos:
                break
            plain.append(token)
        spec, from_draft = [], 0
        for token, _, drafted in speculative_generate_step(
                prompt, target, draft, num_draft_tokens=k, max_tokens=max_tokens):
            token = int(token)
            if token in eos:
                break
            spec.append(token)
            from_draft += bool(drafted)
        results.append({"plain": plain, "spec": spec, "gaps": gaps, "from_draft": from_draft})
    return results, tok


def first_diff(a: list[int], b: list[int]):
    """Index of the first difference, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--out", type=Path, help="write the per-prompt results as JSON")
    args = ap.parse_args()
    if not HOST.exists():
        sys.exit(f"{HOST} is missing: cargo build --release -p target-host -p two-model")
    os.environ.setdefault("RAYON_NUM_THREADS", "2")
    dirs = {role: hf_dir(name) for role, name in PAIR.items()}
    ggufs = {role: CACHE / f"{name}.gguf" for role, name in PAIR.items()}

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(dirs["target"])
    texts, prompts_ids = [], []
    for p in PROMPTS[: args.prompts]:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        theirs = specula_ids(dirs["target"], text)
        assert ids == theirs, f"tokenizers disagree on the prompt: {ids} vs {theirs}"
        texts.append(text)
        prompts_ids.append(ids)

    mlx, _ = mlx_runs(dirs["target"], dirs["draft"], prompts_ids, args.k, args.max_tokens)
    rows, law_ok = [], True
    for i, text in enumerate(texts):
        ref = mlx[i]["plain"]
        runs = {"mlx spec": mlx[i]["spec"]}
        for weights, target, draft in [("hf-f32", dirs["target"], dirs["draft"]),
                                       ("gguf-f32", ggufs["target"], ggufs["draft"])]:
            plain, _ = specula(target, text, args.max_tokens, ["--no-speculation"])
            spec, stats = specula(target, text, args.max_tokens, two_model(draft, args.k))
            runs[f"specula plain {weights}"] = plain
            runs[f"specula spec {weights}"] = spec
            # The law: same weights, same implementation → identical greedy output.
            if spec != plain:
                law_ok = False
                print(f"LAW BROKEN prompt {i} {weights}: spec differs at {first_diff(spec, plain)}")
            runs[f"acceptance {weights}"] = round(stats["acceptance_rate"], 3)
        row = {"prompt": i, "mlx plain tokens": len(ref),
               "mlx draft tokens accepted": mlx[i]["from_draft"]}
        for name, ids in runs.items():
            if name.startswith("acceptance"):
                row[name] = ids
                continue
            d = first_diff(ids, ref)
            gap = mlx[i]["gaps"][d] if d is not None and d < len(mlx[i]["gaps"]) else None
            row[name] = "equal" if d is None else f"differs at {d} (mlx top-2 gap {gap:.4f})"
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print("law (specula spec == specula plain on the same weights):", "OK" if law_ok else "BROKEN")
    sys.exit(0 if law_ok else 1)


if __name__ == "__main__":
    main()
