#!/usr/bin/env python3
"""Writes a draft vocabulary for the dflash drafter (EAGLE-3's `d2t` idea): the ids a target
actually answers with, most frequent first, counted over self-distilled training answers.

The drafter computes logits only for the first N of these ids (`--draft-vocab N`), so its
lm_head reads N rows instead of the whole vocabulary. Exactness is kept by the host's rejection
sampler: the q rows the drafter sends are the distribution it sampled from (zero outside the
subset); greedy drafts are the subset's argmax.

Usage (numpy only):
  python3 drafters/dflash/scripts/draft_vocab.py RESPONSES.npz VOCAB_SIZE TOP OUT.json
e.g.
  python3 drafters/dflash/scripts/draft_vocab.py \
      /work/train-data/smollm2-135m/responses.npz 49152 16384 \
      drafters/weights/smollm2-135m/draft_vocab.json

RESPONSES.npz holds `ids` (uint16/uint32, the answers' token ids concatenated) as written by
train/ (`responses.npz`). Ties in frequency are broken by the smaller id, so the output is a
pure function of the input.
"""

import hashlib
import json
import sys

import numpy as np


def main() -> None:
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    src, vocab, top, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ids = np.load(src)["ids"].astype(np.int64)
    if ids.size == 0 or ids.min() < 0 or ids.max() >= vocab:
        sys.exit(f"{src}: ids must be in 0..{vocab}")
    counts = np.bincount(ids, minlength=vocab)
    # Most frequent first; equal counts by id (lexsort's last key is the primary one).
    order = np.lexsort((np.arange(vocab), -counts))[:top]
    covered = counts[order].sum() / counts.sum()
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    doc = {
        "format": "specula-draft-vocab/1",
        "vocab_size": vocab,
        "source": {"file": src.split("/")[-1], "sha256": digest, "tokens": int(ids.size)},
        "command": "python3 drafters/dflash/scripts/draft_vocab.py " + " ".join(sys.argv[1:]),
        "coverage": {str(n): float(counts[order[:n]].sum() / counts.sum())
                     for n in (1024, 2048, 4096, 8192, 16384) if n <= top},
        "ids": [int(i) for i in order],
    }
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"{out}: {len(order)} ids, {covered:.4f} of the answer tokens")


if __name__ == "__main__":
    main()
