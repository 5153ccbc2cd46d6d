"""CPU tests of the pipeline pieces around the drafters: cached generation, tau bookkeeping,
export round trip, held-out split and prompt parsing."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula_train import evaluate, export, prompts  # noqa: E402
from specula_train.drafters import (  # noqa: E402
    Assistant, DFlash, DSpark, MTP, assistant_config, block_mask, dflash_config, init_weights, mtp_config,
)
from specula_train.target import Target, TargetConfig  # noqa: E402
from specula_train.twin_drafts import load_drafter  # noqa: E402

TC = TargetConfig("llama", 61, 32, 3, 4, 2, 8, 40, 1e-5, 10000.0, 256, True)


ARGS = type("A", (), {
    "taps": 2, "layers": 1, "inter": 24, "markov_rank": 4,
    "assistant_layers": 1, "assistant_inter": 24, "assistant_heads": 4,
})()
HP = {
    "seed": 0, "lr": {"dflash": 1e-3, "dspark": 1e-3, "mtp": 1e-3, "assistant": 1e-3},
    "gamma": {"dflash": 4.0, "dspark": 4.0, "assistant": 4.0}, "anchors": 4, "tokens_per_batch": 1500,
    "rows_per_batch": 4, "train_seconds": 0, "steps": 5, "assistant_steps": 3, "assistant_anchors": 4,
}


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
    tr = Trainer(t, data, ["dflash", "mtp", "assistant"], configs_for(TC, ARGS), HP, "cpu")
    rows = tr.batch_at(0)
    ids, lens, _ = data.batch(rows, "cpu")
    want_taps, want_final, want_kv = tr.target_states(rows, ids, lens)
    tr.cache_target_states(rows_per_forward=5)
    got_taps, got_final, got_kv = tr.target_states(rows, ids, lens)
    valid = torch.arange(ids.shape[1])[None] < lens[:, None]
    assert set(got_taps) == set(want_taps) == set(tr.tap_ids())
    for l in want_taps:
        torch.testing.assert_close(got_taps[l][valid], want_taps[l][valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_final[valid], want_final[valid], atol=1e-5, rtol=1e-5)
    assert want_kv[0].shape == (len(rows), TC.num_kv_heads, ids.shape[1], TC.head_dim)
    for want, got in zip(want_kv, got_kv):  # [B, kv_heads, T, hd]
        torch.testing.assert_close(got.transpose(1, 2)[valid], want.transpose(1, 2)[valid], atol=1e-5, rtol=1e-5)


def self_distilled(tmp_path):
    """A tiny target and a data set of its own greedy answers to 24 random prompts, as the real
    set: every kind has something to learn."""
    from specula_train.gen import Data

    t = tiny_target()
    g = torch.Generator().manual_seed(5)
    prompts_ = [torch.randint(3, TC.vocab_size, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (24,), generator=g)]
    answers = t.generate(prompts_, 24, stop_ids=set(), temperature=torch.zeros(len(prompts_)))
    seqs = [p + a for p, a in zip(prompts_, answers)]
    torch.save({
        "ids": torch.tensor([x for q in seqs for x in q], dtype=torch.int32),
        "offsets": torch.tensor([0] + [len(q) for q in seqs]).cumsum(0),
        "prompt_lens": torch.tensor([len(p) for p in prompts_]), "tags": torch.zeros(24, dtype=torch.long),
        "splits": torch.zeros(24, dtype=torch.long), "sampled": torch.zeros(24, dtype=torch.bool),
        "meta": {"tags": ["chat"], "splits": ["train", "heldout", "bench"], "eos_id": 2},
    }, tmp_path / "d.pt")
    data = Data(tmp_path / "d.pt")
    return t, data


def test_every_kind_trains_a_few_steps_and_its_loss_falls(tmp_path):
    from specula_train.run import configs_for
    from specula_train.train import Trainer

    t, data = self_distilled(tmp_path)
    hp = dict(HP, steps=30, tokens_per_batch=900, rows_per_batch=24)
    tr = Trainer(t, data, ["dflash", "dspark", "mtp", "assistant"], configs_for(TC, ARGS), hp, "cpu")
    tr.cache_target_states()
    recs = [tr.train_step() for _ in range(30)]
    from specula_train.train import to_floats

    recs = to_floats(recs)
    for k in ("dflash", "dspark", "mtp", "assistant"):
        first = sum(r[k]["loss"] for r in recs[:3]) / 3
        last = sum(r[k]["loss"] for r in recs[-3:]) / 3
        assert last < 0.9 * first, (k, first, last)


def test_dflash_variants_train_side_by_side(tmp_path):
    """`dflash_kl` (KL to the target + 0.1 CE) and `dflash_ce` train as two DFlash models on the
    same batches and both learn; a plain `dflash` (or another tag) takes `dflash_loss`; a variant
    exports as a DFlash the loader reads back."""
    from specula_train.run import configs_for
    from specula_train.train import Trainer, to_floats

    t, data = self_distilled(tmp_path)
    hp = dict(HP, steps=30, tokens_per_batch=900, rows_per_batch=24, lr=dict(HP["lr"], dflash_kl=2e-3), dflash_loss="kl")
    tr = Trainer(t, data, ["dflash_ce", "dflash_kl", "dflash", "dflash_b"], configs_for(TC, ARGS), hp, "cpu")
    assert tr.opts["dflash_kl"].param_groups[0]["lr"] == 2e-3
    tr.cache_target_states()
    recs = to_floats([tr.train_step() for _ in range(30)])
    assert "kl" in recs[0]["dflash_kl"] and "kl" not in recs[0]["dflash_ce"]
    assert "kl" in recs[0]["dflash"] and "kl" in recs[0]["dflash_b"]
    for k in ("dflash_ce", "dflash_kl"):
        first = sum(r[k]["loss"] for r in recs[:3]) / 3
        last = sum(r[k]["loss"] for r in recs[-3:]) / 3
        assert last < 0.9 * first, (k, first, last)
    d = tmp_path / "x"
    export.write("dflash", tr.models["dflash_kl"], configs_for(TC, ARGS)["dflash"], TC, "f" * 64, d, "")
    back, _ = load_drafter(d)
    assert type(back) is DFlash


def test_assistant_acceptance_equals_chained_drafting():
    """The teacher-forced unroll behind evaluate_assistant counts exactly the drafts a chained
    drafter (each draft the next step's input) gets accepted."""
    from specula_train.drafters import Assistant, assistant_config

    t = tiny_target()
    torch.manual_seed(3)
    m = Assistant(assistant_config(TC, 2, 24, 4))
    init_weights(m, std=0.3)
    ids = torch.randint(0, TC.vocab_size, (1, 14))
    # Make the continuation the drafter's own greedy chain at position 5 for 3 tokens, so some
    # round accepts several drafts.
    _, final, (k, v) = t.forward_kv(ids, [], TC.num_layers - 1)
    h, tok = final[:, 4:5], ids[0, 5]
    for j in range(3):
        y, h = m.step(t.embed[tok][None, None], h, torch.tensor([[5]]), k[:, :, :5], v[:, :, :5], torch.ones(1, 1, 1, 5, dtype=torch.bool))
        tok = (y[0, 0] @ t.lm_head.T).argmax()
        ids[0, 6 + j] = tok
    lens = torch.tensor([14])
    acc, drafted = evaluate.assistant_accepted(m, t, ids, lens, 4)
    assert int(acc[0, 5]) >= 3
    for a in range(1, 13):
        _, final, (k, v) = t.forward_kv(ids[:, :a], [], TC.num_layers - 1)  # only what exists at a
        h, tok, n = final[:, a - 1 : a], ids[0, a], 0
        for j in range(min(4, 13 - a)):
            y, h = m.step(t.embed[tok][None, None], h, torch.tensor([[a]]), k, v, torch.ones(1, 1, 1, a, dtype=torch.bool))
            tok = (y[0, 0] @ t.lm_head.T).argmax()
            if tok != ids[0, a + 1 + j]:
                break
            n += 1
        assert int(acc[0, a]) == n, a
        assert int(drafted[0, a]) == min(4, 13 - a)


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
        ("assistant", Assistant(assistant_config(TC, 2, 24, 4))),
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
        assert info["params"] == sum(p.numel() for p in m.parameters()) + (2 if kind == "assistant" else 0)
        sums = (out / "SHA256SUMS").read_text().split()
        assert sums[0] == export.sha256(out / "config.json") and sums[2] == export.sha256(out / "model.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mtp" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.3.eh_proj.weight" in names and "model.layers.3.shared_head.norm.weight" in names
    with safe_open(str(tmp_path / "dflash" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "mask_embedding", "layers.0.self_attn.q_norm.weight"} <= names
    with safe_open(str(tmp_path / "assistant" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"pre_projection.weight", "post_projection.weight", "model.norm.weight", "model.layers.1.layer_scalar",
            "model.layers.0.self_attn.q_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"} <= names
    assert not any("k_proj" in n or "embed_tokens" in n for n in names)


def test_int8_export_dequantizes_to_within_half_a_step(tmp_path):
    from safetensors import safe_open

    torch.manual_seed(2)
    m = Assistant(assistant_config(TC, 1, 200, 4))
    init_weights(m)
    export.write("assistant", m, m.config, TC, "f" * 64, tmp_path, "# r\n", quant="int8")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.metadata()["specula_quant"] == "int8-rows"
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.uint8
        assert f.get_tensor("model.layers.0.input_layernorm.weight").dtype == torch.bfloat16
        assert "model.layers.0.mlp.up_proj.weight_scale" in names
        assert "model.layers.0.self_attn.q_norm.weight_scale" not in names
    back = export.read_tensors(tmp_path / "model.safetensors")
    sd = m.state_dict()
    assert set(back) == set(sd)
    for k, w in sd.items():
        w = w.to(torch.bfloat16).float()
        step = w.abs().amax(-1, keepdim=True) / 127 if w.dim() == 2 else 0
        assert ((back[k] - w).abs() <= step / 2 + 1e-6).all(), k
    assert (back["model.layers.0.mlp.up_proj.weight"] != sd["model.layers.0.mlp.up_proj.weight"]).any()


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


def test_a_grown_variant_starts_as_the_smaller_model(tmp_path):
    """`--size` + `--init` from a smaller export (train.grow_from): a DSpark of 2 layers and a
    twice wider MLP computes exactly what the 1-layer model it grew from computes, trains on,
    and exports with its own size."""
    from specula_train.run import configs_for
    from specula_train.train import Trainer

    t, data = self_distilled(tmp_path)
    small_cfg = configs_for(TC, ARGS)["dspark"]
    small = DSpark(small_cfg)
    init_weights(small, std=0.2)
    export.write("dspark", small, small_cfg, TC, "f" * 64, tmp_path / "small", "", None)
    cfgs = configs_for(TC, ARGS, {"dspark_big": {"layers": 2, "inter": 48}})
    hp = dict(HP, steps=10, tokens_per_batch=900, rows_per_batch=24, grow=["dspark_big"],
              init={"dspark": str(tmp_path / "small")})
    tr = Trainer(t, data, ["dspark", "dspark_big"], cfgs, hp, "cpu")
    big = tr.models["dspark_big"]
    assert len(big.layers) == 2 and big.layers[0].mlp.up_proj.weight.shape[0] == 48
    assert sorted({n.split(".")[1] for n in tr.grown["dspark_big"]}) == ["1"]  # only layer 1 is new
    g = torch.Generator().manual_seed(3)
    T = 10
    taps = torch.randn(2, T, 2 * TC.hidden_size, generator=g)
    ids = torch.randint(3, TC.vocab_size, (2, T), generator=g)
    anchors, valid = torch.tensor([[3, 6], [2, 5]]), torch.ones(2, 2, dtype=torch.bool)
    Bk = small_cfg["block_size"]
    x = small.block_embeddings(t.embed, ids.gather(1, anchors), Bk)
    bpos = (anchors[:, :, None] + torch.arange(Bk)).reshape(2, -1)
    mask = block_mask(anchors, valid, T, Bk)
    with torch.no_grad():
        want = tr.models["dspark"](taps, torch.arange(T).expand(2, T), x, bpos, mask)
        got = big(taps, torch.arange(T).expand(2, T), x, bpos, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tr.cache_target_states()
    for _ in range(3):
        tr.train_step()
    assert big.layers[1].self_attn.o_proj.weight.abs().sum() > 0  # the new layer learns
    export.write("dspark", big, cfgs["dspark_big"], TC, "f" * 64, tmp_path / "big", "")
    back, cfg = load_drafter(tmp_path / "big")
    assert cfg["num_hidden_layers"] == 2 and cfg["intermediate_size"] == 48


def test_an_old_data_variant_never_sees_the_extra_rows(tmp_path):
    """`--old-data`: a model trained on the same batches without the extra prompts' rows takes
    the same step whatever those rows hold; the model beside it does see them."""
    from specula_train.run import configs_for
    from specula_train.train import Trainer

    losses = []
    for variant in range(2):
        t, data = self_distilled(tmp_path)
        data.extra = torch.arange(len(data.lens)) % 2 == 1
        if variant:
            for i in range(1, len(data.lens), 2):  # other answers in the extra rows only
                o, p, e = int(data.offsets[i]), int(data.prompt_lens[i]), int(data.offsets[i + 1])
                data.ids[o + p : e] = (data.ids[o + p : e] + 7) % TC.vocab_size
        hp = dict(HP, steps=5, tokens_per_batch=900, rows_per_batch=24, old_data=["dspark_old"])
        tr = Trainer(t, data, ["dspark", "dspark_old"], configs_for(TC, ARGS), hp, "cpu")
        tr.cache_target_states()
        losses.append({k: float(v["loss"]) for k, v in tr.train_step().items() if isinstance(v, dict)})
    assert abs(losses[0]["dspark_old"] - losses[1]["dspark_old"]) < 1e-6
    assert losses[0]["dspark"] != losses[1]["dspark"]


def test_extra_prompts_leave_the_earlier_selection_alone():
    """The extra chat prompts are chosen after the others with their own random stream: the
    earlier prompts are selected exactly as before, and extras are training prompts only."""
    from specula_train import encode_prompts as ep

    base = [{"tag": t, "split": s, "text": f"{t}{s}{i}"} for t in ("chat", "code-c") for s in ("train", "heldout") for i in range(5000)]
    extra = [{"tag": "chat", "split": "train", "text": f"x{i}", "extra": True} for i in range(30000)]
    before = ep.select([dict(p) for p in base], 0)
    after = ep.select([dict(p) for p in base + extra], 0)
    assert [p for p in after if not p.get("extra")] == before
    assert sum(bool(p.get("extra")) for p in after) == 2 * ep.EXTRA_CAPS["chat"]
    assert ep.select([dict(p) for p in base + extra], 0, extra=False) == before


def test_mtp_variants_share_the_target_side_and_weight_rows_by_tag(tmp_path):
    """MTP models on the same batches (`mtp,mtp_top1,mtp_chat`): the target's side of the loss,
    computed once per step, gives a model the loss it gets trained alone; `--tag-weight` is the
    position-weighted mean with each row's weight (weight 1 changes nothing); `_top1` and
    weighted models learn and export as an MTP the loader reads back; a weight for a model that
    is no MTP, or for an unknown tag, stops the run."""
    import pytest

    from specula_train.run import configs_for, parse_tag_weights
    from specula_train.train import Trainer, to_floats

    t, data = self_distilled(tmp_path)
    data.tags = torch.arange(len(data.lens)) % 2  # two tags, so a weight has something to weigh
    data.meta["tags"] = ["chat", "code-c"]
    hp = dict(HP, steps=30, tokens_per_batch=900, rows_per_batch=24)
    alone = Trainer(t, data, ["mtp"], configs_for(TC, ARGS), hp, "cpu")
    alone.cache_target_states()
    want = float(alone.train_step()["mtp"]["loss"])

    assert parse_tag_weights("mtp_one=chat:1,mtp_chat=chat:3:code-c:0.5") == {
        "mtp_one": {"chat": 1.0}, "mtp_chat": {"chat": 3.0, "code-c": 0.5}}
    hp2 = dict(hp, tag_weight=parse_tag_weights("mtp_one=chat:1,mtp_chat=chat:3"))
    kinds = ["mtp", "mtp_one", "mtp_top1", "mtp_chat"]
    tr = Trainer(t, data, kinds, configs_for(TC, ARGS), hp2, "cpu")
    for k in kinds[1:]:
        tr.models[k].load_state_dict(tr.models["mtp"].state_dict())
    tr.cache_target_states()

    # The weighted loss, from the per-row means: sum_b w_b n_b L_b / sum_b w_b n_b.
    rows = tr.batch_at(0)
    ids, lens, plens = data.batch(rows, "cpu")
    _, final, _ = tr.target_states(rows, ids, lens)
    shared = tr.mtp_targets(ids, lens, plens, final)
    m = tr.models["mtp_chat"]
    w = torch.tensor([3.0 if int(data.tags[i]) == 0 else 1.0 for i in rows])
    got = float(tr.loss_mtp(m, ids, lens, plens, final, "kl", w, shared)[0])
    assert abs(float(tr.loss_mtp(m, ids, lens, plens, final, "kl", torch.ones(len(rows)), shared)[0]) - want) < 1e-5
    num = den = 0.0
    for b in range(len(rows)):
        n = int((shared[0] == b).sum())
        if n:
            one = torch.zeros(len(rows))
            one[b] = 1.0
            num += float(w[b]) * n * float(tr.loss_mtp(m, ids, lens, plens, final, "kl", one, shared)[0])
            den += float(w[b]) * n
    assert abs(got - num / den) < 1e-4, (got, num / den)

    recs = to_floats([tr.train_step() for _ in range(30)])
    assert abs(recs[0]["mtp"]["loss"] - want) < 1e-5
    assert abs(recs[0]["mtp_one"]["loss"] - want) < 1e-5
    assert abs(recs[0]["mtp_chat"]["loss"] - want) > 1e-4  # both tags in the first batch
    assert recs[0]["mtp_top1"]["loss"] > recs[0]["mtp"]["loss"]  # 1.0 CE on the argmax instead of 0.1 CE
    for k in ("mtp_top1", "mtp_chat"):
        first = sum(r[k]["loss"] for r in recs[:3]) / 3
        last = sum(r[k]["loss"] for r in recs[-3:]) / 3
        assert last < 0.9 * first, (k, first, last)
    d = tmp_path / "x"
    export.write("mtp", tr.models["mtp_top1"], mtp_config(TC), TC, "f" * 64, d, "")
    back, _ = load_drafter(d)
    assert type(back) is MTP

    with pytest.raises(SystemExit):
        Trainer(t, data, ["mtp", "dflash"], configs_for(TC, ARGS), dict(hp, tag_weight={"dflash": {"chat": 2.0}}), "cpu")
    with pytest.raises(SystemExit):
        Trainer(t, data, ["mtp"], configs_for(TC, ARGS), dict(hp, tag_weight={"mtp": {"poetry": 2.0}}), "cpu")
