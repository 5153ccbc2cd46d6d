//! The engine: one worker thread that owns the target model and its KV cache and runs queued
//! requests one at a time, in arrival order.
//!
//! Requests arrive from any thread (the HTTP handlers) through [`Engine::submit`] and stream
//! their tokens back over a channel. Dropping the receiving end cancels the request at its next
//! token. The drafter is shared through a [`ProposerSlot`] so it can be swapped while a request
//! runs. Running requests one at a time keeps this first engine simple; batched decoding will
//! replace the worker loop, not this interface.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;

use specula_models::chat::ChatTemplate;
use specula_models::loader::LoadedModel;
use specula_models::tokenizer::Tokenizer;
use specula_models::Model;
use tokio::sync::mpsc as tokio_mpsc;

use crate::generation::{generate, Flow, Generation, GenerationRequest, Target, TokenLogprob};
use crate::proposer::{Proposer, ProposerSlot, SessionId};

/// What a submitted request streams back.
#[derive(Debug)]
pub enum Event {
    /// A committed token and the text it made safe to show.
    Token {
        /// Token id.
        id: u32,
        /// Text delta (may be empty).
        text: String,
        /// Log-probabilities, when asked for.
        logprob: Option<TokenLogprob>,
    },
    /// The request ended; always the last event.
    Done(Result<Generation, String>),
}

struct Job {
    req: GenerationRequest,
    events: tokio_mpsc::UnboundedSender<Event>,
}

/// A handle to the engine's worker; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    jobs: mpsc::Sender<Job>,
    slot: Arc<ProposerSlot>,
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    queued: Arc<AtomicUsize>,
    next_session: Arc<AtomicU64>,
}

impl Engine {
    /// Starts the worker thread over `loaded`, drafting with `proposer` (if any).
    pub fn start(loaded: LoadedModel, proposer: Option<Box<dyn Proposer>>) -> Engine {
        let model = Arc::new(loaded.model);
        let tokenizer = Arc::new(loaded.tokenizer);
        let slot = Arc::new(ProposerSlot::new(proposer));
        let queued = Arc::new(AtomicUsize::new(0));
        let (jobs, rx) = mpsc::channel::<Job>();
        {
            let (model, tokenizer, slot, queued) = (
                model.clone(),
                tokenizer.clone(),
                slot.clone(),
                queued.clone(),
            );
            thread::Builder::new()
                .name("engine".into())
                .spawn(move || worker(&model, &tokenizer, &slot, &queued, rx))
                .expect("invariant: the OS can spawn the engine thread");
        }
        Engine {
            jobs,
            slot,
            model,
            tokenizer,
            chat_template: loaded.chat_template.map(Arc::new),
            queued,
            next_session: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Queues `req` and returns the stream of its events. The session id of `req` is replaced
    /// by a fresh one. Dropping the receiver cancels the request.
    pub fn submit(&self, mut req: GenerationRequest) -> tokio_mpsc::UnboundedReceiver<Event> {
        req.session = self.new_session();
        let (events, rx) = tokio_mpsc::unbounded_channel();
        self.queued.fetch_add(1, Ordering::SeqCst);
        if let Err(mpsc::SendError(job)) = self.jobs.send(Job { req, events }) {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = job
                .events
                .send(Event::Done(Err("the engine has stopped".into())));
        }
        rx
    }

    /// A fresh session id.
    pub fn new_session(&self) -> SessionId {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// The drafter slot, for hot-swapping and inspection.
    pub fn slot(&self) -> &Arc<ProposerSlot> {
        &self.slot
    }

    /// The target model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The target's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The target's chat template, when it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_deref()
    }

    /// Requests waiting or running.
    pub fn queue_depth(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }
}

fn worker(
    model: &Model,
    tokenizer: &Tokenizer,
    slot: &ProposerSlot,
    queued: &AtomicUsize,
    jobs: mpsc::Receiver<Job>,
) {
    let target = Target { model, tokenizer };
    let mut cache = model.new_cache();
    for job in jobs {
        if !job.events.is_closed() {
            let events = &job.events;
            let mut sink = |ev: crate::generation::TokenEvent<'_>| {
                let sent = events.send(Event::Token {
                    id: ev.id,
                    text: ev.text.to_string(),
                    logprob: ev.logprob,
                });
                if sent.is_ok() {
                    Flow::Continue
                } else {
                    Flow::Cancel
                }
            };
            let result = generate(&target, &mut cache, slot, &job.req, &mut sink)
                .map_err(|e| format!("{e:#}"));
            if let Err(e) = &result {
                tracing::warn!(session = job.req.session, "generation failed: {e}");
            }
            // The request leaves the queue before its client hears it is done.
            queued.fetch_sub(1, Ordering::SeqCst);
            let _ = job.events.send(Event::Done(result));
        } else {
            queued.fetch_sub(1, Ordering::SeqCst);
        }
    }
}
