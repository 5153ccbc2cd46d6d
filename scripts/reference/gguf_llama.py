"""Plain numpy forward of the llama family (`llama`, `qwen2`) over the dequantized tensors of a GGUF.

This is the numerical reference for Specula's golden tests: no quantized kernels, no fused ops, just
the textbook math in float32 (or float64) so that a disagreement points at the Rust side.

The one subtle point is rope. llama.cpp's converter permutes the q/k rows of `llama` checkpoints so
that ggml's "normal" rope, which rotates adjacent pairs (x0,x1),(x2,x3)..., equals HF's half-split
`rotate_half`; `qwen2` is stored unpermuted and llama.cpp runs it with LLAMA_ROPE_TYPE_NEOX, which
rotates (x_i, x_{i+d/2}). So: interleaved rope for GGUF `llama`, NeoX rope for GGUF `qwen2`.

References: llama.cpp `convert_hf_to_gguf.py` (LlamaModel.permute) and `src/llama-model.cpp`
(llama_model_rope_type); HF transformers `modeling_llama.py` / `modeling_qwen2.py`.
"""

from __future__ import annotations

import numpy as np
import gguf

# GGUF arch name -> rope layout (see the module doc).
ROPE_LAYOUT = {"llama": "interleaved", "qwen2": "neox"}


class GgufFile:
    """Metadata and lazily dequantized tensors of one GGUF file."""

    def __init__(self, path: str):
        self.reader = gguf.GGUFReader(path)
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}

    def meta(self, key: str, default=None):
        """One metadata value (str, number or list), or `default` when the key is absent."""
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def weight(self, name: str, dtype) -> np.ndarray:
        """A tensor dequantized to `dtype`, in numpy order ([out, in] for matrices)."""
        t = self.tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(dtype, copy=False)


class Config:
    """Hyper-parameters read from the `{arch}.*` metadata."""

    def __init__(self, f: GgufFile):
        arch = f.meta("general.architecture")
        if arch not in ROPE_LAYOUT:
            raise ValueError(f"unsupported architecture {arch!r} (supported: {sorted(ROPE_LAYOUT)})")
        self.arch = arch
        self.n_layer = int(f.meta(f"{arch}.block_count"))
        self.dim = int(f.meta(f"{arch}.embedding_length"))
        self.n_head = int(f.meta(f"{arch}.attention.head_count"))
        self.n_kv_head = int(f.meta(f"{arch}.attention.head_count_kv", self.n_head))
        self.head_dim = self.dim // self.n_head
        self.rope_dim = int(f.meta(f"{arch}.rope.dimension_count", self.head_dim))
        self.rope_base = float(f.meta(f"{arch}.rope.freq_base", 10000.0))
        self.eps = float(f.meta(f"{arch}.attention.layer_norm_rms_epsilon"))
        self.rope_layout = ROPE_LAYOUT[arch]
        if self.rope_dim != self.head_dim:
            raise ValueError(f"partial rope ({self.rope_dim} of {self.head_dim}) is not supported")


def rms_norm(xs: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x * rsqrt(mean(x^2) + eps) * w
    var = np.mean(xs * xs, axis=-1, keepdims=True)
    return xs / np.sqrt(var + eps) * w


def rope(xs: np.ndarray, pos: int, cfg: Config) -> np.ndarray:
    """Rotate xs [seq_len, n_heads, head_dim] for positions pos..pos+seq_len."""
    seq_len, _, d = xs.shape
    inv_freq = 1.0 / (cfg.rope_base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.arange(pos, pos + seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(angles).astype(xs.dtype)[:, None, :]
    sin = np.sin(angles).astype(xs.dtype)[:, None, :]
    if cfg.rope_layout == "interleaved":
        x0, x1 = xs[..., 0::2], xs[..., 1::2]
    else:
        x0, x1 = xs[..., : d // 2], xs[..., d // 2 :]
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    out = np.empty_like(xs)
    if cfg.rope_layout == "interleaved":
        out[..., 0::2], out[..., 1::2] = r0, r1
    else:
        out[..., : d // 2], out[..., d // 2 :] = r0, r1
    return out


class Layer:
    """One decoder block's weights."""

    def __init__(self, f: GgufFile, i: int, dtype):
        p = f"blk.{i}."
        get = lambda n: f.weight(p + n, dtype)  # noqa: E731
        opt = lambda n: get(n) if (p + n) in f.tensors else None  # noqa: E731
        self.attn_norm, self.ffn_norm = get("attn_norm.weight"), get("ffn_norm.weight")
        self.q, self.k, self.v = get("attn_q.weight"), get("attn_k.weight"), get("attn_v.weight")
        # qwen2 has q/k/v biases; llama has none.
        self.q_b, self.k_b, self.v_b = opt("attn_q.bias"), opt("attn_k.bias"), opt("attn_v.bias")
        self.o = get("attn_output.weight")
        self.gate, self.up, self.down = get("ffn_gate.weight"), get("ffn_up.weight"), get("ffn_down.weight")


def linear(xs: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    ys = xs @ w.T
    return ys if b is None else ys + b


class Model:
    """The llama-family decoder with a per-layer KV cache (a list of growing [seq, kv_heads, hd] arrays)."""

    def __init__(self, path: str, dtype=np.float32):
        f = GgufFile(path)
        self.file = f
        self.cfg = Config(f)
        self.dtype = dtype
        self.tok_embd = f.weight("token_embd.weight", dtype)
        self.layers = [Layer(f, i, dtype) for i in range(self.cfg.n_layer)]
        self.out_norm = f.weight("output_norm.weight", dtype)
        # Tied embeddings: SmolLM2 has no output.weight.
        self.lm_head = f.weight("output.weight", dtype) if "output.weight" in f.tensors else self.tok_embd
        self.reset()

    def reset(self):
        """Empty the KV cache."""
        self.k_cache = [None] * self.cfg.n_layer
        self.v_cache = [None] * self.cfg.n_layer
        self.pos = 0

    def forward(self, ids: list[int]) -> np.ndarray:
        """Run `ids` after the cached positions; return the logits of the last position, [vocab]."""
        cfg = self.cfg
        if not ids:
            raise ValueError("forward needs at least one token")
        if max(ids) >= self.tok_embd.shape[0] or min(ids) < 0:
            raise ValueError(f"token id out of range 0..{self.tok_embd.shape[0]}")
        xs = self.tok_embd[np.asarray(ids)]
        seq_len = len(ids)
        group = cfg.n_head // cfg.n_kv_head
        # A Python float, not np.float64: numpy 2 would promote every f32 activation to f64.
        scale = 1.0 / float(np.sqrt(cfg.head_dim))
        for i, l in enumerate(self.layers):
            h = rms_norm(xs, l.attn_norm, cfg.eps)
            q = linear(h, l.q, l.q_b).reshape(seq_len, cfg.n_head, cfg.head_dim)
            k = linear(h, l.k, l.k_b).reshape(seq_len, cfg.n_kv_head, cfg.head_dim)
            v = linear(h, l.v, l.v_b).reshape(seq_len, cfg.n_kv_head, cfg.head_dim)
            q, k = rope(q, self.pos, cfg), rope(k, self.pos, cfg)
            if self.k_cache[i] is not None:
                k = np.concatenate([self.k_cache[i], k])
                v = np.concatenate([self.v_cache[i], v])
            self.k_cache[i], self.v_cache[i] = k, v
            kv_len = k.shape[0]
            # GQA: query head h reads kv head h // group.
            k_rep = np.repeat(k, group, axis=1).transpose(1, 2, 0)  # [n_head, hd, kv_len]
            v_rep = np.repeat(v, group, axis=1).transpose(1, 0, 2)  # [n_head, kv_len, hd]
            scores = (q.transpose(1, 0, 2) @ k_rep) * scale  # [n_head, seq_len, kv_len]
            # Causal mask: query t (absolute pos+t) sees keys 0..=pos+t.
            q_pos = self.pos + np.arange(seq_len)[:, None]
            k_pos = np.arange(kv_len)[None, :]
            scores = np.where(k_pos <= q_pos, scores, -np.inf)
            scores = scores - scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = (probs @ v_rep).transpose(1, 0, 2).reshape(seq_len, cfg.dim)
            xs = xs + linear(attn, l.o, None)
            h = rms_norm(xs, l.ffn_norm, cfg.eps)
            gate = linear(h, l.gate, None)
            # SwiGLU: down(silu(gate(h)) * up(h)); sigmoid via tanh so large |gate| cannot overflow exp.
            act = gate * (0.5 * (1.0 + np.tanh(0.5 * gate))) * linear(h, l.up, None)
            xs = xs + linear(act, l.down, None)
            assert xs.dtype == self.dtype, f"layer {i} promoted activations to {xs.dtype}"
        self.pos += seq_len
        last = rms_norm(xs[-1:], self.out_norm, cfg.eps)
        return (last @ self.lm_head.T)[0]
