//! Checking a drafter's reply before the verify loop sees it. A drafter can only change speed,
//! never output; these checks also keep a buggy one from crashing the host.

use specula_protocol::wire::Drafted;

use crate::proposer::{Draft, SessionId};

/// How far a `q` row's sum may stray from 1.
const Q_SUM_TOLERANCE: f32 = 1e-3;

/// The draft in `reply` for `session`, or why it must be discarded.
pub(super) fn validate(
    reply: Drafted,
    session: SessionId,
    n: usize,
    vocab_size: u32,
) -> Result<Draft, String> {
    let [row] = <[_; 1]>::try_from(reply.rows)
        .map_err(|rows: Vec<_>| format!("{} rows for a request of one", rows.len()))?;
    if row.session != session {
        return Err(format!("row for session {}, asked {session}", row.session));
    }
    check(&row.tokens, row.q.as_deref(), n, vocab_size)?;
    Ok(Draft {
        tokens: row.tokens,
        q: row.q,
        confidence: None,
    })
}

/// Whether `tokens` (with their draft distributions `q`, when sent) may be verified: at most
/// `n` ids, all inside the vocabulary, and one finite, non-negative `q` row summing to 1 per
/// token. Used on every draft, whether it came over IPC or from an in-process proposer.
pub(crate) fn check(
    tokens: &[u32],
    q: Option<&[Vec<f32>]>,
    n: usize,
    vocab_size: u32,
) -> Result<(), String> {
    if tokens.len() > n {
        return Err(format!("{} tokens, asked at most {n}", tokens.len()));
    }
    if let Some(&id) = tokens.iter().find(|&&id| id >= vocab_size) {
        return Err(format!("id {id} is outside the vocabulary of {vocab_size}"));
    }
    if let Some(q) = q {
        if q.len() != tokens.len() {
            return Err(format!("{} q rows for {} tokens", q.len(), tokens.len()));
        }
        for (i, p) in q.iter().enumerate() {
            if p.len() != vocab_size as usize {
                return Err(format!(
                    "q row {i} has {} entries, vocab is {vocab_size}",
                    p.len()
                ));
            }
            if p.iter().any(|x| !x.is_finite() || *x < 0.0) {
                return Err(format!("q row {i} has a NaN, infinite or negative entry"));
            }
            let sum: f32 = p.iter().sum();
            if (sum - 1.0).abs() > Q_SUM_TOLERANCE {
                return Err(format!("q row {i} sums to {sum}"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use specula_protocol::wire::DraftedRow;

    use super::*;

    fn reply(session: SessionId, tokens: Vec<u32>, q: Option<Vec<Vec<f32>>>) -> Drafted {
        Drafted {
            rows: vec![DraftedRow { session, tokens, q }],
        }
    }

    #[test]
    fn accepts_a_good_reply() {
        let d = validate(reply(1, vec![0, 3], None), 1, 2, 4).unwrap();
        assert_eq!(d.tokens, vec![0, 3]);
        let q = vec![vec![0.5, 0.5, 0.0, 0.0]];
        let d = validate(reply(1, vec![1], Some(q.clone())), 1, 2, 4).unwrap();
        assert_eq!(d.q, Some(q));
    }

    #[test]
    fn discards_every_kind_of_bad_reply() {
        let cases = [
            (reply(2, vec![1], None), "session 2"),
            (reply(1, vec![1, 1, 1], None), "3 tokens"),
            (reply(1, vec![4], None), "id 4 is outside"),
            (reply(1, vec![1], Some(vec![])), "0 q rows"),
            (reply(1, vec![1], Some(vec![vec![1.0]])), "1 entries"),
            (
                reply(1, vec![1], Some(vec![vec![f32::NAN, 1.0, 0.0, 0.0]])),
                "NaN",
            ),
            (
                reply(1, vec![1], Some(vec![vec![-0.5, 1.5, 0.0, 0.0]])),
                "negative",
            ),
            (
                reply(1, vec![1], Some(vec![vec![0.5, 0.0, 0.0, 0.0]])),
                "sums to 0.5",
            ),
            (Drafted { rows: vec![] }, "0 rows"),
        ];
        for (bad, why) in cases {
            let err = validate(bad, 1, 2, 4).unwrap_err();
            assert!(err.contains(why), "{err:?} should mention {why:?}");
        }
    }
}
