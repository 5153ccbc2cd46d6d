#!/usr/bin/env python3
"""Golden greedy continuations of Gemma-3-270M from transformers, on the dequantized GGUF.

    python3 -m venv .venv-ref && .venv-ref/bin/pip install torch transformers gguf numpy sentencepiece
    .venv-ref/bin/python scripts/reference/gemma3_forward.py [models/cache/gemma3-270m.gguf]

Writes tests/fixtures/gemma3-270m.json. The reference is transformers' `Gemma3ForCausalLM` in float32,
loaded with `from_pretrained(..., gguf_file=...)`: it dequantizes every tensor and undoes llama.cpp's
`+1` on the norm weights. The GGUF lacks some hyper-parameters; transformers then uses the
`Gemma3TextConfig` defaults, which are also llama.cpp's for this model (query_pre_attn_scalar 256,
sliding-window pattern 6 = five sliding layers then one global, local RoPE base 10000, no softcaps);
the fixture records the values used, and Specula's Rust test checks its own against them.

Per prompt the fixture holds the prompt ids (BOS first), the greedy ids, the top-1 minus top-2 logit gap
at each step (a divergence is only acceptable where that gap is tiny), and a few logit rows (the top 16
ids of the first and the 8th step with their logits, plus 16 fixed ids). One prompt is longer than the
512-position sliding window so that the window is exercised. Generation does not stop at <eos>.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "gemma3-270m.json"
STEPS = 40
FIXED_IDS = [0, 1, 2, 3, 106, 107, 236743, 9259, 1902, 100, 1000, 10000, 100000, 200000, 255999, 262143]

LONG = ("The history of the city begins with a small fishing settlement on the river. Over the centuries, "
        "merchants arrived, bridges were built, and the market grew into a center of trade for the whole "
        "region. ") * 16 + "In the end, the most important lesson of this long history is that"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "1, 2, 3, 5, 8, 13,",
    "日本の首都は",
    LONG,
]


def main():
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models/cache/gemma3-270m.gguf"
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    cfg = model.config
    hyper = {
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "sliding_window": cfg.sliding_window,
        "layer_types": cfg.layer_types,
        "rope_global_base": cfg.rope_parameters["full_attention"]["rope_theta"],
        "rope_local_base": cfg.rope_parameters["sliding_attention"]["rope_theta"],
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "rms_norm_eps": cfg.rms_norm_eps,
    }
    print(hyper)
    rows = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0, 0].item() == cfg.bos_token_id
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                 pad_token_id=0)
        gen = out.sequences[0, ids.shape[1]:].tolist()
        gaps, logit_rows = [], []
        for step, logits in enumerate(out.logits):
            row = logits[0].float()
            top = torch.topk(row, 16)
            assert top.indices[0].item() == gen[step]
            gaps.append(round((top.values[0] - top.values[1]).item(), 6))
            if step in (0, 7):
                logit_rows.append({
                    "step": step,
                    "top_ids": top.indices.tolist(),
                    "top_logits": [round(v, 5) for v in top.values.tolist()],
                    "fixed_logits": [round(row[i].item(), 5) for i in FIXED_IDS],
                })
        print(f"{len(ids[0])} prompt ids -> {tok.decode(gen)!r} (min gap {min(gaps):.4f})")
        rows.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "greedy": gen,
                     "top2_gap": gaps, "logits": logit_rows})
    OUT.write_text(json.dumps({"reference": f"transformers {__import__('transformers').__version__} "
                                            "Gemma3ForCausalLM f32 on the dequantized GGUF",
                               "hyper": hyper, "fixed_ids": FIXED_IDS, "prompts": rows},
                              ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
