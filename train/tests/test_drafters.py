"""CPU tests of the drafter twins (tiny random weights): no mask leakage, reference parity.

Run: `python -m pytest train/tests` from the repository root (needs torch; the parity test
also needs the `dflash` package, whose `model.py` is the z-lab reference).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula_train.drafters import DFlash, DSpark, MTP, block_mask, dflash_config, init_weights, mtp_config  # noqa: E402
from specula_train.target import TargetConfig  # noqa: E402

TC = TargetConfig("llama", 97, 32, 6, 4, 2, 8, 48, 1e-5, 10000.0, 256, True)


def tiny(kind):
    torch.manual_seed(0)
    if kind == "mtp":
        m = MTP(mtp_config(TC))
    else:
        c = dflash_config(TC, 2, 40, [1, 3], 4 if kind == "dflash" else 3, {"markov_rank": 5})
        m = (DFlash if kind == "dflash" else DSpark)(c)
    init_weights(m, std=0.2)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


def run_blocks(m, taps, embed, ids, anchors, valid):
    B, T = ids.shape
    Bk = m.config["block_size"]
    x = m.block_embeddings(embed, ids.gather(1, anchors), Bk)
    bpos = (anchors[:, :, None] + torch.arange(Bk)).reshape(B, -1)
    mask = block_mask(anchors, valid, T, Bk)
    return m(taps, torch.arange(T).expand(B, T), x, bpos, mask)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_many_anchors_equal_one_anchor_with_truncated_context(kind):
    """Training's packed blocks see exactly what inference sees: ctx < anchor, own block."""
    m = tiny(kind)
    T, Bk = 20, m.config["block_size"]
    embed = torch.randn(TC.vocab_size, TC.hidden_size)
    ids = torch.randint(0, TC.vocab_size, (1, T))
    taps = torch.randn(1, T, 2 * TC.hidden_size)
    anchors = torch.tensor([[3, 4, 11, 9, 15]])
    packed = run_blocks(m, taps, embed, ids, anchors, torch.ones_like(anchors, dtype=torch.bool))
    for j, a in enumerate(anchors[0].tolist()):
        # Inference: the context is only the a committed rows; the block sits at a..a+Bk-1.
        x = m.block_embeddings(embed, ids[:, a : a + 1], Bk)
        bpos = a + torch.arange(Bk)[None]
        mask = torch.ones(1, 1, Bk, a + Bk, dtype=torch.bool)
        alone = m(taps[:, :a], torch.arange(a)[None], x, bpos, mask)
        torch.testing.assert_close(packed[0, j * Bk : (j + 1) * Bk], alone[0], rtol=1e-4, atol=1e-5)


def test_future_context_does_not_leak():
    m = tiny("dflash")
    T = 16
    embed = torch.randn(TC.vocab_size, TC.hidden_size)
    ids = torch.randint(0, TC.vocab_size, (1, T))
    taps = torch.randn(1, T, 2 * TC.hidden_size)
    anchors = torch.tensor([[6]])
    v = torch.ones_like(anchors, dtype=torch.bool)
    a = run_blocks(m, taps, embed, ids, anchors, v)
    taps2 = taps.clone()
    taps2[:, 6:] += 5.0  # rows at and after the anchor must not matter
    b = run_blocks(m, taps2, embed, ids, anchors, v)
    torch.testing.assert_close(a, b)
    taps2[:, 5] += 5.0  # the row just before the anchor must
    c = run_blocks(m, taps2, embed, ids, anchors, v)
    assert (a - c).abs().max() > 1e-3


def test_dflash_matches_zlab_reference():
    """Our weights, loaded into z-lab's DFlashDraftModel, give the same block hiddens."""
    ref = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    m = tiny("dflash")
    c = dict(m.config)
    cfg = Qwen3Config(**{k: v for k, v in c.items() if k not in ("dflash_config", "architectures")})
    cfg.dflash_config = c["dflash_config"]
    cfg.num_target_layers = c["num_target_layers"]
    cfg.block_size = c["block_size"]
    r = ref.DFlashDraftModel(cfg).eval()
    sd = {k: v for k, v in m.state_dict().items() if k != "mask_embedding"}
    missing, unexpected = r.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    S, Bk = 7, c["block_size"]
    taps = torch.randn(1, S, 2 * TC.hidden_size)
    noise = torch.randn(1, Bk, TC.hidden_size)
    pos = torch.arange(S + Bk)[None]
    with torch.no_grad():
        want = r(position_ids=pos, noise_embedding=noise, target_hidden=taps)
        got = m(taps, pos[:, :S], noise, pos[:, S:], torch.ones(1, 1, Bk, S + Bk, dtype=torch.bool))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_mtp_chain_step_equals_explicit_second_step():
    m = tiny("mtp")
    T = 9
    e = torch.randn(1, T, TC.hidden_size)
    h = torch.randn(1, T, TC.hidden_size)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        x1 = m.fuse(e, h)
        _, h1 = m.block(x1, pos)
        d = torch.randn(1, T, TC.hidden_size)
        y = m.chain_step(x1, d, h1, pos)
        for t in (0, 4, 8):
            # Explicit: run the causal block over [x1[:t+1]; x2_t] at positions [0..t, t+1].
            x2 = m.fuse(d[:, t : t + 1], h1[:, t : t + 1])
            seq = torch.cat([x1[:, : t + 1], x2], 1)
            _, out = m.block(seq, torch.arange(t + 2)[None])
            torch.testing.assert_close(y[0, t], out[0, -1], rtol=1e-4, atol=1e-5)
