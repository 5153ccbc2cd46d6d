//! Suite files: which models, configurations and workloads one benchmark run covers.
//!
//! A suite is a list of groups. A group is one target model, the workload tags it runs, and the
//! configurations compared on it; within a group every configuration sees the same items and
//! the runs alternate (`A B C A B C ...`, see [`schedule`]) so machine drift hits all alike.
//!
//! ```text
//! { "name": "quick", "workload": "../workloads/default.jsonl", "warmup": 1, "repeats": 2,
//!   "groups": [ { "name": "SmolLM2-135M", "model": "smollm2-135m", "tags": ["code-edit"],
//!     "configs": [ {"name": "plain", "engine": "specula"},
//!                  {"name": "ngram k4", "engine": "specula", "drafter": "ngram", "k": 4} ] } ] }
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// Who generates: Specula itself or a peer implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// `target_host::generation::generate` in a `specula-bench worker` process.
    Specula,
    /// llama.cpp through `llama-cpp-python` (plain, prompt lookup), or its `llama-speculative`
    /// binary (draft model).
    LlamaCpp,
    /// `mlx-lm` on the CPU, on the dequantized HF directory.
    MlxLm,
    /// Hugging Face transformers `generate`, on the dequantized HF directory.
    Transformers,
}

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Drafter {
    /// No speculation: plain decoding.
    #[default]
    None,
    /// Specula's n-gram (prompt-lookup) drafter.
    Ngram,
    /// Specula's two-model drafter (needs `draft_model`).
    TwoModel,
    /// Specula's DFlash drafter (`dflash --kind=dflash`, the weights shipped for the target).
    Dflash,
    /// Specula's DSpark drafter (`dflash --kind=dspark`).
    Dspark,
    /// Specula's MTP drafter (the `mtp` binary: the target's multi-token-prediction head).
    Mtp,
    /// Specula's assistant drafter (the `assistant` binary: attends over the target's K/V).
    Assistant,
    /// A peer's prompt-lookup decoding.
    PromptLookup,
    /// A peer's draft-model speculation (needs `draft_model`).
    DraftModel,
}

/// Where a Specula drafter runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Its own process, over IPC (the product).
    #[default]
    Process,
    /// Inside the host, through `target_host::drafter::InProcess` (isolates the IPC cost).
    InProcess,
}

/// One configuration of a group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Unique within the group; shown in tables.
    pub name: String,
    /// Who generates.
    pub engine: Engine,
    /// Where drafts come from.
    #[serde(default)]
    pub drafter: Drafter,
    /// Where a Specula drafter runs.
    #[serde(default)]
    pub placement: Placement,
    /// Drafts per round (with `controller`: the most per round).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k: Option<usize>,
    /// The engine's speculation controller chooses each round's k, 0 included, up to `k`
    /// (`Speculation::Adaptive`, what `target-host serve` runs by default); otherwise every
    /// round drafts `k`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub controller: bool,
    /// The draft model (a `scripts/fetch-model` name or a path) for draft-model drafters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_model: Option<String>,
    /// Extra arguments for a Specula drafter process (`--confidence-threshold=0.3`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drafter_args: Vec<String>,
    /// Overrides every item's temperature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// The configuration whose speed this one's speed-up is measured against (default: the
    /// first plain configuration of the same engine, see [`Group::baseline_of`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// This configuration's own generation budget, seconds (default: the suite's
    /// `config_budget_s`): for a peer known to be slow that should still finish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_s: Option<f64>,
}

impl Config {
    /// Whether drafts are asked for.
    pub fn speculates(&self) -> bool {
        self.drafter != Drafter::None
    }

    /// The line series this configuration belongs to in the speed-up chart: everything but `k`.
    pub fn family(&self) -> String {
        let engine = match self.engine {
            Engine::Specula => "specula",
            Engine::LlamaCpp => "llama.cpp",
            Engine::MlxLm => "mlx-lm",
            Engine::Transformers => "transformers",
        };
        let drafter = match self.drafter {
            Drafter::None => "plain",
            Drafter::Ngram => "ngram",
            Drafter::TwoModel => "two-model",
            Drafter::Dflash => "dflash",
            Drafter::Dspark => "dspark",
            Drafter::Mtp => "mtp",
            Drafter::Assistant => "assistant",
            Drafter::PromptLookup => "prompt lookup",
            Drafter::DraftModel => "draft model",
        };
        let place = match (self.engine, self.drafter, self.placement) {
            (Engine::Specula, Drafter::None, _) => "",
            (Engine::Specula, _, Placement::Process) => " (process)",
            (Engine::Specula, _, Placement::InProcess) => " (in-process)",
            _ => "",
        };
        let controller = if self.controller { " controller" } else { "" };
        format!("{engine} {drafter}{place}{controller}")
    }

    fn validate(&self) -> Result<()> {
        use {Drafter as D, Engine as E};
        let ok = matches!(
            (self.engine, self.drafter),
            (_, D::None)
                | (
                    E::Specula,
                    D::Ngram | D::TwoModel | D::Dflash | D::Dspark | D::Mtp | D::Assistant
                )
                | (
                    E::LlamaCpp | E::Transformers,
                    D::PromptLookup | D::DraftModel
                )
                | (E::MlxLm, D::DraftModel)
        );
        if !ok {
            bail!("engine {:?} has no drafter {:?}", self.engine, self.drafter);
        }
        if self.placement == Placement::InProcess && self.drafter != D::Ngram {
            bail!("only the ngram drafter runs in process");
        }
        if !self.drafter_args.is_empty()
            && (self.engine != E::Specula || self.placement != Placement::Process)
        {
            bail!("\"drafter_args\" are for a Specula drafter process");
        }
        let needs_model = matches!(self.drafter, D::TwoModel | D::DraftModel);
        if needs_model != self.draft_model.is_some() {
            bail!(
                "\"draft_model\" is {} for drafter {:?}",
                if needs_model { "required" } else { "not used" },
                self.drafter
            );
        }
        match (self.speculates(), self.k) {
            (true, None) => bail!("a drafter needs \"k\""),
            (true, Some(0)) => bail!("\"k\" must be at least 1"),
            (false, Some(_)) => bail!("\"k\" without a drafter"),
            _ => {}
        }
        if self.controller && (self.engine != E::Specula || !self.speculates()) {
            bail!("\"controller\" is for a Specula configuration with a drafter");
        }
        if let Some(b) = self.budget_s {
            if !(b > 0.0 && b.is_finite()) {
                bail!("\"budget_s\" must be a positive number of seconds");
            }
        }
        if let Some(t) = self.temperature {
            if !(t >= 0.0 && t.is_finite()) {
                bail!("\"temperature\" must be finite and >= 0");
            }
        }
        Ok(())
    }
}

/// One target model and the configurations compared on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    /// Shown in tables and charts.
    pub name: String,
    /// The target model: a `scripts/fetch-model` name or a GGUF path.
    pub model: String,
    /// Workload tags to run (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
    /// Overrides every item's `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Keeps only the first this many items of each tag (slow models run fewer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_tag: Option<usize>,
    /// The configurations; the first is the default baseline.
    pub configs: Vec<Config>,
}

impl Group {
    /// The baseline of `config` (an index into `configs`): its `baseline` when named, else the
    /// first plain configuration of its engine, else the group's first configuration.
    pub fn baseline_of(&self, config: &Config) -> usize {
        let named = config
            .baseline
            .as_ref()
            .and_then(|b| self.configs.iter().position(|c| &c.name == b));
        let own_plain = || {
            self.configs
                .iter()
                .position(|c| c.engine == config.engine && !c.speculates())
        };
        named.or_else(own_plain).unwrap_or(0)
    }
}

/// A benchmark run's description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Suite {
    /// The suite's name.
    pub name: String,
    /// The workload file, relative to the suite file.
    pub workload: PathBuf,
    /// Unrecorded generations per configuration before the measured ones (page-in, caches).
    pub warmup: usize,
    /// Measured passes.
    pub repeats: usize,
    /// Seconds of generation a configuration may take in one group; past it, its remaining
    /// generations are dropped (visibly), so one slow peer cannot blow the run's time budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_budget_s: Option<f64>,
    /// The groups, run one after another.
    pub groups: Vec<Group>,
}

impl Suite {
    /// Reads and checks a suite file; resolves `workload` against the suite's folder.
    ///
    /// # Errors
    /// An unreadable or malformed file, or a suite [`Suite::validate`] rejects.
    pub fn load(path: &Path) -> Result<Suite> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading suite {}", path.display()))?;
        let mut suite: Suite = serde_json::from_str(&text)
            .with_context(|| format!("parsing suite {}", path.display()))?;
        suite
            .validate()
            .with_context(|| format!("suite {}", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        suite.workload = dir.join(&suite.workload);
        Ok(suite)
    }

    /// Checks names, baselines and every configuration.
    ///
    /// # Errors
    /// The first problem, naming the group and configuration.
    pub fn validate(&self) -> Result<()> {
        if self.repeats == 0 {
            bail!("\"repeats\" must be at least 1");
        }
        if self.groups.is_empty() {
            bail!("no groups");
        }
        let mut groups = HashSet::new();
        for g in &self.groups {
            if !groups.insert(&g.name) {
                bail!("two groups are named {:?}", g.name);
            }
            if g.configs.is_empty() {
                bail!("group {:?} has no configurations", g.name);
            }
            let mut names = HashSet::new();
            for c in &g.configs {
                if !names.insert(&c.name) {
                    bail!(
                        "group {:?}: two configurations are named {:?}",
                        g.name,
                        c.name
                    );
                }
                c.validate()
                    .with_context(|| format!("group {:?}, configuration {:?}", g.name, c.name))?;
            }
            for c in &g.configs {
                if let Some(b) = &c.baseline {
                    if !names.contains(b) {
                        bail!(
                            "group {:?}: {:?} has an unknown baseline {b:?}",
                            g.name,
                            c.name
                        );
                    }
                }
            }
        }
        Ok(())
    }
}

/// One generation in the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// The measured repetition, `None` for a warm-up generation.
    pub rep: Option<usize>,
    /// Index into the group's items.
    pub item: usize,
    /// Index into the group's configurations.
    pub config: usize,
}

/// The order of one group's generations: `warmup` unrecorded generations per configuration
/// (items in turn: they page in weights and start caches), then `repeats` passes over the items,
/// each item run by every configuration in turn, so two configurations' runs of an item are
/// never more than one generation apart.
pub fn schedule(warmup: usize, repeats: usize, items: usize, configs: usize) -> Vec<Slot> {
    let mut out = Vec::with_capacity(warmup * configs + repeats * items * configs);
    for w in 0..warmup {
        for config in 0..configs {
            out.push(Slot {
                rep: None,
                item: w % items.max(1),
                config,
            });
        }
    }
    for rep in 0..repeats {
        for item in 0..items {
            for config in 0..configs {
                out.push(Slot {
                    rep: Some(rep),
                    item,
                    config,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> Config {
        serde_json::from_str(json).unwrap()
    }

    /// Every suite shipped in bench/suites loads: a drafter added to a suite but not to the
    /// harness fails here, not in the middle of a benchmark run.
    #[test]
    fn every_shipped_suite_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("suites");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "json") {
                if let Err(e) = Suite::load(&path) {
                    panic!("{}: {e:#}", path.display());
                }
                n += 1;
            }
        }
        assert!(n >= 3, "only {n} suites under {}", dir.display());
    }

    #[test]
    fn schedule_alternates_configurations_item_by_item() {
        let s = schedule(1, 2, 2, 3);
        assert_eq!(s.len(), 3 + 2 * 2 * 3);
        assert!(s[..3].iter().all(|x| x.rep.is_none() && x.item == 0));
        assert_eq!(
            s[..3].iter().map(|x| x.config).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        let measured = &s[3..];
        let order: Vec<usize> = measured.iter().map(|x| x.config).collect();
        assert_eq!(&order[..6], &[0, 1, 2, 0, 1, 2]);
        let items: Vec<usize> = measured[..6].iter().map(|x| x.item).collect();
        assert_eq!(items, [0, 0, 0, 1, 1, 1]);
        assert_eq!(measured[0].rep, Some(0));
        assert_eq!(measured[11].rep, Some(1));
        // Every (rep, item, config) is measured exactly once.
        let set: HashSet<_> = measured.iter().map(|x| (x.rep, x.item, x.config)).collect();
        assert_eq!(set.len(), measured.len());
        // Warm-ups cycle through the items.
        assert_eq!(
            schedule(3, 0, 2, 1)
                .iter()
                .map(|x| x.item)
                .collect::<Vec<_>>(),
            [0, 1, 0]
        );
    }

    #[test]
    fn configurations_are_checked() {
        let bad = [
            (
                r#"{"name":"a","engine":"specula","drafter":"ngram"}"#,
                "needs \"k\"",
            ),
            (
                r#"{"name":"a","engine":"specula","k":2}"#,
                "without a drafter",
            ),
            (
                r#"{"name":"a","engine":"specula","drafter":"two-model","k":2}"#,
                "required",
            ),
            (
                r#"{"name":"a","engine":"mlx-lm","drafter":"prompt-lookup","k":2}"#,
                "no drafter",
            ),
            (
                r#"{"name":"a","engine":"specula","drafter":"two-model","k":2,"draft_model":"m","placement":"in-process"}"#,
                "only the ngram",
            ),
            (
                r#"{"name":"a","engine":"specula","drafter":"ngram","k":0}"#,
                "at least 1",
            ),
            (r#"{"name":"a","engine":"mlx-lm","budget_s":0}"#, "budget_s"),
            (
                r#"{"name":"a","engine":"mlx-lm","drafter":"dflash","k":2}"#,
                "no drafter",
            ),
            (
                r#"{"name":"a","engine":"llama-cpp","drafter_args":["--x"]}"#,
                "drafter process",
            ),
            (
                r#"{"name":"a","engine":"specula","drafter":"dspark","k":4,"placement":"in-process"}"#,
                "only the ngram",
            ),
            (
                r#"{"name":"a","engine":"specula","controller":true}"#,
                "\"controller\" is for",
            ),
            (
                r#"{"name":"a","engine":"llama-cpp","drafter":"prompt-lookup","k":2,"controller":true}"#,
                "\"controller\" is for",
            ),
        ];
        for (json, want) in bad {
            let err = format!("{:#}", config(json).validate().unwrap_err());
            assert!(err.contains(want), "{json}: {err}");
        }
        config(
            r#"{"name":"a","engine":"llama-cpp","drafter":"draft-model","k":2,"draft_model":"m"}"#,
        )
        .validate()
        .unwrap();
        let adaptive =
            config(r#"{"name":"a","engine":"specula","drafter":"ngram","k":4,"controller":true}"#);
        adaptive.validate().unwrap();
        assert_eq!(adaptive.family(), "specula ngram (process) controller");
    }

    #[test]
    fn suite_checks_names_and_baselines() {
        let suite = |configs: &str| -> Suite {
            serde_json::from_str(&format!(
                r#"{{"name":"s","workload":"w","warmup":0,"repeats":1,"groups":[{{"name":"g","model":"m","configs":[{configs}]}}]}}"#
            ))
            .unwrap()
        };
        let plain = r#"{"name":"p","engine":"specula"}"#;
        suite(plain).validate().unwrap();
        let dup = suite(&format!("{plain},{plain}"));
        assert!(format!("{:#}", dup.validate().unwrap_err()).contains("two configurations"));
        let unknown = suite(&format!(
            r#"{plain},{{"name":"q","engine":"llama-cpp","baseline":"nope"}}"#
        ));
        assert!(format!("{:#}", unknown.validate().unwrap_err()).contains("unknown baseline"));
        let g = &suite(&format!(
            r#"{plain},{{"name":"q","engine":"llama-cpp"}},{{"name":"r","engine":"llama-cpp","drafter":"prompt-lookup","k":4}},
               {{"name":"s","engine":"llama-cpp","drafter":"prompt-lookup","k":2,"baseline":"p"}},{{"name":"t","engine":"mlx-lm","drafter":"draft-model","k":2,"draft_model":"m"}}"#
        ))
        .groups[0];
        let base = |i: usize| g.baseline_of(&g.configs[i]);
        assert_eq!(base(0), 0, "Specula plain is its own baseline");
        assert_eq!(base(1), 1, "a peer's plain is its own baseline");
        assert_eq!(
            base(2),
            1,
            "a peer's drafter is measured against the peer's plain"
        );
        assert_eq!(base(3), 0, "a named baseline wins");
        assert_eq!(base(4), 0, "no plain of its engine: the group's first");
    }

    #[test]
    fn families_drop_k() {
        let a = config(r#"{"name":"a","engine":"specula","drafter":"ngram","k":2}"#);
        let b = config(r#"{"name":"b","engine":"specula","drafter":"ngram","k":8}"#);
        let c = config(
            r#"{"name":"c","engine":"specula","drafter":"ngram","k":8,"placement":"in-process"}"#,
        );
        assert_eq!(a.family(), b.family());
        assert_ne!(a.family(), c.family());
    }
}
