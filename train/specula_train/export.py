"""Write trained drafters in the formats Specula's Rust drafters load.

`drafters/weights/<target>/<kind>/`:
  config.json        the reference's config (z-lab DFlash for dflash/dspark, DeepSeek-style MTP)
                     plus `specula_target` {architecture, tokenizer_fingerprint, hidden_size,
                     num_layers}: the keys a drafter matches against the host's TargetInfo;
  model.safetensors  tensors under the reference's names: bf16, or with `--quant int8` every
                     matrix of at least QUANT_MIN_NUMEL values as int8 with one f32 scale per row
                     (below);
  SHA256SUMS         `sha256sum -c` format;
  RECIPE.md          the command, seed, data recipe, device time and measured numbers.

Int8 (`quant="int8"`): a matrix `W` [rows, cols] is stored as `W` = uint8 `q + 128` with
`q = round(W / s)` in [-127, 127] and `W_scale` = f32 [rows] `s = max|W[r]| / 127`, so
`W = (W_u8 - 128) * W_scale[:, None]`; the file's metadata says `specula_quant: int8-rows`.
Vectors (norms, biases, scalars) stay bf16. The Rust side dequantizes at load in one place
(`specula_models::weights::dequantize_rows`), as `read_tensors` does here.

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


QUANT_MIN_NUMEL = 4096
SCALE_SUFFIX = "_scale"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 q + 128, f32 scale per row) of a matrix, symmetric int8 per row."""
    w = w.detach().float().cpu()
    scale = w.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale[:, None]).round().clamp(-127, 127)
    return (q + 128).to(torch.uint8).contiguous(), scale.contiguous()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float() - 128) * scale.float()[:, None]


def tensors_of(kind: str, model: torch.nn.Module, num_target_layers: int, quant: str | None = None) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    if kind == "mtp":
        sd = {f"model.layers.{num_target_layers}.{k}": v for k, v in sd.items()}
    if quant == "int8":
        out = {}
        for k, v in sd.items():
            if v.dim() == 2 and v.numel() >= QUANT_MIN_NUMEL:
                out[k], out[k + SCALE_SUFFIX] = quantize_rows(v)
            else:
                out[k] = v
        sd = out
    elif quant is not None:
        raise ValueError(f"quant {quant!r}: only int8 (or none, bf16)")
    return sd


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A drafter's safetensors as f32, int8 matrices dequantized (what the Rust loaders see)."""
    from safetensors.torch import load_file

    sd = load_file(str(path))
    out = {}
    for k, v in sd.items():
        if k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in sd:
            continue
        if v.dtype == torch.uint8:
            out[k] = dequantize_rows(v, sd[k + SCALE_SUFFIX])
        else:
            out[k] = v.float()
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(kind: str, model, config: dict, target_cfg, fingerprint: str, out: Path, recipe_md: str, quant: str | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    cfg["specula_target"] = {
        "architecture": target_cfg.architecture,
        "tokenizer_fingerprint": fingerprint,
        "hidden_size": target_cfg.hidden_size,
        "num_layers": target_cfg.num_layers,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = tensors_of(kind, model, target_cfg.num_layers, quant)
    meta = {"format": "pt", "specula_kind": kind} | ({"specula_quant": "int8-rows"} if quant else {})
    save_file(tensors, str(out / "model.safetensors"), metadata=meta)
    (out / "RECIPE.md").write_text(recipe_md)
    sums = "".join(f"{sha256(out / n)}  {n}\n" for n in ("config.json", "model.safetensors"))
    (out / "SHA256SUMS").write_text(sums)
    return {
        "params": sum(t.numel() for k, t in tensors.items() if not k.endswith(SCALE_SUFFIX)),
        "bytes": (out / "model.safetensors").stat().st_size,
    }
