//! The forms a config file may describe its forges in, brought to one before deserializing:
//!
//! - `[[forge]]` entries, each with `kind = "gitea" | "forgejo" | "github"` (the current form);
//! - the older `[forge]` table (a Gitea or Forgejo forge, `flavor` naming which) and `[[github]]`
//!   entries, which stay accepted as they are.
//!
//! A Gitea/Forgejo entry becomes the `[forge]` table (its kind is its `flavor`), a GitHub entry
//! joins the `[[github]]` entries. Each remembers where it was written, so every error names the
//! key as the file spells it (`forge[2].pat`, not the key it was moved to).

use crate::{Config, ConfigError, ForgeConfig, GitHubConfig, RegistrationLayout};

/// Where each forge came from in the file.
#[derive(Clone, Debug, Default)]
pub(crate) struct Origins {
    /// The Gitea/Forgejo forge: `forge` (the table) or `forge[<i>]`.
    pub gitea: Option<String>,
    /// Per `[[github]]` entry after normalising: `github[<j>]` or `forge[<i>]`.
    pub github: Vec<String>,
}

impl Origins {
    /// `key` as the file spells it: `forge.url` of a `[[forge]]` entry is `forge[<i>].url`,
    /// `github[<j>].pat` of one is `forge[<i>].pat`.
    pub(crate) fn spell(&self, key: &str) -> String {
        if let Some(rest) = key.strip_prefix("forge.")
            && let Some(origin) = &self.gitea
        {
            return format!("{origin}.{rest}");
        }
        if let Some(rest) = key.strip_prefix("github[")
            && let Some((index, tail)) = rest.split_once(']')
            && let Ok(j) = index.parse::<usize>()
            && let Some(origin) = self.github.get(j)
        {
            return format!("{origin}{tail}");
        }
        key.to_owned()
    }

    pub(crate) fn respell(&self, error: ConfigError) -> ConfigError {
        match error {
            ConfigError::Key { key, message } => ConfigError::Key {
                key: self.spell(&key),
                message,
            },
            ConfigError::SecretFileMode {
                key,
                path,
                problem,
                mode,
            } => ConfigError::SecretFileMode {
                key: self.spell(&key),
                path,
                problem,
                mode,
            },
            other => other,
        }
    }
}

const KINDS: &str = "one of \"gitea\", \"forgejo\", \"github\"";

/// Keys only a GitHub entry has: an entry without `kind` that has one is a GitHub one.
const GITHUB_KEYS: [&str; 7] = [
    "backend",
    "scale_set",
    "runner_group",
    "pat",
    "pat_file",
    "app_id",
    "api_url",
];

/// Rewrites `[[forge]]` entries into the `[forge]` table and `[[github]]` entries.
pub(crate) fn normalize(table: &mut toml::Table) -> Result<Origins, ConfigError> {
    let mut origins = Origins::default();
    let github_before = match table.get("github") {
        None => 0,
        Some(toml::Value::Array(entries)) => entries.len(),
        // Not an array: deserializing says so with the key.
        Some(_) => return Ok(origins),
    };
    origins.github = (0..github_before).map(|j| format!("github[{j}]")).collect();
    let entries = match table.remove("forge") {
        None => return Ok(origins),
        Some(toml::Value::Table(mut forge)) => {
            // The table form may name its kind too (the flavor under its newer name).
            if let Some(kind) = forge.remove("kind") {
                let flavor = gitea_flavor("forge.kind", &kind)?;
                set_flavor(&mut forge, "forge", flavor)?;
            }
            table.insert("forge".to_owned(), toml::Value::Table(forge));
            origins.gitea = Some("forge".to_owned());
            return Ok(origins);
        }
        Some(toml::Value::Array(entries)) => entries,
        Some(other) => {
            return Err(ConfigError::key(
                "forge",
                format!(
                    "expected [[forge]] entries (or a [forge] table), found a {}",
                    other.type_str()
                ),
            ));
        }
    };
    let mut github = Vec::new();
    for (i, entry) in entries.into_iter().enumerate() {
        let origin = format!("forge[{i}]");
        let toml::Value::Table(mut entry) = entry else {
            return Err(ConfigError::key(origin, "expected a table"));
        };
        // Without a kind, an entry with a scale set's keys is a GitHub one; any other is a
        // Gitea/Forgejo forge (whose `flavor`, default gitea, says which).
        let kind = match entry.remove("kind") {
            Some(kind) => kind,
            None if GITHUB_KEYS.iter().any(|k| entry.contains_key(*k)) => {
                toml::Value::String("github".to_owned())
            }
            None => toml::Value::String(
                entry
                    .get("flavor")
                    .and_then(toml::Value::as_str)
                    .unwrap_or("gitea")
                    .to_owned(),
            ),
        };
        match kind.as_str() {
            Some("github") => {
                origins.github.push(origin);
                github.push(toml::Value::Table(entry));
            }
            _ => {
                let flavor = gitea_flavor(&format!("{origin}.kind"), &kind)?;
                if let Some(first) = &origins.gitea {
                    return Err(ConfigError::key(
                        origin,
                        format!(
                            "a second Gitea/Forgejo forge ({first} is one): a scheduler serves one \
                             Gitea or Forgejo forge (any number of GitHub entries beside it); run \
                             another jetrunner deployment for another"
                        ),
                    ));
                }
                set_flavor(&mut entry, &origin, flavor)?;
                table.insert("forge".to_owned(), toml::Value::Table(entry));
                origins.gitea = Some(origin);
            }
        }
    }
    if !github.is_empty() {
        // `github` is absent or an array (checked above).
        if let Some(toml::Value::Array(entries)) = table.get_mut("github") {
            entries.extend(github);
        } else {
            table.insert("github".to_owned(), toml::Value::Array(github));
        }
    }
    Ok(origins)
}

fn gitea_flavor(key: &str, kind: &toml::Value) -> Result<&'static str, ConfigError> {
    match kind.as_str() {
        Some("gitea") => Ok("gitea"),
        Some("forgejo") => Ok("forgejo"),
        Some("github") => Err(ConfigError::key(
            key,
            "a GitHub forge is a [[forge]] entry of its own (or a [[github]] entry), not the [forge] table",
        )),
        Some(other) => Err(ConfigError::key(key, format!("{other:?}: {KINDS}"))),
        None => Err(ConfigError::key(key, format!("expected a string, {KINDS}"))),
    }
}

/// Sets a Gitea/Forgejo entry's `flavor` from its kind; a `flavor` that says otherwise is an
/// error.
fn set_flavor(entry: &mut toml::Table, origin: &str, flavor: &str) -> Result<(), ConfigError> {
    match entry.get("flavor").map(toml::Value::as_str) {
        None => {
            entry.insert("flavor".to_owned(), toml::Value::String(flavor.to_owned()));
            Ok(())
        }
        Some(Some(given)) if given == flavor => Ok(()),
        Some(_) => Err(ConfigError::key(
            format!("{origin}.flavor"),
            format!("contradicts kind = {flavor:?}; give only kind"),
        )),
    }
}

impl GitHubConfig {
    /// Key `key` of this entry as the file spells it (`github[0].pat`, `forge[2].pat`).
    pub fn key(&self, key: &str) -> String {
        if self.origin.is_empty() {
            format!("github.{key}")
        } else {
            format!("{}.{key}", self.origin)
        }
    }
}

impl Config {
    /// Every intake of the scheduler, as keyed in `JR_INTAKES`: its forge registrations, then
    /// `github.<name>` for each `[[github]]` entry.
    pub fn intake_names(&self) -> Vec<String> {
        let mut names = self.registration_names();
        names.extend(self.github.iter().map(|g| format!("github.{}", g.name)));
        names
    }

    /// The Gitea/Forgejo forge, when `[forge]` is configured.
    pub fn gitea(&self) -> Option<&ForgeConfig> {
        (!self.forge.url.is_empty()).then_some(&self.forge)
    }

    /// The names of the scheduler's forge registrations: `shared`, or each enabled backend's
    /// (the keys of their leases and of their records in `JR_INTAKES`); none without `[forge]`.
    pub fn registration_names(&self) -> Vec<String> {
        if self.gitea().is_none() {
            return Vec::new();
        }
        match self.forge.layout() {
            RegistrationLayout::Shared => vec!["shared".to_owned()],
            RegistrationLayout::PerBackend => self
                .enabled_backends()
                .map(|(n, _)| n.to_string())
                .collect(),
        }
    }
}
