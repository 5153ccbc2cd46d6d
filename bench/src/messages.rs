//! The line protocol between the harness and its workers (`specula-bench worker` and
//! `bench/peers/run_peer.py`): JSON, one message per line.
//!
//! ```text
//! worker → harness   {"ready": {...}}   or   {"skipped": "why"}        (per configuration served)
//! harness → worker   {"item": 3, "config": 0}                          (run item 3)
//! worker → harness   {"sample": {...}}  or   {"error": "why"}
//! harness → worker   end of input
//! worker → harness   {"done": {...}}                                   (then exits)
//! ```
//!
//! A worker serves all of one engine's configurations in a group (each model loads once), and they
//! share its peak RSS; drafter processes report their own.

use serde::{Deserialize, Serialize};

/// A harness request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// The item to generate, an index into the items file.
    pub item: usize,
    /// Which of the worker's configurations runs it (peer workers serve several configurations
    /// of one engine so that they load each model once).
    #[serde(default)]
    pub config: usize,
}

/// Sent once the worker has loaded its model (and started its drafter).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Ready {
    /// What runs, with its version (`specula`, `llama-cpp-python 0.3.36`, ...).
    pub engine: String,
    /// Seconds spent loading.
    pub load_s: f64,
}

/// One generation's measurements.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Prompt length in the engine's tokens.
    pub prompt_tokens: usize,
    /// Tokens the decode time covers: all generated tokens (Specula, whose clock starts at the
    /// end of prefill) or all but the first (peers, whose clock starts at the first token).
    pub tokens: usize,
    /// Decode time, seconds.
    pub decode_s: f64,
    /// Request start to the first generated token.
    pub ttft_s: f64,
    /// Drafts offered to the target, where the engine reports it.
    #[serde(default)]
    pub drafted: Option<usize>,
    /// Drafts accepted.
    #[serde(default)]
    pub accepted: Option<usize>,
    /// Rounds that had drafts.
    #[serde(default)]
    pub rounds: Option<usize>,
    /// Target forwards after prefill.
    #[serde(default)]
    pub target_forwards: Option<usize>,
    /// Time spent waiting for drafts (drafter step latency, IPC included).
    #[serde(default)]
    pub draft_s: Option<f64>,
    /// Bytes of hidden-state taps the host wrote for the drafter during the decode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap_bytes: Option<usize>,
    /// The generated ids, to check that speculation did not change the output.
    pub token_ids: Vec<u32>,
}

/// Sent after the last item, before the worker exits.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Done {
    /// The worker's peak resident set (VmHWM), kB.
    pub peak_rss_kb: Option<u64>,
    /// The drafter process's peak resident set, kB.
    #[serde(default)]
    pub drafter_peak_rss_kb: Option<u64>,
    /// IPC round trip (Draft → Drafted) median, µs.
    #[serde(default)]
    pub rtt_p50_us: Option<f64>,
    /// IPC round trip 99th percentile, µs.
    #[serde(default)]
    pub rtt_p99_us: Option<f64>,
    /// Draft requests that missed the deadline.
    #[serde(default)]
    pub deadline_misses: Option<u64>,
    /// Per configuration served, in order: the drafter fields above (Specula workers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub per_config: Vec<Done>,
}

/// Anything a worker says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    /// Loaded.
    Ready(Ready),
    /// Cannot run here (a missing peer); the harness records the reason.
    Skipped(String),
    /// One generation.
    Sample(Sample),
    /// A generation failed.
    Error(String),
    /// Finished.
    Done(Done),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_shaped_replies_parse() {
        let r: Reply = serde_json::from_str(r#"{"skipped": "mlx_lm is not installed"}"#).unwrap();
        assert_eq!(r, Reply::Skipped("mlx_lm is not installed".into()));
        let r: Reply = serde_json::from_str(
            r#"{"sample": {"prompt_tokens": 5, "tokens": 4, "decode_s": 0.5, "ttft_s": 0.1, "token_ids": [1,2,3,4]}}"#,
        )
        .unwrap();
        let Reply::Sample(s) = r else { panic!("{r:?}") };
        assert_eq!((s.tokens, s.decode_s), (4, 0.5));
        assert_eq!(s.accepted, None);
        let r: Reply = serde_json::from_str(r#"{"done": {"peak_rss_kb": 10}}"#).unwrap();
        assert_eq!(
            r,
            Reply::Done(Done {
                peak_rss_kb: Some(10),
                ..Done::default()
            })
        );
    }
}
