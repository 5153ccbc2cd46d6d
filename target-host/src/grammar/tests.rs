//! Constraint tests on the real SmolLM2 vocabulary: masks after advance, rollback and
//! check_draft equal a fresh replay of the same tokens; compiled schemas refuse what they
//! cannot enforce; a walk through the masks ends in JSON that the schema accepts.

use std::sync::{Arc, OnceLock};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use specula_models::tokenizer::{Special, Tokenizer};

use super::*;

/// The SmolLM2 tokenizer (fetched on first use).
pub(crate) fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = crate::models::resolve_model("smollm2-135m").expect("fetch SmolLM2");
        Tokenizer::from_gguf_file(&path).expect("SmolLM2 tokenizer")
    })
}

/// The SmolLM2 vocabulary.
pub(crate) fn vocab() -> Arc<Vocab> {
    Vocab::of(tokenizer()).expect("vocabulary")
}

fn person() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": false
    })
}

/// A seeded walk: each step picks an allowed token, preferring EOS when allowed and short
/// tokens otherwise so that strings and numbers end. Returns the tokens and the mask before
/// each of them (plus the final one).
fn walk(c: &mut Constraint, seed: u64, steps: usize) -> (Vec<u32>, Vec<Mask>) {
    let tok = tokenizer();
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut ids, mut masks) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        if c.is_complete() {
            break;
        }
        let mask = c.allowed().unwrap().clone();
        let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
            .filter(|&t| mask.allows(t))
            .collect();
        assert!(!allowed.is_empty());
        masks.push(mask);
        let eos = allowed.iter().copied().find(|&t| c.is_eos(t));
        let t = match eos {
            Some(e) => e,
            None => {
                // Two draws, keep the one with the shorter text: ends strings sooner.
                let a = allowed[rng.random_range(0..allowed.len())];
                let b = allowed[rng.random_range(0..allowed.len())];
                let len = |t: u32| tok.id_to_token(t).map_or(0, |s| s.len());
                if len(a) <= len(b) {
                    a
                } else {
                    b
                }
            }
        };
        ids.push(t);
        if c.is_eos(t) {
            break;
        }
        c.advance(t).unwrap();
    }
    if !c.is_complete() && ids.last().is_none_or(|&t| !c.is_eos(t)) {
        masks.push(c.allowed().unwrap().clone());
    }
    (ids, masks)
}

fn text_of(ids: &[u32]) -> String {
    let tok = tokenizer();
    let ids: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|t| !tok.eos_ids().contains(t))
        .collect();
    tok.decode(&ids).unwrap()
}

/// Checks `v` against [`person`] by hand (the schema's every rule).
fn is_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let name_ok = o["name"].as_str().is_some_and(|s| s.chars().count() <= 6);
    let age_ok = o["age"].as_u64().is_some_and(|a| a <= 150);
    let role_ok = matches!(o["role"].as_str(), Some("admin" | "user"));
    let tags_ok = o["tags"]
        .as_array()
        .is_some_and(|a| a.len() <= 2 && a.iter().all(Value::is_boolean));
    o.len() == 4 && name_ok && age_ok && role_ok && tags_ok
}

#[test]
fn walks_through_the_masks_end_in_valid_json() {
    let vocab = vocab();
    let mut complete = 0;
    for seed in 0..6 {
        let mut c = Constraint::json_schema(&vocab, &person(), true).unwrap();
        let (ids, _) = walk(&mut c, seed, 400);
        let text = text_of(&ids);
        let done = c.is_complete() || ids.last().is_some_and(|&t| c.is_eos(t));
        if done {
            complete += 1;
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(is_person(&v), "{text}");
        }
    }
    assert!(complete >= 4, "only {complete} of 6 walks completed");
}

#[test]
fn masks_after_advance_and_rollback_equal_a_fresh_replay() {
    let vocab = vocab();
    let mut c = Constraint::json_schema(&vocab, &person(), true).unwrap();
    let (ids, masks) = walk(&mut c, 7, 60);
    let ids: Vec<u32> = ids.into_iter().filter(|&t| !c.is_eos(t)).collect();
    assert!(ids.len() > 10, "{ids:?}");
    // Advance to i, roll back j, compare with the walk's mask at i - j.
    let mut rng = StdRng::seed_from_u64(1);
    let mut c = Constraint::json_schema(&vocab, &person(), true).unwrap();
    let mut at = 0;
    for _ in 0..40 {
        let fwd = rng.random_range(0..=5).min(ids.len() - at);
        for &t in &ids[at..at + fwd] {
            c.advance(t).unwrap();
        }
        at += fwd;
        assert_eq!(c.allowed().unwrap(), &masks[at], "after advancing to {at}");
        let back = rng.random_range(0..=at.min(4));
        c.rollback(back).unwrap();
        at -= back;
        assert_eq!(
            c.allowed().unwrap(),
            &masks[at],
            "after rolling back to {at}"
        );
    }
}

#[test]
fn check_draft_cuts_at_the_first_invalid_token_and_keeps_the_state() {
    let vocab = vocab();
    let mut c = Constraint::json_schema(&vocab, &person(), true).unwrap();
    let (ids, masks) = walk(&mut c, 3, 40);
    let ids: Vec<u32> = ids.into_iter().filter(|&t| !c.is_eos(t)).collect();
    let tok = tokenizer();
    let bad = tok.encode("Hello", Special::Plain).unwrap()[0];
    for at in [0, 1, 5, 12] {
        let mut c = Constraint::json_schema(&vocab, &person(), true).unwrap();
        for &t in &ids[..at] {
            c.advance(t).unwrap();
        }
        let whole = &ids[at..(at + 6).min(ids.len())];
        assert_eq!(c.check_draft(whole), whole.len(), "a walked draft is valid");
        assert_eq!(c.allowed().unwrap(), &masks[at], "state kept");
        let mut broken = whole.to_vec();
        broken[2] = bad;
        assert!(
            !masks[at + 2].allows(bad),
            "the test's bad token is invalid there"
        );
        assert_eq!(c.check_draft(&broken), 2);
        // The cached masks are the states' own: advance through the valid part and compare.
        for (i, &t) in broken[..2].iter().enumerate() {
            assert_eq!(c.allowed().unwrap(), &masks[at + i]);
            c.advance(t).unwrap();
        }
        assert_eq!(c.allowed().unwrap(), &masks[at + 2]);
        c.rollback(2).unwrap();
        assert_eq!(c.allowed().unwrap(), &masks[at]);
        // An EOS where the grammar does not accept is not a valid draft.
        let eos = tok.eos_ids()[0];
        assert_eq!(c.check_draft(&[eos]), 0);
        assert_eq!(c.check_draft(&[]), 0);
    }
}

#[test]
fn eos_only_where_the_grammar_accepts() {
    let vocab = vocab();
    let tok = tokenizer();
    let mut c = Constraint::json_object(&vocab);
    let eos = tok.eos_ids()[0];
    assert!(!c.allowed().unwrap().allows(eos));
    assert!(!c.is_accepting());
    let ids = tok.encode("{\"a\": [1, 2]}", Special::Plain).unwrap();
    for &t in &ids {
        assert!(c.allowed().unwrap().allows(t), "{:?}", tok.id_to_token(t));
        c.advance(t).unwrap();
    }
    assert!(c.is_accepting() || c.is_complete());
    if !c.is_complete() {
        assert!(c.allowed().unwrap().allows(eos));
    }
    // Text after the object is not JSON.
    let mut d = Constraint::json_object(&vocab);
    let not_object = tok.encode("[1]", Special::Plain).unwrap();
    assert_eq!(d.check_draft(&not_object), 0);
}

#[test]
fn strict_refuses_what_cannot_be_enforced_and_names_it() {
    let vocab = vocab();
    let schema = json!({"type": "array", "items": {"type": "integer"}, "uniqueItems": true});
    let e = Constraint::json_schema(&vocab, &schema, true).unwrap_err();
    assert!(matches!(e, GrammarError::Schema(_)));
    assert!(e.to_string().contains("uniqueItems"), "{e}");
    // Not strict: compiled, the keyword ignored.
    Constraint::json_schema(&vocab, &schema, false).unwrap();
    let e = Constraint::json_schema(&vocab, &json!({"type": "objekt"}), false).unwrap_err();
    assert!(e.to_string().contains("objekt"), "{e}");
    let e = Constraint::json_schema(&vocab, &json!([1]), true).unwrap_err();
    assert!(e.to_string().contains("JSON object"), "{e}");
}

#[test]
fn lark_errors_name_the_problem() {
    let vocab = vocab();
    let e = Constraint::lark(&vocab, "start: missing_rule").unwrap_err();
    assert!(matches!(e, GrammarError::Lark(_)));
    assert!(e.to_string().contains("missing_rule"), "{e}");
}

/// A draft that runs past the grammar's end into EOS (an n-gram drafter copying a prompt's
/// example call and its end of turn) is valid whole, and neither checking it nor verifying
/// it breaks the matcher: EOS is the one token a complete grammar takes.
#[test]
fn an_eos_drafted_after_the_end_keeps_the_matcher_whole() {
    let vocab = vocab();
    let tok = tokenizer();
    let mut c = Constraint::lark(&vocab, "start: \"hello world\"").unwrap();
    let mut draft = tok.encode("hello world", Special::Plain).unwrap();
    let eos = tok.eos_ids()[0];
    draft.push(eos);
    assert_eq!(c.check_draft(&draft), draft.len());
    // As verification does: advance through the accepted drafts, then roll back.
    for &t in &draft {
        assert!(c.allowed().unwrap().allows(t));
        c.advance(t).unwrap();
    }
    c.rollback(draft.len()).unwrap();
    assert!(!c.is_complete());
    // Committing: the grammar completes at the last text token, EOS still goes through.
    for &t in &draft[..draft.len() - 1] {
        c.advance(t).unwrap();
    }
    assert!(c.is_complete());
    assert_eq!(c.allowed().unwrap().count(), tok.eos_ids().len());
    c.advance(eos).unwrap();
    c.rollback(2).unwrap();
    assert!(!c.is_complete());
    assert_eq!(c.check_draft(&draft[draft.len() - 2..]), 2);
}
