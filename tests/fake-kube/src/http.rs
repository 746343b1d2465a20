//! The HTTP face of the fake API server (axum).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::Shared;
use crate::store::{ApiError, Expired, LabelSelector, Resource};

type Params = Query<HashMap<String, String>>;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(
            "/api/v1/namespaces/{ns}/{resource}",
            get(list_namespaced).post(create),
        )
        .route(
            "/api/v1/namespaces/{ns}/{resource}/{name}",
            get(get_one).put(replace).patch(patch).delete(delete),
        )
        .route("/api/v1/{resource}", get(list_all))
        .fallback(|| async {
            reply_error(&ApiError::new(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ))
        })
        .layer(middleware::from_fn_with_state(shared.clone(), outage_guard))
        .with_state(shared)
}

async fn outage_guard(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    if shared.is_unavailable() {
        shared.count_rejected();
        return reply_error(&ApiError::unavailable());
    }
    next.run(request).await
}

fn reply(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn reply_error(error: &ApiError) -> Response {
    let code = StatusCode::from_u16(error.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    reply(code, &error.status_json())
}

fn respond(result: Result<Value, ApiError>, ok: StatusCode) -> Response {
    match result {
        Ok(object) => reply(ok, &object),
        Err(error) => reply_error(&error),
    }
}

fn resource(segment: &str) -> Result<Resource, ApiError> {
    Resource::from_path(segment).ok_or_else(|| {
        ApiError::new(
            404,
            "NotFound",
            format!("the fake API server does not serve resource {segment:?}"),
        )
    })
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

async fn create(
    State(shared): State<Arc<Shared>>,
    Path((ns, res)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let result = resource(&res).and_then(|r| shared.create(r, &ns, parse_body(&body)?));
    respond(result, StatusCode::CREATED)
}

async fn get_one(
    State(shared): State<Arc<Shared>>,
    Path((ns, res, name)): Path<(String, String, String)>,
) -> Response {
    let result = resource(&res).and_then(|r| shared.with_store(|s| s.get(r, &ns, &name)));
    respond(result, StatusCode::OK)
}

async fn replace(
    State(shared): State<Arc<Shared>>,
    Path((ns, res, name)): Path<(String, String, String)>,
    body: Bytes,
) -> Response {
    let result = resource(&res).and_then(|r| {
        let object = parse_body(&body)?;
        shared.with_store(|s| s.replace(r, &ns, &name, object))
    });
    respond(result, StatusCode::OK)
}

async fn patch(
    State(shared): State<Arc<Shared>>,
    Path((ns, res, name)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !matches!(
        content_type,
        "application/merge-patch+json" | "application/strategic-merge-patch+json"
    ) {
        let error = ApiError::new(
            415,
            "UnsupportedMediaType",
            format!("the fake API server only supports merge patches, not {content_type:?}"),
        );
        return reply_error(&error);
    }
    let result = resource(&res).and_then(|r| {
        let patch = parse_body(&body)?;
        shared.with_store(|s| s.patch(r, &ns, &name, &patch))
    });
    respond(result, StatusCode::OK)
}

async fn delete(
    State(shared): State<Arc<Shared>>,
    Path((ns, res, name)): Path<(String, String, String)>,
) -> Response {
    // A slow API server: the call answers (and the object goes) only after the delay.
    let delay = shared.sim.delete_call_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let result = resource(&res).and_then(|r| shared.delete(r, &ns, &name));
    respond(result, StatusCode::OK)
}

async fn list_namespaced(
    State(shared): State<Arc<Shared>>,
    Path((ns, res)): Path<(String, String)>,
    Query(params): Params,
) -> Response {
    list_or_watch(shared, &res, Some(ns), &params)
}

async fn list_all(
    State(shared): State<Arc<Shared>>,
    Path(res): Path<String>,
    Query(params): Params,
) -> Response {
    list_or_watch(shared, &res, None, &params)
}

fn list_or_watch(
    shared: Arc<Shared>,
    res: &str,
    namespace: Option<String>,
    params: &HashMap<String, String>,
) -> Response {
    let resource = match resource(res) {
        Ok(r) => r,
        Err(e) => return reply_error(&e),
    };
    if params.get("fieldSelector").is_some_and(|f| !f.is_empty()) {
        return reply_error(&ApiError::bad_request(
            "the fake API server does not support fieldSelector",
        ));
    }
    let selector =
        match LabelSelector::parse(params.get("labelSelector").map_or("", String::as_str)) {
            Ok(s) => s,
            Err(e) => return reply_error(&e),
        };
    if params.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let since = match params.get("resourceVersion").map(|v| v.parse::<u64>()) {
            None => None,
            Some(Ok(0)) => None,
            Some(Ok(v)) => Some(v),
            Some(Err(_)) => {
                return reply_error(&ApiError::bad_request("resourceVersion must be a number"));
            }
        };
        let timeout = params
            .get("timeoutSeconds")
            .and_then(|t| t.parse::<u64>().ok())
            .map_or(Duration::from_secs(1800), Duration::from_secs);
        let bookmarks = params
            .get("allowWatchBookmarks")
            .is_some_and(|b| b == "true");
        let filter = WatchFilter {
            resource,
            namespace,
            selector,
        };
        return watch_response(shared, filter, since, timeout, bookmarks);
    }
    let limit = match params.get("limit").map(|l| l.parse::<usize>()) {
        None | Some(Ok(0)) => usize::MAX,
        Some(Ok(l)) => l,
        Some(Err(_)) => return reply_error(&ApiError::bad_request("limit must be a number")),
    };
    let token = match params.get("continue").filter(|c| !c.is_empty()) {
        None => None,
        Some(raw) => match ContinueToken::decode(raw) {
            Some(t) => Some(t),
            None => {
                return reply_error(&ApiError::bad_request(
                    "continue key is not valid: the continue token cannot be decoded",
                ));
            }
        },
    };
    let page = shared.with_store(|s| {
        if let Some(t) = &token
            && t.resource_version < s.compacted()
        {
            return Err(ApiError::new(
                410,
                "Expired",
                "The provided continue parameter is too old to display a consistent list \
                 result. You can start a new list without the continue parameter.",
            ));
        }
        let after = token
            .as_ref()
            .map(|t| (t.namespace.clone(), t.name.clone()));
        let (items, next) = s.list_page(
            resource,
            namespace.as_deref(),
            &selector,
            after.as_ref(),
            limit,
        );
        let rv = token
            .as_ref()
            .map_or_else(|| s.resource_version(), |t| t.resource_version);
        Ok((items, next, rv))
    });
    let (items, next, rv) = match page {
        Ok(page) => page,
        Err(e) => return reply_error(&e),
    };
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if let Some((namespace, name)) = next {
        metadata["continue"] = Value::String(
            ContinueToken {
                resource_version: rv,
                namespace,
                name,
            }
            .encode(),
        );
    }
    let list = json!({
        "kind": format!("{}List", resource.kind()),
        "apiVersion": "v1",
        "metadata": metadata,
        "items": items,
    });
    reply(StatusCode::OK, &list)
}

/// Where a paginated list goes on: the resourceVersion of its first page and the last object
/// returned. Later pages show the objects as they are when asked (the real API server serves a
/// consistent snapshot; a client must cope with either), and a token older than the compacted
/// history is refused with `410 Expired`, so clients must be ready to start over.
struct ContinueToken {
    resource_version: u64,
    namespace: String,
    name: String,
}

impl ContinueToken {
    fn encode(&self) -> String {
        use base64::Engine as _;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!(
            "{}/{}/{}",
            self.resource_version, self.namespace, self.name
        ))
    }

    fn decode(raw: &str) -> Option<ContinueToken> {
        use base64::Engine as _;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(raw)
            .ok()?;
        let text = String::from_utf8(bytes).ok()?;
        let mut parts = text.splitn(3, '/');
        Some(ContinueToken {
            resource_version: parts.next()?.parse().ok()?,
            namespace: parts.next()?.to_owned(),
            name: parts.next()?.to_owned(),
        })
    }
}

struct WatchFilter {
    resource: Resource,
    namespace: Option<String>,
    selector: LabelSelector,
}

impl WatchFilter {
    fn matches(&self, resource: Resource, namespace: &str, object: &Value) -> bool {
        resource == self.resource
            && self.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self.selector.matches(object)
    }
}

fn event_line(event_type: &str, object: &Value) -> Bytes {
    let mut line = json!({ "type": event_type, "object": object }).to_string();
    line.push('\n');
    Bytes::from(line)
}

struct WatchStream {
    shared: Arc<Shared>,
    filter: WatchFilter,
    cursor: u64,
    pending: VecDeque<Bytes>,
    changed: watch::Receiver<u64>,
    unavailable: watch::Receiver<bool>,
    deadline: tokio::time::Instant,
    bookmarks: bool,
    /// The `410` error was queued: end after sending it.
    expired: bool,
}

/// The Status of a watch whose resourceVersion was compacted away.
fn expired_status(asked: u64, expired: Expired) -> Value {
    ApiError::new(
        410,
        "Expired",
        format!(
            "too old resource version: {asked} ({})",
            expired.oldest.saturating_add(1)
        ),
    )
    .status_json()
}

/// How often an idle watch with `allowWatchBookmarks=true` gets a BOOKMARK.
const BOOKMARK_EVERY: Duration = Duration::from_secs(2);

impl WatchStream {
    /// Queues every matching event after the cursor and moves the cursor to the newest version.
    /// When the history after the cursor was compacted away, queues an `ERROR` event with a
    /// `410 Expired` status and ends the stream, as the API server does.
    fn collect(&mut self) {
        let filter = &self.filter;
        let cursor = self.cursor;
        let (lines, rv) = self.shared.with_store(|s| {
            let lines: Result<Vec<Bytes>, Expired> = s.events_after(cursor).map(|events| {
                events
                    .iter()
                    .filter(|e| filter.matches(e.resource, &e.namespace, &e.object))
                    .map(|e| event_line(e.event_type.as_str(), &e.object))
                    .collect()
            });
            (lines, s.resource_version())
        });
        match lines {
            Ok(lines) => {
                self.pending.extend(lines);
                self.cursor = rv;
            }
            Err(expired) => {
                self.pending
                    .push_back(event_line("ERROR", &expired_status(cursor, expired)));
                self.expired = true;
            }
        }
    }

    fn bookmark(&self) -> Bytes {
        let object = json!({
            "kind": self.filter.resource.kind(),
            "apiVersion": "v1",
            "metadata": { "resourceVersion": self.cursor.to_string() },
        });
        event_line("BOOKMARK", &object)
    }

    async fn next_line(&mut self) -> Option<Bytes> {
        loop {
            if *self.unavailable.borrow_and_update() {
                return None;
            }
            if let Some(line) = self.pending.pop_front() {
                return Some(line);
            }
            if self.expired {
                return None;
            }
            tokio::select! {
                () = tokio::time::sleep_until(self.deadline) => return None,
                changed = self.changed.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                    self.collect();
                }
                changed = self.unavailable.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                }
                () = tokio::time::sleep(BOOKMARK_EVERY), if self.bookmarks => {
                    let bookmark = self.bookmark();
                    self.pending.push_back(bookmark);
                }
            }
        }
    }
}

fn watch_response(
    shared: Arc<Shared>,
    filter: WatchFilter,
    since: Option<u64>,
    timeout: Duration,
    bookmarks: bool,
) -> Response {
    // Subscribe before reading the store so no change between the two is missed.
    let changed = shared.changed.subscribe();
    let unavailable = shared.unavailable.subscribe();
    let mut stream = WatchStream {
        cursor: 0,
        pending: VecDeque::new(),
        changed,
        unavailable,
        deadline: tokio::time::Instant::now() + timeout,
        bookmarks,
        expired: false,
        filter,
        shared: shared.clone(),
    };
    match since {
        Some(rv) => {
            if let Err(expired) = shared.with_store(|s| s.events_after(rv).map(|_| ())) {
                return reply(StatusCode::GONE, &expired_status(rv, expired));
            }
            stream.cursor = rv;
            stream.collect();
        }
        None => {
            // No version: synthetic ADDED events for what exists now, then changes.
            let filter = &stream.filter;
            let (lines, rv) = shared.with_store(|s| {
                let objects = s.list(
                    filter.resource,
                    filter.namespace.as_deref(),
                    &filter.selector,
                );
                let lines: Vec<Bytes> = objects.iter().map(|o| event_line("ADDED", o)).collect();
                (lines, s.resource_version())
            });
            stream.pending.extend(lines);
            stream.cursor = rv;
        }
    }
    let body = futures::stream::unfold(stream, |mut stream| async move {
        let line = stream.next_line().await?;
        Some((Ok::<_, Infallible>(line), stream))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| {
            reply_error(&ApiError::new(
                500,
                "InternalError",
                "building the watch response failed",
            ))
        })
}
