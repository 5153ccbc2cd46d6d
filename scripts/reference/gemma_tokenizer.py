#!/usr/bin/env python3
"""Reference token ids for Gemma's SentencePiece tokenizer, rebuilt from the GGUF.

    python3 -m venv .venv-ref && .venv-ref/bin/pip install gguf numpy sentencepiece protobuf \
        transformers torch
    .venv-ref/bin/python scripts/reference/gemma_tokenizer.py [models/cache/gemma3-270m.gguf]

Writes tests/fixtures/tokenizer/gemma3-270m.json ([{text, ids}]), the format of
tokenizer_fixtures.py, with ids *without* the BOS (Specula's test adds it the way the model asks).

Which reference, and why: Gemma's original tokenizer.model is not reachable here, but the GGUF keeps
all of it that encoding uses: pieces, scores and types. So this script serializes a SentencePiece
ModelProto from them (model_type BPE, byte_fallback, identity normalizer with whitespace escaped to
"▁", no dummy prefix, no whitespace collapsing: Gemma's normalizer_spec) and encodes with the
`sentencepiece` library itself. llama.cpp's converter stores user-defined pieces with " " in place of
"▁"; they are turned back here. SentencePiece never parses control tokens in text; Hugging Face and
llama.cpp do, so text is first split on control-token strings (longest first), exactly as an
added-token pass does, and the pieces in between are encoded by SentencePiece.

transformers' own GGUF conversion (AutoTokenizer with gguf_file=...) is a cross-check only: it
builds a *Unigram* model from the BPE scores, which segments some words differently, so its
differences are printed, not used.
"""

import json
import re
import sys
from pathlib import Path

import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_fixtures import TEXTS, _json_lines  # noqa: E402  (shared tricky texts)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "tokenizer" / "gemma3-270m.json"

GEMMA_TEXTS = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos>more<pad>",
    "<table><tr><td>1</td></tr></table>",
    "a\tb\t\tc\t\t\t\td",
    "1234567890 007 3.0e-5",
    "    ",
    "hello   world    !     ",
    "\n \n  \n   \n",
    "x\u00a0y\u2003z",
    "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u043f\u0440\u0438\u0432\u0435\u0442",
    "\U0001F468\u200D\U0001F469\u200D\U0001F467 \u2764\ufe0f",
    "\U00013000\U0010FFFD",
    "<unused0><start_of_image>[multimodal]",
    "def main():\n\tif x  ==  1 :\n\t\treturn {'a': [1, 2]}\n",
]


def read(path):
    r = gguf.GGUFReader(str(path))

    def arr(name, conv):
        f = r.fields[name]
        return [conv(f.parts[i]) for i in f.data]

    tokens = arr("tokenizer.ggml.tokens", lambda p: bytes(p).decode("utf-8"))
    scores = arr("tokenizer.ggml.scores", lambda p: float(p[0]))
    types = arr("tokenizer.ggml.token_type", lambda p: int(p[0]))

    def scalar(name):
        f = r.fields[name]
        return f.parts[f.data[0]].tolist()[0]

    return tokens, scores, types, scalar("tokenizer.ggml.unknown_token_id")


def sentencepiece_model(tokens, scores, types, unk):
    m = pb.ModelProto()
    t = m.trainer_spec
    t.model_type = pb.TrainerSpec.BPE
    t.vocab_size = len(tokens)
    t.byte_fallback = True
    t.unk_id, t.bos_id, t.eos_id, t.pad_id = unk, -1, -1, -1
    n = m.normalizer_spec
    n.name = "identity"
    n.add_dummy_prefix = False
    n.remove_extra_whitespaces = False
    n.escape_whitespaces = True
    for i, (tok, score, ty) in enumerate(zip(tokens, scores, types)):
        p = m.pieces.add()
        if ty == 4:
            tok = tok.replace(" ", "\u2581")  # undo llama.cpp's pre-normalized spaces
        p.piece, p.score = tok, score
        # GGUF token types use SentencePiece's numbering; <unk> must be UNKNOWN for the loader.
        p.type = pb.ModelProto.SentencePiece.UNKNOWN if i == unk else ty
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return sp


def encoder(sp, tokens, types):
    control = sorted((t for t, ty in zip(tokens, types) if ty in (2, 3)), key=len, reverse=True)
    split = re.compile("(" + "|".join(map(re.escape, control)) + ")")
    ids = {t: i for i, t in enumerate(tokens)}

    def encode(text):
        out = []
        for k, part in enumerate(split.split(text)):
            if k % 2:
                out.append(ids[part])
            elif part:
                out.extend(sp.EncodeAsIds(part))
        return out

    return encode


def main():
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models/cache/gemma3-270m.gguf"
    tokens, scores, types, unk = read(path)
    sp = sentencepiece_model(tokens, scores, types, unk)
    encode = encoder(sp, tokens, types)

    def decode(ids):
        out, run = [], []
        for i in ids + [None]:
            if i is None or types[i] in (2, 3):
                out.append(sp.DecodeIds(run))
                run = []
                if i is not None:
                    out.append(tokens[i])
            else:
                run.append(i)
        return "".join(out)
    rows = []
    for text in TEXTS + GEMMA_TEXTS:
        ids = encode(text)
        if decode(ids) != text:
            sys.exit(f"SentencePiece does not round-trip {text!r}: {decode(ids)!r}")
        rows.append({"text": text, "ids": ids})
    OUT.write_text(_json_lines(rows))
    print(f"wrote {len(rows)} encodings to {OUT.relative_to(ROOT)}")

    try:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # say so, do not hide it
        print(f"transformers GGUF tokenizer unavailable: {type(e).__name__}: {e}")
        return
    same = 0
    for row in rows:
        got = hf.encode(row["text"], add_special_tokens=False)
        if got != row["ids"]:
            print(f"  transformers' GGUF conversion (Unigram) differs on {row['text']!r}")
        same += got == row["ids"]
    print(f"transformers' GGUF conversion agrees on {same} of {len(rows)} texts")


if __name__ == "__main__":
    main()
