//! `fake-executor`: what demo workloads run instead of act_runner. Reads the executor contract's
//! environment (docs/architecture.md, "Executor contract"), runs one task, exits 0 when a final
//! result was reported, 1 on an error, 2 when no task arrived, 3 when it abandoned its task on
//! purpose.
//!
//! Optional knobs: `JETRUNNER_FAKE_POLL_MS` (default 1000), `JETRUNNER_FAKE_GIVE_UP_SECS`
//! (default 120), `JETRUNNER_FAKE_MISBEHAVIOUR` (`wrong-task-id`, `crash-after-claim`,
//! `no-final-log`).

use std::process::ExitCode;
use std::time::Duration;

use jr_fake_executor::{ExecutorConfig, ExecutorError, ExecutorReport, Misbehaviour, run_one_shot};

fn required(name: &str) -> Result<String, ExecutorError> {
    std::env::var(name).map_err(|_| ExecutorError::Config(format!("{name} is not set")))
}

fn number(name: &str, default: u64) -> Result<u64, ExecutorError> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|e| ExecutorError::Config(format!("{name}={v:?}: {e}"))),
    }
}

fn config_from_env() -> Result<ExecutorConfig, ExecutorError> {
    let mut cfg = ExecutorConfig::new(
        required("JETRUNNER_FACADE_URL")?,
        required("JETRUNNER_ASSIGNMENT_ID")?,
        required("JETRUNNER_RUNNER_TOKEN")?,
    );
    cfg.poll_interval = Duration::from_millis(number("JETRUNNER_FAKE_POLL_MS", 1000)?);
    cfg.give_up_after = Duration::from_secs(number("JETRUNNER_FAKE_GIVE_UP_SECS", 120)?);
    cfg.misbehaviour = match std::env::var("JETRUNNER_FAKE_MISBEHAVIOUR").ok().as_deref() {
        None | Some("") => None,
        Some("wrong-task-id") => Some(Misbehaviour::WrongTaskId),
        Some("crash-after-claim") => Some(Misbehaviour::CrashAfterClaim),
        Some("no-final-log") => Some(Misbehaviour::NoFinalLog),
        Some(other) => {
            return Err(ExecutorError::Config(format!(
                "JETRUNNER_FAKE_MISBEHAVIOUR={other:?}"
            )));
        }
    };
    Ok(cfg)
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let outcome = match config_from_env() {
        Ok(cfg) => run_one_shot(cfg).await,
        Err(err) => Err(err),
    };
    match outcome {
        Ok(ExecutorReport::Finished(report)) => {
            tracing::info!(
                task_id = report.task_id,
                result = report.final_result.as_str_name(),
                forge_result = report.forge_result.as_str_name(),
                rows = report.rows_sent,
                cancelled = report.cancelled,
                "task reported"
            );
            ExitCode::SUCCESS
        }
        Ok(ExecutorReport::NoTask) => {
            tracing::warn!("no task arrived");
            ExitCode::from(2)
        }
        Ok(ExecutorReport::Abandoned { task_id }) => {
            tracing::warn!(task_id, "abandoned the task on purpose");
            ExitCode::from(3)
        }
        Err(err) => {
            tracing::error!(error = %err, kind = err.kind(), "executor failed");
            ExitCode::from(1)
        }
    }
}
