//! Unit tests on a tiny random-weight model: drafts against a from-scratch greedy rollout,
//! the lazy rewind, checkpoint reuse, sampled drafts and the handshake check.

use specula_models::loader::{load_model, LoadOptions};
use specula_models::sampling::argmax;
use specula_models::testing::TinyModel;
use specula_models::{ForwardRequest, Model};
use specula_protocol::wire::{SamplingSpec, TargetInfo};

use crate::check_target;
use crate::session::DraftSession;

fn tiny(seed: u64) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    TinyModel::new("qwen2", seed)
        .unwrap()
        .write_hf_dir(dir.path())
        .unwrap();
    let opts = LoadOptions {
        prefill_chunk: 3, // chunked prefill must agree with one forward
        ..LoadOptions::default()
    };
    let model = load_model(dir.path(), &opts).unwrap();
    (dir, model)
}

/// The obvious reference: a fresh cache, the whole context, then argmax one step at a time.
fn rollout(model: &Model, context: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.new_cache();
    let req = ForwardRequest::default();
    let mut logits = model.forward(context, &mut cache, &req).unwrap().logits;
    let mut out = Vec::new();
    for _ in 0..n {
        let id = argmax(&logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap());
        out.push(id);
        logits = model.forward(&[id], &mut cache, &req).unwrap().logits;
    }
    out
}

const PROMPT: [u32; 7] = [5, 17, 33, 8, 41, 12, 9];

#[test]
fn greedy_drafts_equal_a_fresh_rollout_and_prefill_leaves_the_last_id_pending() {
    let (_dir, model) = tiny(1);
    let mut s = DraftSession::new(&model, &PROMPT, &SamplingSpec::greedy(), None);
    s.prefill(&model).unwrap();
    assert_eq!(s.fed(), PROMPT.len() - 1);
    let p = s.draft(&model, 5).unwrap();
    assert_eq!(p.tokens, rollout(&model, &PROMPT, 5));
    assert!(p.q.is_none(), "greedy drafts carry no q");
    // Pending id + 4 fed drafts (the 5th is not run).
    assert_eq!(s.fed(), PROMPT.len() - 1 + 1 + 4);
}

#[test]
fn commit_rewinds_lazily_and_feeds_only_what_is_missing() {
    let (_dir, model) = tiny(2);
    let mut s = DraftSession::new(&model, &PROMPT, &SamplingSpec::greedy(), None);
    s.prefill(&model).unwrap();
    let d = s.draft(&model, 4).unwrap().tokens;

    // Two accepted, then the target's own token (different from d[2]).
    let other = (d[2] + 1) % 96;
    s.extend(&[d[0], d[1], other]);
    let before = s.fed();
    let p = s.draft(&model, 3).unwrap();
    assert_eq!(p.tokens, rollout(&model, s.tokens(), 3));
    assert_eq!(
        s.fed() - before,
        1 + 2,
        "only the target's token, then 2 draft steps"
    );

    // All accepted plus a bonus token: the unfed last draft and the bonus are fed.
    let d = p.tokens;
    s.extend(&[d[0], d[1], d[2], 7]);
    let before = s.fed();
    let p = s.draft(&model, 2).unwrap();
    assert_eq!(p.tokens, rollout(&model, s.tokens(), 2));
    assert_eq!(s.fed() - before, 2 + 1);

    // Nothing accepted, and new ids arriving with the draft request.
    s.extend(&[3, 4]);
    let p = s.draft(&model, 3).unwrap();
    assert_eq!(p.tokens, rollout(&model, s.tokens(), 3));
}

#[test]
fn a_checkpoint_spares_the_shared_prefix() {
    let (_dir, model) = tiny(3);
    let mut first = DraftSession::new(&model, &PROMPT, &SamplingSpec::greedy(), None);
    first.prefill(&model).unwrap();
    first.draft(&model, 3).unwrap();
    let checkpoint = first.into_checkpoint();

    // A re-open with the prompt plus a few more ids (as after a drafter swap).
    let mut longer = PROMPT.to_vec();
    longer.extend([20, 21, 22]);
    let mut lru = crate::checkpoints::Checkpoints::new(2);
    lru.put(checkpoint);
    let reuse = lru.take_longest(&longer[..longer.len() - 1]);
    assert_eq!(reuse.as_ref().unwrap().ids.len(), PROMPT.len());
    let mut s = DraftSession::new(&model, &longer, &SamplingSpec::greedy(), reuse);
    s.prefill(&model).unwrap();
    assert_eq!(
        s.fed(),
        2,
        "only the new ids before the pending one are run"
    );
    assert_eq!(
        s.draft(&model, 4).unwrap().tokens,
        rollout(&model, &longer, 4)
    );
}

#[test]
fn drafting_stops_at_the_draft_models_context_window() {
    let (_dir, model) = tiny(4);
    let prompt: Vec<u32> = (0..62).map(|i| (i * 7 % 90) as u32 + 3).collect();
    let mut s = DraftSession::new(&model, &prompt, &SamplingSpec::greedy(), None);
    s.prefill(&model).unwrap();
    let p = s.draft(&model, 8).unwrap();
    // Window 64: the pending id and two drafts fill it; a third comes from the last logits.
    assert_eq!(p.tokens.len(), 3);
    assert_eq!(p.tokens[..2], rollout(&model, &prompt, 2));
    s.extend(&[1, 2, 3]);
    assert!(
        s.draft(&model, 4).unwrap().tokens.is_empty(),
        "context past the window"
    );
}

#[test]
fn sampled_drafts_carry_their_distributions_and_follow_the_seed() {
    let (_dir, model) = tiny(5);
    let spec = SamplingSpec {
        temperature: 0.8,
        top_k: Some(20),
        seed: Some(42),
        ..SamplingSpec::greedy()
    };
    let run = || {
        let mut s = DraftSession::new(&model, &PROMPT, &spec, None);
        s.prefill(&model).unwrap();
        s.draft(&model, 5).unwrap()
    };
    let p = run();
    let q = p.q.as_ref().expect("sampled drafts carry q");
    assert_eq!(q.len(), p.tokens.len());
    for (row, &id) in q.iter().zip(&p.tokens) {
        assert_eq!(row.len(), 96);
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-4);
        assert!(
            row[id as usize] > 0.0,
            "a drafted id has probability under q"
        );
        assert!(
            row.iter().filter(|&&x| x > 0.0).count() <= 20,
            "top-k applied"
        );
    }
    assert_eq!(run(), p, "same seed, same drafts");
}

fn target(fingerprint: &str, vocab_size: u32) -> TargetInfo {
    TargetInfo {
        architecture: "qwen2".into(),
        vocab_size,
        hidden_size: 64,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 16,
        tokenizer_fingerprint: fingerprint.into(),
        eos_ids: vec![2],
        weights_path: String::new(),
        context_len: 64,
        ..TargetInfo::default()
    }
}

#[test]
fn handshake_refuses_another_tokenizer_or_vocabulary() {
    assert_eq!(check_target("abc", 96, &target("abc", 96)), Ok(()));
    let err = check_target("abc", 96, &target("xyz", 96)).unwrap_err();
    assert!(err.contains("tokenizer mismatch") && err.contains("abc") && err.contains("xyz"));
    let err = check_target("abc", 96, &target("abc", 128)).unwrap_err();
    assert!(
        err.contains("vocab 96") && err.contains("vocab 128"),
        "{err}"
    );
}
