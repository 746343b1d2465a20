//! How a simulated Pod runs its container: the executor image's entrypoint
//! (`executor/entrypoint.sh`) under `sh`, as a child process, with the fake executor binary
//! answering as `act_runner` on PATH. The Pod's environment (facade URL, assignment id, the token
//! resolved from its Secret, labels) is the container's whole environment, so the scenarios run
//! the same contract and the same script as the real image; only the runner binary differs.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use jr_fake_kube::{ExitStatus, PodRun};

use crate::process::binary;

/// Exit status reported when the entrypoint cannot be started at all (as a container runtime
/// reports a missing command).
const CANNOT_START: i32 = 127;
/// Exit status reported when the child ended by a signal.
const KILLED: i32 = 137;

/// Everything a Pod's container needs on this machine.
#[derive(Debug)]
pub struct EntrypointLauncher {
    script: PathBuf,
    /// Holds `act_runner` → the fake executor binary.
    bin_dir: PathBuf,
    /// One registration directory per Pod below it (the image's `EXECUTOR_STATE_DIR`).
    state_root: PathBuf,
    /// stdout and stderr of every container, appended.
    log: PathBuf,
    /// The fake GitHub's URL, for the GitHub runner stand-in (`run.sh`).
    github: Option<String>,
}

impl EntrypointLauncher {
    /// Sets up the runner stand-ins below `dir` (`act_runner`, and GitHub's `run.sh` talking to
    /// the fake GitHub at `github`). Needs the workspace binaries built.
    pub fn prepare(dir: &Path, github: Option<String>) -> anyhow::Result<EntrypointLauncher> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../executor/entrypoint.sh");
        if !script.is_file() {
            bail!("executor entrypoint missing at {}", script.display());
        }
        let bin_dir = dir.join("executor-bin");
        std::fs::create_dir_all(&bin_dir)?;
        for name in ["act_runner", "run.sh"] {
            let runner = bin_dir.join(name);
            if !runner.exists() {
                std::os::unix::fs::symlink(binary("fake-executor")?, &runner)
                    .with_context(|| format!("linking {}", runner.display()))?;
            }
        }
        let state_root = dir.join("executor-state");
        std::fs::create_dir_all(&state_root)?;
        Ok(EntrypointLauncher {
            script,
            bin_dir,
            state_root,
            log: dir.join("executors.log"),
            github,
        })
    }

    /// Runs one Pod's container to its end. Dropping the future (the Pod was deleted) kills the
    /// process, as the kubelet would.
    pub async fn run(&self, run: PodRun) -> ExitStatus {
        match self.spawn_and_wait(&run).await {
            Ok(Some(0)) => ExitStatus::success(),
            Ok(Some(code)) => ExitStatus::failed(code),
            Ok(None) => ExitStatus::failed(KILLED),
            Err(e) => {
                tracing::warn!(pod = %run.name, error = %e, "executor entrypoint did not start");
                ExitStatus::failed(CANNOT_START)
            }
        }
    }

    async fn spawn_and_wait(&self, run: &PodRun) -> anyhow::Result<Option<i32>> {
        let state = self.state_root.join(&run.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let path = match std::env::var("PATH") {
            Ok(system) => format!("{}:{system}", self.bin_dir.display()),
            Err(_) => format!("{}:/usr/bin:/bin", self.bin_dir.display()),
        };
        let mut command = tokio::process::Command::new("sh");
        command.env_clear();
        if let Some(github) = &self.github {
            command
                .env("EXECUTOR_ACTIONS_RUNNER", self.bin_dir.join("run.sh"))
                .env("JETRUNNER_FAKE_GITHUB_URL", github)
                .env("JETRUNNER_FAKE_JOB_MS", "200");
        }
        let status = command
            .arg(&self.script)
            .envs(&run.env)
            .env("PATH", path)
            .env("EXECUTOR_STATE_DIR", &state)
            // The stand-in's pacing; a real act_runner reads its config file instead.
            .env("JETRUNNER_FAKE_POLL_MS", "100")
            .env("JETRUNNER_FAKE_GIVE_UP_SECS", "60")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .status()
            .await?;
        // Best effort: the scenario's temporary directory goes away at the end anyway.
        let _ = std::fs::remove_dir_all(&state);
        Ok(status.code())
    }
}

/// The fake kubelet's container runner for [`EntrypointLauncher`].
pub fn pod_runner(launcher: Arc<EntrypointLauncher>) -> jr_fake_kube::PodRunner {
    Arc::new(move |run: PodRun| {
        let launcher = launcher.clone();
        Box::pin(async move { launcher.run(run).await })
    })
}

/// A GitHub job's runner as a task of this process (sandboxes, and Pods with
/// `pod_executor_in_process`): what the entrypoint does, with the executor's credentials from
/// `env` (the runner config from the facade, then the runner stand-in against `server`).
pub async fn run_github_in_process(
    env: &std::collections::BTreeMap<String, String>,
    server: &str,
    poll: std::time::Duration,
) -> anyhow::Result<()> {
    jr_fake_executor::github_runner::run_github_executor(
        env,
        server,
        poll,
        std::time::Duration::from_secs(600),
    )
    .await
    .map_err(anyhow::Error::msg)?;
    Ok(())
}
