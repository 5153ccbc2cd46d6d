//! The speculative loop on tiny random models with in-process proposers: greedy output is
//! unchanged by any drafter, and sampled output keeps the target's distribution.

use specula_models::sampling::SamplingParams;
use specula_tests::proposers::{BadProposer, ScriptProposer};
use specula_tests::stats::{chi_square, critical};
use specula_tests::tiny::tiny_loaded;
use target_host::engine::EngineConfig;
use target_host::generation::{generate, Flow, Generation, GenerationRequest, Speculation};
use target_host::proposer::{Proposer, ProposerSlot};

fn run(
    loaded: &specula_models::loader::LoadedModel,
    proposer: Option<Box<dyn Proposer>>,
    req: &GenerationRequest,
) -> Generation {
    let slot = ProposerSlot::new(proposer);
    generate(
        &loaded.model,
        &loaded.tokenizer,
        &slot,
        &EngineConfig::default(),
        req,
        &mut |_| Flow::Continue,
    )
    .expect("generate")
}

fn request(
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    k: usize,
) -> GenerationRequest {
    GenerationRequest {
        session: 1,
        prompt_ids: prompt.to_vec(),
        max_tokens,
        sampling,
        stop: vec![],
        speculation: if k == 0 {
            Speculation::Off
        } else {
            Speculation::On {
                num_draft_tokens: k,
            }
        },
        logprobs: None,
    }
}

/// Greedy decoding through any drafter equals plain greedy decoding; an oracle drafter that
/// proposes the true continuation is accepted in full, cutting target forwards.
#[test]
fn greedy_output_is_independent_of_the_drafter() {
    for arch in ["llama", "qwen2", "qwen3"] {
        let (_dir, loaded) = tiny_loaded(arch, 3);
        let prompt = [5, 17, 33, 8];
        let plain = run(
            &loaded,
            None,
            &request(&prompt, 40, SamplingParams::default(), 0),
        );
        assert!(!plain.token_ids.is_empty(), "{arch}: generated nothing");
        let vocab = loaded.model.config().vocab_size;
        for k in [1, 3, 8] {
            let bad = run(
                &loaded,
                Some(Box::new(BadProposer::new(vocab, false, 1))),
                &request(&prompt, 40, SamplingParams::default(), k),
            );
            assert_eq!(bad.token_ids, plain.token_ids, "{arch} k={k}: bad drafter");
            assert_eq!(bad.text, plain.text);
            let oracle = run(
                &loaded,
                Some(Box::new(ScriptProposer::new(&prompt, &plain.token_ids))),
                &request(&prompt, 40, SamplingParams::default(), k),
            );
            assert_eq!(oracle.token_ids, plain.token_ids, "{arch} k={k}: oracle");
            assert_eq!(oracle.finish_reason, plain.finish_reason);
            let s = &oracle.stats;
            assert_eq!(
                s.accepted, s.drafted,
                "{arch} k={k}: oracle drafts all accepted"
            );
            assert!(
                s.target_forwards < plain.stats.target_forwards
                    || k == 1 && plain.token_ids.len() < 2,
                "{arch} k={k}: {} forwards vs {} plain",
                s.target_forwards,
                plain.stats.target_forwards
            );
        }
    }
}

/// Stops inside an accepted run end the output exactly where plain decoding ends it.
#[test]
fn max_tokens_and_eos_inside_an_accepted_run() {
    let (_dir, loaded) = tiny_loaded("llama", 9);
    let prompt = [7, 40, 41];
    for max in [1, 2, 5, 13] {
        let plain = run(
            &loaded,
            None,
            &request(&prompt, max, SamplingParams::default(), 0),
        );
        assert!(plain.token_ids.len() <= max);
        let oracle = run(
            &loaded,
            Some(Box::new(ScriptProposer::new(&prompt, &plain.token_ids))),
            &request(&prompt, max, SamplingParams::default(), 6),
        );
        assert_eq!(oracle.token_ids, plain.token_ids, "max_tokens {max}");
        assert_eq!(oracle.finish_reason, plain.finish_reason);
    }
}

/// At temperature 1 the tokens committed through rejection sampling have the target's
/// distribution, for a deterministic bad drafter and for a sampling drafter with a wrong `q`;
/// the same test tells the drafter's own proposals apart from the target (it has power).
#[test]
fn rejection_sampling_keeps_the_target_distribution() {
    let (_dir, loaded) = tiny_loaded("llama", 21);
    let vocab = loaded.model.config().vocab_size;
    let prompt = [11, 12, 13];
    let positions = 3;
    let runs = 2500u64;
    let histogram = |proposer: &dyn Fn(u64) -> Option<Box<dyn Proposer>>, k: usize| {
        let mut h = vec![vec![0usize; vocab]; positions];
        for seed in 0..runs {
            let sampling = SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::default()
            };
            let out = run(
                &loaded,
                proposer(seed),
                &request(&prompt, positions, sampling, k),
            );
            for (i, &t) in out.token_ids.iter().enumerate() {
                h[i][t as usize] += 1;
            }
        }
        h
    };
    let plain = histogram(&|_| None, 0);
    for sampled in [false, true] {
        let spec = histogram(
            &|seed| Some(Box::new(BadProposer::new(vocab, sampled, 1000 + seed))),
            4,
        );
        for i in 0..positions {
            let (stat, df) = chi_square(&plain[i], &spec[i]);
            assert!(
                stat < critical(df),
                "sampled drafter={sampled} position {i}: chi2 {stat:.1} >= {:.1} (df {df})",
                critical(df)
            );
        }
    }
    // Power: the drafter's q itself is far from the target at position 0.
    let q = BadProposer::new(vocab, true, 0)
        .q()
        .expect("sampled q")
        .to_vec();
    let drafts: Vec<usize> = q
        .iter()
        .map(|p| (p * runs as f32).round() as usize)
        .collect();
    let (stat, df) = chi_square(&plain[0], &drafts);
    assert!(
        stat > critical(df),
        "the test cannot tell q from p: chi2 {stat:.1}"
    );
}
