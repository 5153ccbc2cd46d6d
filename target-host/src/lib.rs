//! Specula's target host: owns the target model, its KV cache, the speculative verify loop and
//! the OpenAI-compatible HTTP API. Drafters live in other processes and are reached through
//! [`drafter`]; the engine only ever sees them as a [`proposer::Proposer`].
//!
//! | module | job |
//! |---|---|
//! | [`models`] | resolve `--model` (path, fetchable name, or random weights) and load it |
//! | [`bench`] | `target-host bench`: bandwidth, decode, verify-window curve, loop overhead |
//! | [`generation`] | a request and its result; [`generation::generate`]: a batch of one |
//! | [`verify`] | greedy acceptance and lossless rejection sampling |
//! | [`engine`] | continuous batching: scheduler, step, verify, speculation controller |
//! | [`drafter`] | drafter processes: spawn, handshake, supervision; in-process drafters |
//! | [`drafter_args`] | the `--drafter` command-line options |
//! | [`http`] | the OpenAI-compatible server and the admin API |
//! | [`tools`] | tool calling: the request's tools, and calls parsed back from the reply |

pub mod bench;
pub mod drafter;
pub mod drafter_args;
pub mod engine;
pub mod generation;
pub mod grammar;
pub mod http;
pub mod models;
pub mod proposer;
pub mod text;
pub mod tools;
pub mod verify;
