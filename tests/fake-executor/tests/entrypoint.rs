//! The executor image's entrypoint (`executor/entrypoint.sh`) run with `sh`, exactly as the image
//! runs it, with this crate's binary answering as `act_runner` / `forgejo-runner` on PATH. The
//! stand-in checks the registration file against the runner's format (see `runner_cli`) and
//! records what it saw; these tests check the arguments, the file, the refusals and that the
//! token never reaches stdout/stderr. No Docker and no real runner needed.

#[allow(
    dead_code,
    reason = "the stand-in facade is shared with one_shot.rs, which uses more of it"
)]
mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use jr_fake_executor::runner_cli::{Flavour, LabelScheme, parse_registration};
use jr_forge::proto::runner::v1::Result as TaskResult;
use serde_json::Value;

const ASSIGNMENT: &str = "0191d5a0-0000-7000-8000-00000000002a";
const TOKEN: &str = "9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0";
const FACADE: &str = "https://facade.jetrunner.svc:8080";
const CONTRACT: [&str; 4] = [
    "JETRUNNER_FACADE_URL",
    "JETRUNNER_ASSIGNMENT_ID",
    "JETRUNNER_RUNNER_TOKEN",
    "JETRUNNER_LABELS",
];
/// The entrypoint's status for an unusable environment.
const EX_CONFIG: i32 = 78;

fn entrypoint() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../executor/entrypoint.sh")
}

/// A container's file system in miniature: PATH with the stand-in runners, a state directory.
struct Container {
    dir: tempfile::TempDir,
}

impl Container {
    fn new() -> Container {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).expect("bin dir");
        for name in ["act_runner", "forgejo-runner"] {
            std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_fake-executor"), bin.join(name))
                .expect("symlink");
        }
        Container { dir }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn record_path(&self) -> PathBuf {
        self.dir.path().join("record.json")
    }

    /// The worker's variables plus the image's, with the stand-in told to stop after its checks.
    fn env(&self) -> Vec<(String, String)> {
        let path = format!("{}:/usr/bin:/bin", self.dir.path().join("bin").display());
        [
            ("PATH", path.as_str()),
            ("JETRUNNER_FACADE_URL", FACADE),
            ("JETRUNNER_ASSIGNMENT_ID", ASSIGNMENT),
            ("JETRUNNER_RUNNER_TOKEN", TOKEN),
            ("JETRUNNER_LABELS", "pod,self-hosted"),
            ("EXECUTOR_STATE_DIR", &self.state().display().to_string()),
            (
                "JETRUNNER_FAKE_RECORD",
                &self.record_path().display().to_string(),
            ),
            ("JETRUNNER_FAKE_EXIT_AFTER_CHECKS", "0"),
            ("RUST_LOG", "info"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    fn run(&self, env: &[(String, String)]) -> Run {
        let child = Command::new("sh")
            .arg(entrypoint())
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let pid = child.id();
        let out = child.wait_with_output().expect("wait");
        let run = Run {
            pid,
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            record: std::fs::read_to_string(self.record_path())
                .ok()
                .map(|t| serde_json::from_str(&t).expect("record is JSON")),
        };
        // Whatever happened, the token is never printed.
        assert!(
            !run.stdout.contains(TOKEN) && !run.stderr.contains(TOKEN),
            "the token reached stdout/stderr:\n{}\n{}",
            run.stdout,
            run.stderr
        );
        run
    }
}

struct Run {
    pid: u32,
    code: Option<i32>,
    stdout: String,
    stderr: String,
    /// What the stand-in runner saw, when it got that far.
    record: Option<Value>,
}

impl Run {
    fn record(&self) -> &Value {
        self.record
            .as_ref()
            .unwrap_or_else(|| panic!("the runner did not start:\n{}", self.stderr))
    }

    fn registration(&self) -> Value {
        let text = self.record()["registration"].as_str().expect("text");
        serde_json::from_str(text).expect("registration is JSON")
    }
}

fn set(env: &mut Vec<(String, String)>, key: &str, value: &str) {
    env.retain(|(k, _)| k != key);
    env.push((key.to_owned(), value.to_owned()));
}

fn keys(value: &Value) -> Vec<String> {
    value.as_object().expect("object").keys().cloned().collect()
}

#[test]
fn act_runner_is_execed_with_daemon_once_and_a_registration_file_in_its_format() {
    let c = Container::new();
    let run = c.run(&c.env());
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let seen = run.record();
    assert_eq!(seen["program"], "act_runner");
    assert_eq!(seen["args"], serde_json::json!(["daemon", "--once"]));
    assert_eq!(
        seen["pid"],
        serde_json::json!(run.pid),
        "the runner replaces the shell (exec), so signals and the exit status are its own"
    );
    let cwd = std::fs::canonicalize(seen["cwd"].as_str().expect("cwd")).expect("cwd exists");
    assert_eq!(cwd, std::fs::canonicalize(c.state()).expect("state"));
    assert_eq!(seen["registration_mode"], 0o600);
    assert_eq!(seen["token_in_env"], false);

    let file = run.registration();
    let mut fields = keys(&file);
    fields.sort();
    let mut wanted: Vec<String> = Flavour::ActRunner
        .registration_fields()
        .iter()
        .map(|s| s.to_string())
        .collect();
    wanted.sort();
    assert_eq!(fields, wanted);
    assert!(file["WARNING"].is_string());
    assert!(file["id"].is_i64());
    assert_eq!(file["uuid"], ASSIGNMENT);
    assert_eq!(file["token"], TOKEN);
    assert_eq!(file["address"], FACADE);
    assert_eq!(file["name"], format!("jetrunner-{ASSIGNMENT}"));
    assert_eq!(
        file["labels"],
        serde_json::json!(["pod:host", "self-hosted:host"])
    );
    assert_eq!(file["ephemeral"], true);
    // act_runner writes it with two-space indentation; the entrypoint does the same.
    let text = seen["registration"].as_str().expect("text");
    assert!(text.starts_with("{\n  \"WARNING\": "), "{text}");
    let on_disk = std::fs::metadata(c.state().join(".runner")).expect(".runner exists");
    assert_eq!(on_disk.permissions().mode() & 0o777, 0o600);
}

#[test]
fn forgejo_runner_gets_one_job_and_a_file_without_ephemeral() {
    let c = Container::new();
    let mut env = c.env();
    set(&mut env, "EXECUTOR_RUNNER", "forgejo-runner");
    set(&mut env, "EXECUTOR_LABEL_SCHEME", "lxc://debian:bookworm");
    let run = c.run(&env);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.record()["program"], "forgejo-runner");
    assert_eq!(run.record()["args"], serde_json::json!(["one-job"]));
    let file = run.registration();
    assert!(
        file.get("ephemeral").is_none(),
        "forgejo-runner has no ephemeral field"
    );
    let reg = parse_registration(
        Flavour::ForgejoRunner,
        run.record()["registration"].as_str().expect("text"),
    )
    .expect("forgejo-runner format");
    assert_eq!(reg.label_names(), vec!["pod", "self-hosted"]);
    assert_eq!(
        reg.labels[0].scheme,
        LabelScheme::Lxc("debian:bookworm".into())
    );
}

#[test]
fn each_missing_or_empty_contract_variable_is_refused_by_name_before_anything_runs() {
    for name in CONTRACT {
        for empty in [false, true] {
            let c = Container::new();
            let mut env = c.env();
            env.retain(|(k, _)| k != name);
            if empty {
                env.push((name.to_owned(), String::new()));
            }
            let run = c.run(&env);
            assert_eq!(run.code, Some(EX_CONFIG), "{name} (empty: {empty})");
            assert!(
                run.stderr.contains("missing required environment variable")
                    && run.stderr.contains(name),
                "the message names {name}: {}",
                run.stderr
            );
            assert!(run.record.is_none(), "no runner may start without {name}");
            assert!(
                !c.state().join(".runner").exists(),
                "no registration file without {name}"
            );
        }
    }
}

#[test]
fn all_missing_variables_are_named_in_one_message() {
    let c = Container::new();
    let mut env = c.env();
    env.retain(|(k, _)| !CONTRACT.contains(&k.as_str()));
    let run = c.run(&env);
    assert_eq!(run.code, Some(EX_CONFIG));
    for name in CONTRACT {
        assert!(run.stderr.contains(name), "{name}: {}", run.stderr);
    }
}

#[test]
fn malformed_values_are_refused_with_a_clear_message_and_no_token() {
    let cases: [(&str, String, &str); 9] = [
        (
            "JETRUNNER_FACADE_URL",
            "facade:8080".into(),
            "http:// or https://",
        ),
        (
            "JETRUNNER_FACADE_URL",
            "http://a\"b".into(),
            "JETRUNNER_FACADE_URL",
        ),
        ("JETRUNNER_ASSIGNMENT_ID", "not-a-uuid".into(), "UUID"),
        ("JETRUNNER_ASSIGNMENT_ID", "0191d5a0".into(), "UUID"),
        // A bad token is reported without its value (the run helper checks it is not printed).
        (
            "JETRUNNER_RUNNER_TOKEN",
            format!("{TOKEN}\"x"),
            "value not shown",
        ),
        ("JETRUNNER_LABELS", "pod:docker".into(), "colon"),
        ("JETRUNNER_LABELS", "pod,,vm".into(), "empty label"),
        (
            "EXECUTOR_LABEL_SCHEME",
            "lxc://debian".into(),
            "not supported by act_runner",
        ),
        ("EXECUTOR_RUNNER", "gitlab-runner".into(), "EXECUTOR_RUNNER"),
    ];
    for (key, value, message) in cases {
        let c = Container::new();
        let mut env = c.env();
        set(&mut env, key, &value);
        let run = c.run(&env);
        assert_eq!(run.code, Some(EX_CONFIG), "{key}={value:?}: {}", run.stderr);
        assert!(
            run.stderr.contains(message),
            "{key}={value:?}: expected {message:?} in {:?}",
            run.stderr
        );
        assert!(run.record.is_none(), "{key}={value:?} started the runner");
    }
}

#[test]
fn the_runner_exit_status_is_the_entrypoint_exit_status() {
    for code in [0, 1, 7] {
        let c = Container::new();
        let mut env = c.env();
        set(
            &mut env,
            "JETRUNNER_FAKE_EXIT_AFTER_CHECKS",
            &code.to_string(),
        );
        let run = c.run(&env);
        assert_eq!(run.code, Some(code), "{}", run.stderr);
    }
}

#[test]
fn docker_labels_are_written_in_full_form_and_need_a_docker_socket() {
    let c = Container::new();
    let mut env = c.env();
    set(
        &mut env,
        "EXECUTOR_LABEL_SCHEME",
        "docker://node:20-bookworm",
    );
    set(&mut env, "DOCKER_HOST", "tcp://dind:2376");
    let run = c.run(&env);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(
        run.registration()["labels"],
        serde_json::json!([
            "pod:docker://node:20-bookworm",
            "self-hosted:docker://node:20-bookworm"
        ])
    );
    if Path::new("/var/run/docker.sock").exists() {
        return; // the socket check below cannot fail on this machine
    }
    env.retain(|(k, _)| k != "DOCKER_HOST");
    let run = c.run(&env);
    assert_eq!(
        run.code,
        Some(1),
        "a docker label without a Docker engine fails"
    );
    assert!(
        run.stderr.contains("Docker Engine socket not found"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_config_file_is_passed_with_c_and_must_exist() {
    let c = Container::new();
    let config = c.dir.path().join("runner.yaml");
    std::fs::write(&config, "runner:\n  capacity: 1\n").expect("config");
    let mut env = c.env();
    set(
        &mut env,
        "EXECUTOR_CONFIG_FILE",
        &config.display().to_string(),
    );
    let run = c.run(&env);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(
        run.record()["args"],
        serde_json::json!(["-c", config.display().to_string(), "daemon", "--once"])
    );
    set(&mut env, "EXECUTOR_CONFIG_FILE", "/nonexistent/runner.yaml");
    let run = Container::new().run(&env);
    assert_eq!(run.code, Some(EX_CONFIG));
    assert!(
        run.stderr.contains("EXECUTOR_CONFIG_FILE"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_leftover_readable_registration_file_is_replaced_by_a_private_one() {
    let c = Container::new();
    std::fs::create_dir_all(c.state()).expect("state");
    let stale = c.state().join(".runner");
    std::fs::write(&stale, "{\"stale\": true}").expect("stale file");
    std::fs::set_permissions(&stale, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let run = c.run(&c.env());
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.record()["registration_mode"], 0o600);
    assert_eq!(run.registration()["uuid"], ASSIGNMENT);
}

#[test]
fn an_unwritable_state_directory_is_refused() {
    let c = Container::new();
    let blocker = c.dir.path().join("file");
    std::fs::write(&blocker, "").expect("file");
    let mut env = c.env();
    set(
        &mut env,
        "EXECUTOR_STATE_DIR",
        &blocker.join("sub").display().to_string(),
    );
    let run = c.run(&env);
    assert_eq!(run.code, Some(EX_CONFIG), "{}", run.stderr);
    assert!(run.stderr.contains("EXECUTOR_STATE_DIR"), "{}", run.stderr);
}

/// The whole path: entrypoint → stand-in act_runner → a RunnerService, with the identity taken
/// from the file the entrypoint wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_to_its_final_result_through_the_entrypoint() {
    let (facade, url) = support::start(support::Knobs::default(), &[]).await;
    let c = Container::new();
    let mut env = c.env();
    env.retain(|(k, _)| k != "JETRUNNER_FAKE_EXIT_AFTER_CHECKS");
    set(&mut env, "JETRUNNER_FACADE_URL", &url);
    set(&mut env, "JETRUNNER_ASSIGNMENT_ID", support::UUID);
    set(&mut env, "JETRUNNER_RUNNER_TOKEN", support::TOKEN);
    set(&mut env, "JETRUNNER_FAKE_POLL_MS", "20");
    set(&mut env, "JETRUNNER_FAKE_GIVE_UP_SECS", "10");
    let run = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || {
            let run = c.run(&env);
            (run.code, run.stdout, run.stderr)
        }),
    )
    .await
    .expect("entrypoint finishes")
    .expect("join");
    assert_eq!(run.0, Some(0), "{}", run.2);
    assert!(
        !run.1.contains(support::TOKEN) && !run.2.contains(support::TOKEN),
        "token printed"
    );
    let r = facade.recorded.lock().expect("lock");
    assert_eq!(r.result, Some(TaskResult::Success));
    assert!(r.archived, "the final UpdateLog closed the log");
    assert_eq!(r.declared_labels, vec!["pod", "self-hosted"]);
}

/// forgejo-runner's `one-job` asks once; the stand-in does the same, so a facade that has no task
/// yet ends the run without a job (what the image documents for forgejo-runner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forgejo_one_job_fetches_exactly_once() {
    let knobs = support::Knobs {
        empty_fetches: 1,
        ..Default::default()
    };
    let (facade, url) = support::start(knobs, &[]).await;
    let c = Container::new();
    let mut env = c.env();
    env.retain(|(k, _)| k != "JETRUNNER_FAKE_EXIT_AFTER_CHECKS");
    set(&mut env, "EXECUTOR_RUNNER", "forgejo-runner");
    set(&mut env, "JETRUNNER_FACADE_URL", &url);
    set(&mut env, "JETRUNNER_ASSIGNMENT_ID", support::UUID);
    set(&mut env, "JETRUNNER_RUNNER_TOKEN", support::TOKEN);
    set(&mut env, "JETRUNNER_FAKE_POLL_MS", "20");
    let code = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || c.run(&env).code),
    )
    .await
    .expect("entrypoint finishes")
    .expect("join");
    assert_ne!(code, Some(0), "no task, no success");
    let r = facade.recorded.lock().expect("lock");
    assert_eq!(r.declares, 1);
    assert_eq!(r.fetches, 1, "one-job fetches once");
    assert!(r.result.is_none());
}

#[test]
fn github_mode_needs_no_labels_but_a_runner_and_refuses_what_it_cannot_use() {
    let c = Container::new();
    let github = |extra: &[(&str, &str)], drop: &[&str]| -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = c
            .env()
            .into_iter()
            .filter(|(k, _)| k != "JETRUNNER_LABELS" && !drop.contains(&k.as_str()))
            .collect();
        env.push(("JETRUNNER_FORGE".into(), "github".into()));
        env.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        env
    };
    // No runner where EXECUTOR_ACTIONS_RUNNER points: refused before any call to the facade.
    let missing = c.dir.path().join("nowhere/run.sh");
    let run = c.run(&github(
        &[("EXECUTOR_ACTIONS_RUNNER", &missing.display().to_string())],
        &[],
    ));
    assert_eq!(run.code, Some(EX_CONFIG), "{}", run.stderr);
    assert!(
        run.stderr.contains("EXECUTOR_ACTIONS_RUNNER"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("JETRUNNER_LABELS"), "{}", run.stderr);
    // The executor's credentials are still required.
    let run = c.run(&github(&[], &["JETRUNNER_RUNNER_TOKEN"]));
    assert_eq!(run.code, Some(EX_CONFIG), "{}", run.stderr);
    assert!(
        run.stderr.contains("JETRUNNER_RUNNER_TOKEN"),
        "{}",
        run.stderr
    );
    // An unknown forge kind is refused.
    let mut env = c.env();
    env.push(("JETRUNNER_FORGE".into(), "gitlab".into()));
    let run = c.run(&env);
    assert_eq!(run.code, Some(EX_CONFIG), "{}", run.stderr);
    assert!(run.stderr.contains("JETRUNNER_FORGE"), "{}", run.stderr);
}
