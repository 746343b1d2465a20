//! Cross-key rules that serde cannot express. Every error names the offending key.

use std::collections::BTreeSet;

use jr_protocol::BackendName;

use std::time::Duration;

use crate::{BackendKind, Config, ConfigError, FacadeAuthMode, ForgeFlavor, RegistrationLayout};

impl Config {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.nats.url.starts_with("nats://") && !self.nats.url.starts_with("tls://") {
            return Err(ConfigError::key(
                "nats.url",
                "must start with nats:// or tls://",
            ));
        }
        if self.gitea().is_none() && self.github.is_empty() {
            return Err(ConfigError::key(
                "forge.url",
                "no forge configured: give [[forge]] entries (kind = \"gitea\", \"forgejo\" or \"github\"; or the older [forge] table and [[github]] entries)",
            ));
        }
        if self.gitea().is_some()
            && !self.forge.url.starts_with("http://")
            && !self.forge.url.starts_with("https://")
        {
            return Err(ConfigError::key(
                "forge.url",
                "must be an http:// or https:// URL",
            ));
        }
        if self.forge.runner_uuid.is_some()
            != (self.forge.runner_token.is_some() || self.forge.runner_token_file.is_some())
        {
            return Err(ConfigError::key(
                "forge.runner_uuid",
                "give runner_uuid together with runner_token (or runner_token_file), or neither",
            ));
        }
        self.validate_fetching()?;
        self.validate_lease()?;
        self.validate_runtime()?;
        self.validate_spiffe_path()?;
        self.validate_facade()?;
        self.validate_backends()?;
        self.validate_routing()?;
        self.validate_github()?;
        if let Some(problem) = self.url_problems().into_iter().next() {
            return Err(problem);
        }
        for section in crate::SERVICE_SECTIONS {
            if let Some(auth) = self.service_nats(section) {
                validate_nats_auth(section, auth)?;
            }
        }
        if self.reconciler.max_attempts == 0 {
            return Err(ConfigError::key(
                "reconciler.max_attempts",
                "must be at least 1",
            ));
        }
        if let Some(id) = &self.scheduler.seal_key_id
            && self.scheduler.seal_keys_file.is_none()
            && !self.scheduler.seal_keys.contains_key(id)
        {
            return Err(ConfigError::key(
                "scheduler.seal_key_id",
                format!("key id {id:?} is not in scheduler.seal_keys"),
            ));
        }
        Ok(())
    }

    fn validate_github(&self) -> Result<(), ConfigError> {
        let mut names = BTreeSet::new();
        for (i, g) in self.github.iter().enumerate() {
            let key = |k: &str| format!("github[{i}].{k}");
            let valid_name = !g.name.is_empty()
                && g.name.len() <= 64
                && g.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
            if !valid_name {
                return Err(ConfigError::key(
                    key("name"),
                    format!(
                        "{:?}: use 1 to 64 lower-case letters, digits and '-'",
                        g.name
                    ),
                ));
            }
            if !names.insert(g.name.as_str()) {
                return Err(ConfigError::key(
                    key("name"),
                    format!("{:?} is the name of another GitHub entry", g.name),
                ));
            }
            for (k, url) in [("url", Some(&g.url)), ("api_url", g.api_url.as_ref())] {
                if let Some(url) = url
                    && !url.starts_with("http://")
                    && !url.starts_with("https://")
                {
                    return Err(ConfigError::key(
                        key(k),
                        "must be an http:// or https:// URL",
                    ));
                }
            }
            let enabled = self.backend.get(&g.backend).is_some_and(|b| b.enabled);
            if !enabled {
                return Err(ConfigError::key(
                    key("backend"),
                    format!("{:?} is not an enabled [backend.<name>]", g.backend),
                ));
            }
            if g.scale_set.trim().is_empty() {
                return Err(ConfigError::key(key("scale_set"), "must not be empty"));
            }
            if g.max_runners == Some(0) {
                return Err(ConfigError::key(key("max_runners"), "must be at least 1"));
            }
            if let Some(max) = g.max_runners
                && g.min_idle > max
            {
                return Err(ConfigError::key(
                    key("min_idle"),
                    format!("{} is more than max_runners ({max})", g.min_idle),
                ));
            }
            if let Some(b) = self.backend.get(&g.backend)
                && g.min_idle as usize > b.capacity
            {
                return Err(ConfigError::key(
                    key("min_idle"),
                    format!(
                        "{} is more than backend {:?}'s capacity ({})",
                        g.min_idle, g.backend, b.capacity
                    ),
                ));
            }
            let pat = g.pat.is_some() || g.pat_file.is_some();
            let app = [
                g.app_id.is_some(),
                g.app_installation_id.is_some(),
                g.app_private_key_file.is_some(),
            ];
            let any_app = app.iter().any(|x| *x);
            if g.pat.is_some() && g.pat_file.is_some() {
                return Err(ConfigError::key(
                    key("pat"),
                    "give pat or pat_file, not both",
                ));
            }
            if pat == any_app || (any_app && !app.iter().all(|x| *x)) {
                return Err(ConfigError::key(
                    key("pat"),
                    "give a personal access token (pat or pat_file), or a GitHub App (app_id, app_installation_id and app_private_key_file), not both",
                ));
            }
            // GitHub does not let an App manage an enterprise's runners.
            let enterprise = url::Url::parse(&g.url).ok().is_some_and(|u| {
                u.path_segments()
                    .and_then(|mut s| s.next())
                    .is_some_and(|first| first.eq_ignore_ascii_case("enterprises"))
            });
            if any_app && enterprise {
                return Err(ConfigError::key(
                    key("app_id"),
                    "a GitHub App cannot manage an enterprise's runners: use a classic personal access token with the manage_runners:enterprise scope (docs/github.md, \"Credentials\")",
                ));
            }
        }
        Ok(())
    }

    fn validate_spiffe_path(&self) -> Result<(), ConfigError> {
        let p = &self.facade.spiffe_path;
        if !p.starts_with('/') || p.matches("{assignment}").count() != 1 {
            return Err(ConfigError::key(
                "facade.spiffe_path",
                "must start with / and contain {assignment} exactly once, e.g. /jetrunner/executor/{assignment}",
            ));
        }
        Ok(())
    }

    fn validate_runtime(&self) -> Result<(), ConfigError> {
        if !(1..=256).contains(&self.runtime.threads) {
            return Err(ConfigError::key(
                "runtime.threads",
                "must be between 1 and 256",
            ));
        }
        Ok(())
    }

    fn validate_lease(&self) -> Result<(), ConfigError> {
        let l = &self.lease;
        if l.ttl < Duration::from_millis(300) || l.ttl > Duration::from_secs(60) {
            return Err(ConfigError::key(
                "lease.ttl",
                "must be between 300ms and 60s (a standby takes over this long after a holder dies)",
            ));
        }
        if l.ttl <= l.max_clock_skew * 4 {
            return Err(ConfigError::key(
                "lease.max_clock_skew",
                "must be less than a quarter of lease.ttl",
            ));
        }
        Ok(())
    }

    fn validate_fetching(&self) -> Result<(), ConfigError> {
        let f = &self.forge;
        if f.task_capacity == 0 {
            return Err(ConfigError::key(
                "forge.task_capacity",
                "must be at least 1",
            ));
        }
        if f.task_capacity > 1 && f.flavor != ForgeFlavor::Forgejo {
            return Err(ConfigError::key(
                "forge.task_capacity",
                "several tasks per fetch is a Forgejo feature: set forge.flavor = \"forgejo\" or task_capacity = 1",
            ));
        }
        if f.keepalive_interval.is_zero() || f.keepalive_interval > Duration::from_secs(9 * 60) {
            return Err(ConfigError::key(
                "forge.keepalive_interval",
                "must be between 1s and 9m: the forge fails a task after 10 minutes without a heartbeat",
            ));
        }
        if f.version_reset_interval.is_zero() {
            return Err(ConfigError::key(
                "forge.version_reset_interval",
                "must be greater than zero",
            ));
        }
        if f.runner_uuid.is_some() && f.layout() == RegistrationLayout::PerBackend {
            return Err(ConfigError::key(
                "forge.runner_uuid",
                "one runner for all backends is forge.registration = \"shared\"; with per-backend registrations set backend.<name>.runner_uuid/runner_token instead",
            ));
        }
        for (name, b) in &self.backend {
            if b.runner_uuid.is_some()
                != (b.runner_token.is_some() || b.runner_token_file.is_some())
            {
                return Err(ConfigError::key(
                    format!("backend.{name}.runner_uuid"),
                    "give runner_uuid together with runner_token (or runner_token_file), or neither",
                ));
            }
            if b.runner_uuid.is_some() && f.layout() == RegistrationLayout::Shared {
                return Err(ConfigError::key(
                    format!("backend.{name}.runner_uuid"),
                    "per-backend runner credentials need forge.registration = \"per-backend\" (forge.runner_uuid selects one shared registration)",
                ));
            }
        }
        Ok(())
    }

    fn validate_facade(&self) -> Result<(), ConfigError> {
        let f = &self.facade;
        if f.tls_cert_file.is_some() != f.tls_key_file.is_some() {
            return Err(ConfigError::key(
                "facade.tls_cert_file",
                "give tls_cert_file and tls_key_file together",
            ));
        }
        let tls = f.tls_cert_file.is_some();
        if !tls && !f.insecure_plain_http {
            return Err(ConfigError::key(
                "facade.tls_cert_file",
                "the facade serves HTTPS: set tls_cert_file/tls_key_file (or insecure_plain_http = true for development)",
            ));
        }
        if matches!(f.mode, FacadeAuthMode::Spiffe | FacadeAuthMode::Both) {
            if !tls {
                return Err(ConfigError::key(
                    "facade.mode",
                    "spiffe mode needs TLS (tls_cert_file/tls_key_file)",
                ));
            }
            if f.trust_bundle_file.is_none() {
                return Err(ConfigError::key(
                    "facade.trust_bundle_file",
                    "required in spiffe mode",
                ));
            }
            if f.trust_domain.as_deref().is_none_or(str::is_empty) {
                return Err(ConfigError::key(
                    "facade.trust_domain",
                    "required in spiffe mode",
                ));
            }
        }
        Ok(())
    }

    fn validate_backends(&self) -> Result<(), ConfigError> {
        if self.backend.values().all(|b| !b.enabled) {
            return Err(ConfigError::key(
                "backend",
                "at least one enabled backend is required",
            ));
        }
        for (name, b) in &self.backend {
            let key = |k: &str| format!("backend.{name}.{k}");
            BackendName::new(name.clone())
                .map_err(|e| ConfigError::key(format!("backend.{name}"), e.to_string()))?;
            check_runner_block(b.kind, b.runner.as_ref(), &key("runner"))?;
            for (i, p) in b.providers.iter().enumerate() {
                check_runner_block(
                    b.kind,
                    p.runner.as_ref(),
                    &format!("backend.{name}.providers[{i}].runner"),
                )?;
            }
            if b.capacity == 0 {
                return Err(ConfigError::key(key("capacity"), "must be at least 1"));
            }
            match b.kind {
                BackendKind::Pod => {
                    if b.kubernetes.is_none() {
                        return Err(ConfigError::key(
                            key("kubernetes"),
                            "required for kind = \"pod\"",
                        ));
                    }
                    if b.opensandbox.is_some() {
                        return Err(ConfigError::key(
                            key("opensandbox"),
                            "only for kind = \"vm\"",
                        ));
                    }
                }
                BackendKind::Vm => {
                    if b.opensandbox.is_none() {
                        return Err(ConfigError::key(
                            key("opensandbox"),
                            "required for kind = \"vm\"",
                        ));
                    }
                    if b.kubernetes.is_some() {
                        return Err(ConfigError::key(
                            key("kubernetes"),
                            "only for kind = \"pod\"",
                        ));
                    }
                }
            }
            let burst_providers = b
                .providers
                .iter()
                .filter(|p| p.tier == crate::ProviderTier::Burst)
                .count();
            if burst_providers > 0 && burst_providers == b.providers.len() {
                return Err(ConfigError::key(
                    format!("backend.{name}.providers"),
                    "every provider has tier = \"burst\"; the default tier needs at least one",
                ));
            }
            if b.burst.is_some() && burst_providers == 0 {
                return Err(ConfigError::key(
                    format!("backend.{name}.burst"),
                    "no provider has tier = \"burst\"",
                ));
            }
            if let Some(fair) = &b.fair_share {
                for (k, v) in [
                    ("per_repository", fair.per_repository),
                    ("per_owner", fair.per_owner),
                ] {
                    if v == Some(0) {
                        return Err(ConfigError::key(
                            format!("backend.{name}.fair_share.{k}"),
                            "must be at least 1",
                        ));
                    }
                }
                if let Some((repository, _)) = fair.weights.iter().find(|(_, w)| **w == 0) {
                    return Err(ConfigError::key(
                        format!("backend.{name}.fair_share.weights.{repository:?}"),
                        "must be at least 1",
                    ));
                }
                if !fair.weights.is_empty() && fair.per_repository.is_none() {
                    return Err(ConfigError::key(
                        format!("backend.{name}.fair_share.weights"),
                        "weights scale per_repository, which is not set",
                    ));
                }
            }
            if let Some(warm) = &b.warm {
                let wkey = |k: &str| format!("backend.{name}.warm.{k}");
                if warm.max_idle.is_some_and(|m| m < warm.min_idle) {
                    return Err(ConfigError::key(
                        wkey("max_idle"),
                        "must be at least min_idle",
                    ));
                }
                if warm.max_idle() > b.capacity {
                    return Err(ConfigError::key(
                        wkey(if warm.max_idle.is_some() {
                            "max_idle"
                        } else {
                            "min_idle"
                        }),
                        "exceeds the backend's capacity (warm executors hold slots)",
                    ));
                }
                if warm.idle_timeout < Duration::from_secs(1) {
                    return Err(ConfigError::key(
                        wkey("idle_timeout"),
                        "must be at least 1s",
                    ));
                }
                if warm.max_age < Duration::from_secs(60) {
                    return Err(ConfigError::key(wkey("max_age"), "must be at least 1m"));
                }
                // A job bound to a warm executor skips the create call, and with it the checks
                // that only a create makes.
                if b.fair_share.is_some() {
                    return Err(ConfigError::key(
                        wkey("min_idle"),
                        "warm executors cannot be combined with fair_share (a bound job is not counted by the quotas)",
                    ));
                }
                if burst_providers > 0 {
                    return Err(ConfigError::key(
                        wkey("min_idle"),
                        "warm executors cannot be combined with burst-tier providers (a bound job would skip the tier choice)",
                    ));
                }
                let requested = [(&self.pod_worker, "pod"), (&self.vm_worker, "vm")]
                    .into_iter()
                    .any(|(w, default)| {
                        w.publish_requested
                            && w.backend.as_deref().unwrap_or(default) == name.as_str()
                    });
                if requested {
                    return Err(ConfigError::key(
                        wkey("min_idle"),
                        "warm executors need the scheduler to hold the worker's token key; publish_requested is set for this backend's worker",
                    ));
                }
            }
            let mut seen = BTreeSet::new();
            for (i, p) in b.providers.iter().enumerate() {
                if !seen.insert(p.name.as_str()) {
                    return Err(ConfigError::key(
                        format!("backend.{name}.providers[{i}].name"),
                        format!("duplicate provider {:?}", p.name),
                    ));
                }
                let pkey = |k: &str| format!("backend.{name}.providers[{i}].{k}");
                if !is_dns_label(&p.name) {
                    return Err(ConfigError::key(
                        pkey("name"),
                        format!(
                            "{:?} is not a DNS label (lower-case letters, digits and '-', at most 63)",
                            p.name
                        ),
                    ));
                }
                if p.weight == 0 {
                    return Err(ConfigError::key(pkey("weight"), "must be at least 1"));
                }
                if p.max_runners.is_some_and(|m| m > b.capacity) {
                    return Err(ConfigError::key(
                        pkey("max_runners"),
                        "exceeds the backend's capacity",
                    ));
                }
                if p.max_runners == Some(0) {
                    return Err(ConfigError::key(
                        pkey("max_runners"),
                        "must be at least 1 (use disabled = true to drain a provider)",
                    ));
                }
                if p.kubernetes.is_some() && b.kind != BackendKind::Pod {
                    return Err(ConfigError::key(
                        pkey("kubernetes"),
                        "only for kind = \"pod\"",
                    ));
                }
                if p.opensandbox.is_some() && b.kind != BackendKind::Vm {
                    return Err(ConfigError::key(
                        pkey("opensandbox"),
                        "only for kind = \"vm\"",
                    ));
                }
                if p.runner.is_some() && b.kind != BackendKind::Pod {
                    return Err(ConfigError::key(
                        pkey("runner"),
                        "only for kind = \"pod\" (a vm provider chooses its pool with opensandbox.pool)",
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_routing(&self) -> Result<(), ConfigError> {
        let enabled: BTreeSet<&str> = self
            .backend
            .iter()
            .filter(|(_, b)| b.enabled)
            .map(|(n, _)| n.as_str())
            .collect();
        for (i, rule) in self.routing.rules.iter().enumerate() {
            if !self.backend.contains_key(&rule.backend) {
                return Err(ConfigError::key(
                    format!("routing.rules[{i}].backend"),
                    format!("no backend named {:?}", rule.backend),
                ));
            }
        }
        if let Some(d) = &self.routing.default_backend
            && !enabled.contains(d.as_str())
        {
            return Err(ConfigError::key(
                "routing.default_backend",
                format!("no enabled backend named {d:?}"),
            ));
        }
        Ok(())
    }
}

/// One way to authenticate, complete: a credentials file, an nkey seed file, or a user with a
/// password (inline or file).
fn validate_nats_auth(section: &str, auth: &crate::NatsAuthConfig) -> Result<(), ConfigError> {
    let key = |k: &str| format!("{section}.nats.{k}");
    let password = auth.password.is_some() || auth.password_file.is_some();
    if auth.password.is_some() && auth.password_file.is_some() {
        return Err(ConfigError::key(
            key("password"),
            "give password or password_file, not both",
        ));
    }
    let methods = [
        auth.credentials_file.is_some(),
        auth.nkey_seed_file.is_some(),
        auth.user.is_some() || password,
    ]
    .into_iter()
    .filter(|m| *m)
    .count();
    if methods != 1 {
        return Err(ConfigError::key(
            format!("{section}.nats"),
            "give exactly one of credentials_file, nkey_seed_file, or user with password (or password_file)",
        ));
    }
    match (&auth.user, password) {
        (Some(user), _) if user.is_empty() => {
            Err(ConfigError::key(key("user"), "must not be empty"))
        }
        (Some(_), false) => Err(ConfigError::key(
            key("password"),
            "a user needs password or password_file",
        )),
        (None, true) => Err(ConfigError::key(key("user"), "a password needs its user")),
        _ => Ok(()),
    }
}

/// Lower-case letters, digits and '-', starting and ending with a letter or digit, 1–63 long.
fn is_dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first() != Some(&b'-')
        && bytes.last() != Some(&b'-')
}

/// Every key a Pod backend's runner block may have (the pod-worker reads their values).
pub const POD_RUNNER_BLOCK_KEYS: &[&str] = &[
    "image",
    "command",
    "args",
    "env",
    "resources",
    "runtime_class_name",
    "node_selector",
    "tolerations",
    "service_account_name",
    "security_context",
    "pod_security_context",
    "image_pull_secrets",
    "labels",
    "annotations",
];

/// A runner block's keys, checked by every binary (not only by the worker that reads it):
/// only Pod backends have one, with [`POD_RUNNER_BLOCK_KEYS`].
fn check_runner_block(
    kind: BackendKind,
    block: Option<&toml::Table>,
    key: &str,
) -> Result<(), ConfigError> {
    let Some(block) = block.filter(|b| !b.is_empty()) else {
        return Ok(());
    };
    if kind != BackendKind::Pod {
        return Err(ConfigError::key(
            key,
            "only Pod backends have a runner block (a VM's runner comes from its OpenSandbox pool)",
        ));
    }
    if let Some(unknown) = block
        .keys()
        .find(|k| !POD_RUNNER_BLOCK_KEYS.contains(&k.as_str()))
    {
        return Err(ConfigError::key(
            format!("{key}.{unknown}"),
            format!(
                "not a runner block key; expected one of {}",
                POD_RUNNER_BLOCK_KEYS.join(", ")
            ),
        ));
    }
    Ok(())
}
