//! The forge client never follows a redirect: every call carries the runner's credentials in
//! headers, and a redirect (from a misconfigured proxy or a hostile server) must not carry them
//! to another address.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::any;
use jr_forge::proto::runner::v1::FetchTaskRequest;
use jr_forge::{Credentials, ForgeClient};

const TOKEN: &str = "runner-token-that-must-not-leak";

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    format!("http://{addr}")
}

/// A server that records the headers of every request it gets.
async fn collector() -> (String, Arc<Mutex<Vec<HeaderMap>>>) {
    let seen: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
    let record = seen.clone();
    let router = Router::new().fallback(any(move |headers: HeaderMap| {
        let record = record.clone();
        async move {
            record.lock().expect("lock").push(headers);
            StatusCode::OK
        }
    }));
    (serve(router).await, seen)
}

/// A "forge" answering every call with `status` and `Location: <target>/stolen`.
async fn redirector(status: StatusCode, target: &str) -> String {
    let location = format!("{target}/stolen");
    let router = Router::new().fallback(any(move || {
        let location = location.clone();
        async move { (status, [(header::LOCATION, location)]).into_response() }
    }));
    serve(router).await
}

#[tokio::test]
async fn redirects_are_not_followed_so_credentials_stay_with_the_forge() {
    for status in [
        StatusCode::TEMPORARY_REDIRECT,
        StatusCode::PERMANENT_REDIRECT,
        StatusCode::FOUND,
    ] {
        let (elsewhere, seen) = collector().await;
        let forge = redirector(status, &elsewhere).await;
        let client = ForgeClient::new(
            &forge,
            Some(Credentials {
                uuid: "6b2c7a3e-0000-4000-8000-000000000001".into(),
                token: TOKEN.into(),
            }),
            Duration::from_secs(5),
        )
        .expect("client");
        let result = client.fetch_task(&FetchTaskRequest::default()).await;
        assert!(
            result.is_err(),
            "{status}: a redirect was taken as an answer"
        );
        let requests = seen.lock().expect("lock").len();
        assert_eq!(
            requests, 0,
            "{status}: the client followed the redirect to another server"
        );
    }
}
