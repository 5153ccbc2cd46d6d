//! Runs a suite: starts one worker per engine in each group, feeds them the
//! alternating [`crate::suite::schedule`], and collects the samples.
//!
//! Workers' stderr goes to `OUT/logs/`, so the progress bar stays readable; a worker that cannot
//! run (a peer that is not installed) is reported as `SKIPPED` on stderr and in the results.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use target_host::models::resolve_model;

use crate::messages::{Done, Reply, Request};
use crate::results::{ConfigResults, GroupResults, RunResults};
use crate::stats::Record;
use crate::suite::{schedule, Config, Engine, Group, Suite};
use crate::sysinfo::{loadavg, Machine};
use crate::workload::{self, Item};

/// Where things are.
#[derive(Debug, Clone)]
pub struct Paths {
    /// The repository root (scripts, model cache, peers).
    pub root: PathBuf,
    /// This run's output folder.
    pub out: PathBuf,
}

impl Paths {
    fn python(&self) -> PathBuf {
        self.root.join(".venv-ref/bin/python")
    }
    fn hf_dir(&self, model: &str) -> PathBuf {
        self.root.join("models/cache/hf").join(model)
    }
}

/// A running worker process and the group's configurations it serves.
struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    configs: Vec<usize>,
    log: PathBuf,
}

impl Worker {
    fn read(&mut self) -> Result<Reply> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!(
                "worker exited ({status}); its log {} ends with:\n{}",
                self.log.display(),
                tail(&self.log)
            );
        }
        serde_json::from_str(&line).with_context(|| format!("bad worker line: {line}"))
    }

    fn ask(&mut self, req: &Request) -> Result<Reply> {
        let stdin = self.stdin.as_mut().context("worker input closed")?;
        writeln!(stdin, "{}", serde_json::to_string(req)?)?;
        stdin.flush()?;
        self.read()
    }
}

/// The last lines of a log file.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

/// The items a group runs: its tags (all when none are named), at most `per_tag` of each, with
/// its `max_tokens` override.
///
/// # Errors
/// A named tag that selects no item.
pub fn group_items(group: &Group, all: &[Item]) -> Result<Vec<Item>> {
    if let Some(tags) = &group.tags {
        for t in tags {
            if !all.iter().any(|i| &i.tag == t) {
                bail!("group {:?}: no workload item has tag {t:?}", group.name);
            }
        }
    }
    let mut per_tag: std::collections::HashMap<&str, usize> = Default::default();
    Ok(all
        .iter()
        .filter(|i| group.tags.as_ref().is_none_or(|t| t.contains(&i.tag)))
        .filter(|i| {
            let n = per_tag.entry(&i.tag).or_default();
            *n += 1;
            group.per_tag.is_none_or(|max| *n <= max)
        })
        .map(|i| Item {
            max_tokens: group.max_tokens.unwrap_or(i.max_tokens),
            ..i.clone()
        })
        .collect())
}

/// A file-name-safe form of a name.
fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// Runs `suite`, writing worker logs and items files under `paths.out`.
///
/// # Errors
/// Unreadable workloads, unresolvable models, a worker that breaks the protocol.
pub fn run(suite: &Suite, paths: &Paths) -> Result<RunResults> {
    let started = Instant::now();
    let mut machine = Machine::probe();
    let all = workload::load(&suite.workload)?;
    let plans = suite
        .groups
        .iter()
        .map(|g| group_items(g, &all))
        .collect::<Result<Vec<_>>>()?;
    let total: usize = suite
        .groups
        .iter()
        .zip(&plans)
        .map(|(g, items)| (suite.warmup + suite.repeats * items.len()) * g.configs.len())
        .sum();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} eta {eta} {msg}")
            .expect("invariant: the template is valid")
            .progress_chars("=> "),
    );
    std::fs::create_dir_all(paths.out.join("logs"))?;
    let mut groups = Vec::new();
    for (group, items) in suite.groups.iter().zip(plans) {
        bar.set_message(group.name.clone());
        note(
            &bar,
            format!(
                "{}: {} configurations x {} items x {} passes",
                group.name,
                group.configs.len(),
                items.len(),
                suite.repeats
            ),
        );
        groups.push(run_group(suite, group, items, paths, &bar)?);
    }
    bar.finish_and_clear();
    machine.loadavg_end = loadavg();
    Ok(RunResults {
        suite: suite.name.clone(),
        started: String::new(),
        wall_s: started.elapsed().as_secs_f64(),
        warmup: suite.warmup,
        repeats: suite.repeats,
        machine,
        groups,
    })
}

fn run_group(
    suite: &Suite,
    group: &Group,
    items: Vec<Item>,
    paths: &Paths,
    bar: &ProgressBar,
) -> Result<GroupResults> {
    let items_file = paths.out.join(format!("items-{}.jsonl", slug(&group.name)));
    workload::save(&items_file, &items)?;
    let mut results: Vec<ConfigResults> = group
        .configs
        .iter()
        .cloned()
        .map(ConfigResults::new)
        .collect();
    let mut workers = Vec::new();
    // Which worker (and which of its configurations) serves each configuration.
    let mut route: Vec<Option<(usize, usize)>> = vec![None; group.configs.len()];
    for members in worker_plan(&group.configs) {
        bar.set_message(format!(
            "{}: loading {}",
            group.name, group.configs[members[0]].name
        ));
        let started = start_worker(group, &members, &items_file, paths);
        let mut worker = match started {
            Ok(w) => w,
            Err(e) => {
                for &c in &members {
                    skip(bar, group, &mut results[c], format!("{e:#}"));
                }
                continue;
            }
        };
        let mut live = false;
        for (local, &c) in members.iter().enumerate() {
            match worker.read() {
                Ok(Reply::Ready(r)) => {
                    results[c].ready = Some(r);
                    route[c] = Some((workers.len(), local));
                    live = true;
                }
                Ok(Reply::Skipped(why)) => skip(bar, group, &mut results[c], why),
                Ok(other) => skip(bar, group, &mut results[c], format!("unexpected {other:?}")),
                Err(e) => skip(bar, group, &mut results[c], format!("FAILED: {e:#}")),
            }
        }
        if live {
            workers.push(worker);
        } else {
            worker.stdin.take();
            let _ = worker.child.wait();
        }
    }
    bar.set_message(group.name.clone());
    let mut spent = vec![0.0f64; group.configs.len()];
    for slot in schedule(
        suite.warmup,
        suite.repeats,
        items.len(),
        group.configs.len(),
    ) {
        bar.inc(1);
        let Some((w, local)) = route[slot.config] else {
            continue;
        };
        let r = &mut results[slot.config];
        let budget = r.config.budget_s.or(suite.config_budget_s);
        if let Some(budget) = budget.filter(|b| spent[slot.config] > *b) {
            let why = format!(
                "stopped after {:.0} s, over the {budget:.0} s budget per configuration",
                spent[slot.config]
            );
            note(
                bar,
                format!("STOPPED {} / {}: {why}", group.name, r.config.name),
            );
            r.stopped = Some(why);
            route[slot.config] = None;
            continue;
        }
        let asked = Instant::now();
        let reply = workers[w].ask(&Request {
            item: slot.item,
            config: local,
        });
        spent[slot.config] += asked.elapsed().as_secs_f64();
        match reply {
            Ok(Reply::Sample(sample)) => {
                if let Some(rep) = slot.rep {
                    r.records.push(Record {
                        rep,
                        item: slot.item,
                        sample,
                    });
                }
            }
            Ok(Reply::Error(e)) => {
                note(
                    bar,
                    format!(
                        "ERROR {} / {} item {}: {e}",
                        group.name, r.config.name, slot.item
                    ),
                );
                r.errors.push((slot.item, e));
            }
            Ok(other) => bail!("{}: unexpected reply {other:?}", r.config.name),
            Err(e) => {
                note(
                    bar,
                    format!("FAILED {} / {}: {e:#}", group.name, r.config.name),
                );
                r.stopped = Some(format!("worker failed: {e:#}"));
                route
                    .iter_mut()
                    .filter(|x| x.is_some_and(|(ww, _)| ww == w))
                    .for_each(|x| *x = None);
            }
        }
    }
    for (w, worker) in workers.iter_mut().enumerate() {
        worker.stdin.take();
        let done = match worker.read() {
            Ok(Reply::Done(d)) => Some(d),
            _ => None,
        };
        let _ = worker.child.wait();
        for (local, &c) in worker.configs.iter().enumerate() {
            if route[c].is_some_and(|(ww, _)| ww == w) {
                results[c].done = done.as_ref().map(|d| Done {
                    peak_rss_kb: d.peak_rss_kb,
                    per_config: Vec::new(),
                    ..d.per_config
                        .get(local)
                        .cloned()
                        .unwrap_or_else(|| d.clone())
                });
            }
        }
    }
    let mut out = GroupResults {
        group: group.clone(),
        items,
        configs: results,
    };
    out.summarize();
    Ok(out)
}

/// Prints a line above the progress bar, or plainly when the bar is hidden (stderr is not a
/// terminal): a SKIPPED or FAILED line must always be seen.
fn note(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

fn skip(bar: &ProgressBar, group: &Group, r: &mut ConfigResults, why: String) {
    note(
        bar,
        format!("SKIPPED {} / {}: {why}", group.name, r.config.name),
    );
    r.skipped = Some(why);
}

/// Which configurations share a worker: those of one engine (each model loads once).
pub fn worker_plan(configs: &[Config]) -> Vec<Vec<usize>> {
    let mut plan: Vec<(Engine, Vec<usize>)> = Vec::new();
    for (i, c) in configs.iter().enumerate() {
        match plan.iter_mut().find(|(e, _)| *e == c.engine) {
            Some((_, members)) => members.push(i),
            None => plan.push((c.engine, vec![i])),
        }
    }
    plan.into_iter().map(|(_, m)| m).collect()
}

fn start_worker(group: &Group, members: &[usize], items: &Path, paths: &Paths) -> Result<Worker> {
    let configs: Vec<&Config> = members.iter().map(|&i| &group.configs[i]).collect();
    let first = configs[0];
    let log =
        paths
            .out
            .join("logs")
            .join(format!("{}-{}.log", slug(&group.name), slug(&first.name)));
    let model = resolve_model(&group.model)?;
    let mut cmd = if first.engine == Engine::Specula {
        // Unresolvable draft models are left out: the worker skips their configurations.
        let drafts: serde_json::Map<String, serde_json::Value> = configs
            .iter()
            .filter_map(|c| c.draft_model.as_ref())
            .filter_map(|d| Some((d.clone(), serde_json::json!(resolve_model(d).ok()?))))
            .collect();
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("worker")
            .arg("--configs")
            .arg(serde_json::to_string(&configs)?)
            .arg("--model")
            .arg(&model)
            .arg("--drafts")
            .arg(serde_json::Value::Object(drafts).to_string())
            .arg("--items")
            .arg(items);
        cmd
    } else {
        let python = paths.python();
        if !python.exists() {
            bail!(
                "no Python venv at {} (run scripts/setup-peers)",
                python.display()
            );
        }
        let mut drafts = serde_json::Map::new();
        for d in configs.iter().filter_map(|c| c.draft_model.as_ref()) {
            let spec = serde_json::json!({
                "gguf": resolve_model(d)?,
                "hf_dir": paths.hf_dir(d),
            });
            drafts.insert(d.clone(), spec);
        }
        let mut cmd = Command::new(python);
        cmd.arg(paths.root.join("bench/peers/run_peer.py"))
            .arg("--configs")
            .arg(serde_json::to_string(&configs)?)
            .arg("--gguf")
            .arg(&model)
            .arg("--hf-dir")
            .arg(paths.hf_dir(&group.model))
            .arg("--drafts")
            .arg(serde_json::Value::Object(drafts).to_string())
            .arg("--bin-dir")
            .arg(paths.root.join(".peers/bin"))
            .arg("--items")
            .arg(items);
        cmd
    };
    let log_file = std::fs::File::create(&log)?;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log_file)
        .spawn()
        .with_context(|| format!("starting worker for {}", first.name))?;
    let stdin = child.stdin.take();
    let stdout = BufReader::new(child.stdout.take().context("worker stdout")?);
    Ok(Worker {
        child,
        stdin,
        stdout,
        configs: members.to_vec(),
        log,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configs(engines: &[&str]) -> Vec<Config> {
        engines
            .iter()
            .enumerate()
            .map(|(i, e)| {
                serde_json::from_str(&format!(r#"{{"name":"c{i}","engine":"{e}"}}"#)).unwrap()
            })
            .collect()
    }

    #[test]
    fn configurations_share_a_worker_by_engine() {
        let c = configs(&["specula", "llama-cpp", "specula", "mlx-lm", "llama-cpp"]);
        assert_eq!(worker_plan(&c), vec![vec![0, 2], vec![1, 4], vec![3]]);
    }

    #[test]
    fn group_items_selects_tags_and_overrides_max_tokens() {
        let all = workload::parse(
            "w",
            "{\"tag\":\"a\",\"prompt\":\"x\",\"max_tokens\":8}\n{\"tag\":\"b\",\"prompt\":\"y\",\"max_tokens\":8}",
        )
        .unwrap();
        let mut g: Group = serde_json::from_str(
            r#"{"name":"g","model":"m","tags":["b"],"max_tokens":4,"configs":[]}"#,
        )
        .unwrap();
        let items = group_items(&g, &all).unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!((items[0].tag.as_str(), items[0].max_tokens), ("b", 4));
        g.tags = None;
        g.per_tag = Some(1);
        let twice = [all.clone(), all.clone()].concat();
        let items = group_items(&g, &twice).unwrap();
        assert_eq!(
            items
                .iter()
                .map(|i| i.prompt.as_deref().unwrap())
                .collect::<Vec<_>>(),
            ["x", "y"]
        );
        g.tags = Some(vec!["nope".into()]);
        assert!(format!("{:#}", group_items(&g, &all).unwrap_err()).contains("\"nope\""));
    }

    #[test]
    fn committed_suites_are_valid_and_select_items() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("suites");
        for name in ["default.json", "quick.json"] {
            let suite = Suite::load(&dir.join(name)).unwrap();
            let all = workload::load(&suite.workload).unwrap();
            for g in &suite.groups {
                assert!(
                    !group_items(g, &all).unwrap().is_empty(),
                    "{name}: {}",
                    g.name
                );
            }
        }
    }
}
