//! Forwarding of the artifact and cache endpoints act_runner derives from its `address`: method,
//! path, query, headers and body go to the forge unchanged and the answer comes back unchanged.
//! These requests carry their own credentials (the job's runtime token); the facade adds none.

use std::sync::Arc;

use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, StatusCode, header};
use jr_forge::wire::{HEADER_RUNNER_TOKEN, HEADER_RUNNER_UUID};

use super::rpc::not_found;
use super::stats::bump;
use super::{Facade, Ledger};

/// Path prefixes forwarded to the forge.
const PROXIED_PREFIXES: [&str; 3] = [
    "/api/actions_pipeline/",
    "/twirp/github.actions.results.api.v1.ArtifactService/",
    "/_apis/",
];

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1), plus `host`.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Whether `path` is one of the forwarded endpoints (and free of dot segments, so a forwarded
/// path cannot climb out of its prefix on the forge).
pub(crate) fn is_proxied(path: &str) -> bool {
    PROXIED_PREFIXES.iter().any(|p| path.starts_with(p))
        && !path.split('/').any(|segment| {
            let decoded = segment.to_ascii_lowercase().replace("%2e", ".");
            decoded == "." || decoded == ".."
        })
        && !path.to_ascii_lowercase().contains("%2f")
}

/// The message headers of `headers`: hop-by-hop ones, those named in `Connection`, `host` and,
/// for requests, the executor's own `x-runner-*` credentials removed.
fn forwardable(headers: &HeaderMap, request: bool) -> HeaderMap {
    let named_in_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        // Headers a reverse proxy in front of the forge would trust to say who the client is
        // (`X-Forwarded-For`, `X-WEBAUTH-USER` for reverse-proxy login, …) never pass.
        let impersonating = request && {
            let n = name.as_str();
            n == "forwarded"
                || n == "x-real-ip"
                || n.starts_with("x-forwarded-")
                || n.starts_with("x-webauth-")
        };
        let drop = HOP_BY_HOP.contains(name)
            || impersonating
            || named_in_connection.iter().any(|n| n == name.as_str())
            || (request
                && (name == header::HOST
                    || name.as_str() == HEADER_RUNNER_UUID
                    || name.as_str() == HEADER_RUNNER_TOKEN));
        if !drop {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

pub(crate) async fn proxy<L: Ledger>(
    State(facade): State<Arc<Facade<L>>>,
    request: Request,
) -> Response {
    let path = request.uri().path();
    if !is_proxied(path) {
        return not_found();
    }
    let path_and_query = request
        .uri()
        .path_and_query()
        .map_or(path, |pq| pq.as_str())
        .to_owned();
    let url = format!(
        "{}{path_and_query}",
        facade.settings.forge_base_url.trim_end_matches('/')
    );
    let (parts, body) = request.into_parts();
    let mut outgoing = facade
        .proxy_http
        .request(parts.method.clone(), &url)
        .headers(forwardable(&parts.headers, true));
    // A body-less request stays body-less (no chunked empty body on a GET).
    if !body.is_end_stream() {
        outgoing = outgoing.body(reqwest::Body::wrap_stream(body.into_data_stream()));
    }
    bump(&facade.counters.proxied_requests);
    let answer = match outgoing.send().await {
        Ok(answer) => answer,
        Err(err) => {
            bump(&facade.counters.proxy_errors);
            tracing::warn!(method = %parts.method, path = %parts.uri.path(), error = %err, "proxy to forge failed");
            return (StatusCode::BAD_GATEWAY, "forge unreachable").into_response();
        }
    };
    let status = answer.status();
    let headers = forwardable(answer.headers(), false);
    let mut response = Response::new(Body::from_stream(answer.bytes_stream()));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_artifact_and_cache_paths_are_proxied() {
        assert!(is_proxied(
            "/api/actions_pipeline/_apis/pipelines/workflows/1/artifacts"
        ));
        assert!(is_proxied(
            "/twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact"
        ));
        assert!(is_proxied("/_apis/artifactcache/cache"));
        assert!(!is_proxied(
            "/api/actions/runner.v1.RunnerService/FetchTask"
        ));
        assert!(!is_proxied("/api/v1/admin/users"));
        assert!(!is_proxied("/_apis/../api/v1/admin/users"));
        assert!(!is_proxied("/_apis/%2E%2E/api/v1/admin"));
        assert!(!is_proxied("/_apis/x%2f..%2fy"));
    }

    #[test]
    fn hop_by_hop_and_runner_credentials_are_not_forwarded() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, x-private".parse().expect("value"),
        );
        h.insert("x-private", "1".parse().expect("value"));
        h.insert(header::HOST, "facade".parse().expect("value"));
        h.insert(HEADER_RUNNER_TOKEN, "secret".parse().expect("value"));
        h.insert(
            header::AUTHORIZATION,
            "Bearer runtime".parse().expect("value"),
        );
        h.insert(header::CONTENT_LENGTH, "3".parse().expect("value"));
        for spoof in [
            "x-forwarded-for",
            "x-forwarded-proto",
            "forwarded",
            "x-real-ip",
            "x-webauth-user",
        ] {
            h.insert(spoof, "admin".parse().expect("value"));
        }
        let out = forwardable(&h, true);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out[header::AUTHORIZATION], "Bearer runtime");
        assert_eq!(out[header::CONTENT_LENGTH], "3");
    }
}
