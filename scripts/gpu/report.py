#!/usr/bin/env python3
"""Merges the JSON files of one scripts/gpu-bench run into OUT/results.json and a Markdown
table OUT/results.md. A missing or failed part shows as "n/a" (the log says why).

    python3 scripts/gpu/report.py OUT_DIR PRESET...
"""
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def fmt(x, spec=".1f"):
    return "n/a" if x is None else format(x, spec)


def fmt_bool(x):
    return "n/a" if x is None else ("yes" if x else "no")


def cuda_step_table(presets, step, peer, candle, hf_decode):
    """The CUDA step (specula-cuda) beside PyTorch + CUDA graph, candle and HF, same run."""
    lines = ["", "CUDA step (`cuda-bench`: own kernels, one CUDA graph per window; bf16 weights "
             "and KV) beside the PyTorch + CUDA graph peer (`scripts/gpu/torch_step.py`):", "",
             "| shape | bytes/token | limit tok/s | CUDA step tok/s | of limit | with PDL "
             "tok/s | eager launches tok/s | PyTorch + graph tok/s | of limit | candle tok/s | HF tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in presets:
        s, t = step.get(p) or {}, peer.get(p) or {}
        lim = s.get("limit_tok_s")
        tp = t.get("decode_tok_s")
        cd = ((candle.get(p) or {}).get("decode") or {}).get("tokens_per_s")
        lines.append(
            f"| {p} | {fmt(s.get('bytes_per_token') and s['bytes_per_token'] / 1e9, '.2f')} GB | "
            f"{fmt(lim, '.0f')} | {fmt(s.get('decode_tok_s'))} | "
            f"{fmt(s.get('fraction_of_limit'), '.2f')} | {fmt(s.get('decode_pdl_tok_s'))} | "
            f"{fmt(s.get('decode_eager_tok_s'))} | "
            f"{fmt(tp)} | {fmt(tp / lim if tp and lim else None, '.2f')} | {fmt(cd)} | "
            f"{fmt((hf_decode.get(p) or {}).get('decode_tokens_per_s'))} |")
    lines += ["", "Verify window, CUDA step vs PyTorch + graph (ms; x = relative to 1 row):", "",
              "| window | " + " | ".join(f"{p} CUDA step | {p} PyTorch" for p in presets) + " |",
              "|---|" + "---|---|" * len(presets)]
    rows = sorted({w["rows"] for s in step.values() if s for w in s["windows"]})
    for w in rows:
        cells = []
        for p in presets:
            for src in (step.get(p), peer.get(p)):
                v = next((v for v in (src or {}).get("windows", []) if v["rows"] == w), None)
                cells.append("n/a" if v is None else f"{v['ms']:.3f} ({v['ratio']:.2f}x)")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return lines


def main():
    out, presets = sys.argv[1], sys.argv[2:]
    gpu = open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(
        os.path.join(out, "gpu.txt")) else "unknown"
    specula = {p: load(os.path.join(out, f"specula-{p}.json")) for p in presets}
    echo = {p: load(os.path.join(out, f"specula-{p}-echo.json")) for p in presets}
    hf = load(os.path.join(out, "hf.json")) or {}
    hf_decode = {d["model"]: d for d in hf.get("decode", [])}
    step = {p: load(os.path.join(out, f"cuda-{p}.json")) for p in presets}
    peer = load(os.path.join(out, "torch.json")) or {}
    results = {"gpu": gpu, "specula": specula, "specula_echo": echo, "hf": hf,
               "specula_cuda": step, "torch_graph": peer}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)

    lines = [f"GPU: {gpu}", ""]
    copies = [(p, s["copy"]) for p, s in specula.items() if s and s.get("copy")]
    if copies:
        lines.append("Copy bandwidth (device to device, read + write bytes): "
                     + ", ".join(f"candle {c['gb_per_s']:.0f} GB/s ({p} run)" for p, c in copies)
                     + (f", torch {hf['copy']['gb_per_s']:.0f} GB/s" if hf.get("copy") else ""))
        lines.append("")
    lines += ["| shape | params | bytes/token (weights + KV) | bandwidth limit tok/s | "
              "Specula tok/s | fraction of limit | HF transformers tok/s | Specula / HF |",
              "|---|---|---|---|---|---|---|---|"]
    for p in presets:
        s, h = specula.get(p), hf_decode.get(p)
        d = s["decode"] if s else {}
        wb = d.get("weight_bytes_per_token")
        bytes_tok = None if wb is None else (wb + d["kv_bytes_per_token"]) / 1e9
        sp, hp = d.get("tokens_per_s"), (h or {}).get("decode_tokens_per_s")
        lines.append(
            f"| {p} | {fmt(s and s['parameters'] / 1e9, '.2f')}B | {fmt(bytes_tok, '.2f')} GB | "
            f"{fmt(d.get('bandwidth_limit_tokens_per_s'))} | {fmt(sp)} | "
            f"{fmt(d.get('fraction_of_limit'), '.2f')} | {fmt(hp)} | "
            f"{fmt(sp / hp if sp and hp else None, '.2f')} |")
    lines += cuda_step_table(presets, step, peer, specula, hf_decode)
    lines += ["", "Verify window forward time at context 512 (ms; x = relative to 1 token):", "",
              "| window | " + " | ".join(presets) + " |", "|---|" + "---|" * len(presets)]
    windows = sorted({v["window"] for s in specula.values() if s for v in s["verify"]})
    for w in windows:
        cells = []
        for p in presets:
            v = next((v for v in (specula.get(p) or {}).get("verify", []) if v["window"] == w),
                     None)
            cells.append("n/a" if v is None else f"{v['ms']:.2f} ({v['relative_to_one']:.2f}x)")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += ["", "Speculative loop with out-of-process drafters (means per round; rounds with "
              "drafts = verify windows of k + 1):", "",
              "| shape | drafter | k | rounds with drafts / all | forward ms | draft (IPC) ms "
              "| host ms | (draft + host) / forward | host / forward | accepted/round | tok/s "
              "| = plain output |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in presets:
        for runs in (specula, echo):
            sp = (runs.get(p) or {}).get("speculative")
            if not sp:
                lines.append(f"| {p} | n/a |||||||||||")
                continue
            st = sp["stats"]
            div = sp.get("divergence")
            same = "yes" if sp["matches_plain"] else (
                f"first {sp['same_prefix']} ids" + (
                    f" (then a margin of {div['margin']:.4f}, logit std {div['logit_std']:.3f})"
                    if div else ""))
            lines.append(
                f"| {p} | {sp['drafter']} | {sp['num_draft_tokens']} | "
                f"{st['rounds']}/{st['target_forwards']} | {sp['forward_ms_per_round']:.2f} | "
                f"{sp['draft_ms_per_round']:.3f} | {sp['host_ms_per_round']:.3f} | "
                f"{100 * sp['overhead_fraction']:.2f}% | {100 * sp['host_fraction']:.2f}% | "
                f"{st['mean_accepted_per_round']:.2f} | {st['decode_tokens_per_s']:.1f} | {same} |")
    lines += ["", "Plain decode repeatable (two runs, same ids): " + ", ".join(
        f"{p} {fmt_bool((specula.get(p) or {}).get('decode', {}).get('repeatable'))}"
        for p in presets)]
    if hf:
        lines += ["", f"HF: torch {hf.get('torch')}, transformers {hf.get('transformers')}, "
                  f"eager generate, attention {', '.join(sorted({d['attn_implementation'] for d in hf_decode.values()}))}."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
