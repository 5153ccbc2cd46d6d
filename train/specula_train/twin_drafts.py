"""Golden drafts of the PyTorch twins on the shipped weights, for the Rust drafters to match.

For each bench prompt (ids exactly as `serve` feeds them) the target continues greedily (f32,
dequantized GGUF, on CPU), then every drafter kind drafts from that context the way the
verify loop would ask it to:
  dflash / dspark: one round per anchor position a = prompt_len + j (j = 0..rounds-1) with the
    taps of positions < a; the ids drafted, the top-1/top-2 logit margin of each (a Rust port
    may differ where the margin is tiny: its target runs quantized matmuls), and DSpark's
    confidences;
  mtp: the first draft at every position t from (h_t, token t+1), with its margin;
  assistant: one round per pending position a = prompt_len + j over the target's last-layer K/V
    of positions < a and its final hidden at a-1: 7 chained drafts (each the next step's input)
    with their margins.
The weights are read back from the exported safetensors, so this also checks the export.

    python3 -m specula_train.twin_drafts --gguf T.gguf --prompts DIR \
        --weights drafters/weights/smollm2-135m --out train/results/smollm2-135m/twin-drafts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .export import read_tensors
from .drafters import Assistant, DFlash, DSpark, MTP, block_mask
from .gen import load_prompts
from .target import Target, load_gguf


def load_drafter(folder: Path):
    cfg = json.loads((folder / "config.json").read_text())
    sd = read_tensors(folder / "model.safetensors")
    arch = cfg["architectures"][0]
    if arch == "Gemma4AssistantForCausalLM":
        m = Assistant(cfg)
    elif arch == "SpeculaLlamaMTP":
        m = MTP(cfg)
        prefix = cfg["mtp"]["layer_prefix"]
        sd = {k[len(prefix):]: v for k, v in sd.items()}
    else:
        m = (DSpark if arch == "DSparkDraftModel" else DFlash)(cfg)
    m.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return m.eval(), cfg


def margin(logits: torch.Tensor) -> list[float]:
    top = logits.float().topk(2, dim=-1).values
    return [round(float(x), 4) for x in (top[..., 0] - top[..., 1]).reshape(-1)]


@torch.no_grad()
def block_drafts(kind, m, target, ids, plen, rounds):
    Bk = m.config["block_size"]
    taps_ids = m.config["dflash_config"]["target_layer_ids"]
    taps, _ = target.forward(ids[None], taps_ids)
    tapcat = torch.cat([taps[i] for i in taps_ids], -1)
    out, hs = [], []
    for j in range(rounds):
        a = plen + j
        if a + 1 >= len(ids):
            break
        x = m.block_embeddings(target.embed, ids[None, a : a + 1], Bk)
        bpos = a + torch.arange(Bk)[None]
        mask = torch.ones(1, 1, Bk, a + Bk, dtype=torch.bool)
        h = m(tapcat[:, :a], torch.arange(a)[None], x, bpos, mask)
        hs.append(h[0])
        rec = {"anchor_pos": a, "anchor_id": int(ids[a])}
        if kind == "dflash":
            logits = h[0, 1:] @ target.lm_head.T
            rec["drafts"] = logits.argmax(-1).tolist()
            rec["margins"] = margin(logits)
        else:
            U = h[0] @ target.lm_head.T
            prev = ids[a : a + 1]
            d, mg, cf = [], [], []
            for k in range(Bk):
                z, c = m.heads(h[:, k], U[k : k + 1], prev)
                prev = z.argmax(-1)
                d.append(int(prev))
                mg += margin(z)
                cf.append(round(float(torch.sigmoid(c)), 4))
            rec.update(drafts=d, margins=mg, confidence=cf)
        out.append(rec)
    # The packed (training/eval) path must agree with this one-anchor path.
    anchors = torch.tensor([[r["anchor_pos"] for r in out]])
    xb = m.block_embeddings(target.embed, ids[None].gather(1, anchors), Bk)
    bpos = (anchors[:, :, None] + torch.arange(Bk)).reshape(1, -1)
    T = len(ids)
    hp = m(tapcat, torch.arange(T)[None], xb, bpos, block_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), T, Bk))
    torch.testing.assert_close(hp[0], torch.cat(hs), rtol=1e-4, atol=1e-4)
    return out


@torch.no_grad()
def mtp_drafts(m, target, ids, plen):
    _, final = target.forward(ids[None], [])
    T = len(ids)
    pos = torch.arange(T - 1)[None]
    _, h1 = m(target.embed[ids[None, 1:]], final[:, :-1], pos)
    logits = h1[0, plen - 1 :] @ target.lm_head.T
    return {"first_pos": plen - 1, "drafts": logits.argmax(-1).tolist(), "margins": margin(logits)}


@torch.no_grad()
def assistant_drafts(m, target, ids, plen, rounds, n=7):
    _, final, (k, v) = target.forward_kv(ids[None], [], target.cfg.num_layers - 1)
    out = []
    for j in range(rounds):
        a = plen + j
        if a + 1 >= len(ids):
            break
        h, tok, d, mg = final[:, a - 1 : a], ids[a], [], []
        mask = torch.ones(1, 1, 1, a, dtype=torch.bool)
        for _ in range(n):
            y, h = m.step(target.embed[tok][None, None], h, torch.tensor([[a]]), k[:, :, :a], v[:, :, :a], mask)
            logits = y[0, 0] @ target.lm_head.T
            tok = logits.argmax()
            d.append(int(tok))
            mg += margin(logits)
        out.append({"anchor_pos": a, "anchor_id": int(ids[a]), "drafts": d, "margins": mg})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--weights", type=Path, required=True, help="drafters/weights/<target>")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new", type=int, default=24, help="greedy target tokens per prompt")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--kinds", default="dflash,dspark,mtp,assistant",
                    help="the kinds to (re)make; an existing --out keeps the others' drafts")
    ap.add_argument("--cases", type=int, help="only the first N bench prompts (a smoke check)")
    a = ap.parse_args()

    cfg, w = load_gguf(a.gguf)
    target = Target(cfg, w, "cpu", torch.float32)
    prompts, tags, splits, meta = load_prompts(a.prompts)
    bench = [i for i, s in enumerate(splits) if meta["splits"][s] == "bench"]
    kinds = {k: load_drafter(a.weights / k) for k in a.kinds.split(",") if (a.weights / k).exists()}
    old = json.loads(a.out.read_text()) if a.out.exists() else {"cases": [], "weights_sha256": {}}
    cases = []
    for i in bench[: a.cases]:
        p = prompts[i]
        case = next((c for c in old["cases"] if c["prompt_ids"] == p), None)
        if case is None:
            cont = target.generate([p], a.new, {meta["eos_id"], 0}, torch.zeros(1))[0]
            case = {"tag": meta["tags"][tags[i]], "prompt_ids": p, "target_greedy": cont}
        ids = torch.tensor(p + case["target_greedy"])
        cont = case["target_greedy"]
        for k, (m, _) in kinds.items():
            if k == "mtp":
                case[k] = mtp_drafts(m, target, ids, len(p))
            elif k == "assistant":
                case[k] = assistant_drafts(m, target, ids, len(p), a.rounds)
            else:
                case[k] = block_drafts(k, m, target, ids, len(p), a.rounds)
        cases.append(case)
        print(f"{case['tag']}: {len(cont)} target tokens", flush=True)
    doc = {
        "about": __doc__.splitlines()[0],
        "target": a.gguf.name, "dtype": "f32 (dequantized GGUF), CPU",
        "weights_sha256": old["weights_sha256"] | {k: (a.weights / k / "SHA256SUMS").read_text() for k in kinds},
        "cases": cases,
    }
    a.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
