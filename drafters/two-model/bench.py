#!/usr/bin/env python3
"""Benchmarks the two-model drafter: plain vs speculative decoding for k = 1..K.

Runs `target-host generate --json` (release build) alternating plain and speculative runs, so
a noisy shared machine hurts both alike, and prints medians of decode tokens/s and acceptance.
The draft step cost is measured as plain decoding of the draft model itself.

    cargo build --release -p two-model -p target-host
    drafters/two-model/bench.py [--reps 3] [--max-k 6] [--max-tokens 64]
"""

import argparse
import json
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / "target/release/target-host"
PROMPT = ("Write a Python function `is_prime(n)` that checks whether n is prime, "
          "with a docstring, type hints and a few doctests.")


def generate(model, max_tokens, extra):
    cmd = [str(HOST), "generate", "--model", str(model), "--json", "--max-tokens",
           str(max_tokens), "--chat", PROMPT, "--draft-deadline-ms", "10000", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=ROOT / "models/cache/qwen2.5-coder-1.5b.gguf")
    ap.add_argument("--draft", default=ROOT / "models/cache/qwen2.5-coder-0.5b.gguf")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    drafter = ["--drafter", "two-model", "--drafter-arg=--model", f"--drafter-arg={args.draft}"]

    plain, spec, draft_alone = [], {k: [] for k in range(1, args.max_k + 1)}, []
    reference = None
    for rep in range(args.reps):
        draft_alone.append(generate(args.draft, args.max_tokens, ["--no-speculation"]))
        for k in range(1, args.max_k + 1):
            p = generate(args.target, args.max_tokens, ["--no-speculation"])
            s = generate(args.target, args.max_tokens, [*drafter, "--num-draft-tokens", str(k)])
            reference = reference or p["token_ids"]
            # The law: greedy speculative output equals greedy plain output.
            div = lambda ids: next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b),
                                   None if len(ids) == len(reference) else min(len(ids), len(reference)))
            same = f"plain first differs at {div(p['token_ids'])}, spec at {div(s['token_ids'])}"
            plain.append(p)
            spec[k].append(s)
            print(f"rep {rep} k {k}: plain {p['stats']['decode_tokens_per_s']:.2f} tok/s, "
                  f"spec {s['stats']['decode_tokens_per_s']:.2f} tok/s, "
                  f"acceptance {s['stats']['acceptance_rate']:.2f}, {same}",
                  flush=True)

    med = lambda runs, key: statistics.median(r["stats"][key] for r in runs)
    tp = med(plain, "decode_tokens_per_s")
    td = med(draft_alone, "decode_tokens_per_s")
    print(f"\ntarget step {1000 / tp:.1f} ms ({tp:.2f} tok/s), draft step {1000 / td:.1f} ms "
          f"({td:.2f} tok/s), ratio {tp / td:.2f}")
    print("k | plain tok/s | spec tok/s | speedup | acceptance | accepted/round")
    for k, runs in spec.items():
        ts = med(runs, "decode_tokens_per_s")
        print(f"{k} | {tp:.2f} | {ts:.2f} | {ts / tp:.2f}x | {med(runs, 'acceptance_rate'):.2f} "
              f"| {med(runs, 'mean_accepted_per_round'):.2f}")


if __name__ == "__main__":
    main()
