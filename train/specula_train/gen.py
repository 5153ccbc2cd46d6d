"""Self-distillation data: the target answers every prompt itself (greedy, some sampled).

Prompts arrive as the exact ids `serve` would feed (see `encode_prompts.py`). They are sorted by
length and decoded in batches of up to 4096 rows, sized by KV-cache slots, with a preallocated
cache (`Target.generate`). Each finished batch is saved as its own part, so a run cut short
resumes at the next batch; `merge` joins the parts into one `data.pt`:
  ids (int32, prompt + response runs), offsets, prompt_lens, tags, splits, sampled,
and the answers alone into `responses.npz` (uint16, compressed), which a later run can load
instead of generating (`--responses`).
Held-out and bench prompts are always answered greedily (they measure greedy acceptance).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from .target import Target


def load_prompts(folder: Path):
    z = np.load(folder / "prompts.npz")
    meta = json.loads((folder / "prompts.meta.json").read_text())
    ids, off = z["ids"].astype(np.int64), z["offsets"]
    prompts = [ids[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)]
    return prompts, z["tags"].tolist(), z["splits"].tolist(), meta


def load_extra(folder: Path) -> np.ndarray:
    """Which prompts are extra (session-16) training prompts; none in an older prompt set."""
    z = np.load(folder / "prompts.npz")
    return z["extra"].astype(bool) if "extra" in z.files else np.zeros(len(z["tags"]), dtype=bool)


def sampled_rows(splits, sampled_frac: float, seed: int) -> np.ndarray:
    """Which training prompts get a sampled (not greedy) answer; deterministic in the seed."""
    rng = np.random.default_rng(seed)
    return (rng.random(len(splits)) < sampled_frac) & (np.array(splits) == 0)


def plan_batches(prompts, batch: int, max_new: int, cache_tokens: int = 2_600_000):
    """Deterministic batches of prompt indices, by length (little padding): at most `batch` rows
    and `cache_tokens` cache slots (rows x (longest prompt + max_new)) each. SmolLM2's cache
    costs 23 KB a slot in bf16, so the default is ~60 GB of the H200's 139."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) >= batch or (len(cur) + 1) * (len(prompts[i]) + max_new) > cache_tokens):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def generate(
    target: Target, prompt_dir: Path, work: Path, *, max_new: int, batch: int, sampled_frac: float,
    temperature: float, seed: int, deadline: float, log,
) -> bool:
    """Generates missing parts until done or the deadline; True when every part exists."""
    prompts, tags, splits, meta = load_prompts(prompt_dir)
    batches = plan_batches(prompts, batch, max_new)
    sampled = sampled_rows(splits, sampled_frac, seed)
    parts = work / "gen"
    parts.mkdir(parents=True, exist_ok=True)
    stop = {meta["eos_id"], 0}  # <|im_end|> and <|endoftext|>, the GGUF's end tokens
    last = None
    for bi, rows in enumerate(batches):
        path = parts / f"part{bi:04d}.pt"
        if path.exists():
            continue
        if last is not None and time.time() + 1.3 * last > deadline:
            log(f"gen: deadline, {bi}/{len(batches)} batches done")
            return False
        t0 = time.time()
        g = torch.Generator(device=target.device).manual_seed(seed * 100003 + bi)
        temps = torch.tensor([temperature if sampled[i] else 0.0 for i in rows], device=target.device)
        outs = target.generate([prompts[i] for i in rows], max_new, stop, temps, generator=g)
        torch.save({"rows": rows, "responses": outs}, path)
        last = time.time() - t0
        ntok = sum(len(o) for o in outs)
        log(f"gen: batch {bi + 1}/{len(batches)} rows {len(rows)} tokens {ntok} in {last:.1f}s ({ntok / last:.0f} tok/s)")
    return True


def save_responses(resp: dict[int, list[int]], n: int, path: Path):
    """The generated answers alone, as uint16 ids (compressed): what a later session carries back
    instead of generating again (`load_responses`)."""
    assert set(resp) == set(range(n)), "every prompt needs its answer"
    lens = np.array([len(resp[i]) for i in range(n)], dtype=np.int64)
    ids = np.fromiter((t for i in range(n) for t in resp[i]), dtype=np.int64, count=int(lens.sum()))
    assert ids.max(initial=0) < 65536
    np.savez_compressed(path, ids=ids.astype(np.uint16), offsets=np.concatenate([[0], np.cumsum(lens)]))


def load_responses(path: Path, n: int) -> dict[int, list[int]]:
    z = np.load(path)
    ids, off = z["ids"].astype(np.int64), z["offsets"]
    if len(off) != n + 1:
        raise SystemExit(f"{path}: {len(off) - 1} answers for {n} prompts (another prompt set?)")
    return {i: ids[off[i] : off[i + 1]].tolist() for i in range(n)}


def merge(prompt_dir: Path, work: Path, sampled_frac: float, seed: int, responses: Path | None = None) -> Path:
    """Joins the generated parts (or answers carried in `responses`) with the prompts into
    data.pt, and writes responses.npz beside it."""
    prompts, tags, splits, meta = load_prompts(prompt_dir)
    if responses is not None:
        resp = load_responses(responses, len(prompts))
    else:
        resp = {}
        for p in sorted((work / "gen").glob("part*.pt")):
            d = torch.load(p)
            resp.update(zip(d["rows"], d["responses"]))
    assert len(resp) == len(prompts), f"{len(resp)} responses for {len(prompts)} prompts"
    save_responses(resp, len(prompts), work / "responses.npz")
    sampled = sampled_rows(splits, sampled_frac, seed)
    ids, offsets, plens = [], [0], []
    for i, p in enumerate(prompts):
        ids.extend(p + resp[i])
        offsets.append(len(ids))
        plens.append(len(p))
    data = {
        "ids": torch.tensor(ids, dtype=torch.int32), "offsets": torch.tensor(offsets),
        "prompt_lens": torch.tensor(plens), "tags": torch.tensor(tags), "splits": torch.tensor(splits),
        "sampled": torch.from_numpy(sampled), "extra": torch.from_numpy(load_extra(prompt_dir)), "meta": meta,
    }
    out = work / "data.pt"
    torch.save(data, out)
    return out


class Data:
    """The merged self-distillation set."""

    def __init__(self, path: Path):
        d = torch.load(path)
        self.ids, self.offsets = d["ids"], d["offsets"]
        self.prompt_lens, self.tags, self.splits = d["prompt_lens"], d["tags"], d["splits"]
        self.meta = d["meta"]
        self.lens = self.offsets[1:] - self.offsets[:-1]
        self.extra = d.get("extra", torch.zeros(len(self.lens), dtype=torch.bool)).bool()

    def indices(self, split: str) -> list[int]:
        s = self.meta["splits"].index(split)
        return [i for i in range(len(self.lens)) if int(self.splits[i]) == s]

    def seq(self, i: int) -> torch.Tensor:
        return self.ids[self.offsets[i] : self.offsets[i + 1]].long()

    def batch(self, rows: list[int], device):
        """Right-padded ids [B, T], lengths and prompt lengths."""
        T = max(int(self.lens[i]) for i in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        for b, i in enumerate(rows):
            s = self.seq(i)
            ids[b, : len(s)] = s
        lens = torch.tensor([int(self.lens[i]) for i in rows])
        plens = torch.tensor([int(self.prompt_lens[i]) for i in rows])
        return ids.to(device), lens.to(device), plens.to(device)

    def stats(self) -> dict:
        out = {}
        for split in self.meta["splits"]:
            rows = self.indices(split)
            if rows:
                resp = sum(int(self.lens[i] - self.prompt_lens[i]) for i in rows)
                out[split] = {"sequences": len(rows), "tokens": int(sum(int(self.lens[i]) for i in rows)), "response_tokens": resp}
        return out
