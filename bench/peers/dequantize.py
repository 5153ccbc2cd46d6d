#!/usr/bin/env python3
"""Dequantizes a GGUF into a Hugging Face folder (config.json, safetensors, tokenizer) for the
peers that cannot read GGUF (mlx-lm, transformers): the same weights Specula and llama.cpp run.

    bench/peers/dequantize.py models/cache/smollm2-135m.gguf models/cache/hf/smollm2-135m [--dtype float32]

Does nothing when OUT already has a config.json; writes into OUT.tmp first and renames, so an
interrupted run leaves no half folder behind. Needs transformers, torch and gguf.
"""

import argparse
import os
import shutil
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    if os.path.exists(os.path.join(args.out, "config.json")):
        return 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(args.gguf))
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Loading from GGUF dequantizes every tensor, but transformers still marks the model as
    # "gguf-quantized" and refuses to save it: drop the marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = args.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
