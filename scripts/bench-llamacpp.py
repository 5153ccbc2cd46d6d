#!/usr/bin/env python3
"""Peer numbers: llama.cpp decode speed on the GGUFs Specula serves, plain and with prompt lookup.

    python scripts/bench-llamacpp.py --out bench-out/llamacpp.json [--models smollm2-135m,...] [--runs 3]

Installs nothing. It needs llama-cpp-python, which builds llama.cpp from the sdist (cmake; ~20 min on
2 cores), plus numpy and jinja2:

    python -m venv .venv-ref && .venv-ref/bin/pip install numpy jinja2
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-ref/bin/pip install llama-cpp-python

On CPUs that advertise AMX inside a VM that does not enable it (this dev box: SIGILL in ggml's AMX
repack), build without AMX instead: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON
-DGGML_AVX_VNNI=ON -DGGML_BMI2=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF".

What it measures, per model (n_threads=2, greedy, median of --runs after one warm-up):
  * decode: tokens/s over 128 tokens after a short raw prompt (end-of-text banned so all 128 run);
    the clock starts at the first generated token, so prefill is excluded.
  * echo: a "rewrite this code with one change" chat prompt, plain vs LlamaPromptLookupDecoding
    (llama.cpp's n-gram prompt lookup); reports tokens/s of each, the speed-up, and whether the two
    greedy outputs are identical (they must be: a drafter changes speed, never output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from llama_cpp import Llama, LogitsProcessorList
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
DECODE_PROMPT = "The history of the printing press begins"

ECHO_CODE = '''def summarize(orders):
    """Return totals per customer and the overall revenue."""
    totals = {}
    revenue = 0.0
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["unit_price"]
        if order.get("discount"):
            amount = amount * (1.0 - order["discount"])
        totals[customer] = totals.get(customer, 0.0) + amount
        revenue += amount
    best = max(totals, key=totals.get) if totals else None
    return {"totals": totals, "revenue": revenue, "best_customer": best}


def format_report(summary):
    lines = [f"Revenue: {summary['revenue']:.2f}"]
    for customer, amount in sorted(summary["totals"].items()):
        lines.append(f"  {customer}: {amount:.2f}")
    if summary["best_customer"] is not None:
        lines.append(f"Best customer: {summary['best_customer']}")
    return "\\n".join(lines)
'''
ECHO_REQUEST = (
    "Rewrite this code with one change: rename the variable `revenue` to `grand_total` everywhere. "
    "Output only the full code, nothing else.\n\n```python\n" + ECHO_CODE + "```"
)


def model_path(name: str) -> str:
    out = subprocess.run([os.path.join(ROOT, "scripts", "fetch-model"), name], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def chat_ids(llm: Llama, question: str) -> list[int]:
    """The GGUF chat template applied to one user turn, tokenized with llama.cpp's tokenizer."""
    import jinja2

    template = llm.metadata["tokenizer.chat_template"]
    text = jinja2.Environment().from_string(template).render(
        messages=[{"role": "user", "content": question}], add_generation_prompt=True, tools=None
    )
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def timed_generate(llm: Llama, prompt: list[int], max_tokens: int, ban_eos: bool):
    """Greedy-generate; return (token ids, decode tokens/s measured from the first generated token)."""
    llm.reset()
    eos = llm.token_eos()
    procs = None
    if ban_eos:
        def no_eos(_ids, scores):
            scores[eos] = -np.inf
            return scores

        procs = LogitsProcessorList([no_eos])
    out, t_first = [], None
    for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, logits_processor=procs, reset=True):
        if t_first is None:
            t_first = time.perf_counter()
        if tok == eos:
            break
        out.append(tok)
        if len(out) >= max_tokens:
            break
    t_last = time.perf_counter()
    if len(out) < 2:
        raise RuntimeError(f"only {len(out)} tokens generated: cannot time decoding")
    return out, (len(out) - 1) / (t_last - t_first)


def median_run(llm: Llama, prompt: list[int], max_tokens: int, ban_eos: bool, runs: int):
    timed_generate(llm, prompt, max_tokens, ban_eos)  # warm-up: page in the weights
    results = [timed_generate(llm, prompt, max_tokens, ban_eos) for _ in range(runs)]
    ids = results[0][0]
    if any(r[0] != ids for r in results):
        raise RuntimeError("greedy output changed between runs")
    return ids, statistics.median(r[1] for r in results)


def bench_model(name: str, runs: int, threads: int, max_tokens: int, echo_tokens: int) -> dict:
    path = model_path(name)
    common = dict(n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    plain = Llama(path, **common)
    decode_ids, decode_tps = median_run(plain, plain.tokenize(DECODE_PROMPT.encode(), add_bos=False), max_tokens, True, runs)
    prompt = chat_ids(plain, ECHO_REQUEST)
    echo_ids, echo_tps = median_run(plain, prompt, echo_tokens, False, runs)
    del plain
    lookup = Llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10), logits_all=True, **common)
    lookup_ids, lookup_tps = median_run(lookup, prompt, echo_tokens, False, runs)
    return {
        "model": name,
        "decode_tokens": len(decode_ids),
        "decode_tok_s": round(decode_tps, 2),
        "echo_prompt_tokens": len(prompt),
        "echo_tokens": len(echo_ids),
        "echo_plain_tok_s": round(echo_tps, 2),
        "echo_lookup_tok_s": round(lookup_tps, 2),
        "echo_lookup_speedup": round(lookup_tps / echo_tps, 2),
        "echo_lookup_same_output": lookup_ids == echo_ids,
        # llama.cpp's batched (verify) and single-token kernels round differently, so its greedy
        # output can flip at a near-tie: where the two outputs first differ, if they do.
        "echo_first_divergence": next((i for i, (a, b) in enumerate(zip(lookup_ids, echo_ids)) if a != b), None),
        # ggml threads spin at barriers: on an oversubscribed CPU the numbers collapse, so keep the load.
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated fetch-model names")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128, help="decode tokens after the short prompt")
    ap.add_argument("--echo-tokens", type=int, default=400, help="token cap for the echo prompt")
    args = ap.parse_args()
    if args.runs < 1 or args.max_tokens < 2 or args.echo_tokens < 2:
        ap.error("--runs must be >= 1, --max-tokens and --echo-tokens >= 2")

    rows = []
    load_before = os.getloadavg()[0]
    for name in args.models.split(","):
        t0 = time.time()
        rows.append(bench_model(name.strip(), args.runs, args.threads, args.max_tokens, args.echo_tokens))
        print(f"{name}: done in {time.time() - t0:.0f}s", file=sys.stderr)
    print(f"{'model':<22}{'decode tok/s':>13}{'echo plain':>12}{'echo lookup':>13}{'speed-up':>10}{'same out':>10}")
    for r in rows:
        print(
            f"{r['model']:<22}{r['decode_tok_s']:>13.1f}{r['echo_plain_tok_s']:>12.1f}"
            f"{r['echo_lookup_tok_s']:>13.1f}{r['echo_lookup_speedup']:>9.2f}x{str(r['echo_lookup_same_output']):>10}"
        )
    import llama_cpp

    report = {
        "tool": "llama-cpp-python " + llama_cpp.__version__,
        "threads": args.threads,
        "runs": args.runs,
        "loadavg_1m_before": round(load_before, 2),
        "cpu_count": os.cpu_count(),
        "decode_prompt": DECODE_PROMPT,
        "echo_request": ECHO_REQUEST,
        "results": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
