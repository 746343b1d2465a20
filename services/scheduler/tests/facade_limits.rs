//! What a hostile or broken client costs the facade: nothing is read before authentication,
//! bodies are bounded in size and time, and one assignment cannot flood it with calls.

mod facade_support;

use std::time::{Duration, Instant};

use facade_support::*;
use jr_facade::FacadeLimits;
use jr_forge::Code;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const TOKEN: &str = "executor-token-of-attempt-1";

async fn fetch_task(executor: &jr_forge::ForgeClient) -> Option<jr_forge::proto::runner::v1::Task> {
    executor
        .fetch_task(&jr_forge::proto::runner::v1::FetchTaskRequest::default())
        .await
        .expect("FetchTask")
        .task
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Sends a FetchTask request head declaring `declared` body bytes, then `sent` bytes of body.
async fn open_request(
    url: &str,
    uuid: &str,
    token: &str,
    declared: usize,
    sent: usize,
) -> TcpStream {
    let addr = url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /api/actions/runner.v1.RunnerService/FetchTask HTTP/1.1\r\nhost: {addr}\r\n\
         content-type: application/proto\r\nx-runner-uuid: {uuid}\r\nx-runner-token: {token}\r\n\
         content-length: {declared}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("head");
    stream
        .write_all(&vec![0u8; sent])
        .await
        .expect("body start");
    stream
}

/// The status line of the answer, read within `within`.
async fn status_within(stream: &mut TcpStream, within: Duration) -> Option<String> {
    let mut buf = vec![0u8; 512];
    let n = tokio::time::timeout(within, stream.read(&mut buf))
        .await
        .ok()?
        .ok()?;
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_callers_are_refused_before_their_body_is_read() {
    let h = start().await;
    let id = add_assignment(&h, 5, Some(TOKEN));
    let before = rss_bytes();
    let mut streams = Vec::new();
    // Eight connections each declaring a 30 MiB body and trickling only the first KiB.
    for _ in 0..8 {
        streams.push(open_request(&h.url, &id.to_string(), "wrong-token", 30 << 20, 1024).await);
    }
    for s in &mut streams {
        let status = status_within(s, Duration::from_secs(5)).await;
        assert!(
            status.as_deref().is_some_and(|l| l.contains(" 401 ")),
            "refused at once, without waiting for the body: {status:?}"
        );
    }
    let grown = rss_bytes().saturating_sub(before);
    println!(
        "RSS growth with 8 hostile 30 MiB requests: {} KiB",
        grown / 1024
    );
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_but_unsent_body_is_answered_and_closed_after_the_body_timeout() {
    let h = start_with_limits(FacadeLimits {
        body_timeout: Duration::from_secs(1),
        ..FacadeLimits::default()
    })
    .await;
    let id = add_assignment(&h, 6, Some(TOKEN));
    let started = Instant::now();
    let mut stream = open_request(&h.url, &id.to_string(), TOKEN, 100, 0).await;
    let status = status_within(&mut stream, Duration::from_secs(10)).await;
    let waited = started.elapsed();
    assert!(
        status
            .as_deref()
            .is_some_and(|l| l.contains(" 504 ") || l.contains(" 408 ")),
        "{status:?}"
    );
    assert!(
        waited < Duration::from_secs(10),
        "answered after {waited:?}"
    );
    assert_eq!(h.facade.stats().body_timeouts, 1);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_are_refused_with_a_clear_error() {
    let h = start_with_limits(FacadeLimits {
        max_body_bytes: 64 * 1024,
        ..FacadeLimits::default()
    })
    .await;
    let (_, executor) = {
        let id = add_assignment(&h, 7, Some(TOKEN));
        let e = executor(&h.url, id, TOKEN);
        assert!(fetch_task(&e).await.is_some());
        (id, e)
    };
    let rows = (0..2000)
        .map(|i| jr_forge::proto::runner::v1::LogRow {
            time: None,
            content: format!("line {i} {}", "x".repeat(64)),
        })
        .collect();
    let err = executor
        .update_log(&jr_forge::proto::runner::v1::UpdateLogRequest {
            task_id: 7,
            index: 0,
            rows,
            no_more: false,
        })
        .await
        .expect_err("too large");
    assert_eq!(err.code(), Some(Code::ResourceExhausted));
    assert!(err.to_string().contains("max_body_bytes"), "{err}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_assignment_cannot_flood_the_facade() {
    let h = start_with_limits(FacadeLimits {
        max_calls_per_second: 5,
        ..FacadeLimits::default()
    })
    .await;
    let id = add_assignment(&h, 8, Some(TOKEN));
    let executor = executor(&h.url, id, TOKEN);
    let mut refused = 0;
    for _ in 0..20 {
        if let Err(e) = executor.declare(&Default::default()).await {
            assert_eq!(e.code(), Some(Code::ResourceExhausted), "{e}");
            refused += 1;
        }
    }
    assert!(
        refused >= 10,
        "only {refused} of 20 calls in a burst refused"
    );
    assert_eq!(h.facade.stats().rate_limited, refused);
    h.stop().await;
}
