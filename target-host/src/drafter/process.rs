//! Finding and spawning a drafter executable; a child that never outlives its owner.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use specula_protocol::transport::BOOTSTRAP_ENV;
use tracing::info;

use super::DrafterError;

/// Lines of a drafter's stderr kept for error messages.
const STDERR_TAIL: usize = 8;

/// Which drafter to run: an executable and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrafterSpec {
    /// A path, or a bare name looked up next to the running executable (`ngram`).
    pub path: PathBuf,
    /// Arguments passed to it.
    pub args: Vec<String>,
}

impl DrafterSpec {
    /// A drafter without arguments.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        DrafterSpec {
            path: path.into(),
            args: Vec::new(),
        }
    }

    /// Adds arguments.
    pub fn with_args<I: IntoIterator<Item = S>, S: Into<String>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// The executable to run: a bare name resolves next to the running executable.
    ///
    /// # Errors
    /// [`DrafterError::NotFound`] when nothing is there, [`DrafterError::NotExecutable`] when it
    /// is a folder or lacks an execute bit.
    pub fn resolve(&self) -> Result<PathBuf, DrafterError> {
        let bare = self.path.components().count() == 1 && !self.path.is_absolute();
        let path = if bare {
            let exe = std::env::current_exe().map_err(|source| DrafterError::Spawn {
                path: self.path.clone(),
                source,
            })?;
            let dir = exe.parent().unwrap_or(Path::new("."));
            dir.join(&self.path)
        } else {
            self.path.clone()
        };
        let meta =
            std::fs::metadata(&path).map_err(|_| DrafterError::NotFound { path: path.clone() })?;
        if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
            return Err(DrafterError::NotExecutable { path });
        }
        Ok(path)
    }
}

/// A running drafter process. Dropping it kills the process (SIGKILL) and reaps it: no orphans,
/// no zombies.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    path: PathBuf,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    stderr_thread: Option<JoinHandle<()>>,
}

impl ChildGuard {
    /// Spawns `path args…` with the bootstrap name in its environment. Its stderr goes to the
    /// log (and the last lines are kept for error messages).
    ///
    /// # Errors
    /// [`DrafterError::Spawn`] when the OS cannot start it.
    pub fn spawn(path: &Path, args: &[String], bootstrap: &str) -> Result<Self, DrafterError> {
        let mut child = Command::new(path)
            .args(args)
            .env(BOOTSTRAP_ENV, bootstrap)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| DrafterError::Spawn {
                path: path.to_path_buf(),
                source,
            })?;
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let stderr = child.stderr.take().expect("invariant: stderr was piped");
        let tail = stderr_tail.clone();
        let pid = child.id();
        let stderr_thread = std::thread::Builder::new()
            .name(format!("drafter-{pid}-stderr"))
            .spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    info!(pid, "drafter: {line}");
                    let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                    if tail.len() == STDERR_TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            })
            .map_err(|source| DrafterError::Spawn {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(ChildGuard {
            child,
            path: path.to_path_buf(),
            stderr_tail,
            stderr_thread: Some(stderr_thread),
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The executable.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The exit status, when it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `timeout` for the process to exit by itself.
    pub fn wait_for(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The last lines the process wrote to stderr, joined.
    pub fn stderr_tail(&mut self) -> String {
        // The reader thread may still be draining the pipe of a process that just exited.
        if self.try_wait().is_some() {
            if let Some(thread) = self.stderr_thread.take() {
                let _ = thread.join();
            }
        }
        let tail = self.stderr_tail.lock().unwrap_or_else(|e| e.into_inner());
        tail.iter().cloned().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.try_wait().is_none() {
            // Already-exited processes make kill fail harmlessly.
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        if let Some(thread) = self.stderr_thread.take() {
            let _ = thread.join();
        }
    }
}
