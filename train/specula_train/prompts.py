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


def wordnet_records(root: Path):
    """(pos, fields, words, gloss) for every line of WordNet's noun, verb and adjective data
    files: `fields` is the line's head split on spaces (offset, lex file, ..., pointers)."""
    for pos, name in (("n", "noun"), ("v", "verb"), ("a", "adj")):
        for line in (root / f"share/wordnet/data.{name}").read_text(errors="replace").splitlines():
            if line.startswith("  "):
                continue
            head, _, gloss = line.partition(" | ")
            f = head.split()
            cnt = int(f[3], 16)
            words = [re.sub(r"\(.*\)$", "", f[4 + 2 * i].replace("_", " ")) for i in range(cnt)]
            yield pos, f, words, gloss.strip()


def wordnet_synsets(root: Path):
    """(offset, pos, words, gloss) for every noun, verb and adjective synset."""
    for pos, f, words, gloss in wordnet_records(root):
        yield f[0], pos, words, gloss


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


# ---------------------------------------------------------------- extra chat (session 16)
# More chat prompts, in the style of the bench chat items (questions a user asks, answered in
# free prose), from the same Debian text: Python library entries, Linux documentation section
# titles, and familiar WordNet words (kinds of, differences between siblings, opposites, uses).
# They are marked "extra": true and are training prompts only: one whose source document is
# held out is dropped, so the held-out set stays exactly the earlier one and no held-out source
# is trained on. They come from their own random stream after every other prompt, so the
# earlier prompts are unchanged too.

PY_ENTRY_CHAT = {
    "function": [
        "What does the Python function `{n}` do? Give a short example.",
        "How do I use `{n}` in Python? Answer briefly.",
        "Explain `{n}` in Python to a new programmer.",
        "When should I use `{n}` in Python?",
    ],
    "method": [
        "What does the `{n}` method do in Python? Give a short example.",
        "Explain the Python method `{n}` briefly.",
    ],
    "class": [
        "What is the `{n}` class in Python used for? Give a short example.",
        "Explain the Python class `{n}` to a new programmer.",
    ],
    "exception": [
        "When does Python raise `{n}`, and how do I handle it?",
        "What does `{n}` mean in Python? Answer briefly.",
    ],
    "module": [
        "What is the Python `{n}` module for? Answer briefly.",
        "Give me a short introduction to the `{n}` module in Python.",
        "What are the most useful functions of Python's `{n}` module?",
    ],
}
LINUX_TITLE_CHAT = [
    "What is {t} in the Linux kernel? Answer briefly.",
    "Explain {t} in Linux to a new kernel developer.",
    "Give me a short overview of {t} in the Linux kernel.",
]
GENERIC_TITLES = {
    "introduction", "overview", "usage", "example", "examples", "description", "summary", "notes",
    "references", "credits", "authors", "contents", "todo", "testing", "configuration", "background",
    "license", "copyright", "history", "changelog", "api", "interface", "design", "implementation",
}
ACT_CHAT = [
    "What are three good habits for {x}? Answer briefly.",
    "Give me five tips for {x}.",
    "How do I get started with {x}?",
    "What are common mistakes beginners make in {x}?",
]
KINDS_CHAT = [
    "Name three kinds of {p} and describe each in one sentence.",
    "What are the main types of {p}? Answer briefly.",
]
PAIR_CHAT = [
    "Explain the difference between {x} and {y}.",
    "What is the difference between {x} and {y}? Answer briefly.",
    "Compare {x} and {y} in a few sentences.",
]
ANTONYM_CHAT = [
    "What is the opposite of \"{w}\"? Use both words in a sentence.",
    "Explain the difference between \"{w}\" and \"{a}\" with examples.",
]
ARTIFACT_CHAT = [
    "What is {x} used for? Answer briefly.",
    "How does {x} work? Explain it simply.",
    "Describe {x} to someone who has never seen one.",
]
GLOSS_CHAT = [
    "What is the word for {g}?",
    "Which word means {g}? Give an example sentence.",
]


def _art(w: str) -> str:
    return ("an " if w[0] in "aeiou" else "a ") + w


def wordnet_graph(root: Path):
    """Synsets with their pointers, and which (lemma, synset) senses are familiar: tagged in
    WordNet's sense-tagged corpus (index.* tagsense_cnt), i.e. words in everyday use."""
    syn = {}
    for pos, f, words, gloss in wordnet_records(root):
        k = 4 + 2 * len(words)
        ptrs = [(f[k + 1 + 4 * j], f[k + 2 + 4 * j], f[k + 3 + 4 * j]) for j in range(int(f[k]))]
        syn[(pos, f[0])] = {"lex": int(f[1]), "words": words, "gloss": gloss, "ptrs": ptrs}
    familiar = set()
    for pos, name in (("n", "noun"), ("v", "verb"), ("a", "adj")):
        for line in (root / f"share/wordnet/index.{name}").read_text(errors="replace").splitlines():
            if line.startswith("  "):
                continue
            f = line.split()
            n_syn, n_ptr = int(f[2]), int(f[3])
            tagged = int(f[5 + n_ptr])
            for off in f[6 + n_ptr : 6 + n_ptr + min(n_syn, tagged)]:
                familiar.add((f[0].replace("_", " "), pos, off))
    return syn, familiar


def extra_chat_prompts(root: Path, rng: random.Random):
    """(doc, "chat", "chat", text) from Python library entries, Linux section titles and familiar
    WordNet words; see the note above."""
    out = []
    src = root / "share/doc/python3.11/html/_sources"
    for path in sorted((src / "library").glob("*.rst.txt")):
        doc = "py:" + str(path.relative_to(src))
        names = set()
        for kind, name in re.findall(r"^\.\. (function|method|class|exception|module):: ([\w.]+)", read_text(path), re.M):
            if name in names or len(name) < 3:
                continue
            names.add(name)
            out.append((doc, rng.choice(PY_ENTRY_CHAT[kind]).format(n=name)))
    lsrc = root / "share/doc/linux-doc-6.1/Documentation"
    for path in sorted(lsrc.rglob("*.rst.gz")):
        rel = str(path.relative_to(lsrc))
        if rel.startswith(("ABI/", "devicetree/", "translations/")):
            continue
        lines = read_text(path).splitlines()
        seen_t = set()
        for i in range(1, len(lines)):
            u, t = lines[i].strip(), lines[i - 1].strip()
            if not re.fullmatch(r"(=+|-+|~+)", u) or len(u) < len(t) or not t:
                continue
            t = clean_prose(t).strip(" :.")
            words = t.split()
            if not (2 <= len(words) <= 7) or not re.fullmatch(r"[A-Za-z][\w /()'-]*", t):
                continue
            if t.lower() in GENERIC_TITLES or t.lower() in seen_t or t.endswith("?"):
                continue
            seen_t.add(t.lower())
            if rng.random() < 0.35:  # a third: titles are the most numerous source, and the oddest
                out.append(("linux:" + rel, rng.choice(LINUX_TITLE_CHAT).format(t=t)))
    syn, familiar = wordnet_graph(root)
    simple = lambda w: re.fullmatch(r"[a-z]{3,14}", w) is not None  # noqa: E731

    def fam(pos, off):
        """The synset's first familiar simple lemma, or None."""
        for w in syn[(pos, off)]["words"]:
            if simple(w) and (w, pos, off) in familiar:
                return w
        return None

    hypo = {}
    for (pos, off), s in syn.items():
        if pos == "n":
            hypo[off] = [o for sym, o, p in s["ptrs"] if sym in ("~", "~i") and p == "n"]
    for (pos, off), s in sorted(syn.items()):
        w = fam(pos, off)
        if w is None:
            continue
        doc = f"wn:{pos}{off}"
        if pos == "n":
            kids = [k for k in hypo.get(off, []) if fam("n", k)]
            if len(kids) >= 3:
                out.append((doc, rng.choice(KINDS_CHAT).format(p=w)))
            if len(kids) >= 2:
                a, b = rng.sample(kids, 2)
                if not held_out(f"wn:n{a}") and not held_out(f"wn:n{b}") and fam("n", a) != fam("n", b):
                    out.append((doc, rng.choice(PAIR_CHAT).format(x=_art(fam("n", a)), y=_art(fam("n", b)))))
            if s["lex"] == 4 and w.endswith("ing"):  # noun.act: activities
                out.append((doc, rng.choice(ACT_CHAT).format(x=w)))
            if s["lex"] == 6 and rng.random() < 0.5:  # noun.artifact
                out.append((doc, rng.choice(ARTIFACT_CHAT).format(x=_art(w))))
            elif 4 <= len(s["gloss"].split(";")[0].split()) <= 14 and rng.random() < 0.15:
                g = s["gloss"].split(";")[0].strip()
                out.append((doc, rng.choice(GLOSS_CHAT).format(g=_art(g) if not g.startswith(("a ", "an ", "the ")) else g)))
        elif pos == "a":
            ants = [(o, p) for sym, o, p in s["ptrs"] if sym == "!" and p in ("a", "s")]
            if ants and (("a", ants[0][0]) in syn):
                b = fam("a", ants[0][0])
                if b and not held_out(f"wn:a{ants[0][0]}"):
                    out.append((doc, rng.choice(ANTONYM_CHAT).format(w=w, a=b)))
    for doc, text in out:
        if not held_out(doc):
            yield doc, "chat", "chat", text


def build(root: Path, bible_txt: Path, seed: int, extra: bool = True):
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
    if extra:
        for doc, tag, kind, text in extra_chat_prompts(root, random.Random(seed + 16)):
            if text in seen:
                continue
            seen.add(text)
            yield {"tag": tag, "split": "train", "source": doc, "kind": kind, "text": text, "extra": True}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="folder the .deb files were extracted to (has usr/)")
    ap.add_argument("--bible", type=Path, required=True, help="bible.txt dumped by `bible`")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-extra", dest="extra", action="store_false",
                    help="without the extra chat prompts (the set before session 16)")
    a = ap.parse_args()
    n = 0
    with a.out.open("w") as f:
        for p in build(a.root / "usr", a.bible, a.seed, a.extra):
            f.write(json.dumps(p) + "\n")
            n += 1
    print(f"{n} prompts -> {a.out}")


if __name__ == "__main__":
    main()
