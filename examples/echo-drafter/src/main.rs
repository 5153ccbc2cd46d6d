//! An example third-party drafter, written against the SDK only: it proposes the last committed
//! token again (runs of spaces, `}` `}` `}`, table rules...). Build it, then start the target host
//! with `--drafter path/to/echo-drafter`.

use std::collections::HashMap;
use std::process::ExitCode;

use specula_protocol::sdk::{self, CommitArgs, Drafter, DrafterInfo, OpenArgs, Proposal};
use specula_protocol::wire::{Capabilities, SessionId, TargetInfo};

/// The last id of each open session.
#[derive(Default)]
struct Echo {
    last: HashMap<SessionId, u32>,
}

impl Drafter for Echo {
    fn info(&self) -> DrafterInfo {
        DrafterInfo::new(
            "echo",
            env!("CARGO_PKG_VERSION"),
            Capabilities::tokens_only(4),
        )
    }

    fn accept_target(&mut self, target: &TargetInfo) -> Result<(), String> {
        // Any tokenizer will do: we only ever repeat the target's own ids.
        match target.vocab_size {
            0 => Err("the target has an empty vocabulary".to_string()),
            _ => Ok(()),
        }
    }

    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        if let Some(&id) = args.prompt.last() {
            self.last.insert(session, id);
        }
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
        if let Some(&id) = new_tokens.last() {
            self.last.insert(session, id);
        }
        match self.last.get(&session) {
            Some(&id) => Proposal::tokens(vec![id; n]),
            None => Proposal::none(),
        }
    }

    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        if let Some(&id) = args.ids.last() {
            self.last.insert(session, id);
        }
    }

    fn close(&mut self, session: SessionId) {
        self.last.remove(&session);
    }
}

fn main() -> ExitCode {
    sdk::serve(Echo::default())
}
