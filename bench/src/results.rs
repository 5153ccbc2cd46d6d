//! The results of a run, as written to `results.json` and read back by `specula-bench render`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::messages::{Done, Ready};
use crate::stats::{summarize, ItemInfo, Record, TagSummary};
use crate::suite::{Config, Group};
use crate::sysinfo::Machine;
use crate::workload::Item;

/// A whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResults {
    /// The suite's name.
    pub suite: String,
    /// When the run started (UTC, `YYYY-MM-DDTHH:MM:SSZ`).
    pub started: String,
    /// Wall time of the whole run, seconds.
    pub wall_s: f64,
    /// Warm-up generations per configuration.
    pub warmup: usize,
    /// Measured passes per group.
    pub repeats: usize,
    /// Where it ran.
    pub machine: Machine,
    /// One entry per group.
    pub groups: Vec<GroupResults>,
}

/// One group's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GroupResults {
    /// The group as the suite described it.
    pub group: Group,
    /// The items it ran (after tag selection and overrides).
    pub items: Vec<Item>,
    /// One entry per configuration, in the group's order.
    pub configs: Vec<ConfigResults>,
}

/// One configuration's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConfigResults {
    /// The configuration.
    pub config: Config,
    /// What the worker reported on start.
    pub ready: Option<Ready>,
    /// Why it did not run, when it did not.
    pub skipped: Option<String>,
    /// Failed generations, with the item index.
    pub errors: Vec<(usize, String)>,
    /// Measured generations.
    pub records: Vec<Record>,
    /// Why the configuration stopped early, when it did (over its time budget, worker died).
    #[serde(default)]
    pub stopped: Option<String>,
    /// What the worker reported at the end (peak RSS, IPC round trips).
    pub done: Option<Done>,
    /// Per-tag summaries (filled by [`GroupResults::summarize`]).
    #[serde(default)]
    pub summary: BTreeMap<String, TagSummary>,
}

impl ConfigResults {
    /// A configuration not yet run.
    pub fn new(config: Config) -> ConfigResults {
        ConfigResults {
            config,
            ready: None,
            skipped: None,
            errors: Vec::new(),
            records: Vec::new(),
            stopped: None,
            done: None,
            summary: BTreeMap::new(),
        }
    }
}

impl GroupResults {
    /// Fills every configuration's summary from the records.
    pub fn summarize(&mut self) {
        let summaries: Vec<_> = self
            .configs
            .iter()
            .map(|c| {
                let base = &self.configs[self.group.baseline_of(&c.config)];
                let items: Vec<ItemInfo<'_>> = self
                    .items
                    .iter()
                    .map(|i| ItemInfo {
                        tag: &i.tag,
                        greedy: c.config.temperature.unwrap_or(i.temperature) == 0.0
                            && base.config.temperature.unwrap_or(i.temperature) == 0.0,
                    })
                    .collect();
                summarize(&c.records, &base.records, &self.configs[0].records, &items)
            })
            .collect();
        for (c, s) in self.configs.iter_mut().zip(summaries) {
            c.summary = s;
        }
    }

    /// The workload tags, in item order, without repeats.
    pub fn tags(&self) -> Vec<&str> {
        let mut tags: Vec<&str> = Vec::new();
        for i in &self.items {
            if !tags.contains(&i.tag.as_str()) {
                tags.push(&i.tag);
            }
        }
        tags
    }
}
