//! `jr provider drain|undrain BACKEND PROVIDER`: a provider's run-time drain switch (key
//! `drain.<backend>.<provider>` of `JR_PLACEMENT`). The backend and the provider are checked
//! against the reconciler's status API first, which lists every configured provider: a typo
//! would otherwise write a switch nothing reads and report it drained.

use clap::Subcommand;

use crate::{Options, connect, placement_store, status_get};

#[derive(Subcommand)]
pub enum ProviderAction {
    Drain {
        backend: String,
        provider: String,
        /// Write the switch without checking that the backend has the provider (the status
        /// API unreachable, or a provider about to be configured).
        #[arg(long)]
        force: bool,
    },
    Undrain {
        backend: String,
        provider: String,
        #[arg(long)]
        force: bool,
    },
}

pub async fn provider(action: ProviderAction, options: &Options) -> anyhow::Result<()> {
    let (backend, name, drained, force) = match action {
        ProviderAction::Drain {
            backend,
            provider,
            force,
        } => (backend, provider, true, force),
        ProviderAction::Undrain {
            backend,
            provider,
            force,
        } => (backend, provider, false, force),
    };
    for (what, text) in [("backend", &backend), ("provider", &name)] {
        anyhow::ensure!(
            !text.is_empty()
                && text
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "{text:?} is not a {what} name"
        );
    }
    if !force {
        let status = status_get(&options.api, "/api/status").await.map_err(|e| {
            anyhow::anyhow!(
                "cannot check that backend {backend} has a provider {name}: {e}; give --force to \
                 set the switch anyway"
            )
        })?;
        known(&status, &backend, &name)?;
    }
    let js = connect(&options.nats).await?;
    let store = placement_store(&js).await?;
    let key = format!("drain.{backend}.{name}");
    store
        .put(key.as_str(), if drained { "on" } else { "off" }.into())
        .await
        .map_err(|e| anyhow::anyhow!("writing {key}: {e}"))?;
    if options.json {
        println!(
            "{}",
            serde_json::json!({ "backend": backend, "provider": name, "key": key, "drained": drained })
        );
    } else if drained {
        println!("provider {name} of backend {backend} drained: nothing new is placed there");
    } else {
        println!("provider {name} of backend {backend} takes new work again");
    }
    Ok(())
}

/// Whether the status API's `status` lists `provider` for `backend`; the error names what is
/// configured instead.
fn known(status: &serde_json::Value, backend: &str, provider: &str) -> anyhow::Result<()> {
    let backends = status["backends"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = backends.iter().filter_map(|b| b["name"].as_str()).collect();
    let Some(found) = backends.iter().find(|b| b["name"] == backend) else {
        anyhow::bail!(
            "no backend {backend} is configured (backends: {})",
            names.join(", ")
        );
    };
    let providers: Vec<&String> = found["provider_capacity"]
        .as_object()
        .map(|p| p.keys().collect())
        .unwrap_or_default();
    anyhow::ensure!(
        providers.iter().any(|p| *p == provider),
        "backend {backend} has no provider {provider} ({})",
        if providers.is_empty() {
            "it has no providers: it runs on its own API".to_owned()
        } else {
            format!(
                "its providers: {}",
                providers
                    .iter()
                    .map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_configured_provider_of_a_configured_backend_is_known() {
        let status = serde_json::json!({"backends": [
            {"name": "pod", "provider_capacity": {"east": 3, "west": 2}},
            {"name": "vm", "provider_capacity": {}},
        ]});
        known(&status, "pod", "east").expect("configured");
        let e = known(&status, "pod", "north").expect_err("not configured");
        assert!(e.to_string().contains("east, west"), "{e}");
        let e = known(&status, "gpu", "east").expect_err("no backend");
        assert!(e.to_string().contains("pod, vm"), "{e}");
        let e = known(&status, "vm", "east").expect_err("no providers");
        assert!(e.to_string().contains("no providers"), "{e}");
    }
}
