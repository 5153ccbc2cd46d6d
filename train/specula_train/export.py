"""Write trained drafters in the formats Specula's Rust drafters load.

`drafters/weights/<target>/<kind>/`:
  config.json        the reference's config (z-lab DFlash for dflash/dspark, DeepSeek-style MTP)
                     plus `specula_target` {architecture, tokenizer_fingerprint, hidden_size,
                     num_layers}: the keys a drafter matches against the host's TargetInfo;
  model.safetensors  bf16 tensors under the reference's names;
  SHA256SUMS         `sha256sum -c` format;
  RECIPE.md          the command, seed, data recipe, device time and measured numbers.

The tokenizer fingerprint is a port of `specula_models::tokenizer::fingerprint` (SHA-256 over
"specula-tokenizer-v1", each token length-prefixed in id order, BOS, add_bos, EOS ids).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

END_TOKEN_TEXTS = [
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
    "<end_of_turn>", "<|return|>", "<|call|>", "<EOT>", "</s>",
]
TYPE_CONTROL = 3


def tokenizer_fingerprint(gguf_path: Path) -> str:
    import gguf

    r = gguf.GGUFReader(str(gguf_path))
    f = lambda k: r.fields[k].contents() if k in r.fields else None  # noqa: E731
    tokens, types = f("tokenizer.ggml.tokens"), f("tokenizer.ggml.token_type")
    bos = f("tokenizer.ggml.bos_token_id")
    add_bos = bool(f("tokenizer.ggml.add_bos_token") or False)
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        v = f(key)
        if v is not None and v not in eos:
            eos.append(v)
    for i, ty in enumerate(types):
        if ty == TYPE_CONTROL and tokens[i] in END_TOKEN_TEXTS and i not in eos:
            eos.append(i)
    h = hashlib.sha256(b"specula-tokenizer-v1")
    for t in tokens:
        b = t.encode()
        h.update(struct.pack("<I", len(b)) + b)
    h.update(struct.pack("<I", 0xFFFFFFFF if bos is None else bos))
    h.update(bytes([int(add_bos)]))
    h.update(struct.pack("<I", len(eos)))
    for i in eos:
        h.update(struct.pack("<I", i))
    return h.hexdigest()


def tensors_of(kind: str, model: torch.nn.Module, num_target_layers: int) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    if kind == "mtp":
        sd = {f"model.layers.{num_target_layers}.{k}": v for k, v in sd.items()}
    return sd


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(kind: str, model, config: dict, target_cfg, fingerprint: str, out: Path, recipe_md: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    cfg["specula_target"] = {
        "architecture": target_cfg.architecture,
        "tokenizer_fingerprint": fingerprint,
        "hidden_size": target_cfg.hidden_size,
        "num_layers": target_cfg.num_layers,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = tensors_of(kind, model, target_cfg.num_layers)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "specula_kind": kind})
    (out / "RECIPE.md").write_text(recipe_md)
    sums = "".join(f"{sha256(out / n)}  {n}\n" for n in ("config.json", "model.safetensors"))
    (out / "SHA256SUMS").write_text(sums)
    return {
        "params": sum(t.numel() for t in tensors.values()),
        "bytes": (out / "model.safetensors").stat().st_size,
    }
