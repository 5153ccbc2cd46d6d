"""PyTorch twins of Specula's learned drafters: DFlash, DSpark and an MTP head.

DFlash (z-lab `dflash/model.py`, `DFlashDraftModel`): `fc` fuses the concatenated taps, then
`hidden_norm`; each Qwen3-style layer attends from the block (anchor + masks) to
[context K/V from the fused taps ; block K/V], bidirectionally, with q/k RMSNorm per head and
half-split RoPE at absolute positions; `norm`, then the target's own lm_head. The module names
here are the reference's, so `state_dict()` is the z-lab checkpoint layout (plus
`mask_embedding`, learned, since SmolLM2 has no spare vocabulary row for a mask token).

DSpark (DeepSpec `modeling/dspark`): the DFlash backbone whose anchor slot predicts too
(slot k -> token anchor+k+1), a low-rank Markov head added to the logits
(`markov_head.markov_w1` Embedding(V, r), `markov_head.markov_w2` Linear(r, V)) teacher-forced on
the previous token, and a confidence head `confidence_head.proj` Linear(H + r, 1) on
[h_k ; W1[prev]].

MTP (DeepSeek-V3 layout): `eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)])` -> one llama decoder
block of the target's shape (causal, its own KV) -> `shared_head.norm` -> the target's lm_head;
h_t is the target's final-norm output at position t, the block runs at position t.

Assistant (transformers `Gemma4AssistantForCausalLM`; the Rust port is `drafters/assistant`,
the format `ASSISTANT-FORMAT.md`): no K/V projections. A draft step at the pending position P
is `x = pre_projection([embed(tok) ; h])`, then per layer q-only attention (`q_norm`, RoPE at P,
scale 1.0) over the target's last-layer K (roped) and V of positions < P, sandwich norms, a
GELU-tanh MLP and `layer_scalar`; `y = norm(x)`, logits = the target's lm_head(y), and the next
step's h is `post_projection(y)`, at the same position P over the same rows. Step 1 takes the
pending token and the target's final-norm hidden at P-1. The queries never see each other, so
training and evaluation run every position of a sequence at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .target import apply_rope, rms_norm, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA attention; `qk_norm` adds Qwen3's per-head q/k RMSNorm (DFlash), off for llama (MTP)."""

    def __init__(self, h, heads, kv_heads, head_dim, eps, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(h, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, h, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm

    def split(self, x, n):
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim)

    def forward(self, x, kv_src, q_rope, k_rope, mask=None, causal=False):
        """x [B,Q,H] queries; kv_src [B,K,H] keys/values source; ropes are (cos, sin) [B,·,hd]."""
        q = self.split(self.q_proj(x), self.heads)
        k = self.split(self.k_proj(kv_src), self.kv_heads)
        v = self.split(self.v_proj(kv_src), self.kv_heads)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), *q_rope)
        k = apply_rope(k.transpose(1, 2), *k_rope)
        v = v.transpose(1, 2)
        # Masked GQA: expanding K/V to every head for the memory-efficient kernel measured
        # slower on the H200 (800 vs 407 ms per joint step), so SDPA does the grouping.
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, scale=self.head_dim**-0.5
        )
        B, _, Q, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(
            c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
            c["rms_norm_eps"], qk_norm=True,
        )
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c["hidden_size"], c["intermediate_size"])

    def forward(self, x, ctx, rope_q, rope_k, mask):
        h = self.input_layernorm(x)
        # Context rows enter K/V without input_layernorm (the reference feeds hidden_norm(fc(.))).
        x = x + self.self_attn(h, torch.cat([ctx, h], 1), rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlash(nn.Module):
    """DFlash backbone (also DSpark's). `forward` returns normed block hiddens [B, Q, H]."""

    def __init__(self, c: dict):
        super().__init__()
        self.config = c
        n_tap = len(c["dflash_config"]["target_layer_ids"])
        self.fc = nn.Linear(n_tap * c["hidden_size"], c["hidden_size"], bias=False)
        self.hidden_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mask_embedding = nn.Parameter(torch.zeros(c["hidden_size"]))
        cos, sin = rope_tables(c["head_dim"], c["rope_theta"], c["max_position_embeddings"], "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def block_embeddings(self, embed: torch.Tensor, first_ids: torch.Tensor, block: int) -> torch.Tensor:
        """[anchor, MASK x (block-1)] embeddings for anchors `first_ids` [B, A] -> [B, A*block, H]."""
        B, A = first_ids.shape
        e = embed[first_ids].to(self.mask_embedding.dtype)  # [B, A, H]
        m = self.mask_embedding.expand(B, A, block - 1, -1)
        return torch.cat([e[:, :, None], m], 2).reshape(B, A * block, -1)

    def forward(self, taps: torch.Tensor, ctx_pos: torch.Tensor, x: torch.Tensor, block_pos: torch.Tensor, mask):
        """taps [B,T,n*H]; x [B,Q,H] block embeddings; positions [B,T] / [B,Q]; mask [B,1,Q,T+Q]."""
        ctx = self.hidden_norm(self.fc(taps))
        rq = (self.cos[block_pos], self.sin[block_pos])
        kp = torch.cat([ctx_pos, block_pos], 1)
        rk = (self.cos[kp], self.sin[kp])
        for layer in self.layers:
            x = layer(x, ctx, rq, rk, mask)
        return self.norm(x)


class DSpark(DFlash):
    """DFlash backbone + Markov head + confidence head."""

    def __init__(self, c: dict):
        super().__init__(c)
        r, V, H = c["markov_rank"], c["vocab_size"], c["hidden_size"]
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(V, r)
        self.markov_head.markov_w2 = nn.Linear(r, V, bias=False)
        nn.init.normal_(self.markov_head.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_head.markov_w2.weight)  # starts as plain DFlash
        self.confidence_head = nn.Module()
        self.confidence_head.proj = nn.Linear(H + r, 1)

    def heads(self, h: torch.Tensor, base_logits: torch.Tensor, prev: torch.Tensor):
        """Markov-corrected logits and confidence logits given previous tokens `prev` [..]."""
        e = self.markov_head.markov_w1(prev)
        z = base_logits + self.markov_head.markov_w2(e).float()
        conf = self.confidence_head.proj(torch.cat([h, e.to(h.dtype)], -1))[..., 0].float()
        return z, conf


class MTP(nn.Module):
    """One DeepSeek-style MTP module for a llama target, named as DeepSeek-V3 ships it."""

    def __init__(self, c: dict):
        super().__init__()
        self.config = c
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(
            H, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], eps, qk_norm=False
        )
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, c["intermediate_size"])
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, eps)
        cos, sin = rope_tables(c["head_dim"], c["rope_theta"], c["max_position_embeddings"], "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def fuse(self, emb_next, h):
        return self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], -1))

    def block(self, x, pos):
        """Causal block over x [B,T,H] at positions pos; returns (pre-norm out, post-norm out)."""
        r = (self.cos[pos], self.sin[pos])
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, h, r, r, causal=True)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, self.shared_head.norm(x)

    def forward(self, emb_next, h, pos):
        return self.block(self.fuse(emb_next, h), pos)

    def chain_step(self, x1, emb_d1, h1_post, pos):
        """Depth-2 draft for every position t at once: input fuse(emb(d1_t), recycled hidden of t)
        at position t+1, attending to the depth-1 keys of positions <= t and to itself.
        x1 is the depth-1 block *input* (the fused rows whose K/V the MTP cache holds)."""
        x2 = self.fuse(emb_d1, h1_post)
        B, T, _ = x2.shape
        a1 = self.input_layernorm(x1)
        a2 = self.input_layernorm(x2)
        att = self.self_attn
        pos2 = pos + 1
        q = apply_rope(att.split(att.q_proj(a2), att.heads).transpose(1, 2), self.cos[pos2], self.sin[pos2])
        kp = torch.cat([pos, pos2], 1)
        k = apply_rope(
            att.split(att.k_proj(torch.cat([a1, a2], 1)), att.kv_heads).transpose(1, 2), self.cos[kp], self.sin[kp]
        )
        v = att.split(att.v_proj(torch.cat([a1, a2], 1)), att.kv_heads).transpose(1, 2)
        i = torch.arange(T, device=x2.device)
        m = torch.cat([i[None, :] <= i[:, None], torch.eye(T, dtype=torch.bool, device=x2.device)], 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True, scale=att.head_dim**-0.5)
        y = x2 + att.o_proj(a.transpose(1, 2).reshape(B, T, -1))
        y = y + self.mlp(self.post_attention_layernorm(y))
        return self.shared_head.norm(y)


class GeluMLP(MLP):
    """Gemma's gated MLP: down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class AssistantLayer(nn.Module):
    """One Gemma 4 assistant layer: q-only attention over donor K/V, sandwich norms."""

    def __init__(self, tc: dict):
        super().__init__()
        H, eps = tc["hidden_size"], tc["rms_norm_eps"]
        self.heads, self.head_dim = tc["num_attention_heads"], tc["head_dim"]
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(H, self.heads * self.head_dim, bias=False)
        self.self_attn.q_norm = RMSNorm(self.head_dim, eps)
        self.self_attn.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.mlp = GeluMLP(H, tc["intermediate_size"])
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, k, v, rope, mask):
        """x [B,A,H] queries; k, v [B,kv_heads,T,hd] donor rows; rope (cos, sin) [B,A,hd];
        mask [B,1,A,T] (True = visible)."""
        B, A, _ = x.shape
        att = self.self_attn
        q = att.q_norm(att.q_proj(self.input_layernorm(x)).view(B, A, self.heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), *rope)
        a = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, enable_gqa=True, scale=1.0)
        x = x + self.post_attention_layernorm(att.o_proj(a.transpose(1, 2).reshape(B, A, -1)))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar.to(x.dtype)


class Assistant(nn.Module):
    """The Gemma 4 assistant for a llama donor (its own lm_head omitted: the target's is used)."""

    def __init__(self, c: dict):
        super().__init__()
        self.config = c
        tc, Hb = c["text_config"], c["backbone_hidden_size"]
        H = tc["hidden_size"]
        self.pre_projection = nn.Linear(2 * Hb, H, bias=False)
        self.post_projection = nn.Linear(H, Hb, bias=False)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(AssistantLayer(tc) for _ in range(tc["num_hidden_layers"]))
        self.model.norm = RMSNorm(H, tc["rms_norm_eps"])
        theta = tc["rope_parameters"]["full_attention"]["rope_theta"]
        cos, sin = rope_tables(tc["head_dim"], theta, tc["max_position_embeddings"], "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def step(self, e, h, pos, k, v, mask):
        """One draft step for queries [B,A]: e = embed(token), h = the target's final hidden (step
        1) or the last step's projection, both [B,A,Hb]; pos [B,A] the pending positions.
        Returns (y [B,A,H] for the lm_head, post_projection(y) [B,A,Hb] for the next step)."""
        x = self.pre_projection(torch.cat([e, h], -1))
        rope = (self.cos[pos], self.sin[pos])
        for layer in self.model.layers:
            x = layer(x, k, v, rope, mask)
        y = self.model.norm(x)
        return y, self.post_projection(y)

    def unroll(self, tokens, h0, pos, k, v, mask, steps):
        """`steps` chained draft steps; tokens [B,A,steps,Hb] are the embedded step inputs (the
        pending token, then each previous draft). Returns the list of y per step."""
        ys, h = [], h0
        for j in range(steps):
            y, h = self.step(tokens[..., j, :], h, pos, k, v, mask)
            ys.append(y)
        return ys


def assistant_mask(pos: torch.Tensor, T: int) -> torch.Tensor:
    """[B,1,A,T]: query at pending position P sees the donor rows 0..P-1 (the pending token has
    no K/V yet). A query at P = 0 sees row 0, so no row is empty (it is never scored)."""
    j = torch.arange(T, device=pos.device)
    return ((j[None, None, :] < pos[:, :, None]) | (j == 0))[:, None]


def assistant_config(target, layers, inter, heads) -> dict:
    """The `config.json` `drafters/assistant` reads for a llama donor (ASSISTANT-FORMAT.md)."""
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": target.hidden_size,
        "use_ordered_embeddings": False,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": target.hidden_size,
            "num_hidden_layers": layers,
            "num_kv_shared_layers": layers,
            "layer_types": ["full_attention"] * layers,
            "num_attention_heads": heads,
            "num_key_value_heads": target.num_kv_heads,
            "head_dim": target.head_dim,
            "global_head_dim": target.head_dim,
            "intermediate_size": inter,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": target.rms_norm_eps,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": target.rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            "max_position_embeddings": target.max_position_embeddings,
            "vocab_size": target.vocab_size,
            "sliding_window": 512,
            "attention_k_eq_v": False,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
        },
        "specula_donor": {
            "layer": target.num_layers - 1,
            "k": "the target's K after RoPE (Hugging Face half-split layout), no k-norm",
            "embed": "the target's input embedding, unscaled (llama)",
            "lm_head": "the target's (tied embed_tokens); model.embed_tokens is not stored",
            "positions": "every step of a round at the pending position P over donor rows 0..P-1",
        },
        "torch_dtype": "bfloat16",
    }


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, T: int, block: int) -> torch.Tensor:
    """Attention mask [B, 1, A*block, T + A*block] for training/evaluating a batch of blocks.

    A block's queries see context keys at positions strictly before its anchor (by absolute
    position, never by block index: SpecForge #470) and every key of their own block; blocks never
    see each other. Invalid anchors still see their own block so no row is empty."""
    B, A = anchors.shape
    dev = anchors.device
    ctx = torch.arange(T, device=dev)[None, None, :] < anchors[:, :, None]  # [B, A, T]
    ctx = ctx & valid[:, :, None]
    ctx = ctx[:, :, None, :].expand(B, A, block, T).reshape(B, A * block, T)
    blk_id = torch.arange(A * block, device=dev) // block
    own = (blk_id[:, None] == blk_id[None, :])[None].expand(B, -1, -1)
    return torch.cat([ctx, own], 2)[:, None]


def dflash_config(target, layers, inter, taps, block, extra=None) -> dict:
    """A z-lab DFlash `config.json` (Qwen3 draft) for `target` (a TargetConfig)."""
    c = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "intermediate_size": inter,
        "hidden_act": "silu",
        "vocab_size": target.vocab_size,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * layers,
        "block_size": block,
        "num_target_layers": target.num_layers,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": None, "block_size": block},
        "torch_dtype": "bfloat16",
    }
    c.update(extra or {})
    return c


def mtp_config(target) -> dict:
    return {
        "architectures": ["SpeculaLlamaMTP"],
        "model_type": "llama_mtp",
        "hidden_size": target.hidden_size,
        "num_hidden_layers": target.num_layers,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "intermediate_size": target.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": target.vocab_size,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "mtp": {
            "layer_prefix": f"model.layers.{target.num_layers}.",
            "fusion": "eh_proj(cat[enorm(embed(token_{t+1})), hnorm(h_t)])",
            "hidden_input": "target final-norm output at position t",
            "position": "t (the position of h_t)",
            "recycle_hidden_for_depth_2": "shared_head.norm output",
            "rope": "half-split (Hugging Face rotate_half)",
            "embed_and_head": "the target's (tied embed_tokens); shared_head.head is not stored",
        },
    }


def init_weights(m: nn.Module, std=0.02):
    for mod in m.modules():
        if isinstance(mod, nn.Linear) and mod.weight.requires_grad:
            nn.init.normal_(mod.weight, std=std)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)


def param_count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def decay_weights(n: int, gamma: float, device) -> torch.Tensor:
    """Position weights exp(-j/gamma) for the j-th predicted slot, j = 0..n-1."""
    return torch.exp(-torch.arange(n, device=device, dtype=torch.float32) / gamma)
