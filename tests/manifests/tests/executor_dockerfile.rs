//! executor/Dockerfile: each runner release is pinned and its download is checked against a
//! SHA-256 before anything is installed; both targets run the same entrypoint; the docs name the
//! pinned versions. (No Docker engine is needed: the file is read as text.)

mod common;

use common::{read, repo_root};

/// One instruction with its continuation lines joined.
#[derive(Debug)]
struct Instruction {
    stage: String,
    keyword: String,
    args: String,
}

/// The instructions of a Dockerfile, each tagged with its stage name (`AS name`; the global
/// section before the first FROM is "").
fn instructions(text: &str) -> Vec<Instruction> {
    let mut joined = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            current.push_str(head.trim_end());
            current.push(' ');
        } else {
            current.push_str(trimmed);
            joined.push(std::mem::take(&mut current));
        }
    }
    assert!(current.is_empty(), "dangling line continuation");
    let mut stage = String::new();
    joined
        .into_iter()
        .map(|line| {
            let (keyword, args) = line.split_once(' ').unwrap_or((line.as_str(), ""));
            let keyword = keyword.to_ascii_uppercase();
            if keyword == "FROM" {
                let words: Vec<&str> = args.split_whitespace().collect();
                stage = match words.as_slice() {
                    [_, as_kw, name] if as_kw.eq_ignore_ascii_case("as") => (*name).to_owned(),
                    _ => String::new(),
                };
            }
            Instruction {
                stage: stage.clone(),
                keyword,
                args: args.trim().to_owned(),
            }
        })
        .collect()
}

fn dockerfile() -> Vec<Instruction> {
    instructions(&read(&repo_root().join("executor/Dockerfile")))
}

/// `ARG name=default` of `stage`.
fn arg_default(all: &[Instruction], stage: &str, name: &str) -> Option<String> {
    all.iter()
        .filter(|i| i.stage == stage && i.keyword == "ARG")
        .find_map(|i| {
            let (n, v) = i.args.split_once('=')?;
            (n == name).then(|| v.to_owned())
        })
}

fn is_release_version(v: &str) -> bool {
    let parts: Vec<&str> = v.split('.').collect();
    parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
}

fn is_sha256(v: &str) -> bool {
    v.len() == 64
        && v.chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
}

struct Runner {
    /// Build-argument prefix.
    prefix: &'static str,
    download_stage: &'static str,
    final_stage: &'static str,
    binary: &'static str,
}

/// GitHub's runner: a directory, not one binary (see
/// `the_github_target_runs_the_checked_actions_runner`).
const ACTIONS_RUNNER: Runner = Runner {
    prefix: "ACTIONS_RUNNER",
    download_stage: "actions-runner-download",
    final_stage: "actions-runner",
    binary: "actions-runner",
};

const RUNNERS: [Runner; 2] = [
    Runner {
        prefix: "ACT_RUNNER",
        download_stage: "act-runner-download",
        final_stage: "act-runner",
        binary: "act_runner",
    },
    Runner {
        prefix: "FORGEJO_RUNNER",
        download_stage: "forgejo-runner-download",
        final_stage: "forgejo-runner",
        binary: "forgejo-runner",
    },
];

#[test]
fn each_runner_release_is_pinned_with_a_checksum_per_architecture() {
    let all = dockerfile();
    for r in RUNNERS.into_iter().chain([ACTIONS_RUNNER]) {
        let version = arg_default(&all, r.download_stage, &format!("{}_VERSION", r.prefix))
            .unwrap_or_else(|| panic!("{}_VERSION has a default", r.prefix));
        assert!(
            is_release_version(&version),
            "{}_VERSION={version} must be an exact release, not a tag like latest",
            r.prefix
        );
        let amd64 = arg_default(
            &all,
            r.download_stage,
            &format!("{}_SHA256_AMD64", r.prefix),
        )
        .unwrap_or_default();
        assert!(
            is_sha256(&amd64),
            "{}_SHA256_AMD64 is a lower-case SHA-256: {amd64:?}",
            r.prefix
        );
        let arm64 = arg_default(
            &all,
            r.download_stage,
            &format!("{}_SHA256_ARM64", r.prefix),
        );
        assert!(
            arm64
                .as_deref()
                .is_some_and(|v| v.is_empty() || is_sha256(v)),
            "{}_SHA256_ARM64 is declared (empty = arm64 builds refuse): {arm64:?}",
            r.prefix
        );
    }
}

#[test]
fn each_download_is_verified_before_it_is_installed_and_never_unchecked() {
    let all = dockerfile();
    for r in RUNNERS.into_iter().chain([ACTIONS_RUNNER]) {
        let runs: Vec<&Instruction> = all
            .iter()
            .filter(|i| i.stage == r.download_stage && i.keyword == "RUN")
            .collect();
        assert_eq!(
            runs.len(),
            1,
            "{}: one RUN step downloads and checks",
            r.download_stage
        );
        let run = &runs[0].args;
        let url_at = run
            .find(&format!("/releases/download/v${{{}_VERSION}}/", r.prefix))
            .unwrap_or_else(|| panic!("{}: the URL uses the pinned version: {run}", r.prefix));
        let check_at = run
            .find("sha256sum -c")
            .unwrap_or_else(|| panic!("{}: sha256sum -c runs: {run}", r.prefix));
        let install_at = run
            .find("/out/")
            .unwrap_or_else(|| panic!("{}: the binary lands in /out: {run}", r.prefix));
        assert!(
            url_at < check_at && check_at < install_at,
            "{}: download, then check, then install",
            r.prefix
        );
        assert!(
            run.starts_with("set -eu"),
            "{}: a failed check stops the build",
            r.prefix
        );
        assert!(
            run.contains("[ -n \"$sum\" ] ||"),
            "{}: an empty checksum refuses the download",
            r.prefix
        );
        for arch in ["AMD64", "ARM64"] {
            assert!(
                run.contains(&format!("sum=\"${}_SHA256_{arch}\"", r.prefix)),
                "{}: {arch} uses its own checksum",
                r.prefix
            );
        }
    }
}

#[test]
fn both_targets_run_the_entrypoint_with_their_runner_and_act_runner_is_the_default() {
    let all = dockerfile();
    let froms: Vec<&Instruction> = all.iter().filter(|i| i.keyword == "FROM").collect();
    assert_eq!(
        froms.last().map(|i| i.stage.as_str()),
        Some("act-runner"),
        "the last stage is the default target"
    );
    let runtime = |keyword: &str| -> Vec<&Instruction> {
        all.iter()
            .filter(|i| i.stage == "runtime" && i.keyword == keyword)
            .collect()
    };
    let entrypoint = runtime("ENTRYPOINT");
    assert_eq!(entrypoint.len(), 1);
    assert!(
        entrypoint[0]
            .args
            .contains("\"/usr/local/bin/jetrunner-executor\""),
        "{}",
        entrypoint[0].args
    );
    assert!(
        runtime("COPY")
            .iter()
            .any(|c| c.args == "entrypoint.sh /usr/local/bin/jetrunner-executor"),
        "the entrypoint script is copied to the path ENTRYPOINT runs"
    );
    assert!(
        runtime("USER")
            .iter()
            .any(|u| !u.args.starts_with('0') && !u.args.starts_with("root")),
        "the runner does not run as root"
    );
    for r in RUNNERS {
        let stage: Vec<&Instruction> = all.iter().filter(|i| i.stage == r.final_stage).collect();
        assert!(
            stage
                .iter()
                .any(|i| i.keyword == "FROM" && i.args.starts_with("runtime ")),
            "{} builds on the shared runtime",
            r.final_stage
        );
        assert!(
            stage.iter().any(|i| i.keyword == "COPY"
                && i.args
                    == format!(
                        "--from={} /out/{} /usr/local/bin/{}",
                        r.download_stage, r.binary, r.binary
                    )),
            "{} installs the checked {}",
            r.final_stage,
            r.binary
        );
        assert!(
            stage
                .iter()
                .any(|i| i.keyword == "ENV" && i.args == format!("EXECUTOR_RUNNER={}", r.binary)),
            "{} tells the entrypoint which runner to exec",
            r.final_stage
        );
    }
}

#[test]
fn the_github_target_runs_the_checked_actions_runner() {
    let all = dockerfile();
    let stage: Vec<&Instruction> = all
        .iter()
        .filter(|i| i.stage == ACTIONS_RUNNER.final_stage)
        .collect();
    assert!(
        stage
            .iter()
            .any(|i| i.keyword == "FROM" && i.args.starts_with("runtime ")),
        "actions-runner builds on the shared runtime (the entrypoint is its ENTRYPOINT)"
    );
    assert!(
        stage.iter().any(|i| i.keyword == "COPY"
            && i.args == "--from=actions-runner-download /out/actions-runner /opt/actions-runner"),
        "actions-runner installs the checked runner"
    );
    assert!(
        stage.iter().any(|i| i.keyword == "ENV"
            && i.args == "EXECUTOR_ACTIONS_RUNNER=/opt/actions-runner/run.sh"),
        "the entrypoint is told where run.sh is"
    );
    let user = stage.iter().rev().find(|i| i.keyword == "USER");
    assert!(
        user.is_some_and(|u| !u.args.starts_with('0') && !u.args.starts_with("root")),
        "the runner does not run as root: {user:?}"
    );
}

#[test]
fn the_docs_name_the_pinned_versions() {
    let all = dockerfile();
    let doc = read(&repo_root().join("docs/executor.md"));
    let readme = read(&repo_root().join("README.md"));
    for r in RUNNERS.into_iter().chain([ACTIONS_RUNNER]) {
        let version = arg_default(&all, r.download_stage, &format!("{}_VERSION", r.prefix))
            .unwrap_or_default();
        assert!(
            doc.contains(&format!("{} {version}", r.binary)),
            "docs/executor.md names {} {version}",
            r.binary
        );
    }
    assert!(
        readme.contains("docs/executor.md"),
        "the README points at the executor docs"
    );
    assert!(
        readme.contains("executor/"),
        "the README shows the build command"
    );
}

#[test]
fn the_parser_sees_stages_and_continuations() {
    let all = instructions("ARG X=1\nFROM a AS b\n# c\nRUN one \\\n  two\nFROM b\nENV K=v\n");
    let seen: Vec<(&str, &str, &str)> = all
        .iter()
        .map(|i| (i.stage.as_str(), i.keyword.as_str(), i.args.as_str()))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("", "ARG", "X=1"),
            ("b", "FROM", "a AS b"),
            ("b", "RUN", "one two"),
            ("", "FROM", "b"),
            ("", "ENV", "K=v"),
        ]
    );
}
