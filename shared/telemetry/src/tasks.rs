//! Named background tasks: traced, tied to shutdown, aborted on drop, drained with a deadline.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use tokio::task::{Id, JoinSet};
use tracing::Instrument;

use crate::shutdown::Shutdown;

/// What a task's output says about how it ended.
pub trait TaskExit: Send + 'static {
    /// `Some(reason)` when the task failed.
    fn failure(self) -> Option<String>;
}

impl TaskExit for () {
    fn failure(self) -> Option<String> {
        None
    }
}

impl<E: std::fmt::Display + Send + 'static> TaskExit for Result<(), E> {
    fn failure(self) -> Option<String> {
        self.err().map(|e| e.to_string())
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    format!("panicked: {text}")
}

/// How a set of tasks ended at [`TaskSet::join_all`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JoinReport {
    pub finished: Vec<String>,
    /// `(task, reason)` for tasks that returned an error or panicked.
    pub failed: Vec<(String, String)>,
    /// Tasks still running at the deadline; they were aborted.
    pub unfinished: Vec<String>,
}

impl JoinReport {
    pub fn is_clean(&self) -> bool {
        self.failed.is_empty() && self.unfinished.is_empty()
    }
}

/// A set of named tasks sharing one [`Shutdown`]. A task that fails or panics triggers the
/// shutdown (the service stops instead of limping on); every task is expected to watch the
/// shutdown itself and return. Dropping the set aborts whatever still runs.
pub struct TaskSet {
    shutdown: Shutdown,
    set: JoinSet<Option<String>>,
    names: HashMap<Id, String>,
}

impl TaskSet {
    pub fn new(shutdown: Shutdown) -> Self {
        Self {
            shutdown,
            set: JoinSet::new(),
            names: HashMap::new(),
        }
    }

    pub fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }

    /// Spawns `task` inside a span named `task` (field `task.name`).
    pub fn spawn<F>(&mut self, name: impl Into<String>, task: F)
    where
        F: Future + Send + 'static,
        F::Output: TaskExit,
    {
        let name = name.into();
        let span = tracing::info_span!("task", task.name = %name);
        let shutdown = self.shutdown.clone();
        let task_name = name.clone();
        let run = async move {
            // A panic is a failure like any other: it must stop the service, not vanish.
            let failure = match AssertUnwindSafe(task).catch_unwind().await {
                Ok(output) => output.failure(),
                Err(panic) => Some(panic_message(panic.as_ref())),
            };
            match &failure {
                Some(reason) => {
                    tracing::error!(task = %task_name, %reason, "task failed; shutting down");
                    shutdown.trigger();
                }
                None => tracing::debug!(task = %task_name, "task finished"),
            }
            failure
        };
        let handle = self.set.spawn(run.instrument(span));
        self.names.insert(handle.id(), name);
    }

    pub fn len(&self) -> usize {
        self.set.len()
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Waits until every task has ended, for at most `timeout`; aborts the rest. Call after
    /// triggering shutdown.
    pub async fn join_all(mut self, timeout: Duration) -> JoinReport {
        let mut report = JoinReport::default();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let next = tokio::time::timeout_at(deadline, self.set.join_next_with_id()).await;
            match next {
                Ok(None) => break,
                Ok(Some(Ok((id, failure)))) => {
                    let name = self.names.remove(&id).unwrap_or_default();
                    match failure {
                        Some(reason) => report.failed.push((name, reason)),
                        None => report.finished.push(name),
                    }
                }
                Ok(Some(Err(error))) => {
                    let name = self.names.remove(&error.id()).unwrap_or_default();
                    let reason = if error.is_panic() {
                        "panicked"
                    } else {
                        "cancelled"
                    };
                    tracing::error!(task = %name, reason, "task did not return");
                    self.shutdown.trigger();
                    report.failed.push((name, reason.to_owned()));
                }
                Err(_elapsed) => {
                    let mut unfinished: Vec<String> = self.names.drain().map(|(_, n)| n).collect();
                    unfinished.sort();
                    tracing::warn!(tasks = ?unfinished, "tasks did not finish in time; aborting");
                    self.set.abort_all();
                    report.unfinished = unfinished;
                    break;
                }
            }
        }
        report
    }
}
