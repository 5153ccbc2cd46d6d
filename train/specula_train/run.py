"""One command, end to end: data -> training -> evaluation -> export, resumable by stage.

    python3 -m specula_train.run --gguf T.gguf --prompts DIR --kinds dflash,dspark,mtp \
        --work /var/tmp/specula --out OUT --budget-s 560

Every stage keeps its state under --work (outside the repository) and stops cleanly before the
budget, so the same command, repeated, picks up where the last one stopped: generation resumes
at the next batch, training at its last checkpoint. Each call writes into --out what exists so
far: status.json, log.txt, loss.png, metrics.json and one <kind>.tar per exported drafter.
"""

from __future__ import annotations

import argparse
import json
import tarfile
import time
from pathlib import Path

import torch

from . import evaluate, export, gen
from .drafters import assistant_config, dflash_config, mtp_config, param_count
from .target import Target, TargetConfig, load_gguf


def parse_model_pairs(flag: str, spec: str, want: str, cast, keys: tuple = ()) -> dict:
    """`MODEL=K:V[:K:V][,MODEL=...]` -> {MODEL: {K: cast(V), ...}}; `want` names the form in errors,
    `keys` (when given) the only K allowed."""
    out = {}
    for item in (x for x in spec.split(",") if x):
        name, _, kv = item.partition("=")
        f = kv.split(":")
        if not name or len(f) % 2 or not f[0]:
            raise SystemExit(f"{flag} {item!r}: want {want}")
        d = {f[i]: cast(f[i + 1]) for i in range(0, len(f), 2)}
        if keys and (bad := sorted(set(d) - set(keys))):
            raise SystemExit(f"{flag} {item!r}: unknown {', '.join(bad)} ({', '.join(keys)})")
        out[name] = d
    return out


def parse_sizes(spec: str) -> dict:
    """--size MODEL=layers:3:inter:1536[,MODEL=...] -> {MODEL: {"layers": 3, "inter": 1536}}."""
    return parse_model_pairs("--size", spec, "MODEL=layers:N[:inter:N]", int, ("layers", "inter"))


def parse_tag_weights(spec: str) -> dict:
    """--tag-weight mtp_chat=chat:3[:summarise:2][,MODEL=...] -> {"mtp_chat": {"chat": 3.0, ...}}."""
    return parse_model_pairs("--tag-weight", spec, "MODEL=TAG:W[:TAG:W]", float)


def configs_for(tc: TargetConfig, a, sizes: dict | None = None) -> dict:
    """Configs by kind, plus one for each model in `sizes` (a DFlash/DSpark variant of its own
    layer count or MLP width; train.for_model picks a model's own before its kind's)."""
    taps = [round(1 + i * (tc.num_layers - 4) / (a.taps - 1)) for i in range(a.taps)]
    dspark_extra = {
        "architectures": ["DSparkDraftModel"],
        "markov_rank": a.markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "anchor_predicts": True,
    }

    def block(kind, layers, inter):
        if kind == "dflash":
            return dflash_config(tc, layers, inter, taps, 8)
        if kind == "dspark":
            return dflash_config(tc, layers, inter, taps, 7, dspark_extra)
        raise SystemExit(f"--size: only dflash and dspark models have a size (not {kind})")

    out = {
        "dflash": block("dflash", a.layers, a.inter),
        "dspark": block("dspark", a.layers, a.inter),
        "mtp": mtp_config(tc),
        "assistant": assistant_config(tc, a.assistant_layers, a.assistant_inter, a.assistant_heads),
    }
    for name, d in (sizes or {}).items():
        out[name] = block(name.split("_", 1)[0], d.get("layers", a.layers), d.get("inter", a.inter))
    return out


def load_target(gguf_path: Path, work: Path, device) -> Target:
    cache = work / "target.pt"
    if cache.exists():
        d = torch.load(cache)
        cfg, w = TargetConfig(**d["cfg"]), d["w"]
    else:
        cfg, w = load_gguf(gguf_path)
        torch.save({"cfg": cfg.to_dict(), "w": {k: v.to(torch.bfloat16) for k, v in w.items()}}, cache)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    return Target(cfg, w, device, dtype)


def plot(history: list[dict], path: Path):
    try:
        import matplotlib
    except ImportError:  # the GPU image has it; a CPU smoke run may not
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k, v in history[0].items() if isinstance(v, dict)] if history else []
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for k in kinds:
        steps = [r["step"] for r in history]
        for i, (key, label) in enumerate((("loss", "loss"), ("acc1", "first-draft accuracy (train)"))):
            ys = [r[k][key] for r in history]
            w = max(1, len(ys) // 60)
            sm = [sum(ys[max(0, j - w) : j + 1]) / len(ys[max(0, j - w) : j + 1]) for j in range(len(ys))]
            ax[i].plot(steps, sm, label=k)
            ax[i].set_title(label)
            ax[i].set_xlabel("step")
    for x in ax:
        x.legend()
        x.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True, help="folder with prompts.npz/meta")
    ap.add_argument("--kinds", default="dflash,dspark,mtp")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--seed", type=int, default=0)
    # data
    ap.add_argument("--max-new", type=int, default=320)
    ap.add_argument("--gen-batch", type=int, default=4096, help="rows per batch (the cache budget may cut it)")
    ap.add_argument("--responses", type=Path, help="answers from an earlier run (responses.npz): no generation")
    ap.add_argument("--sampled-frac", type=float, default=0.25)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--limit", type=int, help="use only the first N prompts of each split (smoke)")
    # drafters
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--size", default="", help="MODEL=layers:N:inter:N[,...]: a DFlash/DSpark variant's own size "
                    "(e.g. dspark_big=layers:3:inter:1536); with --init from a smaller model it starts as that "
                    "model (train.grow_from: new layers are identity residuals, new MLP neurons add zero)")
    ap.add_argument("--taps", type=int, default=3)
    ap.add_argument("--markov-rank", type=int, default=16)
    ap.add_argument("--assistant-layers", type=int, default=2)
    ap.add_argument("--assistant-inter", type=int, default=1536)
    ap.add_argument("--assistant-heads", type=int, default=9)
    ap.add_argument("--assistant-steps", type=int, default=7, help="chained draft steps trained")
    ap.add_argument("--assistant-anchors", type=int, default=48, help="pending positions per sequence a step")
    ap.add_argument("--quant", choices=["int8", "bf16"], default="int8",
                    help="export format: int8 matrices with a scale per row (export.py), or bf16")
    ap.add_argument("--init", default="", help="KIND=DIR[,KIND=DIR]: start those kinds from exported weights "
                    "(e.g. mtp=drafters/weights/<target>/mtp) instead of random")
    # training
    ap.add_argument("--train-seconds", type=float, default=720)
    ap.add_argument("--steps", type=int, help="fixed step count (default: sized from --train-seconds)")
    ap.add_argument("--tokens-per-batch", type=int, default=24576)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", default="", help="KIND=LR[,KIND=LR]: peak learning rates other than the defaults")
    ap.add_argument("--dflash-loss", choices=["ce", "kl"], default="ce",
                    help="DFlash's loss: CE on the answer token (the reference's), or KL to the target's "
                         "distribution + 0.1 CE (distilled)")
    ap.add_argument("--tag-repeat", default="", help="e.g. chat=2,summarise=2: those prompts twice per epoch "
                    "(extra prompts stay once)")
    ap.add_argument("--tag-weight", default="", help="MODEL=TAG:W[:TAG:W][,MODEL=...]: an MTP model's loss weights "
                    "the rows of those tags W times (e.g. mtp_chat=chat:3; the batches stay those of every model)")
    ap.add_argument("--old-data", default="", help="MODEL[,MODEL]: these models skip the extra (session-16) prompts' "
                    "rows of every batch: the control of an A/B of the extra data on the same batches")
    ap.add_argument("--no-cache-states", dest="cache_states", action="store_false",
                    help="run the target every step instead of caching its taps on the device")
    a = ap.parse_args()

    t_start = time.time()
    deadline = t_start + a.budget_s
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    logf = (a.work / "log.txt").open("a")

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - t_start:5.0f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    timing_path = a.work / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}

    def spent(stage, t0):
        timing[stage] = timing.get(stage, 0.0) + time.time() - t0
        timing_path.write_text(json.dumps(timing, indent=1))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"device {device} {torch.cuda.get_device_name() if device == 'cuda' else ''}; kinds {a.kinds}")
    kinds = a.kinds.split(",")
    # Checked before any stage runs: a misspelt --lr key would otherwise be ignored silently.
    from .train import base_kind, for_model

    lrs = {k: float(v) for k, v in (x.split("=") for x in a.lr.split(",") if x)}
    if bad := sorted(set(lrs) - (set(kinds) | {base_kind(k) for k in kinds})):
        raise SystemExit(f"--lr names {', '.join(bad)}: not a trained kind (training {', '.join(kinds)})")
    sizes = parse_sizes(a.size)
    old_data = [x for x in a.old_data.split(",") if x]
    tag_weight = parse_tag_weights(a.tag_weight)
    if bad := sorted(k for k in tag_weight if k not in kinds or base_kind(k) != "mtp"):
        raise SystemExit(f"--tag-weight names {', '.join(bad)}: not a trained MTP model (training {', '.join(kinds)})")
    if bad := sorted((set(sizes) | set(old_data)) - set(kinds)):
        raise SystemExit(f"--size/--old-data name {', '.join(bad)}: not a trained model (training {', '.join(kinds)})")
    t0 = time.time()
    target = load_target(a.gguf, a.work, device)
    spent("load_target", t0)
    prompts, responses = a.prompts, a.responses
    if a.limit:
        prompts = limit_prompts(a.prompts, a.work, a.limit)
        if responses:
            responses = limit_responses(responses, prompts, a.work)

    status = {"stage": "data"}
    # -------- data
    data_path = a.work / "data.pt"
    if not data_path.exists() and responses:
        gen.merge(prompts, a.work, a.sampled_frac, a.seed, responses=responses)
        log(f"data: answers from {a.responses}")
    if not data_path.exists():
        t0 = time.time()
        done = gen.generate(
            target, prompts, a.work, max_new=a.max_new, batch=a.gen_batch, sampled_frac=a.sampled_frac,
            temperature=a.temperature, seed=a.seed, deadline=deadline - 20, log=log,
        )
        if done:
            gen.merge(prompts, a.work, a.sampled_frac, a.seed)
        spent("data", t0)
        if not done:
            return finish(a, status, log, timing)
    data = gen.Data(data_path)
    if not a.responses and not (a.out / "responses.npz").exists():  # brought back: later sessions need not generate
        import shutil

        shutil.copy(a.work / "responses.npz", a.out / "responses.npz")
    status["data"] = data.stats()
    log(f"data: {json.dumps(status['data'])}")

    # -------- train
    from .train import Trainer

    configs = configs_for(target.cfg, a, sizes)
    hp = {
        "seed": a.seed,
        "lr": {"dflash": 6e-4, "dspark": 6e-4, "mtp": 5e-4, "assistant": 6e-4}
        | lrs,
        "dflash_loss": a.dflash_loss,
        "gamma": {"dflash": 4.0, "dspark": 4.0, "assistant": 4.0}, "anchors": a.anchors,
        "assistant_steps": a.assistant_steps, "assistant_anchors": a.assistant_anchors, "init": dict(x.split("=", 1) for x in a.init.split(",") if x),
        "tag_repeat": {t: int(n) for t, n in (x.split("=") for x in a.tag_repeat.split(",") if x)},
        "grow": sorted(sizes), "old_data": old_data, "tag_weight": tag_weight,
        "tokens_per_batch": a.tokens_per_batch, "rows_per_batch": 48,
        "train_seconds": a.train_seconds, "steps": a.steps,
    }
    status["stage"] = "train"
    tr = Trainer(target, data, kinds, configs, hp, device)
    status["params"] = {k: param_count(m) for k, m in tr.models.items()}
    ckpt = a.work / "ckpt.pt"
    if ckpt.exists():
        tr.load(ckpt)
        log(f"train: resumed at step {tr.step}/{tr.total}")
    done_mark = a.work / "train.done"
    if done_mark.exists() and a.steps and a.steps > int(done_mark.read_text()):
        # A longer schedule than the finished run: continue it, and measure again afterwards.
        done_mark.unlink()
        (a.work / "eval.json").unlink(missing_ok=True)
        log(f"train: continuing the finished run to {a.steps} steps")
    if not done_mark.exists():
        t0 = time.time()
        if a.cache_states:
            tr.cache_target_states(log)
        done = tr.run(deadline - 25, ckpt, log)
        spent("train", t0)
        plot(tr.history, a.out / "loss.png")
        if not done:
            status["step"] = tr.step
            status["total_steps"] = tr.total
            return finish(a, status, log, timing)
        done_mark.write_text(str(tr.step))
    plot(tr.history, a.out / "loss.png")

    # -------- evaluate
    status["stage"] = "eval"
    metrics_path = a.work / "eval.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    for k in kinds:
        if k in metrics:
            continue
        if time.time() > deadline - 60:
            return finish(a, status, log, timing)
        t0 = time.time()
        m, kind = tr.models[k], base_kind(k)
        if kind == "mtp":
            metrics[k] = evaluate.evaluate_mtp(m, target, data, device)
        elif kind == "assistant":
            metrics[k] = evaluate.evaluate_assistant(m, target, data, device)
        else:
            metrics[k] = evaluate.evaluate_block(kind, m, target, data, device)
        spent(f"eval_{k}", t0)
        metrics_path.write_text(json.dumps(metrics, indent=1))
        log(f"eval {k}: " + json.dumps(headline(kind, metrics[k])))

    # -------- export
    status["stage"] = "export"
    fp = export.tokenizer_fingerprint(a.gguf)
    summary = {
        "target": target.cfg.to_dict(), "tokenizer_fingerprint": fp, "data": status["data"],
        "train": {"steps": tr.total, "elapsed_s": tr.elapsed, "hp": hp}, "timing_s": timing,
        "metrics": metrics, "final_train": tr.history[-1] if tr.history else None,
        "argv": vars(a) | {"gguf": str(a.gguf), "prompts": str(a.prompts), "work": str(a.work), "out": str(a.out)},
    }
    for k in kinds:
        d = a.work / "export" / k
        quant = None if a.quant == "bf16" else a.quant
        kind = base_kind(k)
        info = export.write(kind, tr.models[k], for_model(configs, k), target.cfg, fp, d, recipe(k, summary), quant)
        summary.setdefault("export", {})[k] = info
        with tarfile.open(a.out / f"{k}.tar", "w") as t:
            for n in ("config.json", "model.safetensors", "SHA256SUMS", "RECIPE.md"):
                t.add(d / n, arcname=f"{k}/{n}")
        log(f"export {k}: {info}")
    (a.out / "metrics.json").write_text(json.dumps(summary, indent=1, default=str))
    status["stage"] = "done"
    return finish(a, status, log, timing)


def headline(kind: str, m: dict) -> dict:
    if kind == "mtp":
        return {g: round(v["first_token_acceptance"], 3) for g, v in m.items()}
    return {g: round(v["tau_excl_bonus"], 2) for g, v in m.items() if isinstance(v, dict) and "tau_excl_bonus" in v}


def recipe(kind: str, s: dict) -> str:
    a = s["argv"]
    m = s["metrics"].get(kind, {})
    lines = [
        f"# {kind} drafter for {Path(a['gguf']).name}", "",
        "Trained by Specula's pipeline (`train/`), self-distilled from the target itself.", "",
        "## Command (on the GPU machine; see train/README.md)", "```",
        f"train/run TARGET.gguf {a['kinds']} OUT_DIR   # = python3 -m specula_train.run "
        f"--gguf ... --prompts ... --kinds {a['kinds']} --seed {a['seed']} --max-new {a['max_new']} "
        f"--sampled-frac {a['sampled_frac']} --temperature {a['temperature']} --layers {a['layers']} "
        f"--inter {a['inter']} --taps {a['taps']} --markov-rank {a['markov_rank']} "
        f"--assistant-layers {a['assistant_layers']} --assistant-inter {a['assistant_inter']} "
        f"--assistant-heads {a['assistant_heads']} --assistant-steps {a['assistant_steps']} "
        f"--assistant-anchors {a['assistant_anchors']} --quant {a['quant']} "
        + (f"--tag-repeat {a['tag_repeat']} " if a.get("tag_repeat") else "")
        + (f"--size {a['size']} " if a.get("size") else "")
        + (f"--old-data {a['old_data']} " if a.get("old_data") else "")
        + (f"--tag-weight {a['tag_weight']} " if a.get("tag_weight") else "")
        + (f"--init {a['init']} " if a.get("init") else "")
        + (f"--lr {a['lr']} " if a.get("lr") else "")
        + (f"--dflash-loss {a['dflash_loss']} " if a.get("dflash_loss", "ce") != "ce" else "")
        + (f"--steps {a['steps']} " if a.get("steps") else f"--train-seconds {a['train_seconds']} ")
        + f"--tokens-per-batch {a['tokens_per_batch']} --anchors {a['anchors']}",
        "```", "",
        f"- seed {a['seed']}; steps {s['train']['steps']}; training wall time {s['train']['elapsed_s']:.0f} s "
        f"(all kinds trained jointly on the same batches, from the cached passes of the target over the data)",
        f"- device time by stage (s): {json.dumps({k: round(v) for k, v in s['timing_s'].items()})}",
        f"- data: {json.dumps(s['data'])}",
        "- data recipe: prompts from Debian python3.11-doc, linux-doc-6.1, bible-kjv, wordnet-base "
        "(`train/specula_train/prompts.py`, held-out = whole source documents by hash), encoded with the "
        "GGUF chat template exactly as `target-host serve` does (`encode_prompts.py`, checked against the "
        f"Rust tokenizer); answers by the target, greedy, {a['sampled_frac']:.0%} of training prompts "
        f"sampled at T {a['temperature']} / top-k 20 / top-p 0.8, at most {a['max_new']} new tokens.",
        f"- hyperparameters: {json.dumps(s['train']['hp'])}",
        f"- tokenizer fingerprint: `{s['tokenizer_fingerprint']}`", "",
        "## Numbers (greedy, simulated verify on held-out and bench answers; train/specula_train/evaluate.py)", "",
        "```json", json.dumps(m, indent=1), "```", "",
    ]
    return "\n".join(lines)


def limit_prompts(src: Path, work: Path, n: int) -> Path:
    """A copy of the prompt set with at most n prompts per split (for smoke runs)."""
    import numpy as np

    out = work / "prompts-limited"
    if (out / "prompts.npz").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    z = np.load(src / "prompts.npz")
    ids, off, tags, splits = z["ids"], z["offsets"], z["tags"], z["splits"]
    keep, seen = [], {}
    for i in range(len(tags)):
        s = int(splits[i])
        if seen.get(s, 0) < n:
            seen[s] = seen.get(s, 0) + 1
            keep.append(i)
    nid, noff = [], [0]
    for i in keep:
        nid.extend(ids[off[i] : off[i + 1]].tolist())
        noff.append(len(nid))
    np.savez(out / "prompts.npz", ids=np.array(nid, dtype=np.uint16), offsets=np.array(noff),
             tags=tags[keep], splits=splits[keep], extra=gen.load_extra(src)[keep], kept=np.array(keep))
    (out / "prompts.meta.json").write_text((src / "prompts.meta.json").read_text())
    return out


def limit_responses(src: Path, limited: Path, work: Path) -> Path:
    """The answers of a limited prompt set's prompts, cut from a full set's responses.npz."""
    import numpy as np

    out = work / "responses-limited.npz"
    keep = np.load(limited / "prompts.npz")["kept"]
    resp = gen.load_responses(src, int(np.load(src)["offsets"].shape[0] - 1))
    gen.save_responses({j: resp[int(i)] for j, i in enumerate(keep)}, len(keep), out)
    return out


def finish(a, status, log, timing):
    status["timing_s"] = timing
    (a.out / "status.json").write_text(json.dumps(status, indent=1, default=str))
    log(f"stop: stage {status['stage']}")
    (a.out / "log.txt").write_text((a.work / "log.txt").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
