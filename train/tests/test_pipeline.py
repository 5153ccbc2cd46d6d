"""CPU tests of the pipeline pieces around the drafters: cached generation, tau bookkeeping,
export round trip, held-out split and prompt parsing."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula_train import evaluate, export, prompts  # noqa: E402
from specula_train.drafters import DFlash, DSpark, MTP, dflash_config, init_weights, mtp_config  # noqa: E402
from specula_train.target import Target, TargetConfig  # noqa: E402
from specula_train.twin_drafts import load_drafter  # noqa: E402

TC = TargetConfig("llama", 61, 32, 3, 4, 2, 8, 40, 1e-5, 10000.0, 256, True)


def tiny_target(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    w = {"embed_tokens.weight": r(61, 32), "norm.weight": 1 + r(32)}
    for i in range(3):
        p = f"layers.{i}."
        w.update({
            p + "input_layernorm.weight": 1 + r(32), p + "post_attention_layernorm.weight": 1 + r(32),
            p + "self_attn.q_proj.weight": r(32, 32), p + "self_attn.k_proj.weight": r(16, 32),
            p + "self_attn.v_proj.weight": r(16, 32), p + "self_attn.o_proj.weight": r(32, 32),
            p + "mlp.gate_proj.weight": r(40, 32), p + "mlp.up_proj.weight": r(40, 32),
            p + "mlp.down_proj.weight": r(32, 40),
        })
    return Target(TC, w, "cpu", torch.float32)


def test_cached_left_padded_generation_equals_full_forwards():
    t = tiny_target()
    prompts_ = [[5, 9, 2, 44, 17, 3], [8], [30, 31, 32]]
    got = t.generate(prompts_, 7, stop_ids={60}, temperature=torch.zeros(3))
    for p, g in zip(prompts_, got):
        seq = list(p)
        for _ in range(7):
            _, fin = t.forward(torch.tensor([seq]), [])
            seq.append(int(t.logits(fin)[0, -1].argmax()))
        assert g == seq[len(p):len(p) + len(g)]
        assert len(g) == 7 or g[-1] == 60


def test_generation_stops_at_a_stop_id_and_keeps_it():
    t = tiny_target()
    free = t.generate([[1, 2, 3]], 6, stop_ids={60}, temperature=torch.zeros(1))[0]
    stopped = t.generate([[1, 2, 3]], 6, stop_ids={free[2]}, temperature=torch.zeros(1))[0]
    assert stopped == free[: free.index(free[2]) + 1]


def test_dropping_finished_rows_keeps_every_answer():
    # Rows stop at different steps; compacting every 2 steps must not change any row's answer.
    t = tiny_target()
    prompts_ = [[5, 9, 2, 44, 17, 3], [8], [30, 31, 32], [1, 2], [40, 41, 42, 43]]
    free = t.generate(prompts_, 12, stop_ids=set(), temperature=torch.zeros(5))
    stop = {free[0][1], free[2][1]}  # rows stop at different steps, some late
    plain = t.generate(prompts_, 12, stop_ids=stop, temperature=torch.zeros(5), compact_every=1000)
    compact = t.generate(prompts_, 12, stop_ids=stop, temperature=torch.zeros(5), compact_every=2)
    assert compact == plain
    assert len(plain[0]) <= 2 and any(len(r) > 4 for r in plain)


def test_cached_target_states_equal_the_per_step_forward(tmp_path):
    from specula_train.bench import synthetic_data
    from specula_train.run import configs_for
    from specula_train.train import Trainer

    t = tiny_target()
    data = synthetic_data(tmp_path / "d.pt", 12, TC.vocab_size)
    args = type("A", (), {"taps": 2, "layers": 1, "inter": 24, "markov_rank": 4})()
    hp = {"seed": 0, "lr": {"dflash": 1e-3, "dspark": 1e-3, "mtp": 1e-3}, "gamma": {"dflash": 4.0, "dspark": 4.0},
          "anchors": 4, "tokens_per_batch": 1500, "rows_per_batch": 4, "train_seconds": 0, "steps": 5}
    tr = Trainer(t, data, ["dflash", "mtp"], configs_for(TC, args), hp, "cpu")
    rows = tr.batch_at(0)
    ids, lens, _ = data.batch(rows, "cpu")
    want_taps, want_final = tr.target_states(rows, ids, lens)
    tr.cache_target_states(rows_per_forward=5)
    got_taps, got_final = tr.target_states(rows, ids, lens)
    valid = torch.arange(ids.shape[1])[None] < lens[:, None]
    assert set(got_taps) == set(want_taps) == set(tr.tap_ids())
    for l in want_taps:
        torch.testing.assert_close(got_taps[l][valid], want_taps[l][valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_final[valid], want_final[valid], atol=1e-5, rtol=1e-5)


def test_answers_round_trip_through_responses_npz(tmp_path):
    from specula_train import gen

    resp = {0: [5, 60000, 2], 1: [], 2: [7]}
    gen.save_responses(resp, 3, tmp_path / "r.npz")
    assert gen.load_responses(tmp_path / "r.npz", 3) == resp
    try:
        gen.load_responses(tmp_path / "r.npz", 4)
    except SystemExit as e:
        assert "3 answers for 4 prompts" in str(e)
    else:
        raise AssertionError("a prompt-count mismatch must be refused")


def test_summarize_rounds_counts_tau_and_positions():
    # Rounds: (accepted, drafted). Three rounds of 3 drafts: 3 accepted, 0, then 1.
    s = evaluate.summarize_rounds({0: [(3, 3), (0, 3)], 1: [(1, 3)]}, 3)
    assert s["rounds"] == 3
    assert abs(s["tau_excl_bonus"] - 4 / 3) < 1e-9
    assert abs(s["tau_incl_bonus"] - 7 / 3) < 1e-9
    # Position 1 reached 3 times, accepted twice; position 2 reached twice, accepted once.
    assert s["accept_given_reached"] == [2 / 3, 1 / 2, 1.0]
    assert s["accept_cumulative"] == [2 / 3, 1 / 3, 1 / 3]


def test_export_round_trip_keeps_names_and_outputs(tmp_path):
    torch.manual_seed(1)
    for kind, m in (
        ("dflash", DFlash(dflash_config(TC, 1, 24, [0, 1], 4))),
        ("dspark", DSpark(dflash_config(TC, 1, 24, [0, 1], 3, {"architectures": ["DSparkDraftModel"], "markov_rank": 4}))),
        ("mtp", MTP(mtp_config(TC))),
    ):
        init_weights(m)
        out = tmp_path / kind
        info = export.write(kind, m, m.config, TC, "f" * 64, out, "# recipe\n")
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["specula_target"] == {"architecture": "llama", "tokenizer_fingerprint": "f" * 64, "hidden_size": 32, "num_layers": 3}
        back, _ = load_drafter(out)
        for (k, a), (k2, b) in zip(sorted(m.state_dict().items()), sorted(back.state_dict().items())):
            assert k == k2
            torch.testing.assert_close(a.to(torch.bfloat16).float(), b)
        assert info["params"] == sum(p.numel() for p in m.parameters())
        sums = (out / "SHA256SUMS").read_text().split()
        assert sums[0] == export.sha256(out / "config.json") and sums[2] == export.sha256(out / "model.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mtp" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.3.eh_proj.weight" in names and "model.layers.3.shared_head.norm.weight" in names
    with safe_open(str(tmp_path / "dflash" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "mask_embedding", "layers.0.self_attn.q_norm.weight"} <= names


def test_held_out_is_per_document_and_stable():
    docs = [f"py:library/mod{i}.rst.txt" for i in range(2000)]
    picked = [d for d in docs if prompts.held_out(d)]
    assert 40 <= len(picked) <= 130  # ~4 %
    assert picked == [d for d in docs if prompts.held_out(d)]


def test_rst_blocks_find_code_and_prose():
    text = "Title\n=====\n\nSome prose here that is long enough.\nIt continues::\n\n    x = 1\n    print(x)\n\nAfter.\n"
    blocks = list(prompts.rst_blocks(text))
    assert ("code", "", "x = 1\nprint(x)") in blocks
    assert any(k == "prose" and "continues:" in b for k, _, b in blocks)
    assert prompts.doctest_to_code(">>> a = 2\n>>> a + 1\n3") == "a = 2\na + 1"
