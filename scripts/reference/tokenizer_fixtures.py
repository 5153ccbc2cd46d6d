#!/usr/bin/env python3
"""Reference token ids and chat-template renderings for Specula's tokenizer tests.

    python3 -m venv .venv-tok && .venv-tok/bin/pip install tokenizers transformers gguf jinja2 numpy
    .venv-tok/bin/python scripts/reference/tokenizer_fixtures.py

Writes tests/fixtures/tokenizer/<model>.json ([{text, ids}]) and
tests/fixtures/tokenizer/<model>.chat.json ([{messages, add_generation_prompt, rendered}]).

Which reference, and why: the best reference would be each model's original tokenizer.json, but
Hugging Face is not reachable here and no PyPI package ships SmolLM2's or Qwen2.5's. So the
reference tokenizer is built with the `tokenizers` package from the GGUF vocabulary and merges,
using the exact tokenizer.json structure those model families publish:

  SmolLM2: pre_tokenizer Sequence[Digits(individual_digits=True),
           ByteLevel(add_prefix_space=False, use_regex=True)], decoder ByteLevel, no normalizer.
  Qwen2:   normalizer NFC, pre_tokenizer Sequence[Split(Regex(QWEN2_PATTERN), "isolated"),
           ByteLevel(add_prefix_space=False, use_regex=False)], decoder ByteLevel.

Control tokens (GGUF token_type 3) are special added tokens; user-defined ones (type 4, e.g. Qwen's
<tool_call>) are non-special added tokens, as in the published tokenizer.json files.

It is cross-checked against transformers' own GGUF conversion (AutoTokenizer with gguf_file=...)
when that loads; known differences of that conversion (it can miss SmolLM2's digit split or
Qwen's NFC) are printed, not hidden. transformers 5.x refuses to read a GGUF without torch, which
this venv deliberately does not install, so the cross-check prints "unavailable" here. The chat templates are rendered with transformers'
render_jinja_template when importable (jinja2 with trim_blocks, lstrip_blocks, loopcontrols and
HF's tojson/raise_exception/strftime_now), else with an equivalent jinja2 environment.
"""

import json
import sys
from datetime import datetime
from pathlib import Path

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "models" / "cache"
OUT = ROOT / "tests" / "fixtures" / "tokenizer"

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PYTHON_SNIPPET = '''def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)


print([fib(i) for i in range(10)])  # 0, 1, 1, 2, ...
'''

RUST_SNIPPET = '''fn main() {
    let xs: Vec<u64> = (1..=10).map(|x| x * x).collect();
    for (i, x) in xs.iter().enumerate() {
        println!("{i}: {x:>4}");
    }
}
'''

TEXTS = [
    "Hello, world!",
    "12345 3.14159 1,000,000",
    "a  b   c\n\n\n\t\tx",
    "trailing spaces   ",
    "   leading spaces",
    "\U0001F642\U0001F44D\U0001F3FD\U0001F1EB\U0001F1F7",
    "caf\u00e9 (NFC) vs cafe\u0301 (NFD)",
    "\u00e9",
    "e\u0301",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587",
    PYTHON_SNIPPET,
    RUST_SNIPPET,
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "don't I'll we've",
    "DON'T SHOUT, WE'VE HEARD",
    "line one\r\nline two\r\n",
    "x=1;y=22;z=333;w=4444",
    "",
]

CONVERSATIONS = [
    ([{"role": "system", "content": "You are a terse assistant."},
      {"role": "user", "content": "What is 2+2?"}], True),
    ([{"role": "system", "content": "You are a terse assistant."},
      {"role": "user", "content": "What is 2+2?"}], False),
    ([{"role": "user", "content": "  Write a haiku.  "},
      {"role": "assistant", "content": "Leaves fall.\nQuiet."},
      {"role": "user", "content": "Another, in fran\u00e7ais \U0001F642"}], True),
]


def read_gguf(path):
    r = gguf.GGUFReader(str(path))

    def field(name):
        f = r.fields.get(name)
        if f is None:
            return None
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return [int(f.parts[i][0]) for i in f.data]
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return f.parts[f.data[0]].tolist()[0]

    return field


def reference_tokenizer(field):
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    pre = field("tokenizer.ggml.pre")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        sys.exit(f"no reference structure for pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=(ty == 3), normalized=False)
             for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_tokens(added)
    return tok


def transformers_tokenizer(path):
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # torch or a converter may be missing: say so, do not hide it
        print(f"  transformers GGUF tokenizer unavailable: {type(e).__name__}: {e}")
        return None


def render(template, messages, add_generation_prompt, specials):
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
        out, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                       add_generation_prompt=add_generation_prompt, **specials)
        return out[0]
    except ImportError:
        pass
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, tools=None,
                                            add_generation_prompt=add_generation_prompt,
                                            **specials)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name in ["smollm2-135m", "qwen2.5-coder-0.5b"]:
        path = CACHE / f"{name}.gguf"
        print(name)
        field = read_gguf(path)
        ref = reference_tokenizer(field)
        rows = []
        for text in TEXTS:
            ids = ref.encode(text, add_special_tokens=False).ids
            assert ref.decode(ids, skip_special_tokens=False) == _nfc_if(field, text), text
            rows.append({"text": text, "ids": ids})
        (OUT / f"{name}.json").write_text(_json_lines(rows))

        hf = transformers_tokenizer(path)
        if hf is not None:
            for row in rows:
                got = hf.encode(row["text"], add_special_tokens=False)
                if got != row["ids"]:
                    print(f"  transformers' GGUF conversion differs on {row['text']!r}")

        tokens = field("tokenizer.ggml.tokens")
        specials = {}
        for key, var in [("tokenizer.ggml.bos_token_id", "bos_token"),
                         ("tokenizer.ggml.eos_token_id", "eos_token")]:
            tid = field(key)
            if tid is not None:
                specials[var] = tokens[tid]
        template = field("tokenizer.chat_template")
        chats = [{"messages": m, "add_generation_prompt": g,
                  "rendered": render(template, m, g, specials)} for m, g in CONVERSATIONS]
        (OUT / f"{name}.chat.json").write_text(_json_lines(chats))
        print(f"  wrote {len(rows)} encodings, {len(chats)} renderings")


def _json_lines(rows):
    """A JSON list with one compact row per line: small, and diffs stay readable."""
    body = ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
    return f"[\n{body}\n]\n"


def _nfc_if(field, text):
    import unicodedata
    return unicodedata.normalize("NFC", text) if field("tokenizer.ggml.pre") == "qwen2" else text


if __name__ == "__main__":
    main()
