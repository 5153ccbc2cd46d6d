#!/usr/bin/env python3
"""Peer worker for specula-bench: runs llama.cpp, mlx-lm or transformers configurations on the
same workload items as Specula, and speaks the harness's line protocol (bench/src/messages.rs):

    stdout: one {"ready": {...}} or {"skipped": "why"} per configuration, in order;
            then one {"sample": {...}} or {"error": "why"} per {"item": i, "config": c} read on
            stdin; {"done": {...}} at end of input.

Engines (the "engine" of a configuration) and drafters:
  llama-cpp     none: llama-cpp-python greedy decoding; prompt-lookup: LlamaPromptLookupDecoding
                (num_pred_tokens = k); draft-model: the llama.cpp `llama-speculative` binary from
                --bin-dir (--draft-max k), one process per generation, timings parsed from its log.
  mlx-lm        none / draft-model (stream_generate with draft_model, num_draft_tokens = k), CPU;
                with MKL preloaded when the venv has it (see with_fast_blas).
  transformers  none / prompt-lookup (prompt_lookup_num_tokens = k) / draft-model
                (assistant_model, num_assistant_tokens = k, constant schedule), float32, 2 threads.

Timing: the clock for decode speed starts at the first generated token and counts the tokens
after it (prefill excluded, as in Specula); TTFT runs from the request to the first token.
Stdlib only, plus the peer libraries; a missing library or model folder is a "skipped" line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback

THREADS = 2


class Skip(Exception):
    """This configuration cannot run here; the message says why."""


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def load_items(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def peak_rss_kb() -> int:
    """Peak RSS of this process and of its finished children (llama-speculative runs), kB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children)


def timed(stream, start: float, is_eos) -> dict:
    """Consumes a token stream; returns ids and the timing fields of a sample."""
    ids, t_first, t_last = [], None, None
    for tok in stream:
        now = time.perf_counter()
        if is_eos(tok):
            break
        if t_first is None:
            t_first = now
        ids.append(int(tok))
        t_last = now
        if len(ids) >= stream_limit[0]:
            break
    if len(ids) < 2:
        raise RuntimeError(f"only {len(ids)} tokens generated: cannot time decoding")
    return {"tokens": len(ids) - 1, "decode_s": t_last - t_first, "ttft_s": t_first - start, "token_ids": ids}


# The current item's max_tokens, read by `timed` (streams cannot always be told to stop).
stream_limit = [0]


def require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        raise Skip(f"python module {module} is not usable in {sys.prefix}: {e} (run scripts/setup-peers)")


def render_jinja(template: str, messages: list[dict], bos: str, eos: str) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos, tools=None
    )


class LlamaCpp:
    """llama-cpp-python: plain or prompt-lookup decoding."""

    def __init__(self, config: dict, args) -> None:
        llama_cpp = require("llama_cpp")
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.llama_cpp = llama_cpp
        self.engine = f"llama-cpp-python {llama_cpp.__version__}"
        extra = {}
        if config.get("drafter") == "prompt-lookup":
            extra = dict(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=config["k"]), logits_all=True)
        self.llm = llama_cpp.Llama(
            args.gguf, n_ctx=4096, n_threads=THREADS, n_threads_batch=THREADS, verbose=False, seed=0, **extra
        )
        self.prompts = [self.prompt_ids(item) for item in args.items]

    def prompt_ids(self, item: dict) -> list[int]:
        llm = self.llm
        if item.get("messages"):
            bos = llm.detokenize([llm.token_bos()]).decode(errors="replace") if llm.token_bos() >= 0 else ""
            eos = llm.detokenize([llm.token_eos()]).decode(errors="replace")
            text = render_jinja(llm.metadata["tokenizer.chat_template"], item["messages"], bos, eos)
            ids = llm.tokenize(text.encode(), add_bos=True, special=True)
            # A template that writes the BOS itself must not end up with two.
            if len(ids) > 1 and ids[0] == ids[1] == llm.token_bos():
                ids = ids[1:]
            return ids
        return llm.tokenize(item["prompt"].encode(), add_bos=True, special=False)

    def run(self, i: int, item: dict, temperature: float) -> dict:
        llm = self.llm
        vocab = llm._model.vocab
        is_eos = lambda t: self.llama_cpp.llama_vocab_is_eog(vocab, t)  # noqa: E731
        llm.reset()
        llm.set_seed(item.get("seed", 0))
        stream_limit[0] = item["max_tokens"]
        start = time.perf_counter()
        stream = llm.generate(self.prompts[i], temp=temperature, top_k=1 if temperature == 0 else 0,
                              top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        out = timed(stream, start, is_eos)
        out["prompt_tokens"] = len(self.prompts[i])
        return out


class LlamaSpeculative:
    """llama.cpp's `llama-speculative` example binary: draft-model speculation."""

    def __init__(self, config: dict, args) -> None:
        self.binary = os.path.join(args.bin_dir, "llama-speculative")
        if not os.access(self.binary, os.X_OK):
            raise Skip(f"{self.binary} is not built (run scripts/setup-peers llama)")
        llama_cpp = require("llama_cpp")
        draft = args.drafts.get(config["draft_model"], {}).get("gguf")
        if not draft or not os.path.exists(draft):
            raise Skip(f"draft model GGUF for {config['draft_model']} not found")
        self.engine = "llama.cpp llama-speculative"
        self.k = config["k"]
        self.model, self.draft = args.gguf, draft
        # The same chat rendering as the llama-cpp-python peer, from a vocabulary-only load.
        vocab = llama_cpp.Llama(args.gguf, vocab_only=True, verbose=False)
        self.texts = []
        for item in args.items:
            if item.get("messages"):
                eos = vocab.detokenize([vocab.token_eos()]).decode(errors="replace")
                self.texts.append(render_jinja(vocab.metadata["tokenizer.chat_template"], item["messages"], "", eos))
            else:
                self.texts.append(item["prompt"])

    def run(self, i: int, item: dict, temperature: float) -> dict:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as fh:
            fh.write(self.texts[i])
            fh.flush()
            cmd = [self.binary, "-m", self.model, "-md", self.draft, "-f", fh.name, "-n", str(item["max_tokens"]),
                   "-t", str(THREADS), "-td", str(THREADS), "-c", "4096",
                   "--spec-draft-n-max", str(self.k), "--spec-draft-n-min", "0", "--temp", str(temperature),
                   "--seed", str(item.get("seed", 0))]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
            wall = time.perf_counter() - start
        log = proc.stderr + proc.stdout
        if proc.returncode != 0:
            raise RuntimeError(f"llama-speculative exited {proc.returncode}: {log[-600:]}")

        def grab(pattern: str, cast=float):
            m = re.search(pattern, log)
            if not m:
                raise RuntimeError(f"no '{pattern}' in the llama-speculative log: {log[-600:]}")
            return cast(m.group(1))

        enc_n = grab(r"encoded\s+(\d+) tokens", int)
        enc_s = grab(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds")
        dec_n = grab(r"decoded\s+(\d+) tokens", int)
        dec_s = grab(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds")
        drafted = grab(r"n_drafted\s*=\s*(\d+)", int)
        accepted = grab(r"n_accept\s*=\s*(\d+)", int)
        # Token ids are not printed: greedy equality is not checked for this peer.
        return {"prompt_tokens": enc_n, "tokens": dec_n, "decode_s": dec_s, "ttft_s": min(enc_s, wall),
                "drafted": drafted, "accepted": accepted, "token_ids": []}


class HfFolderPeer:
    """A peer that reads the dequantized HF folders (mlx-lm, transformers): loads each folder
    once per worker, whichever configuration asks first."""

    cache: dict = {}

    @classmethod
    def load(cls, path: str):
        if not path or not os.path.exists(os.path.join(path, "config.json")):
            raise Skip(f"no dequantized HF folder at {path} (run scripts/setup-peers)")
        key = (cls.__name__, path)
        if key not in HfFolderPeer.cache:
            HfFolderPeer.cache[key] = cls.open(path)
        return HfFolderPeer.cache[key]

    @staticmethod
    def open(path: str):
        """(model, tokenizer) read from the folder."""
        raise NotImplementedError


class MlxLm(HfFolderPeer):
    """mlx-lm on the CPU: plain or with a draft model."""

    def __init__(self, config: dict, args) -> None:
        mx = require("mlx.core")
        mlx_lm = require("mlx_lm")
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        mx.set_default_device(mx.cpu)
        self.mx, self.stream_generate, self.make_sampler = mx, stream_generate, make_sampler
        self.engine = f"mlx-lm {getattr(mlx_lm, '__version__', '?')} (CPU, {blas_name()})"
        self.model, self.tokenizer = self.load(args.hf_dir)
        self.draft, self.k = None, config.get("k")
        if config.get("drafter") == "draft-model":
            self.draft, _ = self.load(args.drafts.get(config["draft_model"], {}).get("hf_dir", ""))
        self.prompts = [hf_prompt(self.tokenizer, item) for item in args.items]

    @staticmethod
    def open(path: str):
        from mlx_lm import load

        return load(path)

    def run(self, i: int, item: dict, temperature: float) -> dict:
        self.mx.random.seed(item.get("seed", 0))
        kwargs = dict(max_tokens=item["max_tokens"], sampler=self.make_sampler(temp=temperature))
        if self.draft is not None:
            kwargs.update(draft_model=self.draft, num_draft_tokens=self.k)
        eos = set(self.tokenizer.eos_token_ids)
        from_draft = [0]

        def tokens():
            for r in self.stream_generate(self.model, self.tokenizer, self.prompts[i], **kwargs):
                from_draft[0] += int(getattr(r, "from_draft", False))
                yield r.token

        stream_limit[0] = item["max_tokens"]
        out = timed(tokens(), time.perf_counter(), lambda t: t in eos)
        out["prompt_tokens"] = len(self.prompts[i])
        if self.draft is not None:
            out["accepted"] = from_draft[0]
        return out


def hf_prompt(tokenizer, item: dict) -> list[int]:
    """The item's prompt ids; chat rendered to text first (the tokenize=True return type differs
    between transformers versions), then tokenized with the template's own special tokens."""
    if item.get("messages"):
        text = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(item["prompt"]))


class Transformers(HfFolderPeer):
    """Hugging Face transformers generate(): plain, prompt lookup, or assisted by a draft model."""

    def __init__(self, config: dict, args) -> None:
        # torch's OpenMP threads spin-wait by default; on a loaded 2-core box that made
        # transformers 20x slower than passive waiting. Set here, before torch loads, and not for
        # the whole script: ggml's OpenMP threads read the same variable, and PASSIVE made
        # llama.cpp decode SmolLM2 3.4x slower (23 vs 78 tok/s). Each engine runs in a worker
        # of its own (`worker_plan`), so the setting stays in this one's process. Export
        # OMP_WAIT_POLICY=ACTIVE to measure torch's default.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        torch = require("torch")
        transformers = require("transformers")
        torch.set_num_threads(THREADS)
        self.torch = torch
        self.engine = f"transformers {transformers.__version__} (float32, CPU)"
        self.model, self.tokenizer = self.load(args.hf_dir)
        self.extra = {}
        if config.get("drafter") == "prompt-lookup":
            self.extra = dict(prompt_lookup_num_tokens=config["k"])
        elif config.get("drafter") == "draft-model":
            draft, _ = self.load(args.drafts.get(config["draft_model"], {}).get("hf_dir", ""))
            draft.generation_config.num_assistant_tokens = config["k"]
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            self.extra = dict(assistant_model=draft)
        self.prompts = [hf_prompt(self.tokenizer, item) for item in args.items]

    @staticmethod
    def open(path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        return model.eval(), AutoTokenizer.from_pretrained(path)

    def run(self, i: int, item: dict, temperature: float) -> dict:
        from transformers.generation.streamers import BaseStreamer

        times = []

        class Clock(BaseStreamer):
            """Records when each batch of new tokens arrives (the first put is the prompt)."""

            def put(self, value):
                times.append((time.perf_counter(), int(value.numel())))

            def end(self):
                pass

        torch = self.torch
        torch.manual_seed(item.get("seed", 0))
        ids = torch.tensor([self.prompts[i]])
        sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=item["max_tokens"],
                                      streamer=Clock(), pad_token_id=self.tokenizer.eos_token_id, **sampling,
                                      **self.extra)
        new = out[0, ids.shape[1]:].tolist()
        eos = self.model.generation_config.eos_token_id
        eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
        while new and new[-1] in eos:
            new.pop()
        arrivals = times[1:]  # times[0] is the prompt
        if len(new) < 2 or not arrivals:
            raise RuntimeError(f"only {len(new)} tokens generated: cannot time decoding")
        t_first = arrivals[0][0]
        after_first = len(new) - 1
        return {"prompt_tokens": len(self.prompts[i]), "tokens": after_first, "decode_s": arrivals[-1][0] - t_first,
                "ttft_s": t_first - start, "token_ids": new}


def make(config: dict, args):
    engine, drafter = config["engine"], config.get("drafter", "none")
    if engine == "llama-cpp":
        return LlamaSpeculative(config, args) if drafter == "draft-model" else LlamaCpp(config, args)
    if engine == "mlx-lm":
        return MlxLm(config, args)
    if engine == "transformers":
        return Transformers(config, args)
    raise Skip(f"unknown engine {engine}")


def with_fast_blas(configs: list[dict]) -> None:
    """mlx-cpu's Linux wheel links the reference (netlib) BLAS: its f32 gemm runs at 1.4 GFLOP/s
    on the 2-core dev box, so a 1.5B prefill of 150 tokens takes minutes. When scripts/setup-peers
    has put Intel's MKL into the venv, this re-runs an mlx-lm worker with libmkl_rt preloaded, so
    mlx's cblas calls resolve to MKL (about 50x on that gemm). SPECULA_MLX_BLAS=reference keeps
    the wheel's own BLAS."""
    if not any(c.get("engine") == "mlx-lm" for c in configs):
        return
    if os.environ.get("SPECULA_MLX_BLAS") == "reference" or "libmkl_rt" in os.environ.get("LD_PRELOAD", ""):
        return
    lib_dir = os.path.join(sys.prefix, "lib")
    mkl = sorted(f for f in os.listdir(lib_dir) if f.startswith("libmkl_rt.so."))
    if not mkl:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = os.path.join(lib_dir, mkl[-1])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib_dir, env.get("LD_LIBRARY_PATH")) if p)
    env.setdefault("MKL_THREADING_LAYER", "GNU")
    env.setdefault("MKL_NUM_THREADS", str(THREADS))
    # As for torch (see Transformers): MKL's GNU OpenMP threads wait passively between calls.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def blas_name() -> str:
    """Which BLAS this process's mlx calls: MKL when preloaded (see with_fast_blas)."""
    return "MKL BLAS" if "libmkl_rt" in os.environ.get("LD_PRELOAD", "") else "the wheel's reference BLAS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", required=True, help="JSON list of configurations (bench/src/suite.rs)")
    ap.add_argument("--gguf", required=True, help="the target GGUF")
    ap.add_argument("--hf-dir", required=True, help="the target's dequantized HF folder")
    ap.add_argument("--drafts", default="{}", help='JSON {name: {"gguf": path, "hf_dir": path}}')
    ap.add_argument("--bin-dir", required=True, help="folder of llama.cpp binaries")
    ap.add_argument("--items", required=True, help="workload items (JSON lines)")
    args = ap.parse_args()
    args.drafts = json.loads(args.drafts)
    args.items = load_items(args.items)
    configs = json.loads(args.configs)
    with_fast_blas(configs)
    runners = []
    for config in configs:
        try:
            started = time.perf_counter()
            runner = make(config, args)
            emit({"ready": {"engine": runner.engine, "load_s": time.perf_counter() - started}})
        except Skip as e:
            runner = None
            emit({"skipped": str(e)})
        except Exception as e:  # noqa: BLE001 - reported to the harness, which shows it
            traceback.print_exc()
            runner = None
            emit({"skipped": f"FAILED to start: {type(e).__name__}: {e}"})
        runners.append(runner)
    for line in sys.stdin:
        req = json.loads(line)
        runner = runners[req.get("config", 0)]
        item = args.items[req["item"]]
        config = configs[req.get("config", 0)]
        temperature = config.get("temperature")
        temperature = item.get("temperature", 0.0) if temperature is None else temperature
        try:
            emit({"sample": runner.run(req["item"], item, float(temperature))})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            emit({"error": f"{type(e).__name__}: {e}"})
    emit({"done": {"peak_rss_kb": peak_rss_kb()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
