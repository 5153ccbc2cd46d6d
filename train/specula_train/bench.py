"""Speed of the two GPU stages on random weights of a target's shape: no GGUF needed.

    python3 -m specula_train.bench [--shape smollm2-135m] [--profile]

Builds a random llama target (SmolLM2-135M's shape by default) and synthetic sequences of the
self-distillation set's lengths, then times (1) batched generation, tokens/s at a batch of the
pipeline's size, greedy and sampled, and (2) the joint training step (all kinds), ms/step, with
an optional torch.profiler table of the CUDA kernels. It prints numbers only; nothing is saved.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .drafters import param_count
from .gen import Data
from .target import Target, TargetConfig

SHAPES = {
    "smollm2-135m": TargetConfig("llama", 49152, 576, 30, 9, 3, 64, 1536, 1e-5, 100000.0, 8192, True),
}


def random_target(cfg: TargetConfig, device) -> Target:
    g = torch.Generator().manual_seed(0)
    H, kv, I = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    w = {"embed_tokens.weight": r(cfg.vocab_size, H), "norm.weight": torch.ones(H)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w.update({
            p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
            p + "self_attn.q_proj.weight": r(H, H), p + "self_attn.k_proj.weight": r(kv, H),
            p + "self_attn.v_proj.weight": r(kv, H), p + "self_attn.o_proj.weight": r(H, H),
            p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
            p + "mlp.down_proj.weight": r(H, I),
        })
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    return Target(cfg, w, device, dtype)


def synthetic_data(path: Path, n: int, vocab: int, seed: int = 0) -> Data:
    """n sequences with the real set's shape: prompts ~100 tokens, answers ~170 (up to 320)."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(30, 250, (n,), generator=g)
    rlens = torch.randint(20, 321, (n,), generator=g)
    lens = plens + rlens
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    data = {
        "ids": torch.randint(3, vocab, (int(lens.sum()),), generator=g, dtype=torch.int32),
        "offsets": offsets, "prompt_lens": plens, "tags": torch.zeros(n, dtype=torch.long),
        "splits": torch.zeros(n, dtype=torch.long), "sampled": torch.zeros(n, dtype=torch.bool),
        "meta": {"tags": ["chat"], "splits": ["train", "heldout", "bench"], "eos_id": 2},
    }
    torch.save(data, path)
    return Data(path)


def sync(dev):
    if dev != "cpu":
        torch.cuda.synchronize()


def bench_gen(t: Target, dev, batch: int, plen: int, steps: int):
    g = torch.Generator(device=dev).manual_seed(0)
    prompts = [[5 + (i * 7 + j) % 1000 for j in range(plen - i % 17)] for i in range(batch)]
    for label, temp in (("greedy", 0.0), ("sampled", 0.7)):
        temps = torch.full((batch,), temp, device=dev)
        t.generate(prompts[:64], 4, set(), temps[:64], generator=g)  # warm-up
        sync(dev)
        t0 = time.time()
        out = t.generate(prompts, steps, set(), temps, generator=g)
        sync(dev)
        dt = time.time() - t0
        n = sum(len(o) for o in out)
        print(f"gen {label}: batch {batch} prompt {plen} +{steps} tokens: {dt:.2f} s, "
              f"{dt / steps * 1000:.1f} ms/step (prefill included), {n / dt:.0f} tok/s", flush=True)


def bench_train(t: Target, dev, work: Path, steps: int, profile: bool, args):
    from .run import configs_for
    from .train import Trainer, to_floats

    data = synthetic_data(work / "bench-data.pt", args.sequences, t.cfg.vocab_size)
    configs = configs_for(t.cfg, args)
    for tpb in [int(x) for x in args.tokens_per_batch.split(",")]:
        hp = {
            "seed": 0, "lr": {"dflash": 6e-4, "dspark": 6e-4, "mtp": 5e-4, "assistant": 6e-4},
            "gamma": {"dflash": 4.0, "dspark": 4.0, "assistant": 4.0}, "anchors": args.anchors,
            "assistant_steps": args.assistant_steps, "assistant_anchors": args.assistant_anchors, "tokens_per_batch": tpb, "rows_per_batch": 48,
            "train_seconds": 0, "steps": 10_000,
        }
        for cached in (False, True):
            if dev != "cpu":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            tr = Trainer(t, data, args.kinds.split(","), configs, hp, dev)
            if cached:
                tr.cache_target_states(log=print)
            for _ in range(3):
                tr.train_step()
            sync(dev)
            t0 = time.time()
            recs = [tr.train_step() for _ in range(steps)]
            to_floats(recs)
            sync(dev)
            dt = (time.time() - t0) / steps
            toks = sum(r["tokens"] for r in recs) / steps
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev != "cpu" else 0
            print(f"train {args.kinds}, {tpb} tokens/batch, target states cached {cached}: {dt * 1000:.0f} ms/step, "
                  f"{toks:.0f} tokens/step, {toks / dt:.0f} tokens/s, peak {peak:.1f} GiB", flush=True)
            if profile and cached and dev != "cpu":
                from torch.profiler import ProfilerActivity, profile as prof

                with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                    to_floats([tr.train_step() for _ in range(3)])
                    sync(dev)
                print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
            del tr


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--work", type=Path, default=Path("/tmp/specula-bench"))
    ap.add_argument("--gen-batch", type=int, default=2048)
    ap.add_argument("--gen-prompt", type=int, default=128)
    ap.add_argument("--gen-steps", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip-gen", action="store_true")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--taps", type=int, default=3)
    ap.add_argument("--markov-rank", type=int, default=16)
    ap.add_argument("--tokens-per-batch", default="24576", help="comma-separated: one timing each")
    ap.add_argument("--sequences", type=int, default=2000)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--kinds", default="dflash,dspark,mtp,assistant")
    ap.add_argument("--assistant-layers", type=int, default=2)
    ap.add_argument("--assistant-inter", type=int, default=1536)
    ap.add_argument("--assistant-heads", type=int, default=9)
    ap.add_argument("--assistant-steps", type=int, default=7)
    ap.add_argument("--assistant-anchors", type=int, default=48)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {dev} {torch.cuda.get_device_name() if dev == 'cuda' else ''} torch {torch.__version__}", flush=True)
    t = random_target(SHAPES[a.shape], dev)
    if not a.skip_gen:
        bench_gen(t, dev, a.gen_batch, a.gen_prompt, a.gen_steps)
    bench_train(t, dev, a.work, a.train_steps, a.profile, a)


if __name__ == "__main__":
    raise SystemExit(main())
