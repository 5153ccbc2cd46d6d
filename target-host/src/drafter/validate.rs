//! Checking a drafter's reply before the verify loop sees it. A drafter can only change speed,
//! never output; these checks also keep a buggy one from crashing the host.

use specula_protocol::wire::{Proposed, ProposedRow};

use crate::proposer::SessionId;

/// How far a `q` row's sum may stray from 1.
const Q_SUM_TOLERANCE: f32 = 1e-3;

/// One validated row of a reply.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Checked {
    /// Proposed ids, at most the `n` asked for, all inside the vocabulary.
    pub tokens: Vec<u32>,
    /// One probability row per token, when the drafter sampled.
    pub q: Option<Vec<Vec<f32>>>,
    /// One estimate in `0..=1` per token, when the drafter has them.
    pub confidence: Option<Vec<f32>>,
}

/// Checks a whole reply against what was asked (`(session, n)` per row, in order). The outer
/// error discards the whole reply (wrong row count or order); each row is then good or bad on
/// its own, so one bad session does not cost the others their drafts.
pub(crate) fn validate_rows(
    reply: Proposed,
    asked: &[(SessionId, usize)],
    vocab_size: u32,
) -> Result<Vec<Result<Checked, String>>, String> {
    if reply.rows.len() != asked.len() {
        return Err(format!(
            "{} rows for a request of {}",
            reply.rows.len(),
            asked.len()
        ));
    }
    if let Some((row, (session, _))) = reply
        .rows
        .iter()
        .zip(asked)
        .find(|(row, (session, _))| row.session != *session)
    {
        return Err(format!("row for session {}, asked {session}", row.session));
    }
    let rows = reply.rows.into_iter().zip(asked);
    Ok(rows
        .map(|(row, &(_, n))| check_row(row, n, vocab_size))
        .collect())
}

fn check_row(row: ProposedRow, n: usize, vocab_size: u32) -> Result<Checked, String> {
    check(&row.tokens, row.q.as_deref(), n, vocab_size)?;
    if let Some(c) = &row.confidence {
        if c.len() != row.tokens.len() {
            return Err(format!(
                "{} confidences for {} tokens",
                c.len(),
                row.tokens.len()
            ));
        }
        if let Some(x) = c.iter().find(|x| !(0.0..=1.0).contains(*x)) {
            return Err(format!("confidence {x} is outside 0..=1"));
        }
    }
    Ok(Checked {
        tokens: row.tokens,
        q: row.q,
        confidence: row.confidence,
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
    use specula_protocol::wire::{Drafted, DraftedRow};

    use super::*;

    /// One row of a one-row reply, validated.
    fn validate(
        reply: Proposed,
        session: SessionId,
        n: usize,
        vocab: u32,
    ) -> Result<Checked, String> {
        let mut rows = validate_rows(reply, &[(session, n)], vocab)?;
        rows.pop().expect("one row")
    }

    fn reply(session: SessionId, tokens: Vec<u32>, q: Option<Vec<Vec<f32>>>) -> Proposed {
        Drafted {
            rows: vec![DraftedRow { session, tokens, q }],
        }
        .into()
    }

    fn confident(session: SessionId, tokens: Vec<u32>, confidence: Vec<f32>) -> ProposedRow {
        ProposedRow {
            session,
            tokens,
            q: None,
            confidence: Some(confidence),
        }
    }

    #[test]
    fn checks_each_row_of_a_batched_reply_on_its_own() {
        let reply = Proposed {
            rows: vec![
                confident(1, vec![0, 3], vec![0.9, 0.25]),
                confident(2, vec![1], vec![1.5]),
                confident(3, vec![1, 2], vec![0.5]),
                confident(4, vec![], vec![]),
            ],
        };
        let asked = [(1, 2), (2, 2), (3, 2), (4, 0)];
        let rows = validate_rows(reply.clone(), &asked, 4).unwrap();
        assert_eq!(rows[0].as_ref().unwrap().confidence, Some(vec![0.9, 0.25]));
        assert!(rows[1].as_ref().unwrap_err().contains("confidence 1.5"));
        assert!(rows[2]
            .as_ref()
            .unwrap_err()
            .contains("1 confidences for 2"));
        assert_eq!(rows[3].as_ref().unwrap().tokens, Vec::<u32>::new());
        let nan = Proposed {
            rows: vec![confident(1, vec![0], vec![f32::NAN])],
        };
        assert!(validate_rows(nan, &[(1, 1)], 4).unwrap()[0].is_err());
        let swapped = [(2, 2), (1, 2), (3, 2), (4, 0)];
        let err = validate_rows(reply.clone(), &swapped, 4).unwrap_err();
        assert!(err.contains("row for session 1, asked 2"), "{err}");
        let err = validate_rows(reply, &asked[..2], 4).unwrap_err();
        assert!(err.contains("4 rows for a request of 2"), "{err}");
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
            (Drafted { rows: vec![] }.into(), "0 rows"),
        ];
        for (bad, why) in cases {
            let err = validate(bad, 1, 2, 4).unwrap_err();
            assert!(err.contains(why), "{err:?} should mention {why:?}");
        }
    }
}
