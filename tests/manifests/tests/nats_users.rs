//! The NATS server configurations shipped for compose (`config/nats.conf`) and Kubernetes
//! (`k8s/nats/auth.conf`) grant each service exactly the permissions jetrunner derives for it
//! (`jr_bus::permissions`), for the backends each deployment's jetrunner.toml enables, and each
//! service is configured to connect as its own user.
//!
//! Regenerate both files after a permission change with
//! `JR_WRITE_NATS_CONF=1 cargo test -p jr-manifests-test --test nats_users`.

mod common;

use std::path::Path;

use common::{SERVICES, load_config, read, repo_root};
use jr_bus::permissions::{BackendName, NatsUser, Password, Role, authorization_block};

const COMPOSE_HEADER: &str = "\
# nats-server configuration of `docker compose up` (development only: the passwords are the ones
# in config/jetrunner.toml). Each jetrunner service connects as its own user and may use only its
# own subjects (README, \"Security model\"). `admin` may do everything: use it with the nats CLI,
#   nats --server nats://admin:dev-admin@localhost:4222 stream ls
# Generated from jetrunner's permission rules; regenerate with
#   JR_WRITE_NATS_CONF=1 cargo test -p jr-manifests-test --test nats_users
";

const K8S_HEADER: &str = "\
# The jetrunner users of the NATS server (include this file in the server's configuration, e.g.
# `include ./jetrunner-auth.conf`). Each service connects as its own user and may use only its own
# subjects (README, \"Security model\"). The passwords come from the server's environment
# (the Secret in k8s/nats/secret.yaml); each must equal the `password` of the service's own Secret
# `jetrunner-nats-<service>` in k8s/base/secrets.yaml. Add your own administrator user next to
# these (no jetrunner service needs one).
# Generated from jetrunner's permission rules for the backends of k8s/base/jetrunner.toml;
# regenerate with
#   JR_WRITE_NATS_CONF=1 cargo test -p jr-manifests-test --test nats_users
";

fn backends(config: &jr_config::Config) -> Vec<BackendName> {
    config.enabled_backends().map(|(name, _)| name).collect()
}

/// The config section of a role's service (`pod_worker` for the `pod` backend's worker).
fn section(role: &Role) -> String {
    match role {
        Role::Scheduler => "scheduler".to_owned(),
        Role::Worker(backend) => format!("{backend}_worker"),
        Role::Reconciler => "reconciler".to_owned(),
    }
}

/// The env variable of the k8s NATS server holding a role's password.
pub fn password_env(role: &Role) -> String {
    format!(
        "JETRUNNER_{}_PASSWORD",
        role.user().replace('-', "_").to_ascii_uppercase()
    )
}

fn check_or_write(path: &Path, expected: &str) {
    if std::env::var_os("JR_WRITE_NATS_CONF").is_some() {
        std::fs::write(path, expected).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let actual = read(path);
    assert!(
        actual == expected,
        "{} differs from the permission rules; regenerate it (see this test's doc). Expected:\n{expected}",
        path.display()
    );
}

#[test]
fn compose_nats_grants_each_service_its_permissions() {
    let root = repo_root();
    let config = load_config(&root.join("config/jetrunner.toml"), &[]);
    let backends = backends(&config);
    let mut users = Vec::new();
    for role in Role::all(&backends) {
        let auth = config
            .nats_auth(&section(&role))
            .unwrap_or_else(|e| panic!("{role:?}: {e}"));
        let Some(jr_config::NatsAuth::UserPassword { user, password }) = auth else {
            panic!(
                "{} has no NATS user in config/jetrunner.toml",
                section(&role)
            );
        };
        assert_eq!(user, role.user(), "{role:?} connects as another user");
        users.push(NatsUser::service(
            &role,
            &backends,
            Password::Literal(password),
        ));
    }
    users.push(NatsUser {
        user: "admin".into(),
        password: Password::Literal("dev-admin".into()),
        permissions: None,
    });
    let expected = format!("{COMPOSE_HEADER}\n{}", authorization_block(&users));
    check_or_write(&root.join("config/nats.conf"), &expected);
}

#[test]
fn k8s_nats_grants_each_service_its_permissions() {
    let root = repo_root();
    let config = load_config(&root.join("k8s/base/jetrunner.toml"), &[]);
    let backends = backends(&config);
    let users: Vec<NatsUser> = Role::all(&backends)
        .iter()
        .map(|role| {
            let auth = config
                .service_nats(&section(role))
                .unwrap_or_else(|| panic!("{} has no [{}.nats]", role.user(), section(role)));
            assert_eq!(auth.user.as_deref(), Some(role.user().as_str()));
            assert!(
                auth.password_file.is_some() && auth.password.is_none(),
                "{role:?}: the password comes from a mounted Secret"
            );
            NatsUser::service(role, &backends, Password::Env(password_env(role)))
        })
        .collect();
    let expected = format!("{K8S_HEADER}\n{}", authorization_block(&users));
    check_or_write(&root.join("k8s/nats/auth.conf"), &expected);
    // The server's Secret provides every variable the file names.
    let secret = read(&root.join("k8s/nats/secret.yaml"));
    for role in Role::all(&backends) {
        assert!(
            secret.contains(&format!("{}:", password_env(&role))),
            "k8s/nats/secret.yaml lacks {}",
            password_env(&role)
        );
    }
    // One section per service binary.
    assert_eq!(Role::all(&backends).len(), SERVICES.len());
}
