//! The binary's own command line: `--version`, and `--check-config` listing every problem of
//! a file without starting anything (the same bootstrap serves every service).

use std::process::Command;

fn scheduler() -> Command {
    Command::new(env!("CARGO_BIN_EXE_scheduler"))
}

#[test]
fn version_names_the_binary_and_the_release() {
    let out = scheduler().arg("--version").output().expect("runs");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.trim(),
        format!("scheduler {}", env!("CARGO_PKG_VERSION")),
        "{text}"
    );
}

#[test]
fn check_config_accepts_the_shipped_file_and_lists_every_problem_of_a_bad_one() {
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../../config/jetrunner.toml");
    let text = std::fs::read_to_string(shipped).expect("shipped config");
    let dir = tempfile::tempdir().expect("tempdir");
    // The shipped file names secret files of the compose layout; checked here without them.
    let good = dir.path().join("good.toml");
    std::fs::write(&good, &text).expect("write");
    let out = scheduler()
        .args(["--check-config", good.to_str().expect("utf-8")])
        .env_remove("JETRUNNER_CONFIG")
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        // Only missing files may be reported for the shipped file.
        assert!(
            stderr.lines().skip(1).all(|l| l.contains("does not exist")),
            "{stderr}"
        );
    } else {
        assert!(stdout.contains("valid for every service"), "{stdout}");
    }

    let bad = dir.path().join("bad.toml");
    let broken = text
        .replace(
            "public_url = \"http://scheduler:8080\"",
            "public_url = \"scheduler:8080\"",
        )
        .replace(
            "url = \"http://fake-forge:3000\"",
            "url = \"htp:/fake-forge:3000\"",
        );
    assert_ne!(broken, text);
    std::fs::write(&bad, broken).expect("write");
    let out = scheduler()
        .args(["--check-config", bad.to_str().expect("utf-8")])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("problem(s)"), "{stderr}");
    assert!(stderr.contains("facade.public_url"), "{stderr}");
    assert!(stderr.contains("forge.url"), "{stderr}");
    assert!(
        stderr.lines().filter(|l| l.starts_with("  - ")).count() >= 2,
        "every problem listed: {stderr}"
    );
}
