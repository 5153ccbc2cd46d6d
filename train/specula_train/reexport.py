"""Re-export shipped drafters in another format (int8 or bf16) and measure them again.

    python3 -m specula_train.reexport --gguf T.gguf --weights drafters/weights/<t> \
        --kinds dflash,dspark --quant int8 --work WORK --out OUT

Each kind's weights are read (dequantized if int8), written again with `--quant` beside the
original config.json, and the written file is evaluated (greedy verify simulation, as
`train/run` does) on the held-out and bench answers in WORK/data.pt (a `train/run` work folder).
The original RECIPE.md is kept, with a section appended that names this command and the new
numbers. OUT gets one <kind>.tar each and reexport.json.
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

import torch

from . import evaluate, export, gen
from .run import load_target
from .twin_drafts import load_drafter


def measure(kind, m, target, data, device) -> dict:
    m = m.to(device)
    if kind == "mtp":
        return evaluate.evaluate_mtp(m, target, data, device)
    if kind == "assistant":
        return evaluate.evaluate_assistant(m, target, data, device)
    return evaluate.evaluate_block(kind, m, target, data, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--weights", type=Path, required=True, help="drafters/weights/<target>")
    ap.add_argument("--kinds", default="dflash,dspark")
    ap.add_argument("--quant", choices=["int8", "bf16"], default="int8")
    ap.add_argument("--work", type=Path, required=True, help="a train/run work folder (data.pt)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(a.gguf, a.work, device)
    data = gen.Data(a.work / "data.pt")
    a.out.mkdir(parents=True, exist_ok=True)
    fp = export.tokenizer_fingerprint(a.gguf)
    report = {}
    for kind in a.kinds.split(","):
        src = a.weights / kind
        m, cfg = load_drafter(src)
        cfg = {k: v for k, v in cfg.items() if k != "specula_target"}
        d = a.work / "reexport" / kind
        quant = None if a.quant == "bf16" else a.quant
        info = export.write(kind, m, cfg, target.cfg, fp, d, "", quant)
        back, _ = load_drafter(d)  # what ships, read back as the drafters read it
        numbers = measure(kind, back, target, data, device)
        recipe = (src / "RECIPE.md").read_text().rstrip() + "\n\n" + "\n".join([
            f"## Re-exported as {a.quant}", "",
            "The weights above, written again by", "```",
            f"python3 -m specula_train.reexport --gguf {a.gguf.name} --weights {a.weights} --kinds {kind} "
            f"--quant {a.quant} --work WORK --out OUT", "```",
            f"({info['bytes']} bytes). Measured again on the file as shipped:", "",
            "```json", json.dumps(numbers, indent=1), "```", "",
        ])
        (d / "RECIPE.md").write_text(recipe)
        sums = "".join(f"{export.sha256(d / n)}  {n}\n" for n in ("config.json", "model.safetensors"))
        (d / "SHA256SUMS").write_text(sums)
        with tarfile.open(a.out / f"{kind}.tar", "w") as t:
            for n in ("config.json", "model.safetensors", "SHA256SUMS", "RECIPE.md"):
                t.add(d / n, arcname=f"{kind}/{n}")
        report[kind] = {"export": info, "metrics": numbers}
        print(f"{kind}: {info} " + json.dumps({g: v.get("tau_excl_bonus", v.get("first_token_acceptance")) for g, v in numbers.items() if g.endswith("/all")}), flush=True)
    (a.out / "reexport.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
