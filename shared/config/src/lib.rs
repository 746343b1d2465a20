//! One TOML file configures all four services (docs/configuration.md). Environment variables
//! `JETRUNNER__<SECTION>__<KEY>` override keys (levels separated by `__`). Unknown keys are
//! refused with an error naming the key; cross-key rules are checked by [`Config::validate`].

mod check;
mod forges;
mod model;
mod secret;
mod validate;

use std::path::Path;

pub use model::*;
pub use secret::{check_secret_file, read_secret_file, secret_mode_problem};
pub use validate::POD_RUNNER_BLOCK_KEYS;

/// Prefix of environment overrides, e.g. `JETRUNNER__NATS__URL=nats://nats:4222`.
pub const ENV_PREFIX: &str = "JETRUNNER__";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {message}")]
    Read { path: String, message: String },
    #[error("{path}: not valid TOML: {message}")]
    Parse { path: String, message: String },
    #[error("config key `{key}`: {message}")]
    Key { key: String, message: String },
    #[error("environment override {var}: {message}")]
    Env { var: String, message: String },
    #[error(
        "config key `{key}`: secret file {path} {problem} (mode {mode:04o}); make it readable by its owner only: chmod 600 {path}"
    )]
    SecretFileMode {
        key: String,
        path: String,
        problem: &'static str,
        mode: u32,
    },
}

impl ConfigError {
    pub fn kind(&self) -> &'static str {
        match self {
            ConfigError::Read { .. } => "read",
            ConfigError::Parse { .. } => "parse",
            ConfigError::Key { .. } => "key",
            ConfigError::Env { .. } => "env",
            ConfigError::SecretFileMode { .. } => "secret-file-mode",
        }
    }

    pub(crate) fn key(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Key {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// Reads, overrides from the process environment, parses and validates the file.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    let config = load_str(&text, &path.display().to_string(), std::env::vars())?;
    config.check_secret_files()?;
    Ok(config)
}

/// Like [`load`] with the file text and environment given (tests).
pub fn load_str(
    text: &str,
    origin: &str,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Config, ConfigError> {
    let (config, origins, overrides) = parse_str(text, origin, env)?;
    config
        .validate()
        .map_err(|e| overrides.name_variable(origins.respell(e)))?;
    Ok(config)
}

/// Every problem of the file at `path` at once, for `--check-config`: what [`load`] refuses
/// (a file that does not parse stops there), every URL that does not parse as its key
/// expects, and every file it names that is missing, not a file, unreadable or, for a secret,
/// readable by others.
pub fn check(path: &Path) -> Result<Config, Vec<ConfigError>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        vec![ConfigError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        }]
    })?;
    let (config, origins, overrides) =
        parse_str(&text, &path.display().to_string(), std::env::vars()).map_err(|e| vec![e])?;
    let spell = |e| overrides.name_variable(origins.respell(e));
    let mut problems: Vec<ConfigError> = Vec::new();
    if let Err(e) = config.validate() {
        problems.push(spell(e));
    }
    for e in config.url_problems().into_iter().map(spell) {
        if !problems.iter().any(|p| p.to_string() == e.to_string()) {
            problems.push(e);
        }
    }
    problems.extend(config.file_problems().into_iter().map(spell));
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(problems)
    }
}

/// Parses and deserializes the file with its environment overrides, not validated yet.
fn parse_str(
    text: &str,
    origin: &str,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(Config, forges::Origins, Overrides), ConfigError> {
    let mut table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: origin.to_owned(),
        message: e.to_string(),
    })?;
    let overrides = apply_env(&mut table, env)?;
    let origins = forges::normalize(&mut table)?;
    let mut config: Config =
        serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
            let key = e.path().to_string();
            let error = origins.respell(ConfigError::key(
                if key == "." { "<root>".to_owned() } else { key },
                e.inner().to_string(),
            ));
            overrides.name_variable(error)
        })?;
    for (entry, origin) in config.github.iter_mut().zip(&origins.github) {
        entry.origin.clone_from(origin);
    }
    Ok((config, origins, overrides))
}

/// The environment overrides applied, by the config key each set.
#[derive(Debug, Default)]
struct Overrides(Vec<(String, String)>);

impl Overrides {
    /// An error about a key an environment variable set names that variable too.
    fn name_variable(&self, error: ConfigError) -> ConfigError {
        match error {
            ConfigError::Key { key, message } => match self.0.iter().find(|(k, _)| *k == key) {
                Some((_, var)) => ConfigError::Env {
                    var: var.clone(),
                    message: format!("sets config key `{key}`: {message}"),
                },
                None => ConfigError::Key { key, message },
            },
            other => other,
        }
    }
}

fn apply_env(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Overrides, ConfigError> {
    let mut applied = Overrides::default();
    let mut overrides: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect();
    overrides.sort();
    for (var, raw) in overrides {
        let path: Vec<String> = var[ENV_PREFIX.len()..]
            .split("__")
            .map(|p| p.to_ascii_lowercase())
            .collect();
        if path.iter().any(String::is_empty) {
            return Err(ConfigError::Env {
                var,
                message: "empty key segment".into(),
            });
        }
        let value = parse_scalar(&raw);
        let (last, parents) = path.split_last().ok_or_else(|| ConfigError::Env {
            var: var.clone(),
            message: "no key".into(),
        })?;
        let mut cursor = &mut *table;
        for segment in parents {
            let entry = cursor
                .entry(segment.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            cursor = entry.as_table_mut().ok_or_else(|| ConfigError::Env {
                var: var.clone(),
                message: format!("`{segment}` is not a table"),
            })?;
        }
        cursor.insert(last.clone(), value);
        applied.0.push((path.join("."), var));
    }
    Ok(applied)
}

/// An override is read as a TOML value when it is one (`5`, `true`, `["a"]`), else as a string.
fn parse_scalar(raw: &str) -> toml::Value {
    let probe = format!("v = {raw}");
    match toml::from_str::<toml::Table>(&probe) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_owned())),
        Err(_) => toml::Value::String(raw.to_owned()),
    }
}

/// Reads a secret given inline or as a file path (files win; trailing newline trimmed). A file
/// other users can read is refused ([`check_secret_file`]).
pub fn read_secret(
    key: &str,
    inline: &Option<String>,
    file: &Option<std::path::PathBuf>,
) -> Result<Option<String>, ConfigError> {
    if let Some(path) = file {
        let text = read_secret_file(&format!("{key}_file"), path)?;
        return Ok(Some(text.trim_end_matches(['\n', '\r']).to_owned()));
    }
    Ok(inline.clone())
}

/// The config sections of the four services, as named in `[<section>.nats]`.
pub const SERVICE_SECTIONS: [&str; 4] = ["scheduler", "pod_worker", "vm_worker", "reconciler"];

impl Config {
    /// The `[<section>.nats]` table of one service (`scheduler`, `pod_worker`, `vm_worker`,
    /// `reconciler`), if configured.
    pub fn service_nats(&self, section: &str) -> Option<&NatsAuthConfig> {
        match section {
            "scheduler" => self.scheduler.nats.as_ref(),
            "pod_worker" => self.pod_worker.nats.as_ref(),
            "vm_worker" => self.vm_worker.nats.as_ref(),
            "reconciler" => self.reconciler.nats.as_ref(),
            _ => None,
        }
    }

    /// How the service of config section `section` authenticates to NATS: its own
    /// `[<section>.nats]` user, else `nats.credentials_file`, else no credentials. Reads the
    /// password or seed file (refusing files others can read).
    pub fn nats_auth(&self, section: &str) -> Result<Option<NatsAuth>, ConfigError> {
        let Some(auth) = self.service_nats(section) else {
            return Ok(self
                .nats
                .credentials_file
                .clone()
                .map(NatsAuth::CredentialsFile));
        };
        if let Some(path) = &auth.credentials_file {
            return Ok(Some(NatsAuth::CredentialsFile(path.clone())));
        }
        if let Some(path) = &auth.nkey_seed_file {
            let key = format!("{section}.nats.nkey_seed_file");
            let seed = read_secret_file(&key, path)?;
            return Ok(Some(NatsAuth::NKeySeed(seed.trim().to_owned())));
        }
        let key = format!("{section}.nats.password");
        match (
            &auth.user,
            read_secret(&key, &auth.password, &auth.password_file)?,
        ) {
            (Some(user), Some(password)) => Ok(Some(NatsAuth::UserPassword {
                user: user.clone(),
                password,
            })),
            // `validate` refuses a table without a complete method.
            _ => Err(ConfigError::key(
                format!("{section}.nats"),
                "give credentials_file, nkey_seed_file, or user with password (or password_file)",
            )),
        }
    }

    /// Refuses every configured secret file that exists and that other users can read. Files
    /// that do not exist here are left to the service that reads them (each service mounts only
    /// its own secrets).
    pub fn check_secret_files(&self) -> Result<(), ConfigError> {
        let files = [
            ("nats.credentials_file", &self.nats.credentials_file),
            (
                "forge.registration_token_file",
                &self.forge.registration_token_file,
            ),
            ("forge.runner_token_file", &self.forge.runner_token_file),
            ("facade.tls_key_file", &self.facade.tls_key_file),
            ("scheduler.seal_keys_file", &self.scheduler.seal_keys_file),
            ("pod_worker.token_key_file", &self.pod_worker.token_key_file),
            ("vm_worker.token_key_file", &self.vm_worker.token_key_file),
        ];
        for (key, path) in files {
            if let Some(path) = path {
                check_secret_file(key, path)?;
            }
        }
        for section in SERVICE_SECTIONS {
            if let Some(auth) = self.service_nats(section) {
                for (key, path) in [
                    ("credentials_file", &auth.credentials_file),
                    ("password_file", &auth.password_file),
                    ("nkey_seed_file", &auth.nkey_seed_file),
                ] {
                    if let Some(path) = path {
                        check_secret_file(&format!("{section}.nats.{key}"), path)?;
                    }
                }
            }
        }
        for (name, backend) in &self.backend {
            if let Some(path) = backend
                .opensandbox
                .as_ref()
                .and_then(|o| o.api_key_file.as_ref())
            {
                check_secret_file(&format!("backend.{name}.opensandbox.api_key_file"), path)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
