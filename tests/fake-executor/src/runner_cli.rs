//! The fake as a runner command line: invoked under the name `act_runner` or `forgejo-runner`
//! (a symlink or copy), it accepts the one-shot invocations the executor entrypoint uses and reads
//! the registration file the way the real runner does, so tests exercise the entrypoint exactly as
//! the executor image runs it.
//!
//! Stricter than the real runners on purpose: the registration file must hold exactly the
//! documented fields with the documented JSON types and full-form labels (`name:scheme[:arg]`),
//! where the real runners ignore unknown fields and default missing ones. Everything here is pure;
//! `main.rs` does the IO.

use serde_json::{Map, Value};

use crate::ExecutorError;

/// Which runner the fake stands in for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// Gitea's act_runner: `act_runner [-c FILE] daemon --once`, `.runner` with `ephemeral`.
    ActRunner,
    /// forgejo-runner: `forgejo-runner [-c FILE] one-job`, `.runner` without `ephemeral`; one
    /// FetchTask only (no task → exit with an error).
    ForgejoRunner,
}

impl Flavour {
    /// The flavour named by the program name (`argv[0]`'s file name), if any.
    pub fn from_program(program: &str) -> Option<Flavour> {
        let name = program.rsplit('/').next().unwrap_or(program);
        match name {
            "act_runner" => Some(Flavour::ActRunner),
            "forgejo-runner" => Some(Flavour::ForgejoRunner),
            _ => None,
        }
    }

    pub fn program(self) -> &'static str {
        match self {
            Flavour::ActRunner => "act_runner",
            Flavour::ForgejoRunner => "forgejo-runner",
        }
    }

    /// The fields of the registration file, in the order the runner writes them.
    pub fn registration_fields(self) -> &'static [&'static str] {
        match self {
            Flavour::ActRunner => &[
                "WARNING",
                "id",
                "uuid",
                "name",
                "token",
                "address",
                "labels",
                "ephemeral",
            ],
            Flavour::ForgejoRunner => &[
                "WARNING", "id", "uuid", "name", "token", "address", "labels",
            ],
        }
    }
}

/// What the command line asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// `-c FILE` / `--config FILE` (a persistent flag: before or after the subcommand).
    pub config_file: Option<String>,
    /// act_runner's `--once`; always true for forgejo-runner's `one-job`.
    pub once: bool,
}

fn cli_error(flavour: Flavour, message: impl std::fmt::Display) -> ExecutorError {
    ExecutorError::Config(format!("{}: {message}", flavour.program()))
}

/// Parses the arguments after the program name. Only the one-shot subcommands are supported;
/// unknown flags and extra arguments are refused as the real CLI (cobra) refuses them.
pub fn parse_args(flavour: Flavour, args: &[String]) -> Result<Invocation, ExecutorError> {
    let mut config_file = None;
    let mut subcommand: Option<&str> = None;
    let mut once = false;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "-c" | "--config" => {
                let Some(value) = iter.next() else {
                    return Err(cli_error(flavour, format!("flag needs an argument: {arg}")));
                };
                config_file = Some(value.clone());
            }
            a if a.starts_with("--config=") => {
                config_file = Some(a["--config=".len()..].to_owned());
            }
            "--once" if flavour == Flavour::ActRunner && subcommand == Some("daemon") => {
                once = true;
            }
            "daemon" if flavour == Flavour::ActRunner && subcommand.is_none() => {
                subcommand = Some("daemon");
            }
            "one-job" if flavour == Flavour::ForgejoRunner && subcommand.is_none() => {
                subcommand = Some("one-job");
                once = true;
            }
            other if other.starts_with('-') => {
                return Err(cli_error(flavour, format!("unknown flag: {other}")));
            }
            other => {
                return Err(cli_error(
                    flavour,
                    format!(
                        "unexpected argument {other:?} (the fake supports only the one-shot mode)"
                    ),
                ));
            }
        }
    }
    if subcommand.is_none() {
        let wanted = match flavour {
            Flavour::ActRunner => "daemon --once",
            Flavour::ForgejoRunner => "one-job",
        };
        return Err(cli_error(
            flavour,
            format!("no subcommand; expected `{wanted}`"),
        ));
    }
    if config_file.as_deref() == Some("") {
        return Err(cli_error(flavour, "empty --config value"));
    }
    Ok(Invocation { config_file, once })
}

/// How a label's jobs run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelScheme {
    Host,
    /// `docker://<image>`: the image.
    Docker(String),
    /// `lxc://<template>` (forgejo-runner only).
    Lxc(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerLabel {
    pub name: String,
    pub scheme: LabelScheme,
}

/// Parses a full-form label `name:host` or `name:docker://image` (act_runner's label syntax:
/// at most three `:`-separated parts, the argument of docker/lxc starting with `//`).
pub fn parse_label(flavour: Flavour, label: &str) -> Result<RunnerLabel, String> {
    let mut parts = label.splitn(3, ':');
    let name = parts.next().unwrap_or_default();
    let scheme = parts.next();
    let arg = parts.next();
    if name.is_empty() {
        return Err(format!("label {label:?} has an empty name"));
    }
    let image = |arg: Option<&str>| -> Result<String, String> {
        match arg.and_then(|a| a.strip_prefix("//")) {
            Some(image) if !image.is_empty() => Ok(image.to_owned()),
            _ => Err(format!("label {label:?}: expected `<scheme>://<image>`")),
        }
    };
    let scheme = match (scheme, arg) {
        (None, _) => {
            return Err(format!(
                "label {label:?} is not in full form `name:scheme[:arg]`"
            ));
        }
        (Some("host"), None) => LabelScheme::Host,
        (Some("host"), Some(_)) => return Err(format!("label {label:?}: host takes no argument")),
        (Some("docker"), arg) => LabelScheme::Docker(image(arg)?),
        (Some("lxc"), arg) if flavour == Flavour::ForgejoRunner => LabelScheme::Lxc(image(arg)?),
        (Some(other), _) => return Err(format!("unsupported schema: {other}")),
    };
    Ok(RunnerLabel {
        name: name.to_owned(),
        scheme,
    })
}

/// The registration file's content, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub id: i64,
    pub uuid: String,
    pub name: String,
    pub token: String,
    pub address: String,
    pub labels: Vec<RunnerLabel>,
    /// Always false for forgejo-runner (no such field).
    pub ephemeral: bool,
}

impl Registration {
    pub fn label_names(&self) -> Vec<String> {
        self.labels.iter().map(|l| l.name.clone()).collect()
    }

    pub fn needs_docker(&self) -> bool {
        self.labels
            .iter()
            .any(|l| matches!(l.scheme, LabelScheme::Docker(_)))
    }
}

fn registration_error(message: impl std::fmt::Display) -> ExecutorError {
    ExecutorError::Registration(message.to_string())
}

fn string_field(obj: &Map<String, Value>, key: &str) -> Result<String, ExecutorError> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(registration_error(format!(
            "{key:?} must be a JSON string, found {other}"
        ))),
        None => Err(registration_error(format!("{key:?} is missing"))),
    }
}

fn non_empty(key: &str, value: String) -> Result<String, ExecutorError> {
    if value.is_empty() {
        Err(registration_error(format!("{key:?} is empty")))
    } else {
        Ok(value)
    }
}

/// Parses the registration file (`.runner`) of `flavour`: a JSON object with exactly
/// [`Flavour::registration_fields`], of the documented types.
pub fn parse_registration(flavour: Flavour, text: &str) -> Result<Registration, ExecutorError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| registration_error(format!("not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(registration_error("not a JSON object"));
    };
    let expected = flavour.registration_fields();
    for key in obj.keys() {
        if !expected.contains(&key.as_str()) {
            return Err(registration_error(format!(
                "unknown field {key:?} (a {} registration file has {expected:?})",
                flavour.program()
            )));
        }
    }
    for key in expected {
        if !obj.contains_key(*key) {
            return Err(registration_error(format!("{key:?} is missing")));
        }
    }
    string_field(&obj, "WARNING")?;
    let id = match obj.get("id") {
        Some(Value::Number(n)) if n.is_i64() => n.as_i64().unwrap_or_default(),
        other => {
            return Err(registration_error(format!(
                "\"id\" must be a JSON integer, found {other:?}"
            )));
        }
    };
    let uuid = non_empty("uuid", string_field(&obj, "uuid")?)?;
    let name = non_empty("name", string_field(&obj, "name")?)?;
    let token = non_empty("token", string_field(&obj, "token")?)?;
    let address = string_field(&obj, "address")?;
    if !(address.starts_with("http://") || address.starts_with("https://")) {
        return Err(registration_error(format!(
            "\"address\" must be an http(s) URL, found {address:?}"
        )));
    }
    let labels = match obj.get("labels") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => parse_label(flavour, s).map_err(registration_error),
                other => Err(registration_error(format!(
                    "\"labels\" must hold strings, found {other}"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => {
            return Err(registration_error(format!(
                "\"labels\" must be a JSON array, found {other:?}"
            )));
        }
    };
    let ephemeral = match (flavour, obj.get("ephemeral")) {
        (Flavour::ForgejoRunner, _) => false,
        (Flavour::ActRunner, Some(Value::Bool(b))) => *b,
        (Flavour::ActRunner, other) => {
            return Err(registration_error(format!(
                "\"ephemeral\" must be a JSON boolean, found {other:?}"
            )));
        }
    };
    Ok(Registration {
        id,
        uuid,
        name,
        token,
        address,
        labels,
        ephemeral,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    const ACT: &str = r#"{
  "WARNING": "w",
  "id": 0,
  "uuid": "0191d5a0-0000-7000-8000-000000000001",
  "name": "jetrunner-x",
  "token": "t0k",
  "address": "http://facade:8080",
  "labels": ["pod:host", "big:docker://node:20"],
  "ephemeral": true
}"#;

    #[test]
    fn program_names_select_the_flavour() {
        assert_eq!(
            Flavour::from_program("/usr/local/bin/act_runner"),
            Some(Flavour::ActRunner)
        );
        assert_eq!(
            Flavour::from_program("forgejo-runner"),
            Some(Flavour::ForgejoRunner)
        );
        assert_eq!(Flavour::from_program("fake-executor"), None);
    }

    #[test]
    fn act_runner_accepts_daemon_once_with_a_config_anywhere() {
        let inv = parse_args(Flavour::ActRunner, &args(&["daemon", "--once"])).expect("valid");
        assert_eq!(
            inv,
            Invocation {
                config_file: None,
                once: true
            }
        );
        let inv = parse_args(
            Flavour::ActRunner,
            &args(&["-c", "/etc/r.yaml", "daemon", "--once"]),
        )
        .expect("valid");
        assert_eq!(inv.config_file.as_deref(), Some("/etc/r.yaml"));
        let inv = parse_args(Flavour::ActRunner, &args(&["daemon", "--config=/x"])).expect("valid");
        assert!(!inv.once, "--once was not given");
    }

    #[test]
    fn act_runner_refuses_what_the_real_cli_refuses() {
        for bad in [
            &[][..],
            &["one-job"][..],
            &["--once", "daemon"][..],
            &["daemon", "--onse"][..],
            &["daemon", "extra"][..],
            &["daemon", "-c"][..],
            &["register", "--ephemeral"][..],
        ] {
            assert!(
                parse_args(Flavour::ActRunner, &args(bad)).is_err(),
                "{bad:?} must be refused"
            );
        }
    }

    #[test]
    fn forgejo_runner_accepts_only_one_job() {
        let inv = parse_args(Flavour::ForgejoRunner, &args(&["one-job"])).expect("valid");
        assert!(inv.once);
        for bad in [
            &["daemon", "--once"][..],
            &["one-job", "--once"][..],
            &[][..],
        ] {
            assert!(
                parse_args(Flavour::ForgejoRunner, &args(bad)).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn act_runner_registration_parses_with_full_form_labels() {
        let reg = parse_registration(Flavour::ActRunner, ACT).expect("valid");
        assert_eq!(reg.uuid, "0191d5a0-0000-7000-8000-000000000001");
        assert_eq!(reg.token, "t0k");
        assert!(reg.ephemeral);
        assert_eq!(reg.label_names(), vec!["pod", "big"]);
        assert_eq!(reg.labels[1].scheme, LabelScheme::Docker("node:20".into()));
        assert!(reg.needs_docker());
    }

    #[test]
    fn forgejo_registration_has_no_ephemeral_field() {
        let err = parse_registration(Flavour::ForgejoRunner, ACT).expect_err("ephemeral");
        assert!(err.to_string().contains("ephemeral"), "{err}");
        let forgejo = ACT.replace(",\n  \"ephemeral\": true", "");
        let reg = parse_registration(Flavour::ForgejoRunner, &forgejo).expect("valid");
        assert!(!reg.ephemeral);
        assert!(parse_registration(Flavour::ActRunner, &forgejo).is_err());
    }

    #[test]
    fn wrong_types_missing_and_unknown_fields_are_refused() {
        let swaps = [
            ("\"id\": 0", "\"id\": \"0\""),
            ("\"id\": 0", "\"id\": 1.5"),
            ("\"ephemeral\": true", "\"ephemeral\": \"true\""),
            ("\"token\": \"t0k\"", "\"token\": \"\""),
            ("\"token\": \"t0k\"", "\"Token\": \"t0k\""),
            (
                "\"address\": \"http://facade:8080\"",
                "\"address\": \"facade:8080\"",
            ),
            (
                "\"labels\": [\"pod:host\", \"big:docker://node:20\"]",
                "\"labels\": \"pod:host\"",
            ),
            ("\"pod:host\"", "\"pod\""),
            ("\"pod:host\"", "\"pod:vm\""),
            ("\"pod:host\"", "\"pod:lxc://debian\""),
            ("\"pod:host\"", "\"pod:docker://\""),
            ("\"pod:host\"", "7"),
            ("\"WARNING\": \"w\"", "\"WARNING\": null"),
        ];
        for (from, to) in swaps {
            let text = ACT.replace(from, to);
            assert_ne!(text, ACT, "swap {from} did not apply");
            assert!(
                parse_registration(Flavour::ActRunner, &text).is_err(),
                "{to} must be refused"
            );
        }
    }

    #[test]
    fn lxc_labels_are_forgejo_only() {
        assert!(parse_label(Flavour::ForgejoRunner, "a:lxc://debian:bookworm").is_ok());
        assert!(parse_label(Flavour::ActRunner, "a:lxc://debian:bookworm").is_err());
        assert!(parse_label(Flavour::ActRunner, "a:host:extra").is_err());
        assert!(parse_label(Flavour::ActRunner, ":host").is_err());
    }
}
