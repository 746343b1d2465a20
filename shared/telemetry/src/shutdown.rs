//! Shutdown: one token the whole process watches, triggered by SIGTERM/SIGINT or by a failing
//! task.

use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// A clonable shutdown switch (all clones share one state).
#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    token: CancellationToken,
}

impl Shutdown {
    pub fn new() -> Self {
        Self::default()
    }

    /// The underlying token, for APIs that take one (e.g. `jr_bus`).
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    pub fn trigger(&self) {
        self.token.cancel();
    }

    pub fn is_triggered(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves once shutdown has been triggered.
    pub fn cancelled(&self) -> WaitForCancellationFutureOwned {
        self.token.clone().cancelled_owned()
    }

    /// Triggers this shutdown on SIGTERM or SIGINT (see [`shutdown_signal`]).
    pub async fn trigger_on_signal(self) {
        tokio::select! {
            () = shutdown_signal() => self.trigger(),
            () = self.token.cancelled() => {}
        }
    }
}

impl From<CancellationToken> for Shutdown {
    fn from(token: CancellationToken) -> Self {
        Self { token }
    }
}

/// Resolves on the first SIGTERM or SIGINT. After that, a second signal ends the process at
/// once with exit code 130 (an operator pressing Ctrl-C twice means it).
pub async fn shutdown_signal() {
    let name = wait_for_signal().await;
    tracing::info!(
        signal = name,
        "shutdown requested; a second signal exits at once"
    );
    // Detached on purpose: it must outlive every task set and only ever ends the process.
    tokio::spawn(async {
        let name = wait_for_signal().await;
        tracing::warn!(signal = name, "second signal, exiting now");
        std::process::exit(130);
    });
}

#[cfg(unix)]
async fn wait_for_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        },
        _ => {
            tracing::error!("cannot install signal handlers; falling back to Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() -> &'static str {
    let _ = tokio::signal::ctrl_c().await;
    "ctrl-c"
}
