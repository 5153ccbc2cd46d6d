"""Prompts for self-distillation, built from text Debian ships.

Sources (extracted `.deb` packages, see `train/README.md`):
  - python3.11-doc: reST sources of the Python documentation -> code blocks (code editing,
    explanation, raw completion) and prose paragraphs (summaries, explanations), glossary terms
    (chat questions);
  - linux-doc-6.1: kernel documentation -> prose paragraphs and C code blocks;
  - bible-kjv: chapters dumped with the `bible` program -> retelling and summaries;
  - wordnet-base: synsets (words, synonyms, glosses) -> chat and story prompts.

Each prompt carries the document it came from. Whole documents (a doc file, a Bible book, a
WordNet synset) are held out by a hash of their id, so held-out prompts come from sources never
trained on. The prompt styles follow `bench/workloads/default.jsonl`: code-edit, code-complete,
summarise, chat, creative.

Output is JSON lines: {"tag", "split", "source", "kind": "chat"|"raw", "text"}, where `text`
is the user message for chat prompts and the raw completion text otherwise. `encode_prompts.py` turns
these into the exact ids `target-host serve` feeds the target.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
from pathlib import Path

HELD_OUT_PERCENT = 4


def held_out(doc_id: str) -> bool:
    """Whether a whole source document belongs to the held-out split (stable across runs)."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:4], "little")
    return h % 100 < HELD_OUT_PERCENT


def read_text(path: Path) -> str:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- reST parsing

_DIRECTIVE = re.compile(r"^\s*\.\. [\w:-]+::")
_CODE_INTRO = re.compile(r"(::\s*$)|(^\s*\.\. (code-block|code|sourcecode|testcode)::\s*(\w+)?)")


def rst_blocks(text: str):
    """Yields ("code", lang, body) and ("prose", None, body) blocks of a reST document."""
    lines = text.splitlines()
    i = 0
    para: list[str] = []

    def flush():
        if para:
            body = " ".join(s.strip() for s in para).strip()
            para.clear()
            if body:
                return ("prose", None, body)
        return None

    while i < len(lines):
        line = lines[i]
        m = _CODE_INTRO.search(line)
        if m and not line.strip().startswith(".. image"):
            lang = (m.group(4) or "").lower() if m.group(2) else ""
            if m.group(1) and line.strip() != "::":
                para.append(line.rstrip(":").rstrip() + ":")
            out = flush()
            if out:
                yield out
            # The literal block: the following indented lines (after blank lines and options).
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].lstrip().startswith(":")):
                if lines[j].strip() and not lines[j].startswith(" "):
                    break
                j += 1
            body: list[str] = []
            indent = None
            while j < len(lines):
                s = lines[j]
                if s.strip():
                    ind = len(s) - len(s.lstrip())
                    if indent is None:
                        indent = ind
                    if ind < (indent or 1) or ind == 0:
                        break
                body.append(s)
                j += 1
            if indent:
                code = "\n".join(s[indent:] for s in body).strip("\n")
                if code:
                    yield ("code", lang, code)
            i = j
            continue
        if not line.strip():
            out = flush()
            if out:
                yield out
        elif _DIRECTIVE.match(line) or re.match(r"^[=\-~^\"'`#*+]{3,}\s*$", line):
            out = flush()
            if out:
                yield out
        elif line.lstrip().startswith((">>>", "...")) and not para:
            # A doctest session without `::`: collect it as Python code.
            j = i
            body = []
            while j < len(lines) and lines[j].strip():
                body.append(lines[j].strip())
                j += 1
            yield ("code", "pycon", "\n".join(body))
            i = j
            continue
        else:
            para.append(line)
        i += 1
    out = flush()
    if out:
        yield out


_ROLE = re.compile(r":[\w:.-]+:`(?:[^`<]*<)?([^`>]+)>?`")


def clean_prose(s: str) -> str:
    s = _ROLE.sub(lambda m: m.group(1).lstrip("~!"), s)
    s = s.replace("``", "`").replace("**", "").replace("\\", "")
    s = re.sub(r"`([^`]+)`_", r"\1", s)
    s = re.sub(r"\s+", " ", s)
    return s.strip()


def good_prose(s: str) -> bool:
    words = s.split()
    return (
        40 <= len(words) <= 220
        and s[-1:] in ".:)"
        and not s.startswith(("|", "+", "*", "-", "#", ":", "..", "["))
        and sum(c.isalpha() for c in s) > 0.7 * len(s)
    )


def doctest_to_code(code: str) -> str | None:
    """Turns a `>>>` session into the code typed (outputs dropped)."""
    if ">>>" not in code:
        return code
    out = []
    for line in code.splitlines():
        if line.startswith(">>> ") or line == ">>>":
            out.append(line[4:])
        elif line.startswith("... ") or line == "...":
            out.append(line[4:])
    return "\n".join(out).strip() or None


def python_ok(code: str) -> bool:
    try:
        compile(code, "<doc>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


# ---------------------------------------------------------------- prompt templates

CODE_EDITS = [
    "Rename the function `{name}` to `{new}` everywhere in this code. Change nothing else and print the whole code.",
    "Add type hints to every function in this code. Change nothing else and print the whole code.",
    "Add a short docstring to every function in this code. Change nothing else and print the whole code.",
    "Add a comment above each statement explaining what it does. Print the whole code.",
    "Rename the variable `{var}` to `{newvar}` everywhere in this code. Change nothing else and print the whole code.",
    "Reformat this code to follow PEP 8. Change nothing else and print the whole code.",
    "Rewrite this code so that it uses f-strings for all string formatting. Print the whole code.",
    "Wrap this code in a function called `{func}` and print the whole result.",
]
CODE_EXPLAIN = [
    "Explain what this code does, step by step.",
    "Explain this code to a new programmer.",
    "What does this code print, and why?",
    "Is there a bug in this code? Explain briefly.",
    "Describe in one paragraph what this code does.",
]
C_PROMPTS = [
    "Explain what this C code does.",
    "Add a comment explaining each line of this C code. Print the whole code.",
    "Explain this kernel code snippet to a new C programmer.",
    "Rewrite this C code with clearer variable names. Print the whole code.",
]
PROSE_PROMPTS = [
    "Summarise this text in two sentences.",
    "Summarise this text in one sentence.",
    "Explain this text to a beginner in simple words.",
    "List the three most important points of this text.",
    "Rewrite this text in plain English.",
    "What is the main idea of this text? Answer briefly.",
    "Write three questions a reader might ask after reading this text, and answer them.",
]
BIBLE_PROMPTS = [
    "Retell this passage in plain modern English.",
    "Summarise this passage in two sentences.",
    "Write a short story for children inspired by this passage.",
    "What is this passage about? Answer briefly.",
    "Write a short poem inspired by this passage.",
]
WORD_CHAT = [
    "What does the word \"{w}\" mean?",
    "Use the word \"{w}\" in three different sentences.",
    "Explain the meaning of \"{w}\" to a child.",
    "What is the difference between \"{w}\" and \"{s}\"?",
    "Give me a synonym for \"{w}\" and explain when to use it.",
    "Define \"{w}\" and give an example.",
]
CREATIVE = [
    "Write a short poem about {a} {n}.",
    "Write a short story about {a} {n} who wants to {v}.",
    "Invent a new board game about {a} {n} and describe its rules in a few sentences.",
    "Describe {a} {n} in vivid detail, in one paragraph.",
    "Write a haiku about {a} {n}.",
    "Write a dialogue between {a} {n} and {a2} {n2}.",
    "Write a limerick about {a} {n} that likes to {v}.",
    "Tell me a bedtime story about {a} {n}.",
]
GLOSSARY_CHAT = [
    "Explain what {t} means in Python. Answer briefly.",
    "What is {t} in Python? Give a short example.",
    "Explain {t} to a new programmer.",
    "Why would I use {t} in Python?",
]
GENERAL_CHAT = [
    "What are three good habits for {g}? Answer briefly.",
    "Give me five tips for {g}.",
    "Explain the difference between {x} and {y} to a new programmer.",
    "How do I get started with {g}?",
]
GENERAL_TOPICS = [
    "writing maintainable software", "learning a new language", "testing code", "code review",
    "writing documentation", "debugging a crash", "staying focused", "learning mathematics",
    "planning a trip", "cooking on a budget", "keeping a garden", "running a meeting",
    "reading more books", "public speaking", "saving money", "sleeping well",
]
CS_PAIRS = [
    ("a process", "a thread"), ("a list", "a tuple"), ("a stack", "a queue"),
    ("compiling", "interpreting"), ("a class", "an object"), ("TCP", "UDP"),
    ("a mutex", "a semaphore"), ("recursion", "iteration"), ("a pointer", "a reference"),
    ("an array", "a linked list"), ("a function", "a method"), ("git merge", "git rebase"),
    ("a hash map", "a tree map"), ("static typing", "dynamic typing"), ("RAM", "disk storage"),
]


def _ident(rng: random.Random, words: list[str]) -> str:
    return "_".join(rng.sample(words, 2))


def code_prompts(code: str, rng: random.Random, words: list[str]):
    """Code-edit / explain prompts and a raw completion prefix for one Python snippet."""
    funcs = re.findall(r"^\s*def (\w+)\(", code, re.M)
    vars_ = sorted(set(re.findall(r"^\s*(\w+) = ", code, re.M)))
    out = []
    for t in rng.sample(CODE_EDITS, 2):
        if "{name}" in t and not funcs:
            t = CODE_EDITS[3]
        if "{var}" in t and not vars_:
            t = CODE_EDITS[5]
        msg = t.format(
            name=funcs[0] if funcs else "", new=_ident(rng, words),
            var=vars_[0] if vars_ else "", newvar=_ident(rng, words), func=_ident(rng, words),
        )
        out.append(("code-edit", "chat", f"{msg}\n\n```python\n{code}\n```"))
    out.append(("code-explain", "chat", f"{rng.choice(CODE_EXPLAIN)}\n\n```python\n{code}\n```"))
    # Raw completions: the code up to (and 0-2 lines past) each `def`/`class` line.
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*(def|class) ", line):
            out.append(("code-complete", "raw", "\n".join(lines[: i + 1 + rng.randrange(0, 3)]) + "\n"))
    return out


def python_doc_prompts(root: Path, rng: random.Random, words: list[str]):
    src = root / "share/doc/python3.11/html/_sources"
    for path in sorted(src.rglob("*.rst.txt")):
        doc = "py:" + str(path.relative_to(src))
        text = read_text(path)
        if path.name == "glossary.rst.txt":
            for term in re.findall(r"^   (\S[^\n]{1,40})\n      \S", text, re.M):
                term = term.strip().strip("`")
                if re.match(r"^[\w ._()-]+$", term):
                    d = f"py:glossary:{term}"
                    yield d, "chat", "chat", rng.choice(GLOSSARY_CHAT).format(t=term)
            continue
        for kind, lang, body in rst_blocks(text):
            if kind == "code" and lang in ("", "python", "python3", "pycon", "py"):
                code = doctest_to_code(body)
                if not code or not python_ok(code):
                    continue
                n = code.count("\n") + 1
                if 3 <= n <= 45 and len(code) <= 1600:
                    for tag, k, t in code_prompts(code, rng, words):
                        yield doc, tag, k, t
            elif kind == "prose":
                s = clean_prose(body)
                if good_prose(s):
                    yield doc, "summarise", "chat", f"{rng.choice(PROSE_PROMPTS)}\n\n{s}"


def linux_doc_prompts(root: Path, rng: random.Random):
    src = root / "share/doc/linux-doc-6.1/Documentation"
    for path in sorted(src.rglob("*.rst.gz")):
        rel = str(path.relative_to(src))
        if rel.startswith(("ABI/", "devicetree/", "translations/")):
            continue
        doc = "linux:" + rel
        for kind, lang, body in rst_blocks(read_text(path)):
            if kind == "prose":
                s = clean_prose(body)
                if good_prose(s):
                    yield doc, "summarise", "chat", f"{rng.choice(PROSE_PROMPTS)}\n\n{s}"
            elif kind == "code" and lang in ("", "c") and ";" in body and "{" in body:
                n = body.count("\n") + 1
                if 4 <= n <= 40 and len(body) <= 1400:
                    yield doc, "code-c", "chat", f"{rng.choice(C_PROMPTS)}\n\n```c\n{body}\n```"


def bible_prompts(bible_txt: Path, rng: random.Random):
    book = chapter = None
    verses: list[str] = []

    def emit():
        if not verses:
            return
        i = 0
        while i < len(verses):
            n = rng.randrange(4, 10)
            passage = " ".join(verses[i : i + n])
            i += n
            if 150 <= len(passage) <= 1500:
                t = rng.choice(BIBLE_PROMPTS)
                tag = "creative" if ("story" in t or "poem" in t) else "summarise"
                yield f"bible:{book}", tag, "chat", f"{t}\n\n{passage}"

    for line in bible_txt.read_text().splitlines():
        m = re.match(r"^([1-3]?\s?[A-Z][A-Za-z ]+?) (\d+)$", line)
        if m:
            yield from emit()
            verses = []
            book, chapter = m.group(1), m.group(2)
            continue
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            verses.append(m.group(1).strip())
    yield from emit()


def wordnet_synsets(root: Path):
    """(offset, pos, words, gloss) for every noun, verb and adjective synset."""
    for pos, name in (("n", "noun"), ("v", "verb"), ("a", "adj")):
        for line in (root / f"share/wordnet/data.{name}").read_text(errors="replace").splitlines():
            if line.startswith("  "):
                continue
            head, _, gloss = line.partition(" | ")
            f = head.split()
            cnt = int(f[3], 16)
            words = [f[4 + 2 * i].replace("_", " ") for i in range(cnt)]
            words = [re.sub(r"\(.*\)$", "", w) for w in words]
            yield f[0], pos, words, gloss.strip()


def wordnet_prompts(root: Path, rng: random.Random):
    syn = list(wordnet_synsets(root))
    simple = lambda w: re.match(r"^[a-z]{3,14}$", w) is not None  # noqa: E731
    nouns = [s for s in syn if s[1] == "n" and simple(s[2][0])]
    verbs = [s for s in syn if s[1] == "v" and simple(s[2][0])]
    adjs = [s for s in syn if s[1] == "a" and simple(s[2][0])]
    for off, pos, words, gloss in rng.sample(syn, min(len(syn), 60000)):
        w = words[0]
        if not simple(w) or rng.random() > 0.12:
            continue
        others = [x for x in words[1:] if simple(x)]
        t = rng.choice(WORD_CHAT)
        if "{s}" in t and not others:
            t = WORD_CHAT[0]
        yield f"wn:{pos}{off}", "chat", "chat", t.format(w=w, s=others[0] if others else "")
    for _ in range(7000):
        n, n2 = rng.choice(nouns), rng.choice(nouns)
        a, a2 = rng.choice(adjs)[2][0], rng.choice(adjs)[2][0]
        v = rng.choice(verbs)[2][0]
        art = lambda x: "an " + x if x[0] in "aeiou" else "a " + x  # noqa: E731
        t = rng.choice(CREATIVE).format(
            a=art(a).split()[0], n=f"{a} {n[2][0]}", v=v, a2=art(a2).split()[0], n2=f"{a2} {n2[2][0]}"
        )
        yield f"wn:n{n[0]}", "creative", "chat", t.replace("  ", " ")


def general_prompts(rng: random.Random):
    for g in GENERAL_TOPICS:
        for t in GENERAL_CHAT:
            if "{x}" in t:
                continue
            yield f"gen:{g}", "chat", "chat", t.format(g=g)
    for x, y in CS_PAIRS:
        yield f"gen:{x}|{y}", "chat", "chat", GENERAL_CHAT[2].format(x=x, y=y)


def build(root: Path, bible_txt: Path, seed: int):
    rng = random.Random(seed)
    words = sorted({w for _, p, ws, _ in wordnet_synsets(root) for w in ws if re.match(r"^[a-z]{3,8}$", w)})
    gens = [
        python_doc_prompts(root, rng, words),
        linux_doc_prompts(root, rng),
        bible_prompts(bible_txt, rng),
        wordnet_prompts(root, rng),
        general_prompts(rng),
    ]
    seen = set()
    for g in gens:
        for doc, tag, kind, text in g:
            if text in seen or not text.strip():
                continue
            seen.add(text)
            yield {
                "tag": tag, "split": "heldout" if held_out(doc) else "train",
                "source": doc, "kind": kind, "text": text,
            }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="folder the .deb files were extracted to (has usr/)")
    ap.add_argument("--bible", type=Path, required=True, help="bible.txt dumped by `bible`")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    n = 0
    with a.out.open("w") as f:
        for p in build(a.root / "usr", a.bible, a.seed):
            f.write(json.dumps(p) + "\n")
            n += 1
    print(f"{n} prompts -> {a.out}")


if __name__ == "__main__":
    main()
