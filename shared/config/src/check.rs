//! What a config needs beyond its shape, checked for real: every URL parsed (scheme and host),
//! every file it names present, a file (not a directory) and readable, and secret files private.
//! URL problems refuse the file at every start; `--check-config` lists every problem at once.

use std::path::{Path, PathBuf};

use crate::{Config, ConfigError};

/// What a URL key accepts.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// `http://` or `https://` with a host.
    Http,
    /// `nats://` or `tls://` with a host (several, comma-separated).
    Nats,
    /// `postgres://` or `postgresql://`.
    Postgres,
}

impl Kind {
    fn schemes(self) -> &'static [&'static str] {
        match self {
            Kind::Http => &["http", "https"],
            Kind::Nats => &["nats", "tls"],
            Kind::Postgres => &["postgres", "postgresql"],
        }
    }
}

/// The problem with `text` as a URL of `kind`, if any.
fn url_problem(text: &str, kind: Kind) -> Option<String> {
    let parts: Vec<&str> = match kind {
        Kind::Nats => text.split(',').map(str::trim).collect(),
        _ => vec![text.trim()],
    };
    for part in parts {
        let schemes = kind.schemes().join("://, ") + "://";
        let url = match url::Url::parse(part) {
            Ok(url) => url,
            Err(e) => return Some(format!("{part:?} is not a URL ({e}); expected {schemes}…")),
        };
        if !kind.schemes().contains(&url.scheme()) {
            return Some(format!(
                "{part:?}: scheme {:?} is not one of {schemes}",
                url.scheme()
            ));
        }
        // A Postgres URL may name its host in the query (`?host=/run/postgresql`).
        let needs_host = !matches!(kind, Kind::Postgres);
        if needs_host && url.host_str().is_none_or(str::is_empty) {
            return Some(format!("{part:?} names no host"));
        }
    }
    None
}

impl Config {
    /// Every URL of the file that does not parse as its key expects, each with its key.
    pub fn url_problems(&self) -> Vec<ConfigError> {
        let mut urls: Vec<(String, &str, Kind)> = vec![
            ("nats.url".into(), self.nats.url.as_str(), Kind::Nats),
            (
                "database.url".into(),
                self.database.url.as_str(),
                Kind::Postgres,
            ),
            (
                "facade.public_url".into(),
                self.facade.public_url.as_str(),
                Kind::Http,
            ),
        ];
        if let Some(forge) = self.gitea() {
            urls.push(("forge.url".into(), forge.url.as_str(), Kind::Http));
        }
        for g in &self.github {
            urls.push((g.key("url"), g.url.as_str(), Kind::Http));
            if let Some(api) = &g.api_url {
                urls.push((g.key("api_url"), api.as_str(), Kind::Http));
            }
        }
        for (name, b) in &self.backend {
            if let Some(o) = &b.opensandbox {
                urls.push((
                    format!("backend.{name}.opensandbox.url"),
                    o.url.as_str(),
                    Kind::Http,
                ));
            }
            if let Some(api) = b.kubernetes.as_ref().and_then(|k| k.api_url.as_ref()) {
                urls.push((
                    format!("backend.{name}.kubernetes.api_url"),
                    api,
                    Kind::Http,
                ));
            }
            for (i, p) in b.providers.iter().enumerate() {
                if let Some(url) = p.opensandbox.as_ref().and_then(|o| o.url.as_ref()) {
                    urls.push((
                        format!("backend.{name}.providers[{i}].opensandbox.url"),
                        url,
                        Kind::Http,
                    ));
                }
                if let Some(api) = p.kubernetes.as_ref().and_then(|k| k.api_url.as_ref()) {
                    urls.push((
                        format!("backend.{name}.providers[{i}].kubernetes.api_url"),
                        api,
                        Kind::Http,
                    ));
                }
            }
        }
        if let Some(otlp) = &self.telemetry.otlp_endpoint {
            urls.push(("telemetry.otlp_endpoint".into(), otlp, Kind::Http));
        }
        urls.into_iter()
            .filter_map(|(key, text, kind)| {
                url_problem(text, kind).map(|problem| ConfigError::key(key, problem))
            })
            .collect()
    }

    /// Every file the file names that is missing, not a regular file, unreadable, or (for a
    /// secret) readable by others, each with its key. The scheduler's `credentials_file`,
    /// which it writes itself, is not among them.
    pub fn file_problems(&self) -> Vec<ConfigError> {
        let mut files: Vec<(String, &Path, bool)> = Vec::new();
        named(
            &mut files,
            "nats.credentials_file".into(),
            &self.nats.credentials_file,
            true,
        );
        for section in crate::SERVICE_SECTIONS {
            if let Some(auth) = self.service_nats(section) {
                named(
                    &mut files,
                    format!("{section}.nats.credentials_file"),
                    &auth.credentials_file,
                    true,
                );
                named(
                    &mut files,
                    format!("{section}.nats.password_file"),
                    &auth.password_file,
                    true,
                );
                named(
                    &mut files,
                    format!("{section}.nats.nkey_seed_file"),
                    &auth.nkey_seed_file,
                    true,
                );
            }
        }
        if let Some(forge) = self.gitea() {
            named(
                &mut files,
                "forge.registration_token_file".into(),
                &forge.registration_token_file,
                true,
            );
            named(
                &mut files,
                "forge.runner_token_file".into(),
                &forge.runner_token_file,
                true,
            );
        }
        for g in &self.github {
            named(&mut files, g.key("pat_file"), &g.pat_file, true);
            named(
                &mut files,
                g.key("app_private_key_file"),
                &g.app_private_key_file,
                true,
            );
        }
        named(
            &mut files,
            "facade.tls_cert_file".into(),
            &self.facade.tls_cert_file,
            false,
        );
        named(
            &mut files,
            "facade.tls_key_file".into(),
            &self.facade.tls_key_file,
            true,
        );
        named(
            &mut files,
            "facade.trust_bundle_file".into(),
            &self.facade.trust_bundle_file,
            false,
        );
        named(
            &mut files,
            "scheduler.seal_keys_file".into(),
            &self.scheduler.seal_keys_file,
            true,
        );
        named(
            &mut files,
            "pod_worker.token_key_file".into(),
            &self.pod_worker.token_key_file,
            true,
        );
        named(
            &mut files,
            "vm_worker.token_key_file".into(),
            &self.vm_worker.token_key_file,
            true,
        );
        for (name, b) in &self.backend {
            named(
                &mut files,
                format!("backend.{name}.runner_token_file"),
                &b.runner_token_file,
                true,
            );
            if let Some(o) = &b.opensandbox {
                named(
                    &mut files,
                    format!("backend.{name}.opensandbox.api_key_file"),
                    &o.api_key_file,
                    true,
                );
            }
            for (i, p) in b.providers.iter().enumerate() {
                if let Some(o) = &p.opensandbox {
                    named(
                        &mut files,
                        format!("backend.{name}.providers[{i}].opensandbox.api_key_file"),
                        &o.api_key_file,
                        true,
                    );
                }
            }
        }
        files
            .into_iter()
            .filter_map(|(key, path, secret)| file_problem(&key, path, secret))
            .collect()
    }
}

/// Adds the file `path` names, if any.
fn named<'a>(
    files: &mut Vec<(String, &'a Path, bool)>,
    key: String,
    path: &'a Option<PathBuf>,
    secret: bool,
) {
    if let Some(path) = path {
        files.push((key, path.as_path(), secret));
    }
}

/// The problem with the file `path` named by `key`, if any.
fn file_problem(key: &str, path: &Path, secret: bool) -> Option<ConfigError> {
    let problem = |message: String| {
        Some(ConfigError::Read {
            path: format!("{} (from `{key}`)", path.display()),
            message,
        })
    };
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return problem("does not exist".to_owned());
        }
        Err(e) => return problem(e.to_string()),
    };
    if meta.is_dir() {
        return problem("is a directory, not a file".to_owned());
    }
    if let Err(e) = std::fs::File::open(path) {
        return problem(format!("cannot be opened: {e}"));
    }
    if secret {
        return crate::check_secret_file(key, path).err();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_for_real() {
        for (text, kind) in [
            ("http://forge:3000", Kind::Http),
            ("https://code.example/sub/path/", Kind::Http),
            ("nats://a:4222, nats://b:4222", Kind::Nats),
            ("tls://nats.example:4222", Kind::Nats),
            ("postgres://u@db/jetrunner", Kind::Postgres),
            (
                "postgresql:///jetrunner?host=/run/postgresql",
                Kind::Postgres,
            ),
        ] {
            assert_eq!(url_problem(text, kind), None, "{text}");
        }
        for (text, kind, says) in [
            ("http://", Kind::Http, "not a URL"),
            ("htp:/forge", Kind::Http, "scheme"),
            ("scheduler:8080", Kind::Http, "scheme"),
            ("forge:3000", Kind::Http, "scheme"),
            ("file:///etc/passwd", Kind::Http, "scheme"),
            ("nats://a:4222,", Kind::Nats, "not a URL"),
            ("http://nats:4222", Kind::Nats, "scheme"),
            ("mysql://db", Kind::Postgres, "scheme"),
        ] {
            let problem = url_problem(text, kind).unwrap_or_default();
            assert!(problem.contains(says), "{text}: {problem:?}");
        }
    }
}
