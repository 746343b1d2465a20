use super::*;

const MINIMAL: &str = r#"
[nats]
url = "nats://127.0.0.1:4222"

[forge]
url = "http://127.0.0.1:3000"
registration_token = "abc"

[facade]
listen = "127.0.0.1:8080"
public_url = "http://127.0.0.1:8080"
insecure_plain_http = true

[[routing.rules]]
label = "vm"
backend = "vm"

[[routing.rules]]
label = "pod"
backend = "pod"

[backend.pod]
kind = "pod"
capacity = 20
kubernetes = { namespace = "jobs" }

[backend.vm]
kind = "vm"
capacity = 15
opensandbox = { url = "http://127.0.0.1:8081" }
"#;

/// One valid `[[github]]` entry (scale set on the vm backend, a PAT).
const GITHUB_ENTRY: &str = r#"
[[github]]
name = "gh"
url = "https://github.com/acme"
backend = "vm"
pat = "ghp_x"
"#;

fn load_env(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    load_str(
        text,
        "test.toml",
        env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
    )
}

#[test]
fn minimal_file_loads_with_defaults() {
    let c = load_env(MINIMAL, &[]).expect("valid");
    assert_eq!(c.backend["pod"].capacity, 20);
    assert_eq!(
        c.backend["vm"]
            .opensandbox
            .as_ref()
            .map(|o| o.pool.as_str()),
        Some("ci-vm")
    );
    assert_eq!(c.reconciler.max_attempts, 3);
    assert_eq!(c.enabled_backends().count(), 2);
}

#[test]
fn unknown_key_is_refused_with_its_path() {
    let text = MINIMAL.replace("capacity = 20", "capacity = 20\ncapacty = 3");
    let err = load_env(&text, &[]).expect_err("typo must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("backend.pod") && msg.contains("capacty"),
        "{msg}"
    );
}

#[test]
fn environment_overrides_keys_with_typed_values() {
    let c = load_env(
        MINIMAL,
        &[
            ("JETRUNNER__BACKEND__POD__CAPACITY", "5"),
            ("JETRUNNER__NATS__URL", "nats://nats:4222"),
        ],
    )
    .expect("valid");
    assert_eq!(c.backend["pod"].capacity, 5);
    assert_eq!(c.nats.url, "nats://nats:4222");
}

#[test]
fn environment_override_of_unknown_key_is_refused() {
    let err = load_env(MINIMAL, &[("JETRUNNER__NATS__URLL", "x")]).expect_err("unknown");
    assert!(err.to_string().contains("urll"), "{err}");
}

#[test]
fn duplicate_providers_are_refused() {
    let text = format!(
        "{MINIMAL}\n[[backend.pod.providers]]\nname = \"a\"\n[[backend.pod.providers]]\nname = \"a\"\n"
    );
    let err = load_env(&text, &[]).expect_err("duplicate");
    assert!(
        err.to_string().contains("backend.pod.providers[1].name"),
        "{err}"
    );
}

#[test]
fn routing_to_a_missing_backend_is_refused() {
    let text = MINIMAL.replace("backend = \"vm\"", "backend = \"vmm\"");
    let err = load_env(&text, &[]).expect_err("missing backend");
    assert!(
        err.to_string().contains("routing.rules[0].backend"),
        "{err}"
    );
}

#[test]
fn plain_http_facade_needs_explicit_opt_in() {
    let text = MINIMAL.replace("insecure_plain_http = true", "");
    let err = load_env(&text, &[]).expect_err("plain http");
    assert!(err.to_string().contains("facade.tls_cert_file"), "{err}");
}

#[test]
fn spiffe_mode_requires_trust_bundle_and_domain() {
    let text = MINIMAL.replace(
        "insecure_plain_http = true",
        "mode = \"spiffe\"\ntls_cert_file = \"c.pem\"\ntls_key_file = \"k.pem\"",
    );
    let err = load_env(&text, &[]).expect_err("spiffe");
    assert!(err.to_string().contains("trust_bundle_file"), "{err}");
}

#[test]
fn pod_backend_without_kubernetes_section_is_refused() {
    let text = MINIMAL.replace("kubernetes = { namespace = \"jobs\" }", "");
    let err = load_env(&text, &[]).expect_err("pod without kubernetes");
    assert!(err.to_string().contains("backend.pod.kubernetes"), "{err}");
}

#[test]
fn invalid_backend_name_is_refused() {
    let text = MINIMAL
        .replace("[backend.vm]", "[backend.\"VM.x\"]")
        .replace("backend = \"vm\"", "backend = \"pod\"");
    let err = load_env(&text, &[]).expect_err("bad name");
    assert!(err.to_string().contains("backend.VM.x"), "{err}");
}

#[test]
fn example_configs_in_the_repository_are_valid() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config");
    let mut seen = 0;
    for entry in std::fs::read_dir(&root).expect("config/ exists") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).expect("readable");
            load_str(&text, &path.display().to_string(), std::iter::empty())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen += 1;
        }
    }
    assert!(seen > 0, "no example configs found");
}

#[test]
fn opensandbox_create_timeout_defaults_to_two_minutes_and_can_be_set() {
    let c = load_env(MINIMAL, &[]).expect("valid");
    let timeout = |c: &Config| {
        c.backend["vm"]
            .opensandbox
            .as_ref()
            .map(|o| o.create_timeout)
    };
    assert_eq!(timeout(&c), Some(std::time::Duration::from_secs(120)));
    let text = MINIMAL.replace(
        r#"opensandbox = { url = "http://127.0.0.1:8081" }"#,
        r#"opensandbox = { url = "http://127.0.0.1:8081", create_timeout = "2s" }"#,
    );
    let c = load_env(&text, &[]).expect("valid");
    assert_eq!(timeout(&c), Some(std::time::Duration::from_secs(2)));
}

#[test]
fn sandbox_task_runs_the_executor_entrypoint_unless_configured_otherwise() {
    let entrypoint = |c: &Config| {
        c.backend["vm"]
            .opensandbox
            .as_ref()
            .map(|o| o.entrypoint.clone())
    };
    let c = load_env(MINIMAL, &[]).expect("valid");
    assert_eq!(
        entrypoint(&c),
        Some(vec!["/usr/local/bin/jetrunner-executor".to_owned()])
    );
    let text = MINIMAL.replace(
        r#"opensandbox = { url = "http://127.0.0.1:8081" }"#,
        r#"opensandbox = { url = "http://127.0.0.1:8081", entrypoint = [] }"#,
    );
    assert_eq!(
        entrypoint(&load_env(&text, &[]).expect("valid")),
        Some(vec![])
    );
}

#[test]
fn each_service_picks_its_own_nats_user() {
    let text = format!(
        "{MINIMAL}\n[scheduler.nats]\nuser = \"scheduler\"\npassword = \"s-pass\"\n\n[reconciler.nats]\ncredentials_file = \"/run/r.creds\"\n"
    );
    let env = [
        ("JETRUNNER__POD_WORKER__NATS__USER", "pod-worker"),
        ("JETRUNNER__POD_WORKER__NATS__PASSWORD", "p-pass"),
        ("JETRUNNER__NATS__CREDENTIALS_FILE", "/run/shared.creds"),
    ];
    let config = load_env(&text, &env).expect("valid");
    assert_eq!(
        config.nats_auth("scheduler").expect("resolves"),
        Some(NatsAuth::UserPassword {
            user: "scheduler".into(),
            password: "s-pass".into()
        })
    );
    assert_eq!(
        config.nats_auth("pod_worker").expect("resolves"),
        Some(NatsAuth::UserPassword {
            user: "pod-worker".into(),
            password: "p-pass".into()
        })
    );
    assert_eq!(
        config.nats_auth("reconciler").expect("resolves"),
        Some(NatsAuth::CredentialsFile("/run/r.creds".into()))
    );
    // No table of its own: the shared credentials.
    assert_eq!(
        config.nats_auth("vm_worker").expect("resolves"),
        Some(NatsAuth::CredentialsFile("/run/shared.creds".into()))
    );
    let debug = format!("{config:?}");
    assert!(
        !debug.contains("s-pass") && !debug.contains("p-pass"),
        "{debug}"
    );
}

#[test]
fn a_nats_user_table_needs_exactly_one_complete_method() {
    for (table, key) in [
        ("user = \"a\"", "scheduler.nats.password"),
        ("password = \"x\"", "scheduler.nats.user"),
        ("user = \"\"\npassword = \"x\"", "scheduler.nats.user"),
        (
            "user = \"a\"\npassword = \"x\"\npassword_file = \"/p\"",
            "scheduler.nats.password",
        ),
        (
            "credentials_file = \"/c\"\nnkey_seed_file = \"/s\"",
            "scheduler.nats",
        ),
        (
            "user = \"a\"\npassword = \"x\"\ncredentials_file = \"/c\"",
            "scheduler.nats",
        ),
        ("", "scheduler.nats"),
        ("token = \"t\"", "scheduler.nats.token"),
    ] {
        let text = format!("{MINIMAL}\n[scheduler.nats]\n{table}\n");
        let err = load_env(&text, &[]).expect_err(table);
        assert!(
            err.to_string().contains(&format!("`{key}`")),
            "{table}: {err}"
        );
    }
}

#[cfg(unix)]
#[test]
fn a_nats_password_file_is_read_and_must_be_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nats-password");
    std::fs::write(&path, "file-pass\n").expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let text = format!(
        "{MINIMAL}\n[vm_worker.nats]\nuser = \"vm-worker\"\npassword_file = \"{}\"\n",
        path.display()
    );
    let config = load_env(&text, &[]).expect("valid");
    assert_eq!(
        config.nats_auth("vm_worker").expect("resolves"),
        Some(NatsAuth::UserPassword {
            user: "vm-worker".into(),
            password: "file-pass".into()
        })
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o664)).expect("chmod");
    let err = config
        .nats_auth("vm_worker")
        .expect_err("shared file accepted");
    assert!(
        err.to_string().contains("vm_worker.nats.password_file"),
        "{err}"
    );
    assert!(config.check_secret_files().is_err());
}

#[test]
fn bad_providers_are_refused_with_the_key_named() {
    let cases = [
        (
            "[[backend.pod.providers]]\nname = \"a\"\nweight = 0\n",
            "backend.pod.providers[0].weight",
        ),
        (
            "[[backend.pod.providers]]\nname = \"a\"\n[[backend.pod.providers]]\nname = \"b\"\nmax_runners = 21\n",
            "backend.pod.providers[1].max_runners",
        ),
        (
            "[[backend.pod.providers]]\nname = \"a\"\nmax_runners = 0\n",
            "backend.pod.providers[0].max_runners",
        ),
        (
            "[[backend.pod.providers]]\nname = \"East_1\"\n",
            "backend.pod.providers[0].name",
        ),
        (
            "[[backend.vm.providers]]\nname = \"a\"\nkubernetes = { namespace = \"x\" }\n",
            "backend.vm.providers[0].kubernetes",
        ),
        (
            "[[backend.pod.providers]]\nname = \"a\"\nopensandbox = { pool = \"x\" }\n",
            "backend.pod.providers[0].opensandbox",
        ),
        (
            "[[backend.pod.providers]]\nname = \"a\"\nwieght = 2\n",
            "wieght",
        ),
    ];
    for (providers, key) in cases {
        let err = load_env(&format!("{MINIMAL}\n{providers}"), &[]).expect_err(providers);
        assert!(err.to_string().contains(key), "{providers}: {err}");
    }
    let ok = "[[backend.pod.providers]]\nname = \"east\"\nweight = 3\nmax_runners = 20\nkubernetes = { namespace = \"jobs-east\" }\n[[backend.vm.providers]]\nname = \"big\"\nopensandbox = { pool = \"big\" }\n";
    let c = load_env(&format!("{MINIMAL}\n{ok}"), &[]).expect("valid providers");
    let east = &c.backend["pod"].providers[0];
    assert_eq!(
        east.kubernetes
            .as_ref()
            .and_then(|k| k.namespace.as_deref()),
        Some("jobs-east")
    );
}

#[test]
fn burst_tier_needs_a_default_tier_and_burst_providers() {
    let only_burst = "[[backend.pod.providers]]\nname = \"a\"\ntier = \"burst\"\n";
    let err = load_env(&format!("{MINIMAL}\n{only_burst}"), &[]).expect_err("no default tier");
    assert!(err.to_string().contains("backend.pod.providers"), "{err}");
    let table_only = "[backend.pod.burst]\nafter = \"30s\"\n";
    let text = MINIMAL.replace(
        "kubernetes = { namespace = \"jobs\" }\n",
        &format!("kubernetes = {{ namespace = \"jobs\" }}\n{table_only}"),
    );
    let err = load_env(&text, &[]).expect_err("no burst provider");
    assert!(err.to_string().contains("backend.pod.burst"), "{err}");
    let bad_tier = "[[backend.pod.providers]]\nname = \"a\"\ntier = \"spare\"\n";
    let err = load_env(&format!("{MINIMAL}\n{bad_tier}"), &[]).expect_err("unknown tier");
    assert!(err.to_string().contains("spare"), "{err}");
    let ok = "[[backend.pod.providers]]\nname = \"home\"\n[[backend.pod.providers]]\nname = \"cloud\"\ntier = \"burst\"\n[[backend.pod.burst.protected]]\nrepository = \"acme/release-*\"\n";
    let c = load_env(&format!("{MINIMAL}\n{ok}"), &[]).expect("valid burst tier");
    let burst = c.backend["pod"].burst.as_ref().expect("burst table");
    assert_eq!(
        burst.protected[0].repository.as_deref(),
        Some("acme/release-*")
    );
    assert_eq!(
        c.backend["pod"].providers[1].tier,
        crate::ProviderTier::Burst
    );
}

#[test]
fn a_zero_fair_share_is_refused_with_its_key() {
    let text = MINIMAL.replace(
        "kubernetes = { namespace = \"jobs\" }\n",
        "kubernetes = { namespace = \"jobs\" }\nfair_share = { per_repository = 0 }\n",
    );
    let err = load_env(&text, &[]).expect_err("zero quota");
    assert!(
        err.to_string()
            .contains("backend.pod.fair_share.per_repository"),
        "{err}"
    );
    let text = MINIMAL.replace(
        "kubernetes = { namespace = \"jobs\" }\n",
        "kubernetes = { namespace = \"jobs\" }\nfair_share = { per_repository = 3, per_owner = 5 }\n",
    );
    let c = load_env(&text, &[]).expect("valid quotas");
    let fair = c.backend["pod"].fair_share.clone().expect("fair_share");
    assert_eq!((fair.per_repository, fair.per_owner), (Some(3), Some(5)));
    for (table, key) in [
        (
            "fair_share = { weights = { \"acme/a\" = 2 } }",
            "backend.pod.fair_share.weights",
        ),
        (
            "fair_share = { per_repository = 2, weights = { \"acme/a\" = 0 } }",
            "backend.pod.fair_share.weights",
        ),
    ] {
        let text = MINIMAL.replace(
            "kubernetes = { namespace = \"jobs\" }\n",
            &format!("kubernetes = {{ namespace = \"jobs\" }}\n{table}\n"),
        );
        let err = load_env(&text, &[]).expect_err(table);
        assert!(err.to_string().contains(key), "{table}: {err}");
    }
}

#[test]
fn warm_executors_are_validated_with_their_keys() {
    let with = |table: &str| {
        MINIMAL.replace(
            "kubernetes = { namespace = \"jobs\" }\n",
            &format!("kubernetes = {{ namespace = \"jobs\" }}\n{table}\n"),
        )
    };
    let c = load_env(&with("warm = { min_idle = 2, max_idle = 3 }"), &[]).expect("valid warm");
    let warm = c.backend["pod"].warm.clone().expect("warm");
    assert_eq!((warm.min_idle, warm.max_idle()), (2, 3));
    assert_eq!(warm.idle_timeout, std::time::Duration::from_secs(300));
    assert_eq!(warm.max_age, std::time::Duration::from_secs(3600));
    let c = load_env(&with("warm = { min_idle = 2 }"), &[]).expect("valid warm");
    assert_eq!(
        c.backend["pod"].warm.as_ref().map(|w| w.max_idle()),
        Some(2)
    );
    for (table, key) in [
        (
            "warm = { min_idle = 3, max_idle = 2 }",
            "backend.pod.warm.max_idle",
        ),
        ("warm = { min_idle = 1000 }", "backend.pod.warm.min_idle"),
        (
            "warm = { min_idle = 1, max_idle = 1000 }",
            "backend.pod.warm.max_idle",
        ),
        (
            "warm = { min_idle = 1, idle_timeout = \"0s\" }",
            "backend.pod.warm.idle_timeout",
        ),
        (
            "warm = { min_idle = 1, max_age = \"10s\" }",
            "backend.pod.warm.max_age",
        ),
        ("warm = { min_idle = 1, spare = 2 }", "spare"),
        (
            "warm = { min_idle = 1 }\nfair_share = { per_repository = 2 }",
            "backend.pod.warm.min_idle",
        ),
    ] {
        let err = load_env(&with(table), &[]).expect_err(table);
        assert!(err.to_string().contains(key), "{table}: {err}");
    }
    let err = load_env(
        &with("warm = { min_idle = 1 }"),
        &[("JETRUNNER__POD_WORKER__PUBLISH_REQUESTED", "true")],
    )
    .expect_err("warm without the scheduler holding the key");
    assert!(err.to_string().contains("publish_requested"), "{err}");
}

#[test]
fn runtime_threads_default_to_one_and_are_bounded() {
    let c = load_env(MINIMAL, &[]).expect("valid");
    assert_eq!(c.runtime.threads, 1);
    let c = load_env(&format!("{MINIMAL}\n[runtime]\nthreads = 4\n"), &[]).expect("valid");
    assert_eq!(c.runtime.threads, 4);
    let err = load_env(&format!("{MINIMAL}\n[runtime]\nthreads = 0\n"), &[])
        .expect_err("no thread cannot run anything");
    assert!(err.to_string().contains("runtime.threads"), "{err}");
}

#[test]
fn github_entries_load_with_defaults_and_bad_ones_name_their_key() {
    let entry = GITHUB_ENTRY;
    let c = load_env(&format!("{MINIMAL}{entry}"), &[]).expect("valid");
    let g = &c.github[0];
    assert_eq!(
        (g.scale_set.as_str(), g.runner_group.as_str(), g.max_runners),
        ("jetrunner", "default", None)
    );
    assert_eq!(g.min_idle, 0);
    let warm = load_env(&format!("{MINIMAL}{entry}min_idle = 1\n"), &[]).expect("warm runners");
    assert_eq!(warm.github[0].min_idle, 1);
    assert!(
        !format!("{c:?}").contains("ghp_x"),
        "the PAT shows in Debug"
    );
    let app = r#"
[[github]]
name = "gh"
url = "https://github.com/acme"
backend = "vm"
app_id = "Iv1.x"
app_installation_id = 7
app_private_key_file = "/run/key.pem"
"#;
    load_env(&format!("{MINIMAL}{app}"), &[]).expect("an App is valid");
    for (bad, key) in [
        (
            entry.replace("name = \"gh\"", "name = \"Git Hub\""),
            "github[0].name",
        ),
        (
            entry.replace("backend = \"vm\"", "backend = \"gpu\""),
            "github[0].backend",
        ),
        (entry.replace("pat = \"ghp_x\"", ""), "github[0].pat"),
        (
            entry.replace("pat = \"ghp_x\"", "pat = \"x\"\napp_id = \"1\""),
            "github[0].pat",
        ),
        (app.replace("app_installation_id = 7", ""), "github[0].pat"),
        (
            entry.replace("https://github.com/acme", "github.com/acme"),
            "github[0].url",
        ),
        (format!("{entry}{entry}"), "github[1].name"),
        (
            format!("{entry}max_runners = 2\nmin_idle = 3\n"),
            "github[0].min_idle",
        ),
        (format!("{entry}min_idle = 1000\n"), "github[0].min_idle"),
        (
            app.replace(
                "https://github.com/acme",
                "https://github.com/Enterprises/big",
            ),
            "github[0].app_id",
        ),
    ] {
        let err = load_env(&format!("{MINIMAL}{bad}"), &[]).expect_err(key);
        assert!(err.to_string().contains(key), "{key}: {err}");
    }
}

#[test]
fn a_deployment_serves_github_alone_without_a_forge_table_but_not_no_forge_at_all() {
    let github = GITHUB_ENTRY;
    let without_forge = MINIMAL.replace(
        "[forge]\nurl = \"http://127.0.0.1:3000\"\nregistration_token = \"abc\"\n",
        "",
    );
    assert_ne!(without_forge, MINIMAL);
    let c = load_env(&format!("{without_forge}{github}"), &[]).expect("GitHub alone is valid");
    assert!(c.gitea().is_none());
    assert!(c.registration_names().is_empty());
    assert_eq!(c.intake_names(), vec!["github.gh".to_owned()]);
    let err = load_env(&without_forge, &[]).expect_err("no forge at all");
    assert!(err.to_string().contains("no forge configured"), "{err}");
    // With `[forge]` both are served, and its URL is still checked.
    let c = load_env(&format!("{MINIMAL}{github}"), &[]).expect("both");
    assert_eq!(c.registration_names(), vec!["pod", "vm"]);
    let bad = MINIMAL.replace("http://127.0.0.1:3000", "127.0.0.1:3000");
    assert!(load_env(&bad, &[]).is_err());
}

/// [`MINIMAL`] without its `[forge]` table.
fn without_forge_table() -> String {
    let text = MINIMAL.replace(
        "[forge]\nurl = \"http://127.0.0.1:3000\"\nregistration_token = \"abc\"\n",
        "",
    );
    assert_ne!(text, MINIMAL);
    text
}

const FORGE_ENTRIES: &str = r#"
[[forge]]
kind = "github"
name = "acme"
url = "https://github.com/acme"
backend = "vm"
pat = "ghp_x"

[[forge]]
kind = "forgejo"
url = "http://127.0.0.1:3000"
registration_token = "abc"
task_capacity = 4

[[forge]]
kind = "github"
name = "beta"
url = "https://github.com/beta"
backend = "pod"
pat = "ghp_y"
"#;

#[test]
fn forge_entries_of_every_kind_load_side_by_side() {
    let c = load_env(&format!("{}{FORGE_ENTRIES}", without_forge_table()), &[])
        .expect("[[forge]] entries are valid");
    let gitea = c.gitea().expect("the forgejo entry");
    assert_eq!(gitea.url, "http://127.0.0.1:3000");
    assert_eq!(gitea.flavor, ForgeFlavor::Forgejo);
    assert_eq!(gitea.task_capacity, 4);
    let names: Vec<_> = c.github.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["acme", "beta"]);
    assert_eq!(c.github[1].key("pat"), "forge[2].pat");
    assert_eq!(
        c.intake_names(),
        ["pod", "vm", "github.acme", "github.beta"].map(String::from)
    );
    // GitHub alone, as entries.
    let github_only = "[[forge]]\nkind = \"github\"\nname = \"gh\"\nurl = \"https://github.com/acme\"\nbackend = \"vm\"\npat = \"ghp_x\"\n";
    let c = load_env(&format!("{}{github_only}", without_forge_table()), &[])
        .expect("one GitHub entry");
    assert!(c.gitea().is_none());
    assert_eq!(c.intake_names(), ["github.gh".to_owned()]);
}

#[test]
fn the_older_forge_table_and_github_entries_still_load_alone_and_together() {
    // `[forge]` alone (the minimal file), `[[github]]` alone, and both.
    let c = load_env(MINIMAL, &[]).expect("[forge] alone");
    assert_eq!(c.gitea().map(|f| f.flavor), Some(ForgeFlavor::Gitea));
    assert!(c.github.is_empty());
    let c = load_env(&format!("{}{GITHUB_ENTRY}", without_forge_table()), &[])
        .expect("[[github]] alone");
    assert_eq!(c.github[0].key("pat"), "github[0].pat");
    let c = load_env(&format!("{MINIMAL}{GITHUB_ENTRY}"), &[]).expect("both");
    assert_eq!(c.intake_names().len(), 3);
    // The table may name its kind; and old and new forms mix.
    let forgejo = MINIMAL.replace("[forge]\n", "[forge]\nkind = \"forgejo\"\n");
    let c = load_env(&forgejo, &[]).expect("[forge] with a kind");
    assert_eq!(c.forge.flavor, ForgeFlavor::Forgejo);
    let mixed = format!(
        "{}{GITHUB_ENTRY}\n[[forge]]\nkind = \"gitea\"\nurl = \"http://g:3000\"\nregistration_token = \"t\"\n",
        without_forge_table()
    );
    let c = load_env(&mixed, &[]).expect("[[github]] beside [[forge]]");
    assert_eq!(c.forge.url, "http://g:3000");
    assert_eq!(c.github.len(), 1);
}

#[test]
fn bad_forge_entries_are_refused_with_the_key_as_written() {
    let base = without_forge_table();
    let gitea_entry =
        "\n[[forge]]\nkind = \"gitea\"\nurl = \"http://g:3000\"\nregistration_token = \"t\"\n";
    for (bad, key, says) in [
        // Without a kind, an entry with GitHub's keys is a GitHub one, and its errors say so.
        (
            FORGE_ENTRIES.replace("kind = \"forgejo\"\n", "").replace(
                "registration_token = \"abc\"",
                "registration_token = \"abc\"\nbackend = \"pod\"",
            ),
            "forge[1]",
            "unknown field `registration_token`",
        ),
        (
            FORGE_ENTRIES.replace("kind = \"forgejo\"", "kind = \"gitlab\""),
            "forge[1].kind",
            "gitlab",
        ),
        (
            FORGE_ENTRIES.replace("task_capacity = 4", "task_capacity = 4\nflavor = \"gitea\""),
            "forge[1].flavor",
            "contradicts",
        ),
        // Errors of moved entries name them where they are written.
        (
            FORGE_ENTRIES.replace("pat = \"ghp_y\"", ""),
            "forge[2].pat",
            "",
        ),
        (
            FORGE_ENTRIES.replace("name = \"beta\"", "name = \"acme\""),
            "forge[2].name",
            "another",
        ),
        (
            FORGE_ENTRIES.replace(
                "registration_token = \"abc\"",
                "registratoin_token = \"abc\"",
            ),
            "forge[1]",
            "registratoin_token",
        ),
        (
            FORGE_ENTRIES.replace("http://127.0.0.1:3000", "127.0.0.1:3000"),
            "forge[1].url",
            "http",
        ),
        (
            format!("{FORGE_ENTRIES}{gitea_entry}"),
            "forge[3]",
            "second Gitea/Forgejo forge",
        ),
    ] {
        let err = load_env(&format!("{base}{bad}"), &[]).expect_err(key);
        let text = err.to_string();
        assert!(text.contains(key) && text.contains(says), "{key}: {text}");
    }
    let err = load_env(
        &MINIMAL.replace("[forge]\n", "[forge]\nkind = \"github\"\n"),
        &[],
    )
    .expect_err("a GitHub [forge] table");
    assert!(err.to_string().contains("forge.kind"), "{err}");
}

#[test]
fn urls_that_do_not_parse_as_their_key_expects_are_refused_with_the_key() {
    for (from, to, key) in [
        (
            "url = \"http://127.0.0.1:3000\"",
            "url = \"http://\"",
            "forge.url",
        ),
        (
            "opensandbox = { url = \"http://127.0.0.1:8081\" }",
            "opensandbox = { url = \"htp:/sandbox:8081\" }",
            "backend.vm.opensandbox.url",
        ),
        (
            "public_url = \"http://127.0.0.1:8080\"",
            "public_url = \"scheduler:8080\"",
            "facade.public_url",
        ),
        (
            "url = \"nats://127.0.0.1:4222\"",
            "url = \"nats://\"",
            "nats.url",
        ),
    ] {
        let bad = MINIMAL.replace(from, to);
        assert_ne!(bad, MINIMAL, "{key}");
        let err = load_env(&bad, &[]).expect_err(key);
        assert!(
            err.to_string().contains(&format!("`{key}`")),
            "{key}: {err}"
        );
    }
}

#[test]
fn an_environment_override_that_is_refused_names_its_variable() {
    let err = load_env(MINIMAL, &[("JETRUNNER__BACKEND__POD__CAPACITY", "many")])
        .expect_err("not a number");
    let text = err.to_string();
    assert!(
        text.contains("JETRUNNER__BACKEND__POD__CAPACITY") && text.contains("backend.pod.capacity"),
        "{text}"
    );
    let err = load_env(MINIMAL, &[("JETRUNNER__FORGE__URL", "forge:3000")]).expect_err("not a URL");
    assert!(err.to_string().contains("JETRUNNER__FORGE__URL"), "{err}");
}

#[test]
fn check_lists_every_problem_of_a_file_at_once() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_dir = dir.path().join("a-directory");
    std::fs::create_dir(&secret_dir).expect("dir");
    let open_secret = dir.path().join("seal-keys.toml");
    std::fs::write(&open_secret, "k1 = \"x\"\n").expect("write");
    std::fs::set_permissions(&open_secret, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let text = format!(
        "{}\n[scheduler]\nseal_keys_file = \"{}\"\n\n[pod_worker]\ntoken_key_file = \"{}\"\n\n[vm_worker]\ntoken_key_file = \"{}\"\n",
        MINIMAL
            .replace(
                "public_url = \"http://127.0.0.1:8080\"",
                "public_url = \"scheduler:8080\""
            )
            .replace(
                "opensandbox = { url = \"http://127.0.0.1:8081\" }",
                "opensandbox = { url = \"htp:/x\" }"
            ),
        open_secret.display(),
        secret_dir.display(),
        dir.path().join("missing").display(),
    );
    let path = dir.path().join("jetrunner.toml");
    std::fs::write(&path, text).expect("write config");
    let problems = check(&path).expect_err("several problems");
    let all: Vec<String> = problems.iter().map(ToString::to_string).collect();
    for says in [
        "facade.public_url",
        "backend.vm.opensandbox.url",
        "scheduler.seal_keys_file",
        "is a directory, not a file",
        "does not exist",
    ] {
        assert!(
            all.iter().any(|p| p.contains(says)),
            "{says} not in {all:#?}"
        );
    }
    assert!(all.len() >= 5, "{all:#?}");
    // A good file has no problem.
    let good = dir.path().join("good.toml");
    std::fs::write(&good, MINIMAL).expect("write");
    check(&good).expect("no problem");
}

#[test]
fn a_secret_path_that_is_a_directory_is_called_a_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = check_secret_file("scheduler.seal_keys_file", dir.path()).expect_err("a directory");
    assert!(err.to_string().contains("is a directory"), "{err}");
}

#[test]
fn runner_blocks_are_checked_by_every_binary() {
    let with_block = |backend: &str, block: &str| {
        MINIMAL.replace(
            &format!("[backend.{backend}]\n"),
            &format!("[backend.{backend}]\nrunner = {block}\n"),
        )
    };
    load_env(
        &with_block("pod", "{ image = \"runner:1\", env = { A = \"b\" } }"),
        &[],
    )
    .expect("a pod runner block");
    let err = load_env(
        &with_block("pod", "{ image = \"runner:1\", volumes = [] }"),
        &[],
    )
    .expect_err("volumes is not a runner block key");
    assert!(
        err.to_string().contains("backend.pod.runner.volumes"),
        "{err}"
    );
    let err = load_env(&with_block("vm", "{ image = \"runner:1\" }"), &[])
        .expect_err("a vm backend has no runner block");
    assert!(err.to_string().contains("backend.vm.runner"), "{err}");
}

#[test]
fn a_forge_entry_without_a_kind_is_read_by_its_keys() {
    let entries = FORGE_ENTRIES
        .replace("kind = \"github\"\n", "")
        .replace("kind = \"forgejo\"\n", "flavor = \"forgejo\"\n");
    let c = load_env(&format!("{}{entries}", without_forge_table()), &[])
        .expect("kinds read from the keys");
    assert_eq!(c.gitea().map(|f| f.flavor), Some(ForgeFlavor::Forgejo));
    assert_eq!(c.github.len(), 2);
    let gitea_only = "[[forge]]\nurl = \"http://g:3000\"\nregistration_token = \"t\"\n";
    let c = load_env(&format!("{}{gitea_only}", without_forge_table()), &[])
        .expect("a Gitea entry without a kind");
    assert_eq!(c.gitea().map(|f| f.flavor), Some(ForgeFlavor::Gitea));
}
