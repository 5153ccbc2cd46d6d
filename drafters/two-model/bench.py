#!/usr/bin/env python3
"""Benchmarks the two-model drafter (Qwen2.5-Coder 0.5B drafting for 1.5B) against plain
decoding and against llama.cpp's draft-model speculation on the same GGUF pair.

    cargo build --release -p two-model -p target-host
    scripts/setup-peers llama            # optional: .peers/bin/llama-{speculative,completion}
    drafters/two-model/bench.py [--reps 2] [--max-k 6] [--max-tokens 64] [--llama-k 2,4]

Per prompt kind (code completion, chat) and repetition, the configurations run in one
interleaved order, so a noisy shared machine hurts all alike:

  * Specula plain 1.5B, and 1.5B + two-model at k = 1..max-k and adaptive (`--adaptive-draft`
    with `--num-draft-tokens max-k`);
  * llama.cpp plain (`llama-completion`) and `llama-speculative` at each --llama-k (greedy,
    `-t 2`), when scripts/setup-peers built them (skipped with a note otherwise).

Every tool gets the same raw text (the chat prompt is rendered with Qwen2.5's template here),
greedy, prefill excluded from tokens/s. It prints medians of decode tokens/s, acceptance and the
speed-up over its own plain decoding, checks the law (Specula's speculative ids == its plain
ids), and the draft step cost vs the target step cost (plain decoding of each model alone).
"""

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / "target/release/target-host"
PEERS = ROOT / ".peers/bin"

CHAT_TEMPLATE = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                 "assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
PROMPTS = {
    "code": ("import math\n\n\ndef is_prime(n: int) -> bool:\n"
             "    \"\"\"Return True when n is a prime number.\"\"\"\n"),
    "chat": CHAT_TEMPLATE.format("Explain what a binary search tree is and when to use one."),
}


def specula(model, text, max_tokens, extra):
    cmd = [str(HOST), "generate", "--model", str(model), "--json", "--max-tokens",
           str(max_tokens), "--prompt", text, "--draft-deadline-ms", "10000", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    s = res["stats"]
    return {"tps": s["decode_tokens_per_s"], "acceptance": s["acceptance_rate"],
            "per_round": s["mean_accepted_per_round"], "ids": res["token_ids"],
            "draft_ms": s["draft_ms"], "forward_ms": s["forward_ms"],
            "tokens": s["generated_tokens"], "drafted": s["drafted"], "rounds": s["rounds"]}


def llama_speculative(target, draft, text, max_tokens, k):
    cmd = [str(PEERS / "llama-speculative"), "-m", str(target), "-md", str(draft), "-p", text,
           "-n", str(max_tokens), "--spec-draft-n-max", str(k), "-t", "2", "--temp", "0",
           "-c", "2048"]
    err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    tps = float(re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s",
                          err).group(1))
    acc = float(re.search(r"accept\s+=\s+([\d.]+)%", err).group(1)) / 100
    return {"tps": tps, "acceptance": acc}


def llama_plain(target, text, max_tokens):
    cmd = [str(PEERS / "llama-completion"), "-m", str(target), "-p", text, "-n",
           str(max_tokens), "-t", "2", "--temp", "0", "-c", "2048", "-no-cnv",
           "--no-display-prompt", "--simple-io"]
    err = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         stdin=subprocess.DEVNULL).stderr
    tps = float(re.search(r"\beval time =.*?([\d.]+) tokens per second", err.replace(
        "prompt eval time", "prompt_eval")).group(1))
    return {"tps": tps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=ROOT / "models/cache/qwen2.5-coder-1.5b.gguf")
    ap.add_argument("--draft", default=ROOT / "models/cache/qwen2.5-coder-0.5b.gguf")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llama-k", default="2,4", help="llama-speculative draft lengths")
    ap.add_argument("--kinds", default="code,chat")
    ap.add_argument("--out", type=Path, help="write all runs as JSON")
    args = ap.parse_args()
    drafter = ["--drafter", "two-model", "--drafter-arg=--model", f"--drafter-arg={args.draft}"]
    have_llama = all((PEERS / b).exists() for b in ("llama-speculative", "llama-completion"))
    if not have_llama:
        print("NOTE: llama.cpp peer missing (run scripts/setup-peers llama); skipped")

    configs = [("plain", ["--no-speculation"])]
    configs += [(f"k={k}", [*drafter, "--num-draft-tokens", str(k)])
                for k in range(1, args.max_k + 1)]
    configs += [(f"adaptive<={args.max_k}",
                 [*drafter, "--adaptive-draft", "--num-draft-tokens", str(args.max_k)])]
    llama_ks = [int(k) for k in args.llama_k.split(",") if k] if have_llama else []

    runs = {}  # (kind, config) -> [result]
    law = []
    for rep in range(args.reps):
        for kind in args.kinds.split(","):
            text = PROMPTS[kind]
            # The draft model alone: its decode step is the drafter's cost per draft token.
            r = specula(args.draft, text, args.max_tokens, ["--no-speculation"])
            runs.setdefault((kind, "draft model alone"), []).append(r)
            for name, extra in configs:
                r = specula(args.target, text, args.max_tokens, extra)
                runs.setdefault((kind, name), []).append(r)
                plain_ids = runs[(kind, "plain")][0]["ids"]
                if name != "plain" and r["ids"] != plain_ids:
                    law.append(f"{kind} {name} rep {rep}")
                print(f"rep {rep} {kind} {name}: {r['tps']:.2f} tok/s "
                      f"acceptance {r['acceptance']:.2f}", flush=True)
            if have_llama:
                r = llama_plain(args.target, text, args.max_tokens)
                runs.setdefault((kind, "llama.cpp plain"), []).append(r)
                print(f"rep {rep} {kind} llama.cpp plain: {r['tps']:.2f} tok/s", flush=True)
                for k in llama_ks:
                    r = llama_speculative(args.target, args.draft, text, args.max_tokens, k)
                    runs.setdefault((kind, f"llama.cpp k={k}"), []).append(r)
                    print(f"rep {rep} {kind} llama.cpp k={k}: {r['tps']:.2f} tok/s "
                          f"acceptance {r['acceptance']:.2f}", flush=True)

    med = lambda rs, key: statistics.median(r[key] for r in rs)
    print("\nkind | config | tok/s | vs own plain | acceptance | accepted/round")
    best = {}
    for (kind, name), rs in runs.items():
        own = "llama.cpp plain" if name.startswith("llama") else "plain"
        base = med(runs[(kind, own)], "tps") if (kind, own) in runs else float("nan")
        tps = med(rs, "tps")
        acc = f"{med(rs, 'acceptance'):.2f}" if "acceptance" in rs[0] and name != "plain" else "-"
        per = f"{med(rs, 'per_round'):.2f}" if "per_round" in rs[0] and name != "plain" else "-"
        if name == "draft model alone":
            print(f"{kind} | {name} (0.5B) | {tps:.2f} | - | - | -")
            continue
        print(f"{kind} | {name} | {tps:.2f} | {tps / base:.2f}x | {acc} | {per}")
        if name.startswith("k="):
            best[kind] = max(best.get(kind, (0, "")), (tps / base, name))
    for kind in args.kinds.split(","):
        t = med(runs[(kind, "plain")], "tps")
        d = med(runs[(kind, "draft model alone")], "tps")
        spec = [r for name, _ in configs[1:] for r in runs[(kind, name)]]
        ipc = statistics.median(r["draft_ms"] / max(r["drafted"], 1) for r in spec)
        print(f"{kind}: target step {1000 / t:.1f} ms, draft step {1000 / d:.1f} ms "
              f"(alone; ratio {d / t:.2f}x faster), draft wait per drafted token as the host "
              f"saw it {ipc:.1f} ms; best fixed k {best[kind][1]} at {best[kind][0]:.2f}x")
    print("law (spec ids == plain ids):", "OK" if not law else f"BROKEN in {law}")
    if args.out:
        args.out.write_text(json.dumps({f"{k}|{n}": rs for (k, n), rs in runs.items()}))


if __name__ == "__main__":
    main()
