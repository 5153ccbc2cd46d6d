#!/usr/bin/env python3
"""The PyTorch peer of Specula's CUDA step (scripts/gpu-bench runs it on the GPU machine).

A minimal decoder of the same shapes as `cuda-bench` (random bf16 weights, Qwen2.5-1.5B and
Qwen3-8B, mirroring models/src/random.rs): fused q|k|v and gate|up projections, a static KV
cache written with index_copy_, SDPA over the cache with a causal mask built from device-side
positions, argmax on the device, and one CUDA graph per window size. Measures plain decode
tokens/s at a context (each token read back by the host, as a server must) and the verify
window curve (median wall time of a forward of 1-16 rows, read back included).

    python3 scripts/gpu/torch_step.py --out torch.json [--context 512 --decode-tokens 128]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

PRESETS = {
    "qwen2.5-1.5b": dict(vocab=151936, hidden=1536, inter=8960, layers=28, heads=12, kv=2,
                         hd=128, bias=True, qk_norm=False, tied=True, theta=1e6),
    "qwen3-8b": dict(vocab=151936, hidden=4096, inter=12288, layers=36, heads=32, kv=8,
                     hd=128, bias=False, qk_norm=True, tied=False, theta=1e6),
}


class Decoder:
    def __init__(self, c, max_ctx, dev):
        self.c, self.max_ctx = c, max_ctx
        g = torch.Generator(device=dev).manual_seed(0)

        def rnd(*shape):
            return (torch.randn(*shape, device=dev, generator=g) * 0.02).to(torch.bfloat16)

        h, hd, qkv = c["hidden"], c["hd"], (c["heads"] + 2 * c["kv"]) * c["hd"]
        self.embed = rnd(c["vocab"], h)
        self.lm_head = self.embed if c["tied"] else rnd(c["vocab"], h)
        ones = lambda n: torch.ones(n, device=dev, dtype=torch.bfloat16)
        self.layers = [dict(
            ln1=ones(h), wqkv=rnd(qkv, h), bqkv=rnd(qkv) if c["bias"] else None,
            qn=ones(hd) if c["qk_norm"] else None, kn=ones(hd) if c["qk_norm"] else None,
            wo=rnd(h, c["heads"] * hd), ln2=ones(h), wgu=rnd(2 * c["inter"], h),
            wd=rnd(h, c["inter"])) for _ in range(c["layers"])]
        self.norm = ones(h)
        self.k = torch.zeros(c["layers"], 1, c["kv"], max_ctx, hd, device=dev, dtype=torch.bfloat16)
        self.v = torch.zeros_like(self.k)
        inv = 1.0 / (c["theta"] ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float64) / hd))
        ang = torch.arange(max_ctx, device=dev, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16)
        self.keys = torch.arange(max_ctx, device=dev)

    @staticmethod
    def rms(x, w, eps=1e-6):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    @staticmethod
    def rot(x, cos, sin):
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat([-b, a], -1) * sin

    def forward(self, tokens, pos):
        c = self.c
        m, hd, nh, kv = tokens.shape[0], c["hd"], c["heads"], c["kv"]
        x = self.embed[tokens]
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        mask = (self.keys[None, :] <= pos[:, None])[None, None]
        for i, L in enumerate(self.layers):
            y = self.rms(x, L["ln1"])
            qkv = F.linear(y, L["wqkv"], L["bqkv"])
            q, k, v = qkv.split([nh * hd, kv * hd, kv * hd], -1)
            q = q.view(m, nh, hd).transpose(0, 1)[None]
            k = k.view(m, kv, hd).transpose(0, 1)[None]
            v = v.view(m, kv, hd).transpose(0, 1)[None]
            if L["qn"] is not None:
                q, k = self.rms(q, L["qn"]), self.rms(k, L["kn"])
            q, k = self.rot(q, cos, sin), self.rot(k, cos, sin)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(o[0].transpose(0, 1).reshape(m, nh * hd), L["wo"])
            gu = F.linear(self.rms(x, L["ln2"]), L["wgu"])
            g, u = gu.chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, L["wd"])
        return F.linear(self.rms(x, self.norm), self.lm_head).argmax(-1)


class Graphs:
    """One captured forward per window size, with static token and position buffers."""

    def __init__(self, model, windows, dev):
        self.model, self.g = model, {}
        s = torch.cuda.Stream()
        for w in windows:
            tok = torch.zeros(w, dtype=torch.long, device=dev)
            pos = torch.arange(w, device=dev)
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    model.forward(tok, pos)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model.forward(tok, pos)
            self.g[w] = (graph, tok, pos, out)

    def run(self, tokens, pos0):
        graph, tok, pos, out = self.g[len(tokens)]
        tok.copy_(torch.tensor(tokens), non_blocking=True)
        pos.copy_(torch.arange(pos0, pos0 + len(tokens)), non_blocking=True)
        graph.replay()
        return out.tolist()


@torch.inference_mode()
def bench(name, args, dev):
    c = PRESETS[name]
    model = Decoder(c, args.context + args.decode_tokens + 32, dev)
    windows = sorted(set(args.windows) | {1, 16})
    graphs = Graphs(model, windows, dev)
    prompt = [(i * 7919 + 13) % c["vocab"] for i in range(args.context)]
    last = 0
    for s in range(0, args.context, 16):
        last = graphs.run(prompt[s:s + 16], s)[-1]

    def decode(tok):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(args.decode_tokens):
            tok = graphs.run([tok], args.context + i)[0]
        return args.decode_tokens / (time.perf_counter() - t)

    decode(last)
    tps = decode(last)
    curve = []
    for w in args.windows:
        times = []
        for _ in range(args.reps + 2):
            t = time.perf_counter()
            graphs.run(prompt[:w], args.context)
            times.append((time.perf_counter() - t) * 1e3)
        curve.append((w, statistics.median(times[2:])))
    one = dict(curve)[1]
    print(f"{name}: torch + CUDA graph decode {tps:.1f} tok/s; " +
          ", ".join(f"w{w} {ms:.3f} ms ({ms / one:.2f}x)" for w, ms in curve), flush=True)
    del graphs, model
    torch.cuda.empty_cache()
    return {"decode_tok_s": tps, "windows": [{"rows": w, "ms": ms, "ratio": ms / one} for w, ms in curve]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--presets", default=",".join(PRESETS))
    args = p.parse_args()
    dev = torch.device("cuda")
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    for name in args.presets.split(","):
        out[name] = bench(name, args, dev)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
