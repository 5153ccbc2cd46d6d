//! End-to-end tests: real binaries, real (small) models, real drafter processes.
//!
//! Real models are fetched on first use by `scripts/fetch-model` (see `specula_tests::model_path`).

mod assistant;
mod batch;
mod chaos;
mod dflash;
mod drafters;
mod generate;
mod golden;
mod grammar;
mod law;
mod mtp;
mod server;
mod spec;
mod tokenizer;
mod tools;
mod two_model;
