//! Draft distributions `q` and sampling from them. `probs` is z-lab `dflash/model.py`
//! `_sampling_probs` (temperature, then top-k, softmax, then top-p renormalised); with
//! `top_p = 1` and no `top_k` it is DeepSpec's `logits_to_probs` (`softmax(z / T)`).

use rand::Rng;

/// The distribution a draft is sampled from, over the whole vocabulary.
pub fn probs(logits: &[f32], temperature: f32, top_p: f32, top_k: Option<u32>) -> Vec<f32> {
    let scores: Vec<f32> = logits.iter().map(|&z| z / temperature).collect();
    let vocab = scores.len();
    // PyTorch: scores, indices = torch.topk(scores, top_k) when 0 < top_k < vocab.
    let mut keep: Vec<usize> = (0..vocab).collect();
    if let Some(k) = top_k.map(|k| k as usize).filter(|&k| k > 0 && k < vocab) {
        keep.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        keep.truncate(k);
    }
    let max = keep
        .iter()
        .map(|&i| scores[i])
        .fold(f32::NEG_INFINITY, f32::max);
    let mut p = vec![0.0f32; vocab];
    let mut sum = 0.0f32;
    for &i in &keep {
        p[i] = (scores[i] - max).exp();
        sum += p[i];
    }
    for &i in &keep {
        p[i] /= sum;
    }
    if top_p < 1.0 {
        // keep = sorted.cumsum() - sorted < top_p, then renormalise.
        keep.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let mut before = 0.0f32;
        let mut kept = 0.0f32;
        for &i in &keep {
            if before < top_p {
                kept += p[i];
            } else {
                p[i] = 0.0;
            }
            before += if p[i] > 0.0 { p[i] } else { 0.0 };
        }
        for x in &mut p {
            *x /= kept;
        }
    }
    p
}

/// Draws an id from `p` (which sums to 1).
pub fn sample(p: &[f32], rng: &mut impl Rng) -> u32 {
    let u: f32 = rng.random();
    let mut acc = 0.0f32;
    for (i, &x) in p.iter().enumerate() {
        acc += x;
        if u < acc {
            return i as u32;
        }
    }
    // Rounding left the tail short of u: the last id with any mass.
    p.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn temperature_top_k_and_top_p_shape_the_distribution() {
        let z = [2.0f32, 1.0, 0.0, -1.0];
        let p = probs(&z, 1.0, 1.0, None);
        let e: Vec<f32> = z.iter().map(|x| x.exp()).collect();
        let s: f32 = e.iter().sum();
        for (a, b) in p.iter().zip(&e) {
            assert!((a - b / s).abs() < 1e-6);
        }
        let k2 = probs(&z, 1.0, 1.0, Some(2));
        assert_eq!((k2[2], k2[3]), (0.0, 0.0));
        assert!((k2[0] + k2[1] - 1.0).abs() < 1e-6);
        // p = [0.64, 0.24, 0.09, 0.03]: top_p 0.7 keeps the first two (0 < .7, .64 < .7).
        let tp = probs(&z, 1.0, 0.7, None);
        assert!(tp[0] > 0.0 && tp[1] > 0.0 && tp[2] == 0.0 && tp[3] == 0.0);
        assert!((tp.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let cold = probs(&z, 0.1, 1.0, None);
        assert!(cold[0] > 0.99);
    }

    #[test]
    fn samples_follow_the_distribution() {
        let p = [0.1f32, 0.0, 0.6, 0.3];
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[sample(&p, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[1], 0);
        for (c, want) in counts.iter().zip(p) {
            assert!((*c as f32 / 20_000.0 - want).abs() < 0.02, "{counts:?}");
        }
    }
}
