//! Secret files (tokens, keys) and secret values in `Debug` output.
//!
//! A secret file must not be readable by anyone but its owner. The one exception is the layout
//! Kubernetes gives Secret volumes to a non-root container: owned by root, group = the Pod's
//! `fsGroup`, mode `0440` (or `0640`). Such a file may be group-readable, never group-writable,
//! and never accessible to others.

use std::path::Path;

use crate::ConfigError;

/// Why a secret file with permission bits `mode` owned by `owner_uid` must not be used, or
/// `None` when it may be. Pure, so every combination is testable without touching files.
pub fn secret_mode_problem(mode: u32, owner_uid: u32) -> Option<&'static str> {
    let perms = mode & 0o777;
    if perms & 0o007 != 0 {
        return Some("is accessible to other users");
    }
    if perms & 0o070 == 0 {
        return None;
    }
    // Group access: only the read-only, root-owned layout of a Kubernetes Secret volume.
    if owner_uid == 0 && perms & 0o030 == 0 {
        None
    } else {
        Some("is accessible to its group")
    }
}

/// Refuses `path` (named in config as `key`) when other users could read it. A missing file is
/// reported by whoever reads it; this only judges files that exist.
pub fn check_secret_file(key: &str, path: &Path) -> Result<(), ConfigError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let meta = match std::fs::metadata(path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(ConfigError::Read {
                    path: format!("{} (from `{key}`)", path.display()),
                    message: e.to_string(),
                });
            }
        };
        if meta.is_dir() {
            return Err(ConfigError::Read {
                path: format!("{} (from `{key}`)", path.display()),
                message: "is a directory, not a file".to_owned(),
            });
        }
        if let Some(problem) = secret_mode_problem(meta.mode(), meta.uid()) {
            return Err(ConfigError::SecretFileMode {
                key: key.to_owned(),
                path: path.display().to_string(),
                problem,
                mode: meta.mode() & 0o777,
            });
        }
    }
    #[cfg(not(unix))]
    let _ = (key, path);
    Ok(())
}

/// Reads a whole secret file after [`check_secret_file`].
pub fn read_secret_file(key: &str, path: &Path) -> Result<String, ConfigError> {
    check_secret_file(key, path)?;
    std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: format!("{} (from `{key}`)", path.display()),
        message: e.to_string(),
    })
}

/// `Debug` stand-in for a secret: says whether it is set, never what it is.
pub(crate) struct Redacted(pub bool);

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0 { "<redacted>" } else { "None" })
    }
}

pub(crate) fn redacted<T>(value: &Option<T>) -> Redacted {
    Redacted(value.is_some())
}

/// A URL with its password (the part of the user info after `:`) replaced. User info without
/// `:` is replaced whole: NATS reads it as a token.
pub(crate) fn url_without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let shown = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:<redacted>"),
                None => "<redacted>".to_owned(),
            };
            format!("{scheme}://{shown}@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

// `Debug` of the configuration sections that hold secrets. Each lists its non-secret fields and
// only whether a secret is set; fields not listed are left out (`..`), so a field added later is
// never printed by accident.

impl std::fmt::Debug for crate::NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &url_without_password(&self.url))
            .field("credentials_file", &self.credentials_file)
            .field("stream_replicas", &self.stream_replicas)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::DatabaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &url_without_password(&self.url))
            .field("max_connections", &self.max_connections)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::ForgeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForgeConfig")
            .field("url", &self.url)
            .field("runner_name", &self.runner_name)
            .field("registration_token", &redacted(&self.registration_token))
            .field("registration_token_file", &self.registration_token_file)
            .field("runner_uuid", &self.runner_uuid)
            .field("runner_token", &redacted(&self.runner_token))
            .field("runner_token_file", &self.runner_token_file)
            .field("credentials_file", &self.credentials_file)
            .field("poll_interval", &self.poll_interval)
            .field("request_timeout", &self.request_timeout)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::GitHubConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitHubConfig")
            .field("name", &self.name)
            .field("url", &self.url)
            .field("api_url", &self.api_url)
            .field("backend", &self.backend)
            .field("scale_set", &self.scale_set)
            .field("pat", &redacted(&self.pat))
            .field("pat_file", &self.pat_file)
            .field("app_id", &self.app_id)
            .field("app_installation_id", &self.app_installation_id)
            .field("app_private_key_file", &self.app_private_key_file)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::BackendConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendConfig")
            .field("kind", &self.kind)
            .field("enabled", &self.enabled)
            .field("capacity", &self.capacity)
            .field("labels", &self.labels)
            .field("max_duration", &self.max_duration)
            .field("providers", &self.providers)
            .field("warm", &self.warm)
            .field("kubernetes", &self.kubernetes)
            .field("opensandbox", &self.opensandbox)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::OpenSandboxConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenSandboxConfig")
            .field("url", &url_without_password(&self.url))
            .field("api_key", &redacted(&self.api_key))
            .field("api_key_file", &self.api_key_file)
            .field("pool", &self.pool)
            .field("poll_interval", &self.poll_interval)
            .field("create_timeout", &self.create_timeout)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::SchedulerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key_ids: Vec<&String> = self.seal_keys.keys().collect();
        f.debug_struct("SchedulerConfig")
            .field("ops_listen", &self.ops_listen)
            .field("seal_key_id", &self.seal_key_id)
            .field("seal_keys (ids)", &key_ids)
            .field("seal_keys_file", &self.seal_keys_file)
            .field("nats", &self.nats)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::WorkerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerConfig")
            .field("backend", &self.backend)
            .field("ops_listen", &self.ops_listen)
            .field("worker_id", &self.worker_id)
            .field("token_key", &redacted(&self.token_key))
            .field("token_key_file", &self.token_key_file)
            .field("nats", &self.nats)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::NatsAuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAuthConfig")
            .field("credentials_file", &self.credentials_file)
            .field("user", &self.user)
            .field("password", &redacted(&self.password))
            .field("password_file", &self.password_file)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for crate::NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            crate::NatsAuth::CredentialsFile(path) => {
                f.debug_tuple("CredentialsFile").field(path).finish()
            }
            crate::NatsAuth::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .finish_non_exhaustive(),
            crate::NatsAuth::NKeySeed(_) => f.write_str("NKeySeed(..)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn debug_output_of_the_whole_config_holds_no_secret() {
        let text = r#"
[nats]
url = "nats://natstoken-AAAA@nats:4222"
[database]
url = "postgres://jr:dbpass-BBBB@db/jr"
[forge]
url = "https://forge.example"
runner_uuid = "u-1"
runner_token = "runnertoken-CCCC"
[facade]
listen = "0.0.0.0:8443"
public_url = "http://facade:8443"
insecure_plain_http = true
mode = "token"
[backend.vm]
kind = "vm"
capacity = 2
opensandbox = { url = "https://sb.example", api_key = "apikey-DDDD" }
[scheduler]
seal_key_id = "k1"
[scheduler.seal_keys]
k1 = "sealkey-EEEE"
[scheduler.nats]
user = "scheduler"
password = "natspass-HHHH"
[pod_worker]
token_key = "tokenkey-FFFF"
[vm_worker]
token_key = "tokenkey-GGGG"
"#;
        let config = crate::load_str(text, "test", std::iter::empty()).expect("valid config");
        let debug = format!("{config:?}");
        for secret in [
            "natstoken-AAAA",
            "dbpass-BBBB",
            "runnertoken-CCCC",
            "apikey-DDDD",
            "sealkey-EEEE",
            "tokenkey-FFFF",
            "tokenkey-GGGG",
            "natspass-HHHH",
        ] {
            assert!(!debug.contains(secret), "{secret} printed in {debug}");
        }
        // What is not secret still shows.
        for shown in ["forge.example", "u-1", "k1", "sb.example", "<redacted>"] {
            assert!(debug.contains(shown), "{shown} missing from {debug}");
        }
    }

    #[test]
    fn owner_only_files_pass_and_shared_ones_fail() {
        assert_eq!(secret_mode_problem(0o100600, 1000), None);
        assert_eq!(secret_mode_problem(0o100400, 1000), None);
        assert!(secret_mode_problem(0o100644, 1000).is_some());
        assert!(secret_mode_problem(0o100640, 1000).is_some());
        assert!(secret_mode_problem(0o100604, 1000).is_some());
        // Kubernetes Secret volume for a non-root container: root-owned, group-readable.
        assert_eq!(secret_mode_problem(0o100440, 0), None);
        assert_eq!(secret_mode_problem(0o100640, 0), None);
        assert!(secret_mode_problem(0o100660, 0).is_some());
        assert!(secret_mode_problem(0o100444, 0).is_some());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn others_never_get_access(mode in 0u32..0o10000, uid in prop_oneof![Just(0u32), 1u32..70000]) {
            if mode & 0o007 != 0 {
                prop_assert!(secret_mode_problem(mode, uid).is_some());
            }
        }

        #[test]
        fn group_access_only_for_root_owned_read_only_files(mode in 0u32..0o10000, uid in 1u32..70000) {
            let accepted = secret_mode_problem(mode, uid).is_none();
            prop_assert_eq!(accepted, mode & 0o077 == 0);
            let root_accepted = secret_mode_problem(mode, 0).is_none();
            prop_assert_eq!(root_accepted, mode & 0o037 == 0);
        }
    }

    #[cfg(unix)]
    fn file_with_mode(dir: &tempfile::TempDir, mode: u32) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.path().join(format!("secret-{mode:o}"));
        std::fs::write(&path, "s3cret\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        path
    }

    #[cfg(unix)]
    #[test]
    fn a_group_readable_token_file_is_refused_naming_file_and_fix() {
        // Files created here belong to the test's user; as root the group exception applies, so
        // use a mode that is refused for every owner.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = file_with_mode(&dir, 0o664);
        let err = crate::read_secret("forge.runner_token", &None, &Some(path.clone()))
            .expect_err("group-writable secret file accepted");
        let text = err.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("chmod 600"), "{text}");
        assert!(text.contains("forge.runner_token_file"), "{text}");
        let other = file_with_mode(&dir, 0o604);
        assert!(read_secret_file("scheduler.seal_keys_file", &other).is_err());
    }

    #[cfg(unix)]
    #[test]
    fn an_owner_only_token_file_is_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = file_with_mode(&dir, 0o600);
        let value = crate::read_secret("forge.runner_token", &None, &Some(path))
            .expect("0600 file refused");
        assert_eq!(value.as_deref(), Some("s3cret"));
    }

    #[cfg(unix)]
    #[test]
    fn a_missing_file_is_left_to_its_reader() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(check_secret_file("x_file", &dir.path().join("absent")).is_ok());
        assert!(read_secret_file("x_file", &dir.path().join("absent")).is_err());
    }

    #[test]
    fn url_passwords_are_hidden() {
        assert_eq!(
            url_without_password("postgres://jr:hunter2@db:5432/jr?sslmode=require"),
            "postgres://jr:<redacted>@db:5432/jr?sslmode=require"
        );
        assert_eq!(url_without_password("nats://nats:4222"), "nats://nats:4222");
        assert_eq!(
            url_without_password("nats://s3cret@nats:4222"),
            "nats://<redacted>@nats:4222"
        );
        assert_eq!(url_without_password("not a url"), "not a url");
    }
}
