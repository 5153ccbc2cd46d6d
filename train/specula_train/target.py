"""The target model in PyTorch, loaded from its GGUF: forward with taps, batched generation.

A llama-architecture GGUF (SmolLM2, ...) is dequantized with the `gguf` package (every tensor
to f32, then to the compute dtype). llama.cpp's converter permutes Q/K rows for its interleaved
RoPE; they are permuted back so the model uses the Hugging Face half-split RoPE, the layout of
every drafter weight file we write.

Layer indexing follows Specula's protocol: tap `l` is the output of decoder layer `l`
(= Hugging Face `hidden_states[l + 1]`); `final` is the output of the final RMSNorm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class TargetConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    def to_dict(self):
        return asdict(self)


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved RoPE -> half-split RoPE)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_gguf(path: Path) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    """Reads a llama GGUF into f32 tensors named in the Hugging Face layout."""
    import gguf

    r = gguf.GGUFReader(str(path))

    def field(k, default=None):
        return r.fields[k].contents() if k in r.fields else default

    arch = field("general.architecture")
    if arch != "llama":
        raise SystemExit(f"{path}: architecture {arch!r} is not supported yet (llama only)")
    p = f"{arch}."
    n_head = field(p + "attention.head_count")
    n_kv = field(p + "attention.head_count_kv", n_head)
    hidden = field(p + "embedding_length")
    tensors = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        a = a.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists ne0 (the inner dim) first
        tensors[t.name] = a
    names = {
        "token_embd.weight": "embed_tokens.weight",
        "output_norm.weight": "norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    out = {}
    for name, a in tensors.items():
        if name in names:
            out[names[name]] = a
            continue
        _, i, kind, _w = name.split(".")
        if kind == "attn_q":
            a = _reverse_permute(a, n_head)
        elif kind == "attn_k":
            a = _reverse_permute(a, n_kv)
        out[f"layers.{i}.{per_layer[kind]}.weight"] = a
    tie = "lm_head.weight" not in out
    cfg = TargetConfig(
        architecture=arch,
        vocab_size=out["embed_tokens.weight"].shape[0],
        hidden_size=hidden,
        num_layers=field(p + "block_count"),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=field(p + "rope.dimension_count", hidden // n_head),
        intermediate_size=field(p + "feed_forward_length"),
        rms_norm_eps=float(field(p + "attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(p + "rope.freq_base", 10000.0)),
        max_position_embeddings=field(p + "context_length"),
        tie_word_embeddings=tie,
    )
    return cfg, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen RMSNorm: normalize in f32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope_tables(head_dim: int, theta: float, max_pos: int, device, dtype=torch.float32):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    f = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd] (already gathered at the positions)."""
    c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * c + rotate_half(x) * s


class Target:
    """A frozen llama target: full forwards with taps, and batched generation."""

    def __init__(self, cfg: TargetConfig, w: dict[str, torch.Tensor], device, dtype=torch.bfloat16):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        g = lambda k: w[k].to(device=device, dtype=dtype)  # noqa: E731
        self.embed = g("embed_tokens.weight")
        self.lm_head = g("lm_head.weight") if "lm_head.weight" in w else self.embed
        self.norm = g("norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            self.layers.append({
                "ln1": g(p + "input_layernorm.weight"), "ln2": g(p + "post_attention_layernorm.weight"),
                "qkv": torch.cat([g(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0),
                "o": g(p + "self_attn.o_proj.weight"),
                "gu": torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")], 0),
                "down": g(p + "mlp.down_proj.weight"),
            })
        self.cos, self.sin = rope_tables(cfg.head_dim, cfg.rope_theta, 8192, device)
        self.eps = cfg.rms_norm_eps

    def layer_weights(self, i: int) -> dict[str, torch.Tensor]:
        """Layer `i` in Hugging Face names (for initialising an MTP block from it)."""
        L, H = self.layers[i], self.cfg.num_heads * self.cfg.head_dim
        kv = self.cfg.num_kv_heads * self.cfg.head_dim
        inter = self.cfg.intermediate_size
        q, k, v = L["qkv"].split([H, kv, kv], 0)
        gate, up = L["gu"].split([inter, inter], 0)
        return {
            "input_layernorm.weight": L["ln1"], "post_attention_layernorm.weight": L["ln2"],
            "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": L["o"], "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": L["down"],
        }

    def _qkv(self, L, x, pos):
        c = self.cfg
        B, T, _ = x.shape
        h = rms_norm(x, L["ln1"], self.eps)
        qkv = h @ L["qkv"].T
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
        q = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.cos[pos], self.sin[pos]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, L, x, a):
        B, T = x.shape[:2]
        x = x + a.transpose(1, 2).reshape(B, T, -1) @ L["o"].T
        gu = rms_norm(x, L["ln2"], self.eps) @ L["gu"].T
        g, u = gu.chunk(2, -1)
        return x + (F.silu(g) * u) @ L["down"].T

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, taps: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Causal forward over right-padded rows. Returns ({layer: [B,T,H]}, final-norm [B,T,H])."""
        out, final, _ = self.forward_kv(ids, taps, None)
        return out, final

    @torch.no_grad()
    def forward_kv(self, ids: torch.Tensor, taps: list[int], kv_layer: int | None):
        """`forward`, plus layer `kv_layer`'s K (after RoPE, half-split) and V as
        [B, kv_heads, T, head_dim] each (None without a layer): an assistant's donor rows."""
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device).expand(B, T)
        x = self.embed[ids]
        out, kv = {}, None
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, pos)
            if i == kv_layer:
                kv = (k, v)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = self._finish(L, x, a)
            if i in taps:
                out[i] = x
        return out, rms_norm(x, self.norm, self.eps), kv

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.lm_head.T

    def _prefill_attention(self, q, k, v, mask, rows: int = 256):
        """Prefill attention in row chunks: the masked path materializes [rows, heads, P, P]."""
        return torch.cat([
            F.scaled_dot_product_attention(
                q[r : r + rows], k[r : r + rows], v[r : r + rows], attn_mask=mask[r : r + rows], enable_gqa=True
            )
            for r in range(0, q.shape[0], rows)
        ], 0)

    def _decode_attention(self, q, kc, vc, valid):
        """One query per row over the cache, GQA without expanding K/V.

        q [B, heads, 1, hd]; kc/vc [B, kv, L, hd]; valid [B, L]. The q heads of one K/V head are
        the rows of one small matmul, so the cache is read once (SDPA's masked GQA fallback
        copies it heads/kv times: most of the old 70 ms/step)."""
        c = self.cfg
        B, L = valid.shape
        g = c.num_heads // c.num_kv_heads
        qg = q.reshape(B, c.num_kv_heads, g, c.head_dim)
        s = (qg @ kc.transpose(-1, -2)).float() * c.head_dim**-0.5  # [B, kv, g, L]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        a = s.softmax(-1).to(vc.dtype) @ vc  # [B, kv, g, hd]
        return a.reshape(B, c.num_heads, 1, c.head_dim)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new: int, stop_ids: set[int], temperature: torch.Tensor,
        top_k: int = 20, top_p: float = 0.8, generator: torch.Generator | None = None,
        compact_every: int = 16,
    ) -> list[list[int]]:
        """Batched decoding with a preallocated KV cache; rows are left-padded.

        Rows with temperature 0 are greedy; the others sample at their temperature from the top-k
        tokens, nucleus top-p. A row stops after emitting a stop id (which it keeps). Every
        `compact_every` steps (one host sync) the batch stops when every row is done, and drops
        its finished rows from the cache once they are a quarter of it, so the long answers do
        not drag the short ones' dead rows to the end."""
        c, dev = self.cfg, self.device
        B, P = len(prompts), max(len(p) for p in prompts)
        T = P + max_new
        pad = torch.tensor([P - len(p) for p in prompts], device=dev)
        ids = torch.zeros(B, P, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p, device=dev)
        valid = torch.zeros(B, T, dtype=torch.bool, device=dev)
        valid[:, :P] = torch.arange(P, device=dev)[None] >= pad[:, None]
        kc = torch.zeros(len(self.layers), B, c.num_kv_heads, T, c.head_dim, dtype=self.dtype, device=dev)
        vc = torch.zeros_like(kc)
        pos = (torch.arange(P, device=dev)[None] - pad[:, None]).clamp(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        mask = (causal[None] & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=dev)[None]
        x = self.embed[ids]
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, pos)
            kc[i, :, :, :P], vc[i, :, :, :P] = k, v
            x = self._finish(L, x, self._prefill_attention(q, k, v, mask[:, None]))
        logits = self.logits(rms_norm(x[:, -1], self.norm, self.eps))
        del x, mask
        out = torch.zeros(B, max_new, dtype=torch.long, device=dev)
        row = torch.arange(B, device=dev)  # batch slot -> prompt index
        temp = temperature.to(dev)
        sample = bool((temp > 0).any())  # decided once: a per-step check would sync the host
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        stop = torch.tensor(sorted(stop_ids), device=dev)
        n = 0
        for s in range(max_new):
            tok = self._pick(logits, temp, top_k, top_p, generator, sample)
            tok = torch.where(done, torch.zeros_like(tok), tok)
            out[row, s] = tok
            n = s + 1
            done = done | torch.isin(tok, stop)
            if s + 1 == max_new:
                break
            if (s + 1) % compact_every == 0:
                nd = int(done.sum())
                if nd == done.numel():
                    break
                if nd * 4 >= done.numel():
                    keep = (~done).nonzero()[:, 0]
                    kc, vc = kc[:, keep], vc[:, keep]
                    valid, pad, row, temp = valid[keep], pad[keep], row[keep], temp[keep]
                    tok, done = tok[keep], done[keep]
            idx = P + s
            valid[:, idx] = True
            x = self.embed[tok][:, None]
            p = (idx - pad)[:, None]
            m = valid[:, : idx + 1]
            for i, L in enumerate(self.layers):
                q, k, v = self._qkv(L, x, p)
                kc[i, :, :, idx], vc[i, :, :, idx] = k[:, :, 0], v[:, :, 0]
                a = self._decode_attention(q, kc[i, :, :, : idx + 1], vc[i, :, :, : idx + 1], m)
                x = self._finish(L, x, a)
            logits = self.logits(rms_norm(x[:, 0], self.norm, self.eps))
        res = []
        out = out[:, :n].tolist()
        for b in range(B):
            r = out[b]
            for j, t in enumerate(r):
                if t in stop_ids:
                    r = r[: j + 1]
                    break
            res.append(r)
        return res

    @staticmethod
    def _pick(logits, temperature, top_k, top_p, generator, sample: bool):
        greedy = logits.argmax(-1)
        if not sample:
            return greedy
        t = temperature.clamp(min=1e-6)[:, None]
        vals, idx = torch.topk(logits.float() / t, top_k, dim=-1)
        probs = vals.softmax(-1)
        keep = probs.cumsum(-1) - probs < top_p
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
        choice = torch.multinomial(probs, 1, generator=generator)[:, 0]
        sampled = idx.gather(-1, choice[:, None])[:, 0]
        return torch.where(temperature > 0, sampled, greedy)
