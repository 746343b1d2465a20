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
/// `https://github.com/enterprises/big`, or the same on a GitHub Enterprise Server).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigUrl {
    /// As configured, without trailing slashes (sent to the runner registration).
    pub url: String,
    pub scope: Scope,
    /// REST API base without a trailing slash; its path (`/api/v3`, or a proxy's prefix given
    /// as the override) is kept in front of every REST path.
    pub api: String,
}

impl ConfigUrl {
    /// Parses `url`. `api` overrides the REST API base (GitHub Enterprise Server behind a
    /// proxy with a path prefix, or a test server); otherwise it is derived as
    /// `actions/scaleset` derives it:
    /// - github.com and www.github.com: `https://api.github.com`;
    /// - `*.ghe.com` and `github.localhost`: `api.` + the host, with the URL's scheme and port;
    /// - any other host (GitHub Enterprise Server): `/api/v3` on the URL's scheme, host and
    ///   port.
    ///
    /// The path names the scope: one segment is an organisation, two are a repository, and
    /// `enterprises/NAME` (matched case-insensitively) an enterprise. A path prefix in front
    /// of them cannot be told from a repository's owner, so it is refused as actions/scaleset
    /// refuses it; a server under a prefix is reached by giving `api`.
    pub fn parse(url: &str, api: Option<&str>) -> Result<ConfigUrl, GitHubError> {
        let trimmed = url.trim().trim_end_matches('/');
        let parsed = url::Url::parse(trimmed)
            .map_err(|e| GitHubError::Config(format!("github url {trimmed:?}: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(GitHubError::Config(format!(
                "github url {trimmed:?} must be http or https"
            )));
        }
        let host = parsed
            .host_str()
            .ok_or_else(|| GitHubError::Config(format!("github url {trimmed:?} has no host")))?
            .to_ascii_lowercase();
        let segments: Vec<&str> = parsed
            .path_segments()
            .map(|s| s.filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        let scope = match segments.as_slice() {
            [kind, enterprise] if kind.eq_ignore_ascii_case("enterprises") => Scope::Enterprise {
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
            Some(api) => {
                let api = api.trim().trim_end_matches('/');
                url::Url::parse(api)
                    .map_err(|e| GitHubError::Config(format!("github api url {api:?}: {e}")))?;
                api.to_owned()
            }
            None => Self::derived_api(&parsed, &host)?,
        };
        Ok(ConfigUrl {
            url: trimmed.to_owned(),
            scope,
            api,
        })
    }

    /// The REST base `url` implies. Built from the parsed URL rather than from its host name,
    /// so that the scheme and an explicit port survive (a GitHub Enterprise Server on
    /// `http://ghes:8080/acme` has its API on `http://ghes:8080/api/v3`); credentials, query
    /// and fragment of the config URL are dropped.
    fn derived_api(parsed: &url::Url, host: &str) -> Result<String, GitHubError> {
        if host == "github.com" || host == "www.github.com" {
            return Ok("https://api.github.com".to_owned());
        }
        let mut api = parsed.clone();
        let refused =
            |what: &str| GitHubError::Config(format!("github url {parsed}: cannot derive {what}"));
        api.set_username("").map_err(|()| refused("the API base"))?;
        api.set_password(None)
            .map_err(|()| refused("the API base"))?;
        api.set_query(None);
        api.set_fragment(None);
        if host.ends_with(".ghe.com") || host == "github.localhost" {
            api.set_host(Some(&format!("api.{host}")))
                .map_err(|e| refused(&format!("the API host: {e}")))?;
            api.set_path("");
        } else {
            api.set_path("/api/v3");
        }
        Ok(api.as_str().trim_end_matches('/').to_owned())
    }

    /// `path` (starting with `/`) under the REST base.
    pub fn rest_url(&self, path: &str) -> String {
        format!("{}{path}", self.api)
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

    /// Where a registration token for this scope is made.
    pub fn registration_token_url(&self) -> String {
        self.rest_url(&self.registration_token_path())
    }

    /// Where a registration token is exchanged for the Actions service URL and admin token.
    pub fn runner_registration_url(&self) -> String {
        self.rest_url("/actions/runner-registration")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> ConfigUrl {
        ConfigUrl::parse(url, None).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    #[test]
    fn github_com_urls_name_their_scope_and_use_api_github_com() {
        let org = parse("https://github.com/acme/");
        assert_eq!(org.scope, Scope::Organization { org: "acme".into() });
        assert_eq!(org.url, "https://github.com/acme");
        assert_eq!(
            org.registration_token_url(),
            "https://api.github.com/orgs/acme/actions/runners/registration-token"
        );
        assert_eq!(
            org.runner_registration_url(),
            "https://api.github.com/actions/runner-registration"
        );
        let repo = parse("https://www.github.com/acme/app");
        assert_eq!(
            repo.registration_token_url(),
            "https://api.github.com/repos/acme/app/actions/runners/registration-token"
        );
        let ent = parse("https://github.com/enterprises/big");
        assert_eq!(
            ent.registration_token_url(),
            "https://api.github.com/enterprises/big/actions/runners/registration-token"
        );
    }

    #[test]
    fn an_enterprise_server_url_keeps_its_scheme_and_port() {
        let org = parse("http://ghes.internal:44611/acme");
        assert_eq!(org.api, "http://ghes.internal:44611/api/v3");
        assert_eq!(
            org.registration_token_url(),
            "http://ghes.internal:44611/api/v3/orgs/acme/actions/runners/registration-token"
        );
        assert_eq!(
            org.runner_registration_url(),
            "http://ghes.internal:44611/api/v3/actions/runner-registration"
        );
        let repo = parse("https://10.0.0.7:8443/acme/app/");
        assert_eq!(
            repo.registration_token_url(),
            "https://10.0.0.7:8443/api/v3/repos/acme/app/actions/runners/registration-token"
        );
        let v6 = parse("https://[fd00::7]:8443/acme");
        assert_eq!(v6.api, "https://[fd00::7]:8443/api/v3");
        // A default port is no port; credentials and a query are not carried into the API.
        let plain = parse("https://user:pw@ghes.example.com:443/enterprises/big?x=1");
        assert_eq!(plain.api, "https://ghes.example.com/api/v3");
    }

    #[test]
    fn an_enterprise_server_behind_a_path_prefix_keeps_the_prefix_of_its_api_url() {
        let prefixed = ConfigUrl::parse(
            "https://proxy.example.com/acme",
            Some("https://proxy.example.com:8443/github/api/v3/"),
        )
        .expect("override");
        assert_eq!(
            prefixed.registration_token_url(),
            "https://proxy.example.com:8443/github/api/v3/orgs/acme/actions/runners/registration-token"
        );
        assert_eq!(
            prefixed.runner_registration_url(),
            "https://proxy.example.com:8443/github/api/v3/actions/runner-registration"
        );
        // The config URL itself is sent to the runner registration as configured.
        assert_eq!(prefixed.url, "https://proxy.example.com/acme");
    }

    #[test]
    fn a_ghe_com_url_uses_the_api_host_with_its_scheme_and_port() {
        let cloud = parse("https://octo.ghe.com/acme");
        assert_eq!(cloud.api, "https://api.octo.ghe.com");
        assert_eq!(
            cloud.registration_token_url(),
            "https://api.octo.ghe.com/orgs/acme/actions/runners/registration-token"
        );
        let local = parse("http://github.localhost:3000/enterprises/big");
        assert_eq!(local.api, "http://api.github.localhost:3000");
        assert_eq!(
            local.runner_registration_url(),
            "http://api.github.localhost:3000/actions/runner-registration"
        );
    }

    #[test]
    fn enterprises_is_matched_whatever_its_case() {
        for url in [
            "https://github.com/Enterprises/big",
            "https://ghes.example.com/ENTERPRISES/big",
        ] {
            assert_eq!(
                parse(url).scope,
                Scope::Enterprise {
                    enterprise: "big".into()
                },
                "{url}"
            );
        }
    }

    #[test]
    fn urls_that_name_nothing_are_refused() {
        for bad in [
            "https://github.com",
            "https://github.com/a/b/c",
            "https://ghes.example.com/prefix/enterprises/big",
            "github.com/acme",
            "ftp://github.com/acme",
            "",
        ] {
            assert!(ConfigUrl::parse(bad, None).is_err(), "{bad} accepted");
        }
        assert!(ConfigUrl::parse("https://github.com/acme", Some("not a url")).is_err());
    }
}
