"""Joint training of the drafters on one pass of the frozen target per batch.

The frozen target runs once over the whole training set (`cache_target_states`) and its taps
(DFlash, DSpark) and final-norm hidden (MTP) stay on the device; each step gathers its batch's
rows and computes the target's logits where a loss compares against them (DSpark's TV and
confidence labels, MTP's KL). The drafters have disjoint parameters and optimizers, so training
them together equals training each alone on the same batches.

Losses (per the references):
  DFlash: CE on slots 1..B-1, weights exp(-(k-1)/gamma) (DFlash §5, gamma 4 at block 8); with
          hp["dflash_loss"] = "kl", KL to the target's distribution + 0.1*CE instead.
  DSpark: slots 0..g-1 (the anchor slot predicts), weights exp(-k/gamma) from k = 0 as DeepSpec's
          code does; 0.1*CE + 0.9*TV(p_draft, p_target) + 1.0*BCE(conf, 1 - TV detached).
  MTP:    KL to the target's next-next distribution + 0.1*CE on the response token; a `mtp_top1`
          variant KL + 1.0*CE on the target's argmax; hp["tag_weight"] weights a model's rows by tag.
  Assistant: at random pending positions P, `assistant_steps` chained steps with the true tokens
          as inputs (= the drafter's own drafts for as long as they are accepted: what verify
          scores) and its own projected hidden; KL to the target's distribution at P+j plus
          0.1*CE, weights exp(-j/gamma). Its donor K/V (the target's last layer) are cached with
          the taps.

Anchors are resampled every step inside the response (SpecForge/DFlash random anchors).
State (models, optimizers, step, loss history) is checkpointed so a run spans several commands.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .drafters import DFlash, DSpark, MTP, Assistant, assistant_mask, block_mask, decay_weights, init_weights
from .gen import Data
from .target import Target


KINDS = {"dflash": DFlash, "dspark": DSpark, "mtp": MTP, "assistant": Assistant}


def base_kind(k: str) -> str:
    """A variant `KIND_TAG` (e.g. `dflash_ce`: a second DFlash trained on the same batches with
    CE, for an A/B in one run) is a model of kind KIND."""
    return k.split("_", 1)[0]


def for_model(table: dict, k: str):
    """Model `k`'s entry of a per-kind table (`hp["lr"]`, `hp["init"]`, the configs): its own,
    else its kind's."""
    return table.get(k, table.get(base_kind(k)))


@torch.no_grad()
def grow_from(m: torch.nn.Module, start: dict) -> list[str]:
    """Loads `start` (a smaller model's state dict of the same kind) into `m` so that `m` computes
    what `start` computes: a tensor of the same shape is copied; a larger one (a wider MLP) gets
    `start` in its leading block, and the columns of `down_proj` past it are zero (the new
    neurons add nothing yet); a layer `start` lacks keeps its fresh init but with `o_proj` and
    `down_proj` zero (an identity residual layer). Returns the names of the new layers'
    tensors. A tensor of `start` that `m` lacks, or cannot hold, is an error."""
    sd = m.state_dict()
    if missing := sorted(set(start) - set(sd)):
        raise ValueError(f"the start weights have tensors the model lacks: {missing[:4]}")
    fresh = []
    for name, t in sd.items():
        if name in start:
            w = start[name].to(t.dtype)
            if w.shape == t.shape:
                t.copy_(w)
                continue
            if w.dim() != t.dim() or any(a > b for a, b in zip(w.shape, t.shape)):
                raise ValueError(f"{name}: start {tuple(w.shape)} does not fit in {tuple(t.shape)}")
            if name.endswith("down_proj.weight"):
                t.zero_()
            t[tuple(slice(0, n) for n in w.shape)] = w
        else:
            fresh.append(name)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
    return fresh


class Schedule:
    """Linear warmup then cosine to `floor` of the peak."""

    def __init__(self, total: int, warmup: float = 0.04, floor: float = 0.1):
        self.total, self.warm, self.floor = total, max(1, int(total * warmup)), floor

    def __call__(self, step: int) -> float:
        if step < self.warm:
            return (step + 1) / self.warm
        p = min(1.0, (step - self.warm) / max(1, self.total - self.warm))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * p))


def sample_anchors(lens, plens, n: int, margin: int, gen: torch.Generator):
    """Up to n distinct anchors per row in [plen, len - 1 - margin]; (anchors [B,n], valid [B,n])."""
    B = lens.shape[0]
    T = int(lens.max())
    dev = lens.device
    pos = torch.arange(T, device=dev)[None]
    ok = (pos >= plens[:, None]) & (pos <= (lens - 1 - margin)[:, None])
    score = torch.rand(B, T, generator=gen, device=dev).masked_fill(~ok, -1.0)
    top, idx = score.topk(min(n, T), dim=1)
    return idx, top >= 0


class Trainer:
    def __init__(self, target: Target, data: Data, kinds: list[str], configs: dict, hp: dict, device):
        self.t, self.data, self.kinds, self.hp, self.dev = target, data, kinds, hp, device
        self.models, self.opts = {}, {}
        torch.manual_seed(hp["seed"])
        for k in kinds:
            kind = base_kind(k)
            c = for_model(configs, k)  # a variant may have its own size (run.py --size)
            m = KINDS[kind](c)
            init_weights(m)
            if kind == "dspark":
                torch.nn.init.zeros_(m.markov_head.markov_w2.weight)
            if kind in ("dflash", "dspark"):
                with torch.no_grad():
                    m.mask_embedding.copy_(target.embed.float().mean(0))
            if kind == "mtp":
                # The block starts as the target's last layer (a known-good llama block).
                sd = {n: w.float() for n, w in target.layer_weights(target.cfg.num_layers - 1).items()}
                m.load_state_dict(sd, strict=False)
            if kind == "assistant":
                # Scale 1.0 attention: q_norm's weight is the 1/sqrt(d) a plain layer would apply.
                with torch.no_grad():
                    for layer in m.model.layers:
                        layer.self_attn.q_norm.weight.fill_(layer.head_dim**-0.5)
            init = for_model(hp.get("init") or {}, k)
            if init:
                from .twin_drafts import load_drafter

                start, _ = load_drafter(Path(init))
                if k in (hp.get("grow") or ()):
                    # A larger variant starts as the smaller shipped model (same function).
                    self.grown = getattr(self, "grown", {}) | {k: grow_from(m, start.state_dict())}
                else:
                    m.load_state_dict(start.state_dict())  # a shape mismatch stops here, naming the tensor
            m.to(device)
            self.models[k] = m
            self.opts[k] = torch.optim.AdamW(
                m.parameters(), lr=for_model(hp["lr"], k), betas=(0.9, 0.95), weight_decay=0.01, fused=device != "cpu"
            )
        # --tag-weight: {model: {tag: w}} -> a weight per tag index for that model's rows (MTP only).
        self.tag_w = {}
        tag_names = data.meta["tags"]
        for k, tw in (hp.get("tag_weight") or {}).items():
            if k not in self.models or base_kind(k) != "mtp":
                raise SystemExit(f"--tag-weight {k}: not a trained MTP model (training {', '.join(kinds)})")
            if bad := sorted(set(tw) - set(tag_names)):
                raise SystemExit(f"--tag-weight {k}: unknown tag {', '.join(bad)} (tags: {', '.join(tag_names)})")
            self.tag_w[k] = torch.tensor([float(tw.get(t, 1.0)) for t in tag_names], device=device)
        self.step, self.total = 0, hp.get("steps")
        self.history: list[dict] = []
        self.train_rows = data.indices("train")
        self.is_extra = data.extra.tolist()  # rows of the extra (session-16) prompts
        self._epochs: dict[int, list[list[int]]] = {}
        self.elapsed = 0.0
        self.sched = Schedule(self.total or 1)

    # ------------------------------------------------------------ batches
    def batches_of_epoch(self, epoch: int) -> list[list[int]]:
        """Length-bucketed batches of ~tokens_per_batch, shuffled per epoch (deterministic). A tag
        in hp["tag_repeat"] ({tag: n}) has its rows n times in every epoch."""
        g = torch.Generator().manual_seed(self.hp["seed"] * 1000 + epoch)
        tags = self.data.meta["tags"]
        repeat = self.hp.get("tag_repeat") or {}
        extra = self.is_extra
        # Extra (session-16) prompts are in every epoch once: tag_repeat is the earlier recipe's.
        pool = [
            i for i in self.train_rows
            for _ in range(1 if extra[i] else repeat.get(tags[int(self.data.tags[i])], 1))
        ]
        rows = [pool[i] for i in torch.randperm(len(pool), generator=g)]
        chunk = 64 * self.hp["rows_per_batch"]
        out = []
        for c in range(0, len(rows), chunk):
            grp = sorted(rows[c : c + chunk], key=lambda i: int(self.data.lens[i]))
            b, cur = [], 0
            for i in grp:
                L = int(self.data.lens[i])
                if b and (len(b) + 1) * max(cur, L) > self.hp["tokens_per_batch"]:
                    out.append(b)
                    b, cur = [], 0
                b.append(i)
                cur = max(cur, L)
            if b:
                out.append(b)
        perm = torch.randperm(len(out), generator=g).tolist()
        return [out[i] for i in perm]

    def batch_at(self, step: int) -> list[int]:
        epoch, k = 0, step
        while True:
            if epoch not in self._epochs:
                self._epochs[epoch] = self.batches_of_epoch(epoch)
            bs = self._epochs[epoch]
            if k < len(bs):
                return bs[k]
            k -= len(bs)
            epoch += 1

    # ------------------------------------------------------------ losses
    def tap_ids(self) -> list[int]:
        ids = set()
        for k, m in self.models.items():
            if base_kind(k) in ("dflash", "dspark"):
                ids.update(m.config["dflash_config"]["target_layer_ids"])
        return sorted(ids)

    def taps_for(self, m, taps):
        return torch.cat([taps[i] for i in m.config["dflash_config"]["target_layer_ids"]], -1)

    def loss_dflash(self, m: DFlash, ids, lens, plens, taps, final, gen, mode="ce"):
        c, Bk = m.config, m.config["block_size"]
        anchors, valid = sample_anchors(lens, plens, self.hp["anchors"], 1, gen)
        B, A = anchors.shape
        T = ids.shape[1]
        x = m.block_embeddings(self.t.embed, ids.gather(1, anchors), Bk)
        bpos = (anchors[:, :, None] + torch.arange(Bk, device=ids.device)).reshape(B, A * Bk)
        mask = block_mask(anchors, valid, T, Bk)
        cpos = torch.arange(T, device=ids.device).expand(B, T)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            h = m(self.taps_for(m, taps), cpos, x, bpos.clamp(max=c["max_position_embeddings"] - 1), mask)
        h = h.view(B, A, Bk, -1)[:, :, 1:]
        lpos = bpos.view(B, A, Bk)[:, :, 1:]
        ok = valid[:, :, None] & (lpos < lens[:, None, None])
        labels = ids.gather(1, lpos.clamp(max=T - 1).reshape(B, -1)).view_as(lpos)
        w = decay_weights(Bk - 1, self.hp["gamma"]["dflash"], ids.device).expand_as(lpos)
        sel = ok.nonzero(as_tuple=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            logits = (h[sel] @ self.t.lm_head.T.to(h.dtype)).float()
        ww = w[sel]
        info = {}
        if mode == "kl":
            # Distilled: KL to the target's own distribution for that token (its final hidden one
            # position earlier) + 0.1 CE, as MTP and the assistant train. The sampled answers'
            # tokens are not the target's argmax; its distribution is what greedy verify scores.
            b, lp = sel[0], lpos[sel]
            with torch.no_grad():
                pt = (final[b, lp - 1] @ self.t.lm_head.T).float().softmax(-1)
            logp = logits.log_softmax(-1)
            kl = (pt * (pt.clamp_min(1e-12).log() - logp)).sum(-1)
            ce = F.nll_loss(logp, labels[sel], reduction="none")
            per = kl + 0.1 * ce
            info["kl"] = (kl.detach() * ww).sum() / ww.sum()
        else:
            ce = F.cross_entropy(logits, labels[sel], reduction="none")
            per = ce
        loss = (per * ww).sum() / ww.sum()
        hit = (logits.argmax(-1) == labels[sel]).float()
        slot = sel[2]
        return loss, {"loss": loss.detach(), "acc1": hit[slot == 0].mean(), "acc": hit.mean()} | info

    def loss_dspark(self, m: DSpark, ids, lens, plens, taps, final, gen):
        c, g = m.config, m.config["block_size"]
        anchors, valid = sample_anchors(lens, plens, self.hp["anchors"], 1, gen)
        B, A = anchors.shape
        T = ids.shape[1]
        x = m.block_embeddings(self.t.embed, ids.gather(1, anchors), g)
        bpos = (anchors[:, :, None] + torch.arange(g, device=ids.device)).reshape(B, A * g)
        mask = block_mask(anchors, valid, T, g)
        cpos = torch.arange(T, device=ids.device).expand(B, T)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            h = m(self.taps_for(m, taps), cpos, x, bpos.clamp(max=c["max_position_embeddings"] - 1), mask)
        h = h.view(B, A, g, -1)
        spos = bpos.view(B, A, g)  # slot k sits at a+k, predicts a+k+1, follows token at a+k
        ok = valid[:, :, None] & (spos + 1 < lens[:, None, None])
        sel = ok.nonzero(as_tuple=True)
        sp = spos[sel]
        b = sel[0]
        labels = ids[b, (sp + 1).clamp(max=T - 1)]
        prev = ids[b, sp.clamp(max=T - 1)]
        with torch.no_grad():
            pt = (final[b, sp] @ self.t.lm_head.T).float().softmax(-1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            hs = h[sel]
            U = (hs @ self.t.lm_head.T.to(hs.dtype)).float()
            z, conf = m.heads(hs, U, prev)
        ce = F.cross_entropy(z, labels, reduction="none")
        tv = 0.5 * (z.softmax(-1) - pt).abs().sum(-1)
        cstar = (1 - tv).detach().clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(conf, cstar, reduction="none")
        w = decay_weights(g, self.hp["gamma"]["dspark"], ids.device)[sel[2]]
        per = 0.1 * ce + 0.9 * tv + 1.0 * bce
        loss = (per * w).sum() / w.sum()
        hit = (z.argmax(-1) == labels).float()
        return loss, {
            "loss": loss.detach(), "ce": (ce.detach() * w).sum() / w.sum(), "tv": tv.detach().mean(),
            "bce": bce.detach().mean(), "acc1": hit[sel[2] == 0].mean(), "acc": hit.mean(),
        }

    def loss_assistant(self, m: Assistant, ids, lens, plens, final, kv, gen):
        S, H = self.hp["assistant_steps"], self.t.cfg.hidden_size
        anchors, valid = sample_anchors(lens, plens, self.hp["assistant_anchors"], 1, gen)
        B, A = anchors.shape
        T = ids.shape[1]
        tpos = anchors[:, :, None] + torch.arange(S, device=ids.device)  # step j's input token
        tok = ids.gather(1, tpos.clamp(max=T - 1).reshape(B, -1)).view(B, A, S)
        e = self.t.embed[tok].float()
        h0 = final.gather(1, (anchors - 1).clamp(min=0)[:, :, None].expand(B, A, H)).float()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            y = torch.stack(m.unroll(e, h0, anchors, *kv, assistant_mask(anchors, T), S), 2)
        lpos = tpos + 1
        ok = valid[:, :, None] & (lpos < lens[:, None, None])
        sel = ok.nonzero(as_tuple=True)
        b, lp = sel[0], lpos[sel]
        labels = ids[b, lp]
        with torch.no_grad():
            pt = (final[b, lp - 1] @ self.t.lm_head.T).float().softmax(-1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            ys = y[sel]
            logits = (ys @ self.t.lm_head.T.to(ys.dtype)).float()
        logp = logits.log_softmax(-1)
        kl = (pt * (pt.clamp_min(1e-12).log() - logp)).sum(-1)
        ce = F.nll_loss(logp, labels, reduction="none")
        w = decay_weights(S, self.hp["gamma"]["assistant"], ids.device)[sel[2]]
        loss = ((kl + 0.1 * ce) * w).sum() / w.sum()
        hit = (logits.argmax(-1) == labels).float()
        return loss, {
            "loss": loss.detach(), "kl": (kl.detach() * w).sum() / w.sum(),
            "acc1": hit[sel[2] == 0].mean(), "acc": hit.mean(),
        }

    def mtp_targets(self, ids, lens, plens, final):
        """An MTP step's loss positions (b, t: the head at t predicts token t+2), their answer
        tokens, the target's distribution there and its negative entropy (the constant part of
        the KL). The same for every MTP model on the batch, so `train_step` computes it once."""
        T = ids.shape[1]
        t = torch.arange(T - 2, device=ids.device)[None]
        ok = (t + 2 < lens[:, None]) & (t + 2 >= plens[:, None])
        b, tt = ok.nonzero(as_tuple=True)
        with torch.no_grad():
            pt = (final[b, tt + 1] @ self.t.lm_head.T).float().softmax(-1)
            negent = (pt * pt.clamp_min(1e-12).log()).sum(-1)
        return b, tt, ids[b, tt + 2], pt, negent

    def loss_mtp(self, m: MTP, ids, lens, plens, final, mode="kl", row_w=None, shared=None):
        """KL to the target's next-next distribution + 0.1 CE on the answer token (mode "kl"), or
        KL + 1.0 CE on the target's argmax, the token greedy verify accepts (mode "top1"). Every
        answer position counts; `row_w` [B] weights a row's positions (`hp["tag_weight"]`)."""
        B, T = ids.shape
        b, tt, labels, pt, negent = shared if shared is not None else self.mtp_targets(ids, lens, plens, final)
        emb_next = self.t.embed[ids[:, 1:]].float()
        h = final[:, :-1].float()
        pos = torch.arange(T - 1, device=ids.device).expand(B, T - 1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            _, hn = m(emb_next, h, pos)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            hs = hn[b, tt]
            logits = (hs @ self.t.lm_head.T.to(hs.dtype)).float()
        logp = logits.log_softmax(-1)
        kl = negent - (pt * logp).sum(-1)
        if mode == "top1":
            per = kl + F.nll_loss(logp, pt.argmax(-1), reduction="none")
        else:
            per = kl + 0.1 * F.nll_loss(logp, labels, reduction="none")
        if row_w is None:
            loss = per.mean()
        else:
            w = row_w[b]
            loss = (per * w).sum() / w.sum()
        acc = (logits.argmax(-1) == labels).float().mean()
        return loss, {"loss": loss.detach(), "kl": kl.detach().mean(), "acc1": acc}

    # ------------------------------------------------------------ loop
    def cache_target_states(self, log=None, rows_per_forward: int = 256):
        """Runs the frozen target once over every training sequence and keeps its taps and
        final-norm hidden on the device (bf16, flat by token): each step then gathers them instead
        of running the target again. SmolLM2: 6.6M tokens x 4 x 576 x 2 B = 30 GB of the H200's
        139. Identical to the per-step forward: the rows are right-padded and causal."""
        taps_ids = self.tap_ids()
        H = self.t.cfg.hidden_size
        n = int(self.data.offsets[-1])
        width = (len(taps_ids) + 1) * H + (2 * self.kv_width() if self.kv_layer() is not None else 0)
        self.cache = torch.empty(n, width, dtype=self.t.dtype, device=self.dev)
        order = sorted(self.train_rows, key=lambda i: int(self.data.lens[i]))
        t0 = time.time()
        for c in range(0, len(order), rows_per_forward):
            part = order[c : c + rows_per_forward]
            ids, lens, _ = self.data.batch(part, self.dev)
            taps, final, kv = self.t.forward_kv(ids, taps_ids, self.kv_layer())
            flat = [] if kv is None else [x.transpose(1, 2).flatten(2) for x in kv]
            states = torch.cat([taps[i] for i in taps_ids] + [final] + flat, -1)
            for b, i in enumerate(part):
                o, L = int(self.data.offsets[i]), int(lens[b])
                self.cache[o : o + L] = states[b, :L]
        if log:
            log(f"train: target states of {len(order)} sequences cached ({self.cache.numel() * 2 / 2**30:.1f} GiB) in {time.time() - t0:.0f} s")

    def kv_layer(self) -> int | None:
        """The target layer whose K/V the assistant borrows (its last), if one is trained."""
        return self.t.cfg.num_layers - 1 if "assistant" in self.models else None

    def kv_width(self) -> int:
        return self.t.cfg.num_kv_heads * self.t.cfg.head_dim

    def target_states(self, rows, ids, lens):
        """(taps {layer: [B,T,H]}, final [B,T,H], donor (K, V) [B,kv_heads,T,hd] or None) for a
        batch: from the cache when there is one."""
        taps_ids = self.tap_ids()
        if getattr(self, "cache", None) is None:
            return self.t.forward_kv(ids, taps_ids, self.kv_layer())
        B, T = ids.shape
        off = torch.tensor([int(self.data.offsets[i]) for i in rows], device=self.dev)
        t = torch.arange(T, device=self.dev)[None]
        idx = off[:, None] + torch.minimum(t, (lens - 1)[:, None])  # padding repeats the last row
        st = self.cache[idx]
        H = self.t.cfg.hidden_size
        taps = {l: st[..., j * H : (j + 1) * H] for j, l in enumerate(taps_ids)}
        f = len(taps_ids) * H
        kv = None
        if self.kv_layer() is not None:
            w, c = self.kv_width(), self.t.cfg
            kv = tuple(
                st[..., f + H + i * w : f + H + (i + 1) * w].reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
                for i in range(2)
            )
        return taps, st[..., f : f + H], kv

    def train_step(self):
        rows = self.batch_at(self.step)
        ids, lens, plens = self.data.batch(rows, self.dev)
        gen = torch.Generator(device=self.dev).manual_seed(self.hp["seed"] * 7919 + self.step)
        taps, final, kv = self.target_states(rows, ids, lens)
        rec = {"step": self.step, "rows": len(rows), "tokens": int(lens.sum())}
        old_only = set(self.hp.get("old_data") or ())
        is_extra = [self.is_extra[i] for i in rows]
        lens_all = lens
        mtp_shared = None
        row_tags = torch.as_tensor([int(self.data.tags[i]) for i in rows], device=self.dev) if self.tag_w else None
        for k, m in self.models.items():
            opt = self.opts[k]
            kind = base_kind(k)
            lens = lens_all
            if k in old_only and any(is_extra):
                # The control of the extra-data A/B: the same batches without the extra rows. A
                # row cut to its prompt has no anchor and no loss position.
                if all(is_extra):
                    continue
                keep = torch.tensor([not e for e in is_extra], device=lens.device)
                lens = torch.where(keep, lens_all, plens)
            lr = for_model(self.hp["lr"], k) * self.sched(self.step)
            for gr in opt.param_groups:
                gr["lr"] = lr
            if kind == "dflash":
                # A `_ce` / `_kl` variant names its loss; any other model takes --dflash-loss.
                tag = k.partition("_")[2]
                mode = tag if tag in ("ce", "kl") else self.hp.get("dflash_loss", "ce")
                loss, info = self.loss_dflash(m, ids, lens, plens, taps, final, gen, mode)
            elif kind == "dspark":
                loss, info = self.loss_dspark(m, ids, lens, plens, taps, final, gen)
            elif kind == "assistant":
                loss, info = self.loss_assistant(m, ids, lens, plens, final, kv, gen)
            else:
                # A `_top1` variant trains on the target's argmax; a `--tag-weight` model weights rows
                # by tag. The target's side of the loss is shared by the MTP models of the batch.
                mode = "top1" if k.partition("_")[2] == "top1" else "kl"
                row_w = self.tag_w[k][row_tags] if k in self.tag_w else None
                if lens is lens_all:
                    if mtp_shared is None:
                        mtp_shared = self.mtp_targets(ids, lens, plens, final)
                    shared = mtp_shared
                else:
                    shared = None
                loss, info = self.loss_mtp(m, ids, lens, plens, final, mode, row_w, shared)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            info["grad_norm"] = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            rec[k] = info
        self.step += 1
        return rec

    def run(self, deadline: float, ckpt: Path, log, save_every_s: float = 120.0) -> bool:
        """Trains until `total` steps or the deadline; True when finished.

        Step records hold device tensors (no host sync per step); they become floats in the
        history every `flush` steps, with one sync."""
        flush = 25
        pending: list[dict] = []

        def drain():
            self.history.extend(to_floats(pending))
            pending.clear()

        if self.total is None:
            # Size the run from a time budget: time a few steps, then fix the step count.
            for _ in range(3):  # warm-up (allocator, kernels)
                pending.append(self.train_step())
            drain()
            t0 = time.time()
            for _ in range(8):
                pending.append(self.train_step())
            drain()
            per = (time.time() - t0) / 8
            self.total = max(self.step + 1, int(self.hp["train_seconds"] / per))
            self.elapsed += time.time() - t0
            log(f"train: {per * 1000:.0f} ms/step -> {self.total} steps for {self.hp['train_seconds']} s")
        self.sched = Schedule(self.total)
        last_save, t_mark, s_mark, t_step = time.time(), time.time(), self.step, None
        logged = self.step
        while self.step < self.total:
            if t_step is not None and time.time() + 2 * t_step + 15 > deadline:
                drain()
                self.save(ckpt)
                log(f"train: deadline at step {self.step}/{self.total}")
                return False
            pending.append(self.train_step())
            if len(pending) == flush or self.step == self.total:
                drain()
                now = time.time()
                t_step = (now - t_mark) / max(1, self.step - s_mark)
                self.elapsed += now - t_mark
                t_mark, s_mark = now, self.step
                if self.step // 100 > logged // 100 or self.step == self.total:  # flushes may straddle 100s
                    logged = self.step
                    log("train: " + summary(self.history[-1], self.total) + f" | {t_step * 1000:.0f} ms/step")
                if now - last_save > save_every_s:
                    self.save(ckpt)
                    last_save = time.time()
        drain()
        self.save(ckpt)
        return True

    def save(self, path: Path):
        tmp = path.with_suffix(".tmp")
        torch.save({
            "step": self.step, "total": self.total, "history": self.history, "elapsed": self.elapsed,
            "models": {k: m.state_dict() for k, m in self.models.items()},
            "opts": {k: o.state_dict() for k, o in self.opts.items()},
        }, tmp)
        tmp.replace(path)

    def load(self, path: Path):
        s = torch.load(path, map_location=self.dev)
        for k, m in self.models.items():
            m.load_state_dict(s["models"][k])
            self.opts[k].load_state_dict(s["opts"][k])
        self.step, self.total, self.history = s["step"], s["total"], s["history"]
        if self.hp.get("steps") and self.hp["steps"] > self.step:
            self.total = self.hp["steps"]  # a longer schedule continues a finished run; a shorter one fits a budget
        self.elapsed = s.get("elapsed", 0.0)


def to_floats(recs: list[dict]) -> list[dict]:
    """Step records with 0-dim device tensors -> plain floats, in one host sync."""
    if not recs:
        return []
    keys = list(dict.fromkeys((k, n) for r in recs for k, v in r.items() if isinstance(v, dict) for n in v))
    dev = next(v for r in recs for v in r.values() if isinstance(v, dict) for v in v.values()).device
    nan = torch.full((), float("nan"), device=dev)  # a model that skipped a step (train_step)
    vals = torch.stack([
        torch.stack([r[k][n].float() if n in r.get(k, {}) else nan for k, n in keys]) for r in recs
    ]).tolist()
    out = []
    for r, row in zip(recs, vals):
        o = {k: v for k, v in r.items() if not isinstance(v, dict)}
        for (k, n), x in zip(keys, row):
            o.setdefault(k, {})[n] = x
        out.append(o)
    return out


def summary(rec: dict, total) -> str:
    parts = [f"step {rec['step'] + 1}/{total}"]
    for k, v in rec.items():
        if isinstance(v, dict):
            parts.append(f"{k} loss {rec[k]['loss']:.3f} acc1 {rec[k]['acc1']:.3f}")
    return " | ".join(parts)
