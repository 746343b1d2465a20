//! The configured GitHub URL: which organisation, repository or enterprise the scale set
//! belongs to, and where its REST API is.

use crate::GitHubError;

/// Whose runners these are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    Organization { org: String },
    Repository { owner: String, repo: String },
    Enterprise { enterprise: String },
}

/// A parsed config URL (`https://github.com/acme`, `https://github.com/acme/app`,
/// `https://github.com/enterprises/big`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigUrl {
    /// As configured, without trailing slashes (sent to the runner registration).
    pub url: String,
    pub scope: Scope,
    /// REST API base without a trailing slash.
    pub api: String,
}

impl ConfigUrl {
    /// Parses `url`. `api` overrides the REST API base (GitHub Enterprise Server behind a
    /// proxy, or a test server); otherwise github.com and `*.ghe.com` use `api.<host>` and
    /// any other host `https://<host>/api/v3`.
    pub fn parse(url: &str, api: Option<&str>) -> Result<ConfigUrl, GitHubError> {
        let trimmed = url.trim().trim_end_matches('/');
        let parsed = url::Url::parse(trimmed)
            .map_err(|e| GitHubError::Config(format!("github url {trimmed:?}: {e}")))?;
        let host = parsed
            .host_str()
            .ok_or_else(|| GitHubError::Config(format!("github url {trimmed:?} has no host")))?
            .to_ascii_lowercase();
        let segments: Vec<&str> = parsed
            .path_segments()
            .map(|s| s.filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        let scope = match segments.as_slice() {
            ["enterprises", enterprise] => Scope::Enterprise {
                enterprise: (*enterprise).to_owned(),
            },
            [org] => Scope::Organization {
                org: (*org).to_owned(),
            },
            [owner, repo] => Scope::Repository {
                owner: (*owner).to_owned(),
                repo: (*repo).to_owned(),
            },
            _ => {
                return Err(GitHubError::Config(format!(
                    "github url {trimmed:?} must name an organisation (https://github.com/ORG), a repository (…/OWNER/REPO) or an enterprise (…/enterprises/NAME)"
                )));
            }
        };
        let api = match api {
            Some(api) => api.trim_end_matches('/').to_owned(),
            None if host == "github.com" || host == "www.github.com" => {
                "https://api.github.com".to_owned()
            }
            None if host.ends_with(".ghe.com") || host == "github.localhost" => {
                format!("{}://api.{host}", parsed.scheme())
            }
            None => format!("{}://{host}/api/v3", parsed.scheme()),
        };
        Ok(ConfigUrl {
            url: trimmed.to_owned(),
            scope,
            api,
        })
    }

    /// The REST path of the registration-token endpoint for this scope.
    pub fn registration_token_path(&self) -> String {
        match &self.scope {
            Scope::Organization { org } => {
                format!("/orgs/{org}/actions/runners/registration-token")
            }
            Scope::Repository { owner, repo } => {
                format!("/repos/{owner}/{repo}/actions/runners/registration-token")
            }
            Scope::Enterprise { enterprise } => {
                format!("/enterprises/{enterprise}/actions/runners/registration-token")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_and_api_bases() {
        let org = ConfigUrl::parse("https://github.com/acme/", None).expect("org");
        assert_eq!(org.scope, Scope::Organization { org: "acme".into() });
        assert_eq!(org.api, "https://api.github.com");
        assert_eq!(org.url, "https://github.com/acme");
        let repo = ConfigUrl::parse("https://github.com/acme/app", None).expect("repo");
        assert_eq!(
            repo.registration_token_path(),
            "/repos/acme/app/actions/runners/registration-token"
        );
        let ent = ConfigUrl::parse("https://ghes.example.com/enterprises/big", None).expect("ent");
        assert_eq!(ent.api, "https://ghes.example.com/api/v3");
        assert_eq!(
            ent.scope,
            Scope::Enterprise {
                enterprise: "big".into()
            }
        );
        let cloud = ConfigUrl::parse("https://octo.ghe.com/acme", None).expect("ghe.com");
        assert_eq!(cloud.api, "https://api.octo.ghe.com");
        let local = ConfigUrl::parse("https://github.com/acme", Some("http://127.0.0.1:9/"))
            .expect("override");
        assert_eq!(local.api, "http://127.0.0.1:9");
    }

    #[test]
    fn urls_that_name_nothing_are_refused() {
        for bad in [
            "https://github.com",
            "https://github.com/a/b/c",
            "github.com/acme",
            "",
        ] {
            assert!(ConfigUrl::parse(bad, None).is_err(), "{bad} accepted");
        }
    }
}
