//! ForgeClient against a small axum stand-in of the forge.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use jr_forge::proto::ping::v1::{PingRequest, PingResponse};
use jr_forge::proto::runner::v1::{
    DeclareRequest, FetchTaskRequest, FetchTaskResponse, RegisterRequest, RegisterResponse, Runner,
    Task, UpdateLogRequest,
};
use jr_forge::{Code, Credentials, ForgeClient, ForgeError, connect_error_body};
use prost::Message;

const FETCH: &str = "/api/actions/runner.v1.RunnerService/FetchTask";
const REGISTER: &str = "/api/actions/runner.v1.RunnerService/Register";
const DECLARE: &str = "/api/actions/runner.v1.RunnerService/Declare";
const UPDATE_LOG: &str = "/api/actions/runner.v1.RunnerService/UpdateLog";
const PING: &str = "/api/actions/ping.v1.PingService/Ping";

type Seen = Arc<Mutex<Vec<HeaderMap>>>;

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    // Mounted under a sub-path, and the base given with a trailing slash, as instance URLs may be.
    let app = Router::new().nest("/gitea", router);
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    format!("http://{addr}/gitea/")
}

fn creds() -> Credentials {
    Credentials {
        uuid: "6b2c7a3e-0000-4000-8000-000000000001".into(),
        token: "a".repeat(40),
    }
}

fn client(base: &str, credentials: Option<Credentials>) -> ForgeClient {
    ForgeClient::new(base, credentials, Duration::from_secs(5)).expect("client")
}

fn proto_reply(message: &impl Message) -> Response {
    (
        [(header::CONTENT_TYPE, "application/proto")],
        message.encode_to_vec(),
    )
        .into_response()
}

fn connect_error(code: Code, message: &str) -> Response {
    let status = StatusCode::from_u16(code.http_status()).expect("status");
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        connect_error_body(code, message),
    )
        .into_response()
}

fn recording(seen: &Seen, headers: HeaderMap) {
    seen.lock().expect("lock").push(headers);
}

#[tokio::test]
async fn fetch_task_succeeds_with_auth_and_connect_headers() {
    let seen: Seen = Arc::default();
    let state = seen.clone();
    let router = Router::new().route(
        FETCH,
        post(move |headers: HeaderMap, body: Bytes| async move {
            recording(&state, headers);
            let request = FetchTaskRequest::decode(body).expect("request body");
            proto_reply(&FetchTaskResponse {
                task: Some(Task {
                    id: 42,
                    ..Default::default()
                }),
                tasks_version: request.tasks_version + 1,
                ..Default::default()
            })
        }),
    );
    let base = serve(router).await;
    let reply = client(&base, Some(creds()))
        .fetch_task(&FetchTaskRequest {
            tasks_version: 5,
            ..Default::default()
        })
        .await
        .expect("fetch");
    assert_eq!(reply.tasks_version, 6);
    assert_eq!(reply.task.map(|t| t.id), Some(42));

    let headers = seen.lock().expect("lock")[0].clone();
    assert_eq!(headers["content-type"], "application/proto");
    assert_eq!(headers["connect-protocol-version"], "1");
    assert_eq!(headers["x-runner-uuid"], creds().uuid.as_str());
    assert_eq!(headers["x-runner-token"], creds().token.as_str());
}

#[tokio::test]
async fn register_and_ping_send_no_runner_headers() {
    let seen: Seen = Arc::default();
    let (s1, s2) = (seen.clone(), seen.clone());
    let router = Router::new()
        .route(
            REGISTER,
            post(move |headers: HeaderMap, body: Bytes| async move {
                recording(&s1, headers);
                let request = RegisterRequest::decode(body).expect("request body");
                let runner = Runner {
                    uuid: "u-1".into(),
                    token: "t-1".into(),
                    name: request.name,
                    ..Default::default()
                };
                proto_reply(&RegisterResponse {
                    runner: Some(runner),
                })
            }),
        )
        .route(
            PING,
            post(move |headers: HeaderMap, body: Bytes| async move {
                recording(&s2, headers);
                let request = PingRequest::decode(body).expect("request body");
                proto_reply(&PingResponse {
                    data: format!("Hello, {}!", request.data),
                })
            }),
        );
    let base = serve(router).await;
    // Credentials present on the client must still not be sent on Register/Ping.
    let forge = client(&base, Some(creds()));
    let reply = forge
        .register(&RegisterRequest {
            name: "jr".into(),
            token: "reg".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(
        reply.expect("register").runner.map(|r| (r.uuid, r.name)),
        Some(("u-1".into(), "jr".into()))
    );
    let pong = forge
        .ping(&PingRequest { data: "jr".into() })
        .await
        .expect("ping");
    assert_eq!(pong.data, "Hello, jr!");
    for headers in seen.lock().expect("lock").iter() {
        assert!(!headers.contains_key("x-runner-uuid"));
        assert!(!headers.contains_key("x-runner-token"));
    }
}

#[tokio::test]
async fn with_credentials_sends_the_new_credentials() {
    let seen: Seen = Arc::default();
    let state = seen.clone();
    let router = Router::new().route(
        DECLARE,
        post(move |headers: HeaderMap| async move {
            recording(&state, headers);
            proto_reply(&jr_forge::proto::runner::v1::DeclareResponse::default())
        }),
    );
    let base = serve(router).await;
    let anonymous = client(&base, None);
    let err = anonymous
        .declare(&DeclareRequest::default())
        .await
        .expect_err("no credentials");
    assert!(matches!(
        err,
        ForgeError::MissingCredentials { method: "Declare" }
    ));
    assert!(
        seen.lock().expect("lock").is_empty(),
        "no request without credentials"
    );

    let real = Credentials {
        uuid: "real-uuid".into(),
        token: "real-token".into(),
    };
    anonymous
        .with_credentials(real)
        .declare(&DeclareRequest::default())
        .await
        .expect("declare");
    let headers = seen.lock().expect("lock")[0].clone();
    assert_eq!(headers["x-runner-uuid"], "real-uuid");
    assert_eq!(headers["x-runner-token"], "real-token");
}

#[tokio::test]
async fn proper_unauthenticated_is_unregistered() {
    let router = Router::new().route(
        FETCH,
        post(|| async { connect_error(Code::Unauthenticated, "unregistered runner") }),
    );
    let base = serve(router).await;
    let err = client(&base, Some(creds()))
        .fetch_task(&FetchTaskRequest::default())
        .await
        .expect_err("refused");
    assert!(err.is_unregistered());
    assert!(!err.is_retryable());
    assert_eq!(err.kind(), "unauthenticated");
    assert!(matches!(
        err,
        ForgeError::Connect {
            unwrapped_from_unknown: false,
            ..
        }
    ));
}

#[tokio::test]
async fn gitea_unknown_wrapping_unauthenticated_is_unregistered() {
    let router = Router::new().route(
        FETCH,
        post(|| async {
            connect_error(
                Code::Unknown,
                "rpc error: code = Unauthenticated desc = unregistered runner",
            )
        }),
    );
    let base = serve(router).await;
    let err = client(&base, Some(creds()))
        .fetch_task(&FetchTaskRequest::default())
        .await
        .expect_err("refused");
    assert!(err.is_unregistered());
    match err {
        ForgeError::Connect {
            code,
            message,
            unwrapped_from_unknown,
        } => {
            assert_eq!(code, Code::Unauthenticated);
            assert!(unwrapped_from_unknown);
            assert_eq!(
                message,
                "rpc error: code = Unauthenticated desc = unregistered runner"
            );
        }
        other => panic!("expected a Connect error, got {other:?}"),
    }
}

#[tokio::test]
async fn gitea_archived_log_maps_to_already_exists() {
    let router = Router::new().route(
        UPDATE_LOG,
        post(|| async {
            connect_error(
                Code::Unknown,
                "rpc error: code = AlreadyExists desc = log file has been archived",
            )
        }),
    );
    let base = serve(router).await;
    let err = client(&base, Some(creds()))
        .update_log(&UpdateLogRequest::default())
        .await
        .expect_err("archived");
    assert_eq!(err.code(), Some(Code::AlreadyExists));
    assert!(!err.is_unregistered());
}

#[tokio::test]
async fn proxy_plain_text_401_is_not_unregistered() {
    let router = Router::new().route(
        FETCH,
        post(|| async {
            (
                StatusCode::UNAUTHORIZED,
                [(header::CONTENT_TYPE, "text/html")],
                "<html>401 Authorization Required</html>",
            )
        }),
    );
    let base = serve(router).await;
    let err = client(&base, Some(creds()))
        .fetch_task(&FetchTaskRequest::default())
        .await
        .expect_err("refused");
    assert!(!err.is_unregistered());
    assert_eq!(err.kind(), "http");
    match err {
        ForgeError::Http {
            status,
            body_snippet,
        } => {
            assert_eq!(status, 401);
            assert!(body_snippet.contains("Authorization Required"));
        }
        other => panic!("expected an Http error, got {other:?}"),
    }
}

#[tokio::test]
async fn gzip_compressed_reply_is_decoded() {
    let seen: Seen = Arc::default();
    let state = seen.clone();
    let task = Task {
        id: 7,
        workflow_payload: Some(b"jobs:\n  build:\n    runs-on: pod\n".repeat(100)),
        ..Default::default()
    };
    let expected = task.clone();
    let router = Router::new().route(
        FETCH,
        post(move |headers: HeaderMap| async move {
            recording(&state, headers);
            let plain = FetchTaskResponse {
                task: Some(task),
                tasks_version: 3,
                ..Default::default()
            }
            .encode_to_vec();
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(&plain).expect("gzip");
            let compressed = encoder.finish().expect("gzip");
            assert!(compressed.len() < plain.len());
            (
                [
                    (header::CONTENT_TYPE, "application/proto"),
                    (header::CONTENT_ENCODING, "gzip"),
                ],
                compressed,
            )
                .into_response()
        }),
    );
    let base = serve(router).await;
    let reply = client(&base, Some(creds()))
        .fetch_task(&FetchTaskRequest::default())
        .await
        .expect("fetch");
    assert_eq!(reply.task, Some(expected));
    let headers = seen.lock().expect("lock")[0].clone();
    assert!(
        headers["accept-encoding"]
            .to_str()
            .expect("ascii")
            .contains("gzip")
    );
}

#[tokio::test]
async fn service_unavailable_is_retryable_and_permission_denied_is_not() {
    let router = Router::new()
        .route(
            FETCH,
            post(|| async { (StatusCode::SERVICE_UNAVAILABLE, "upstream down") }),
        )
        .route(
            DECLARE,
            post(|| async { connect_error(Code::Unavailable, "draining") }),
        )
        .route(
            UPDATE_LOG,
            post(|| async { connect_error(Code::PermissionDenied, "not your task") }),
        );
    let base = serve(router).await;
    let forge = client(&base, Some(creds()));

    let proxy = forge
        .fetch_task(&FetchTaskRequest::default())
        .await
        .expect_err("503");
    assert!(matches!(proxy, ForgeError::Http { status: 503, .. }));
    assert!(proxy.is_retryable());

    let connect = forge
        .declare(&DeclareRequest::default())
        .await
        .expect_err("unavailable");
    assert_eq!(connect.code(), Some(Code::Unavailable));
    assert!(connect.is_retryable());

    let denied = forge
        .update_log(&UpdateLogRequest::default())
        .await
        .expect_err("denied");
    assert!(!denied.is_retryable());
    assert!(!denied.is_unregistered());
}

#[tokio::test]
async fn slow_forge_is_a_retryable_timeout() {
    let router = Router::new().route(
        FETCH,
        post(|| async {
            tokio::time::sleep(Duration::from_secs(10)).await;
            proto_reply(&FetchTaskResponse::default())
        }),
    );
    let base = serve(router).await;
    let forge = ForgeClient::new(&base, Some(creds()), Duration::from_millis(200)).expect("client");
    let err = forge
        .fetch_task(&FetchTaskRequest::default())
        .await
        .expect_err("timeout");
    assert_eq!(err.kind(), "timeout");
    assert!(err.is_retryable());
}

#[tokio::test]
async fn refused_connection_is_a_transport_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let err = client(&format!("http://{addr}"), Some(creds()))
        .fetch_task(&FetchTaskRequest::default())
        .await;
    let err = err.expect_err("nothing listens");
    assert_eq!(err.kind(), "transport");
    assert!(err.is_retryable());
    assert!(!err.is_unregistered());
}

#[tokio::test]
async fn a_transport_error_says_why_the_call_failed() {
    // A port nothing listens on: the connection is refused.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let c = client(&format!("http://{addr}"), None);
    let err = c
        .ping(&jr_forge::proto::ping::v1::PingRequest {
            data: "x".to_owned(),
        })
        .await
        .expect_err("nothing listens");
    let text = err.to_string();
    assert!(text.starts_with("forge transport error: "), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection refused"),
        "the cause is in the message: {text}"
    );
}
