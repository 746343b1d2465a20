//! `fake-executor`: what demo and test workloads run instead of a real runner.
//!
//! Two ways to start it:
//! - as `fake-executor`: reads the executor contract's environment (`JETRUNNER_FACADE_URL`,
//!   `JETRUNNER_ASSIGNMENT_ID`, `JETRUNNER_RUNNER_TOKEN`) directly and runs one task;
//! - under the name `act_runner` or `forgejo-runner` (symlink): behaves like that runner's
//!   one-shot command (`daemon --once` / `one-job`), taking its identity only from the
//!   registration file `.runner` in the working directory, which `executor/entrypoint.sh` writes.
//!   Registration checks: see [`jr_fake_executor::runner_cli`]; in addition the file must not be
//!   readable by group or others, the runner's environment must not carry
//!   `JETRUNNER_RUNNER_TOKEN` any more, and docker labels need a Docker socket (`DOCKER_HOST` or
//!   `/var/run/docker.sock`), as the real runner requires.
//!
//! Exit status: 0 when a final result was reported, 1 on an error, 2 when no task arrived, 3 when
//! it abandoned its task on purpose.
//!
//! Optional knobs: `JETRUNNER_FAKE_POLL_MS` (default 1000), `JETRUNNER_FAKE_GIVE_UP_SECS`
//! (default 120), `JETRUNNER_FAKE_MISBEHAVIOUR` (`wrong-task-id`, `crash-after-claim`,
//! `no-final-log`). In runner mode only: `JETRUNNER_FAKE_RECORD=<path>` writes what the runner
//! saw (arguments, working directory, pid, registration file and its mode, whether the token was
//! in its environment) as JSON; `JETRUNNER_FAKE_EXIT_AFTER_CHECKS=<n>` exits with `n` after the
//! checks instead of contacting the facade.

use std::process::ExitCode;
use std::time::Duration;

use jr_fake_executor::runner_cli::{self, Flavour, Invocation, Registration};
use jr_fake_executor::{ExecutorConfig, ExecutorError, ExecutorReport, Misbehaviour, run_one_shot};

const REGISTRATION_FILE: &str = ".runner";

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

/// The `JETRUNNER_FAKE_*` knobs shared by both modes.
fn apply_knobs(mut cfg: ExecutorConfig) -> Result<ExecutorConfig, ExecutorError> {
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

fn config_from_env() -> Result<ExecutorConfig, ExecutorError> {
    apply_knobs(ExecutorConfig::new(
        required("JETRUNNER_FACADE_URL")?,
        required("JETRUNNER_ASSIGNMENT_ID")?,
        required("JETRUNNER_RUNNER_TOKEN")?,
    ))
}

/// What a run in runner mode decided before talking to the facade.
enum RunnerStart {
    Run(ExecutorConfig),
    /// `JETRUNNER_FAKE_EXIT_AFTER_CHECKS`.
    ExitAfterChecks(u8),
}

/// Runner mode: the checks the real runner makes at start, plus the contract's own, then the
/// executor config built from the registration file alone.
fn runner_start(flavour: Flavour, args: &[String]) -> Result<RunnerStart, ExecutorError> {
    let invocation = runner_cli::parse_args(flavour, args)?;
    if let Some(path) = &invocation.config_file
        && !std::path::Path::new(path).is_file()
    {
        return Err(ExecutorError::Config(format!(
            "config file {path:?} does not exist"
        )));
    }
    let text = match std::fs::read_to_string(REGISTRATION_FILE) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ExecutorError::Registration(
                "registration file not found, please register the runner first".into(),
            ));
        }
        Err(e) => return Err(ExecutorError::Registration(e.to_string())),
    };
    let mode = registration_mode()?;
    let registration = runner_cli::parse_registration(flavour, &text)?;
    let token_in_env = std::env::var_os("JETRUNNER_RUNNER_TOKEN").is_some();
    record(flavour, args, mode, &text, token_in_env)?;
    if mode & 0o077 != 0 {
        return Err(ExecutorError::Registration(format!(
            "{REGISTRATION_FILE} has mode {mode:o}; the token must not be readable by group or others"
        )));
    }
    if token_in_env {
        return Err(ExecutorError::Config(
            "JETRUNNER_RUNNER_TOKEN is still in the runner's environment; job steps would inherit it"
                .into(),
        ));
    }
    check_one_shot(flavour, &invocation, &registration)?;
    if registration.needs_docker()
        && std::env::var_os("DOCKER_HOST").is_none()
        && !std::path::Path::new("/var/run/docker.sock").exists()
    {
        return Err(ExecutorError::Config(
            "daemon Docker Engine socket not found and docker_host config was invalid".into(),
        ));
    }
    if let Ok(code) = std::env::var("JETRUNNER_FAKE_EXIT_AFTER_CHECKS") {
        let code = code.trim().parse().map_err(|e| {
            ExecutorError::Config(format!("JETRUNNER_FAKE_EXIT_AFTER_CHECKS={code:?}: {e}"))
        })?;
        return Ok(RunnerStart::ExitAfterChecks(code));
    }
    let mut cfg = apply_knobs(ExecutorConfig::new(
        registration.address.clone(),
        registration.uuid.clone(),
        registration.token.clone(),
    ))?;
    cfg.labels = registration.label_names();
    cfg.single_fetch = flavour == Flavour::ForgejoRunner;
    cfg.forgejo_reporting = flavour == Flavour::ForgejoRunner;
    Ok(RunnerStart::Run(cfg))
}

fn check_one_shot(
    flavour: Flavour,
    invocation: &Invocation,
    registration: &Registration,
) -> Result<(), ExecutorError> {
    // act_runner runs one job with `--once` or an ephemeral registration; anything else would be
    // a long-running daemon, which an executor must never be.
    if invocation.once || registration.ephemeral {
        Ok(())
    } else {
        Err(ExecutorError::Config(format!(
            "{} would run as a long-lived daemon (no --once, not ephemeral)",
            flavour.program()
        )))
    }
}

#[cfg(unix)]
fn registration_mode() -> Result<u32, ExecutorError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(REGISTRATION_FILE)
        .map(|m| m.permissions().mode() & 0o777)
        .map_err(|e| ExecutorError::Registration(e.to_string()))
}

#[cfg(not(unix))]
fn registration_mode() -> Result<u32, ExecutorError> {
    Ok(0o600)
}

/// `JETRUNNER_FAKE_RECORD`: what this runner process saw, for the entrypoint tests.
fn record(
    flavour: Flavour,
    args: &[String],
    mode: u32,
    registration: &str,
    token_in_env: bool,
) -> Result<(), ExecutorError> {
    let Some(path) = std::env::var_os("JETRUNNER_FAKE_RECORD") else {
        return Ok(());
    };
    let cwd = std::env::current_dir()
        .map(|d| d.display().to_string())
        .unwrap_or_default();
    let seen = serde_json::json!({
        "program": flavour.program(),
        "args": args,
        "cwd": cwd,
        "pid": std::process::id(),
        "registration_mode": mode,
        "registration": registration,
        "token_in_env": token_in_env,
    });
    std::fs::write(&path, seen.to_string())
        .map_err(|e| ExecutorError::Config(format!("cannot write JETRUNNER_FAKE_RECORD: {e}")))
}

/// Started as GitHub's `run.sh` (or `actions-runner`): the JIT runner stand-in.
fn is_actions_runner(program: &str) -> bool {
    let name = std::path::Path::new(program)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    matches!(name, "run.sh" | "actions-runner")
}

/// The JIT runner stand-in: the config comes from `ACTIONS_RUNNER_INPUT_JITCONFIG` (the
/// runner's environment form of `--jitconfig`, out of every process list), the fake GitHub's
/// address from `JETRUNNER_FAKE_GITHUB_URL`. Exit status: 0 when its job was reported, 1 on an
/// error, 2 when no job came.
async fn github_runner_main(args: Vec<String>) -> ExitCode {
    use jr_fake_executor::github_runner::{GitHubRunnerConfig, run_github_runner};
    let config = (|| -> Result<GitHubRunnerConfig, ExecutorError> {
        if !args.is_empty() {
            return Err(ExecutorError::Config(format!(
                "arguments {args:?}: the JIT config must come from the environment, not the command line"
            )));
        }
        if std::env::var_os("JETRUNNER_RUNNER_TOKEN").is_some() {
            return Err(ExecutorError::Config(
                "JETRUNNER_RUNNER_TOKEN is still in the runner's environment; job steps would inherit it"
                    .into(),
            ));
        }
        Ok(GitHubRunnerConfig {
            server: required("JETRUNNER_FAKE_GITHUB_URL")?,
            jit_config: required("ACTIONS_RUNNER_INPUT_JITCONFIG")?,
            poll_interval: Duration::from_millis(number("JETRUNNER_FAKE_POLL_MS", 1000)?),
            give_up_after: Duration::from_secs(number("JETRUNNER_FAKE_GIVE_UP_SECS", 120)?),
            job_time: Duration::from_millis(number("JETRUNNER_FAKE_JOB_MS", 100)?),
        })
    })();
    let config = match config {
        Ok(config) => config,
        Err(err) => {
            tracing::error!(error = %err, "actions runner stand-in cannot start");
            return ExitCode::from(1);
        }
    };
    github_exit(
        run_github_runner(config).await,
        "actions runner stand-in failed",
    )
}

/// The exit status of a GitHub runner's run: 0 when its job was reported, 2 when no job came,
/// 1 on an error (logged as `failed`).
fn github_exit(
    outcome: Result<jr_fake_executor::github_runner::GitHubRunnerReport, String>,
    failed: &str,
) -> ExitCode {
    use jr_fake_executor::github_runner::GitHubRunnerReport;
    match outcome {
        Ok(GitHubRunnerReport::Finished { request_id, result }) => {
            tracing::info!(request_id, %result, "GitHub job reported");
            ExitCode::SUCCESS
        }
        Ok(GitHubRunnerReport::NoJob) => {
            tracing::warn!("no GitHub job came");
            ExitCode::from(2)
        }
        Err(error) => {
            tracing::error!(%error, "{failed}");
            ExitCode::from(1)
        }
    }
}

/// [`jr_fake_executor::github_runner::run_github_executor`] with this process's environment;
/// the fake GitHub's address from `JETRUNNER_FAKE_GITHUB_URL` (or `FAKE_GITHUB_URL`). Exit
/// status as the stand-in's.
async fn github_executor_main() -> ExitCode {
    use jr_fake_executor::github_runner::run_github_executor;
    let env: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    let settings = (|| -> Result<(String, Duration, Duration), ExecutorError> {
        // JETRUNNER_* names are jetrunner's own in a runner block: the simulated backends of
        // `docker compose up` pass the address as FAKE_GITHUB_URL.
        Ok((
            required("JETRUNNER_FAKE_GITHUB_URL").or_else(|_| required("FAKE_GITHUB_URL"))?,
            Duration::from_millis(number("JETRUNNER_FAKE_POLL_MS", 1000)?),
            Duration::from_secs(number("JETRUNNER_FAKE_GIVE_UP_SECS", 120)?),
        ))
    })();
    let (server, poll, give_up) = match settings {
        Ok(settings) => settings,
        Err(err) => {
            tracing::error!(error = %err, "GitHub executor cannot start");
            return ExitCode::from(1);
        }
    };
    github_exit(
        run_github_executor(&env, &server, poll, give_up).await,
        "GitHub executor failed",
    )
}

fn exit_code(outcome: Result<ExecutorReport, ExecutorError>) -> ExitCode {
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

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let mut args = std::env::args();
    let program = args.next().unwrap_or_default();
    if is_actions_runner(&program) {
        return github_runner_main(args.collect()).await;
    }
    let outcome = match Flavour::from_program(&program) {
        Some(flavour) => {
            let args: Vec<String> = args.collect();
            match runner_start(flavour, &args) {
                Ok(RunnerStart::Run(cfg)) => run_one_shot(cfg).await,
                Ok(RunnerStart::ExitAfterChecks(code)) => return ExitCode::from(code),
                Err(err) => Err(err),
            }
        }
        // A Pod or sandbox of a GitHub assignment, started as the executor itself (the
        // simulated backends of `docker compose up` run this binary, not the image's
        // entrypoint): the runner config from the facade, then the runner stand-in.
        None if std::env::var("JETRUNNER_FORGE").as_deref() == Ok("github") => {
            return github_executor_main().await;
        }
        None => match config_from_env() {
            Ok(cfg) => run_one_shot(cfg).await,
            Err(err) => Err(err),
        },
    };
    exit_code(outcome)
}
