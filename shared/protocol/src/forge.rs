//! Which forge an assignment's job came from, parsed once from its `forge_instance`, and what
//! that means for the executor that runs it (the executor contract). Every decision that
//! depends on the kind of forge matches [`ForgeKind`] exhaustively; nothing else reads the
//! `forge_instance` text.

/// What a GitHub assignment's `forge_instance` starts with (then the forge's `[[github]]`
/// name); a Gitea or Forgejo one is the forge's URL.
const GITHUB_PREFIX: &str = "github:";

/// The forge of an assignment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ForgeKind {
    /// Gitea or Forgejo, by URL: the assignment is the forge's task, which the executor
    /// fetches from the facade and runs.
    Gitea(String),
    /// A GitHub scale set, by its `[[github]]` name: the assignment stands for a just-in-time
    /// runner, whose config the executor asks the facade for; GitHub gives the runner a job.
    GitHub(String),
}

impl ForgeKind {
    /// Reads an assignment's `forge_instance`.
    pub fn parse(forge_instance: &str) -> ForgeKind {
        match forge_instance.strip_prefix(GITHUB_PREFIX) {
            Some(name) => ForgeKind::GitHub(name.to_owned()),
            None => ForgeKind::Gitea(forge_instance.to_owned()),
        }
    }

    /// The `forge_instance` text of this forge (the inverse of [`ForgeKind::parse`]).
    pub fn instance(&self) -> String {
        match self {
            ForgeKind::Gitea(url) => url.clone(),
            ForgeKind::GitHub(name) => format!("{GITHUB_PREFIX}{name}"),
        }
    }

    /// The value of `JETRUNNER_FORGE` a workload gets: how its entrypoint starts the runner
    /// (none: act_runner against the facade, the default).
    pub fn executor_forge_env(&self) -> Option<&'static str> {
        match self {
            ForgeKind::Gitea(_) => None,
            ForgeKind::GitHub(_) => Some("github"),
        }
    }

    /// Whether a warm executor (an act_runner started ahead of demand, waiting on the facade)
    /// may run the job. A GitHub job runs only on the runner made for it.
    pub fn may_bind_warm(&self) -> bool {
        match self {
            ForgeKind::Gitea(_) => true,
            ForgeKind::GitHub(_) => false,
        }
    }

    /// Whether the assignment is a task the forge handed out, which the scheduler keeps alive
    /// at the forge until an executor claims it and reports failed when its workload is lost.
    pub fn holds_forge_task(&self) -> bool {
        match self {
            ForgeKind::Gitea(_) => true,
            ForgeKind::GitHub(_) => false,
        }
    }
}

/// What is sealed into the assignment of a runner-bound forge (GitHub): the one-use
/// registration the executor's runner starts with, handed out by the facade's runner-config
/// route. JSON, sealed like a Gitea task.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct RunnerRegistration {
    /// The just-in-time runner's name (`jr-<assignment>-<attempt>`).
    pub runner_name: String,
    /// The forge's encoded just-in-time config: the runner starts with `--jitconfig <this>`.
    pub jit_config: String,
}

impl std::fmt::Debug for RunnerRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunnerRegistration")
            .field("runner_name", &self.runner_name)
            .field("jit_config", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instances_parse_to_their_kind_and_back() {
        for (text, kind) in [
            (
                "https://gitea.example",
                ForgeKind::Gitea("https://gitea.example".to_owned()),
            ),
            ("github:acme", ForgeKind::GitHub("acme".to_owned())),
        ] {
            assert_eq!(ForgeKind::parse(text), kind);
            assert_eq!(kind.instance(), text);
        }
        let github = ForgeKind::parse("github:acme");
        assert_eq!(github.executor_forge_env(), Some("github"));
        assert!(!github.may_bind_warm() && !github.holds_forge_task());
        let gitea = ForgeKind::parse("http://forge:3000");
        assert_eq!(gitea.executor_forge_env(), None);
        assert!(gitea.may_bind_warm() && gitea.holds_forge_task());
    }
}
