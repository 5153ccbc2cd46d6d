"""Turn prompts into the exact token ids `target-host serve` feeds the target.

Chat prompts are rendered with the GGUF's own chat template (`tokenizer.chat_template`, the
context `target-host` gives minijinja: messages, add_generation_prompt, bos/eos token text, no
tools) and encoded with special tokens parsed; raw prompts are encoded as they are (the
completions API). BOS is prepended only when the GGUF says `add_bos_token` and the text does not
already start with it, as `specula_models::tokenizer::Tokenizer::encode` does.
`--check-with target-host` re-encodes a sample through the Rust binary and fails on any
difference, so training sees no template gap (SpecForge #533).

Writes `prompts.npz` (ids as uint16 runs + offsets, tag and split per prompt) and
`prompts.meta.json` (tag names, target fingerprint keys, the selection recipe).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

# Training mix (cap per tag) and held-out prompts per tag.
TRAIN_CAPS = {
    "summarise": 7000, "creative": 3500, "code-edit": 6000, "chat": 3000,
    "code-explain": 2700, "code-complete": 2000, "code-c": 1000,
}
HELDOUT_PER_TAG = 48
MAX_PROMPT_TOKENS = 384
# The extra (session-16) training prompts, per tag, on top of TRAIN_CAPS: chosen after every
# other prompt with their own random stream, so the earlier selection is unchanged.
EXTRA_CAPS = {"chat": 9000}


class GgufPrompter:
    """The GGUF's tokenizer and chat template, as `target-host` applies them."""

    def __init__(self, gguf_path: Path):
        import gguf
        import jinja2
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        from transformers import AutoTokenizer

        # The tokenizer comes from the GGUF's metadata alone, which needs no torch, but
        # transformers' GGUF loader refuses to start without it: let a CPU machine without
        # torch (where `train/prepare` runs) through that check.
        gguf_utils.is_torch_available = lambda: True
        reader = gguf.GGUFReader(str(gguf_path))
        field = lambda k: reader.fields[k].contents() if k in reader.fields else None  # noqa: E731
        self.tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokens = field("tokenizer.ggml.tokens")
        self.bos_id = field("tokenizer.ggml.bos_token_id")
        self.eos_id = field("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(field("tokenizer.ggml.add_bos_token"))
        self.bos_text = tokens[self.bos_id] if self.bos_id is not None else ""
        self.eos_text = tokens[self.eos_id] if self.eos_id is not None else ""
        env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
        self.template = env.from_string(field("tokenizer.chat_template"))
        self.vocab_size = len(tokens)

    def render(self, user: str) -> str:
        return self.template.render(
            messages=[{"role": "user", "content": user}], add_generation_prompt=True,
            bos_token=self.bos_text, eos_token=self.eos_text, tools=None,
        )

    def encode(self, text: str) -> list[int]:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def prompt_ids(self, kind: str, text: str) -> list[int]:
        return self.encode(self.render(text) if kind == "chat" else text)


def bench_prompts(path: Path):
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("//"):
            continue
        d = json.loads(line)
        if "messages" in d:
            assert len(d["messages"]) == 1 and d["messages"][0]["role"] == "user"
            yield {"tag": d["tag"], "split": "bench", "kind": "chat", "text": d["messages"][0]["content"]}
        else:
            yield {"tag": d["tag"], "split": "bench", "kind": "raw", "text": d["prompt"]}


def cap_of(p: dict) -> int:
    if p.get("extra"):
        return EXTRA_CAPS.get(p["tag"], 0)
    return TRAIN_CAPS.get(p["tag"], 0) if p["split"] == "train" else HELDOUT_PER_TAG


def count_key(p: dict) -> str:
    return f"{p['split']}/{p['tag']}" + ("/extra" if p.get("extra") else "")


def select(prompts: list[dict], seed: int, extra: bool = True) -> list[dict]:
    rng = random.Random(seed)
    by = defaultdict(list)
    for p in prompts:
        if not p.get("extra"):
            by[(p["split"], p["tag"])].append(p)
    out = []
    for (split, tag), ps in sorted(by.items()):
        rng.shuffle(ps)
        cap = TRAIN_CAPS.get(tag, 0) if split == "train" else HELDOUT_PER_TAG
        out.extend(ps[: cap * 2])  # twice the cap: some are dropped as too long
    if extra:
        rng = random.Random(seed + 16)
        by = defaultdict(list)
        for p in prompts:
            if p.get("extra"):
                assert p["split"] == "train", "extra prompts are training prompts only"
                by[p["tag"]].append(p)
        for tag, ps in sorted(by.items()):
            rng.shuffle(ps)
            out.extend(ps[: EXTRA_CAPS.get(tag, 0) * 2])
    return out


def check_with_rust(binary: Path, gguf_path: Path, prompter: GgufPrompter, sample: list[dict]):
    """Encodes `sample` with `target-host generate --json` and compares prompt ids."""
    for p in sample:
        flag = "--chat" if p["kind"] == "chat" else "--prompt"
        out = subprocess.run(
            [str(binary), "generate", "--model", str(gguf_path), flag, p["text"], "--max-tokens", "1", "--json"],
            check=True, capture_output=True, text=True,
        ).stdout
        rust = json.loads(out)["prompt_ids"]
        ours = prompter.prompt_ids(p["kind"], p["text"])
        if rust != ours:
            raise SystemExit(f"template gap on {p['tag']} prompt {p['text'][:60]!r}:\n rust {rust[:40]}\n ours {ours[:40]}")
    print(f"checked {len(sample)} prompts against {binary}: ids identical")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True, help="prompts.jsonl from prompts.py")
    ap.add_argument("--bench", type=Path, help="bench/workloads/default.jsonl (evaluated, never trained on)")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-with", type=Path, help="target-host binary: verify ids on a sample")
    ap.add_argument("--check-n", type=int, default=24)
    ap.add_argument("--no-extra", dest="extra", action="store_false", help="leave the extra chat prompts out")
    a = ap.parse_args()

    prompter = GgufPrompter(a.gguf)
    prompts = [json.loads(line) for line in a.prompts.read_text().splitlines()]
    chosen = select(prompts, a.seed, a.extra)
    if a.bench:
        chosen += list(bench_prompts(a.bench))
    ids_all, offsets, tags, splits, extras, kept = [], [0], [], [], [], []
    counts: Counter = Counter()
    tag_names = sorted({p["tag"] for p in chosen})
    split_names = ["train", "heldout", "bench"]
    for p in chosen:
        if p["split"] != "bench" and counts[count_key(p)] >= cap_of(p):
            continue
        ids = prompter.prompt_ids(p["kind"], p["text"])
        if len(ids) > MAX_PROMPT_TOKENS:
            continue
        counts[count_key(p)] += 1
        ids_all.extend(ids)
        offsets.append(len(ids_all))
        tags.append(tag_names.index(p["tag"]))
        splits.append(split_names.index(p["split"]))
        extras.append(bool(p.get("extra")))
        kept.append(p)
    if a.check_with:
        rng = random.Random(a.seed)
        sample = [p for p in kept if p["split"] == "bench"] + rng.sample(kept, a.check_n)
        check_with_rust(a.check_with, a.gguf, prompter, sample)
    a.out.mkdir(parents=True, exist_ok=True)
    assert max(ids_all) < 65536
    np.savez_compressed(
        a.out / "prompts.npz", ids=np.array(ids_all, dtype=np.uint16),
        offsets=np.array(offsets, dtype=np.int64), tags=np.array(tags, dtype=np.int8),
        splits=np.array(splits, dtype=np.int8), extra=np.array(extras, dtype=np.int8),
    )
    meta = {
        "tags": tag_names, "splits": split_names, "seed": a.seed,
        "train_caps": TRAIN_CAPS, "heldout_per_tag": HELDOUT_PER_TAG,
        "extra_caps": EXTRA_CAPS if a.extra else {},
        "max_prompt_tokens": MAX_PROMPT_TOKENS, "eos_id": prompter.eos_id,
        "counts": dict(sorted(counts.items())),
    }
    (a.out / "prompts.meta.json").write_text(json.dumps(meta, indent=1))
    with (a.out / "heldout.jsonl").open("w") as f:
        for p in kept:
            if p["split"] != "train":
                f.write(json.dumps(p) + "\n")
    print(json.dumps(meta["counts"]), f"tokens {len(ids_all)}")


if __name__ == "__main__":
    main()
