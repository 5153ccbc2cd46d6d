//! Specula's target host: owns the target model, its KV cache, the speculative verify loop and
//! the OpenAI-compatible HTTP API. Drafters live in other processes and are reached through
//! [`drafter`]; the verify loop only ever sees them as a [`proposer::Proposer`].

pub mod drafter;
pub mod proposer;
