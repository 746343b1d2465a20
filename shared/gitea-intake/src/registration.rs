//! Runner registration with the forge: pre-made credentials, persisted ones, or a registration
//! token used once; then `Declare` of every enabled backend's labels at each start.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use jr_bus::async_nats::jetstream::kv;
use jr_bus::lease::Leadership;

use jr_config::ForgeConfig;
use jr_forge::proto::ping::v1::PingRequest;
use jr_forge::proto::runner::v1::{DeclareRequest, RegisterRequest};
use jr_forge::{Credentials, ForgeClient, ForgeError};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

pub const RUNNER_VERSION: &str = concat!("jetrunner-", env!("CARGO_PKG_VERSION"));

/// The forge's capabilities, on Declare replies (newer Gitea).
pub const CAPABILITIES_HEADER: &str = jr_forge::wire::HEADER_CAPABILITIES;

#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    #[error(
        "no runner credentials: set forge.registration_token (or registration_token_file) to register, \
         or forge.runner_uuid + forge.runner_token"
    )]
    NoCredentials,
    #[error("the forge does not know runner {uuid} (deleted, or stale credentials). {remedy}")]
    Unregistered { uuid: String, remedy: String },
    #[error("registration refused by the forge: {0}")]
    Refused(#[source] ForgeError),
    #[error("credentials file {path}: {message}")]
    CredentialsFile { path: String, message: String },
    #[error("config: {0}")]
    Config(#[from] jr_config::ConfigError),
    #[error("forge client: {0}")]
    Client(#[source] ForgeError),
    #[error("runner credentials in the KV bucket JR_SCHEDULER ({key}): {message}")]
    Shared { key: String, message: String },
    #[error("shut down while waiting for the forge")]
    Shutdown,
    #[error("the forge is not reachable")]
    Unreachable(#[source] ForgeError),
    #[error("declaring the runner's labels failed")]
    Declare(#[source] ForgeError),
}

#[derive(Serialize, Deserialize)]
struct StoredCredentials {
    uuid: String,
    token: String,
    #[serde(default)]
    id: i64,
}

fn read_stored(path: &Path) -> Result<Option<Credentials>, RegistrationError> {
    let err = |message: String| RegistrationError::CredentialsFile {
        path: path.display().to_string(),
        message,
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let stored: StoredCredentials =
                serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
            Ok(Some(Credentials {
                uuid: stored.uuid,
                token: stored.token,
            }))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(err(e.to_string())),
    }
}

/// Writes atomically: a new temp file created with mode 0600 (never an existing file or a
/// symlink planted in its place), then renamed over the target (a rename replaces a symlink at
/// the target instead of following it).
fn write_stored(path: &Path, creds: &Credentials, id: i64) -> Result<(), RegistrationError> {
    use std::io::Write as _;
    let err = |message: String| RegistrationError::CredentialsFile {
        path: path.display().to_string(),
        message,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
    }
    let text = serde_json::to_string_pretty(&StoredCredentials {
        uuid: creds.uuid.clone(),
        token: creds.token.clone(),
        id,
    })
    .map_err(|e| err(e.to_string()))?;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(&tmp).map_err(|e| err(e.to_string()))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| err(e.to_string()))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))
}

/// Registered runner credentials shared by the scheduler's replicas: sealed with the scheduler's
/// seal key (NATS readers see no token) in the KV bucket `JR_SCHEDULER` under
/// `credentials.<registration>`. Only the replica holding the registration's lease registers a
/// runner; the others wait for its record, so replicas never register two runners.
#[derive(Clone)]
pub struct SharedCredentials {
    pub store: kv::Store,
    pub sealer: Arc<jr_seal::Sealer>,
    pub leadership: Leadership,
    pub registration: String,
}

impl SharedCredentials {
    fn key(&self) -> String {
        format!("credentials.{}", self.registration)
    }

    fn purpose(&self) -> String {
        format!("runner-credentials/{}", self.registration)
    }

    fn error(&self, message: impl std::fmt::Display) -> RegistrationError {
        RegistrationError::Shared {
            key: self.key(),
            message: message.to_string(),
        }
    }

    /// The stored credentials, if any.
    pub async fn load(&self) -> Result<Option<Credentials>, RegistrationError> {
        let Some(bytes) = self
            .store
            .get(self.key())
            .await
            .map_err(|e| self.error(e))?
        else {
            return Ok(None);
        };
        let sealed: jr_protocol::SealedTask =
            serde_json::from_slice(&bytes).map_err(|e| self.error(e))?;
        let plain = self
            .sealer
            .open_record(&self.purpose(), &sealed)
            .map_err(|e| self.error(format!("{e}; keep the sealing key listed in scheduler.seal_keys, or delete the key to register anew")))?;
        let stored: StoredCredentials =
            serde_json::from_slice(&plain).map_err(|e| self.error(e))?;
        Ok(Some(Credentials {
            uuid: stored.uuid,
            token: stored.token,
        }))
    }

    pub async fn save(&self, creds: &Credentials, id: i64) -> Result<(), RegistrationError> {
        let plain = serde_json::to_vec(&StoredCredentials {
            uuid: creds.uuid.clone(),
            token: creds.token.clone(),
            id,
        })
        .map_err(|e| self.error(e))?;
        let sealed = self
            .sealer
            .seal_record(&self.purpose(), &plain)
            .map_err(|e| self.error(e))?;
        let value = serde_json::to_vec(&sealed).map_err(|e| self.error(e))?;
        self.store
            .put(self.key(), value.into())
            .await
            .map_err(|e| self.error(e))?;
        Ok(())
    }
}

/// Waits until the forge answers Ping, retrying with capped backoff (the forge may be starting).
async fn wait_for_forge(client: &ForgeClient, name: &str) -> Result<(), RegistrationError> {
    client
        .ping(&PingRequest {
            data: name.to_owned(),
        })
        .await
        .map(|_| ())
        .map_err(RegistrationError::Unreachable)
}

/// Who one forge registration is: its runner name, pre-made credentials (if configured) and
/// where registered credentials are kept.
#[derive(Clone, Debug)]
pub struct RunnerIdentity {
    pub name: String,
    /// `(config key, uuid, token)` of pre-made credentials; read at establish time.
    pub preset: Option<(String, String, Option<String>, Option<std::path::PathBuf>)>,
    pub credentials_file: std::path::PathBuf,
}

impl RunnerIdentity {
    /// The single registration of `forge.registration = "shared"`.
    pub fn shared(cfg: &ForgeConfig) -> Self {
        Self {
            name: cfg.runner_name.clone(),
            preset: cfg.runner_uuid.clone().map(|uuid| {
                (
                    "forge.runner_token".to_owned(),
                    uuid,
                    cfg.runner_token.clone(),
                    cfg.runner_token_file.clone(),
                )
            }),
            credentials_file: cfg.credentials_file.clone(),
        }
    }

    /// Backend `backend`'s own registration: runner `<runner_name>-<backend>`, credentials
    /// from `backend.<name>.runner_uuid/…` or kept next to `forge.credentials_file` as
    /// `<stem>.<backend>.<ext>`.
    pub fn per_backend(cfg: &ForgeConfig, backend: &str, b: &jr_config::BackendConfig) -> Self {
        let file = &cfg.credentials_file;
        let stem = file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "jetrunner-runner".to_owned());
        let name = match file.extension() {
            Some(ext) => format!("{stem}.{backend}.{}", ext.to_string_lossy()),
            None => format!("{stem}.{backend}"),
        };
        Self {
            name: format!("{}-{backend}", cfg.runner_name),
            preset: b.runner_uuid.clone().map(|uuid| {
                (
                    format!("backend.{backend}.runner_token"),
                    uuid,
                    b.runner_token.clone(),
                    b.runner_token_file.clone(),
                )
            }),
            credentials_file: file.with_file_name(name),
        }
    }
}

/// Registers a new runner with the registration token and keeps its credentials in the file;
/// also returns the forge's runner id.
async fn register_new(
    cfg: &ForgeConfig,
    identity: &RunnerIdentity,
    labels: &[String],
    anonymous: &ForgeClient,
) -> Result<(Credentials, i64), RegistrationError> {
    let token = jr_config::read_secret(
        "forge.registration_token",
        &cfg.registration_token,
        &cfg.registration_token_file,
    )?
    .ok_or(RegistrationError::NoCredentials)?;
    let reply = anonymous
        .register(&RegisterRequest {
            name: identity.name.clone(),
            token,
            version: RUNNER_VERSION.to_owned(),
            labels: labels.to_vec(),
            ..Default::default()
        })
        .await
        .map_err(RegistrationError::Refused)?;
    let runner = reply.runner.unwrap_or_default();
    let creds = Credentials {
        uuid: runner.uuid,
        token: runner.token,
    };
    write_stored(&identity.credentials_file, &creds, runner.id)?;
    tracing::info!(runner = %identity.name, uuid = %creds.uuid, file = %identity.credentials_file.display(), "registered with the forge");
    Ok((creds, runner.id))
}

/// The credentials another replica registered, or a new registration by this replica once it
/// holds the registration's lease (and nobody stored credentials meanwhile).
async fn obtain_shared(
    cfg: &ForgeConfig,
    identity: &RunnerIdentity,
    labels: &[String],
    anonymous: &ForgeClient,
    shared: &SharedCredentials,
    shutdown: &CancellationToken,
) -> Result<Credentials, RegistrationError> {
    let mut told = false;
    loop {
        if let Some(c) = shared.load().await? {
            if let Err(e) = write_stored(&identity.credentials_file, &c, 0) {
                tracing::warn!(error = %e, "cannot keep the shared runner credentials in the file");
            }
            tracing::info!(runner = %identity.name, uuid = %c.uuid, "using the runner credentials another replica registered");
            return Ok(c);
        }
        if shared.leadership.acting().is_some() {
            let (creds, id) = register_new(cfg, identity, labels, anonymous).await?;
            shared.save(&creds, id).await?;
            return Ok(creds);
        }
        if !told {
            told = true;
            tracing::info!(runner = %identity.name, "waiting for the replica holding the lease to register the runner");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Err(RegistrationError::Shutdown),
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

/// Returns a client carrying the runner's credentials, after a successful `Declare` of `labels`.
pub async fn establish(
    cfg: &ForgeConfig,
    identity: &RunnerIdentity,
    labels: &[String],
    shutdown: &CancellationToken,
) -> Result<ForgeClient, RegistrationError> {
    establish_declared(cfg, identity, labels, None, shutdown)
        .await
        .map(|(client, _)| client)
}

/// [`establish`], also returning the forge's capabilities header of the `Declare` reply
/// (`x-gitea-actions-capabilities`), which the facade relays to executors.
pub async fn establish_declared(
    cfg: &ForgeConfig,
    identity: &RunnerIdentity,
    labels: &[String],
    shared: Option<&SharedCredentials>,
    shutdown: &CancellationToken,
) -> Result<(ForgeClient, Option<String>), RegistrationError> {
    let anonymous =
        ForgeClient::new(&cfg.url, None, cfg.request_timeout).map_err(RegistrationError::Client)?;
    wait_for_forge(&anonymous, &identity.name).await?;

    let configured = match &identity.preset {
        Some((key, uuid, token, token_file)) => jr_config::read_secret(key, token, token_file)?
            .map(|token| Credentials {
                uuid: uuid.clone(),
                token,
            }),
        None => None,
    };
    let creds = match configured {
        Some(c) => c,
        None => match read_stored(&identity.credentials_file)? {
            Some(c) => {
                // Replicas without this file find them on the bus.
                if let Some(shared) = shared
                    && matches!(shared.load().await, Ok(None))
                    && let Err(e) = shared.save(&c, 0).await
                {
                    tracing::warn!(error = %e, "cannot share the runner credentials with other replicas");
                }
                c
            }
            None => match shared {
                None => register_new(cfg, identity, labels, &anonymous).await?.0,
                Some(shared) => {
                    obtain_shared(cfg, identity, labels, &anonymous, shared, shutdown).await?
                }
            },
        },
    };

    let client = anonymous.with_credentials(creds.clone());
    let declare = DeclareRequest {
        version: RUNNER_VERSION.to_owned(),
        labels: labels.to_vec(),
        ..Default::default()
    };
    match client
        .call_raw(
            jr_forge::wire::RUNNER_SERVICE,
            "Declare",
            &declare,
            true,
            &[],
        )
        .await
    {
        Ok((_, headers)) => {
            let capabilities = headers
                .get(CAPABILITIES_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            tracing::info!(runner = %identity.name, ?labels, ?capabilities, "declared labels to the forge");
            Ok((client, capabilities))
        }
        Err(e) if e.is_unregistered() => {
            let remedy = match &identity.preset {
                Some((key, ..)) => format!(
                    "Configure fresh credentials ({key} and its runner_uuid), or remove them and set forge.registration_token to register anew"
                ),
                None => format!(
                    "Remove {} and restart with a valid forge.registration_token, or configure pre-made runner credentials",
                    identity.credentials_file.display()
                ),
            };
            Err(RegistrationError::Unregistered {
                uuid: creds.uuid,
                remedy,
            })
        }
        Err(e) if e.is_retryable() => Err(RegistrationError::Declare(e)),
        Err(e) => Err(RegistrationError::Refused(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn credentials_are_written_owner_only_and_never_through_a_planted_symlink() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "do not touch").expect("victim");
        let path = dir.path().join("runner.json");
        std::os::unix::fs::symlink(&victim, &path).expect("symlink");
        let creds = Credentials {
            uuid: "u".into(),
            token: "t".into(),
        };
        write_stored(&path, &creds, 7).expect("written");
        assert_eq!(
            std::fs::read_to_string(&victim).expect("victim"),
            "do not touch",
            "the symlink's target was not written"
        );
        let meta = std::fs::symlink_metadata(&path).expect("metadata");
        assert!(
            meta.file_type().is_file(),
            "the link was replaced by a file"
        );
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let stored = read_stored(&path).expect("read").expect("stored");
        assert_eq!(stored.token, "t");
    }
}
