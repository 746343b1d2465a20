//! Options are accepted anywhere on the command line, as with `nats` and `kubectl`: every
//! subcommand runs here with `--server`, `--status-url`, `--forge` and `--json` after its own
//! arguments (and some before or between), against a real nats-server and a small status API.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use jr_bus::testing::NatsServer;

fn jr(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_jr"))
        .args(args)
        // Only what the command line says: no deployment's environment leaks in.
        .env_remove("NATS_URL")
        .env_remove("JR_STATUS_URL")
        .env_remove("JR_FORGE_URL")
        .output()
        .expect("jr runs")
}

/// The command's standard output as JSON; fails with its stderr when it did not succeed.
fn json_of(args: &[&str]) -> serde_json::Value {
    let out = jr(args);
    assert!(
        out.status.success(),
        "jr {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "jr {args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A status API answering fixed JSON per path, recording the paths asked for.
struct StatusApi {
    url: String,
    paths: Arc<Mutex<Vec<String>>>,
}

fn status_api(answers: BTreeMap<String, serde_json::Value>) -> StatusApi {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let paths = Arc::new(Mutex::new(Vec::new()));
    let seen = paths.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut request = String::new();
            if reader.read_line(&mut request).is_err() {
                continue;
            }
            // Read the headers to their end.
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let path = request.split(' ').nth(1).unwrap_or("").to_owned();
            seen.lock().expect("lock").push(path.clone());
            let (status, body) = match answers.get(&path) {
                Some(v) => ("200 OK", v.to_string()),
                None => ("404 Not Found", r#"{"error":"no such path"}"#.to_owned()),
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    StatusApi { url, paths }
}

#[tokio::test]
async fn burst_and_provider_take_the_nats_options_after_their_arguments() {
    let nats = NatsServer::start()
        .await
        .expect("nats-server ≥ 2.10 on PATH");
    let server = nats.url();
    let set = json_of(&["burst", "set", "25%", "--server", &server, "--json"]);
    assert_eq!(set["percent"], 25);
    let shown = json_of(&["burst", "show", "--json", "--server", &server]);
    assert_eq!(shown["value"], "25%", "{shown}");
    assert_eq!(shown["enabled"], true);
    // Between the subcommand and its action, and before everything, too.
    let shown = json_of(&["burst", "--server", &server, "show", "--json"]);
    assert_eq!(shown["value"], "25%");
    let shown = json_of(&["--json", "--server", &server, "burst", "show"]);
    assert_eq!(shown["value"], "25%");

    let drained = json_of(&[
        "provider", "drain", "pod", "west", "--server", &server, "--json", "--force",
    ]);
    assert_eq!(drained["key"], "drain.pod.west");
    assert_eq!(drained["drained"], true);
    let undrained = json_of(&[
        "provider", "undrain", "pod", "west", "--json", "--force", "--server", &server,
    ]);
    assert_eq!(undrained["drained"], false);

    // The option really is the one used: another server after the arguments is what fails.
    let out = jr(&["burst", "show", "--server", "nats://127.0.0.1:1"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nats://127.0.0.1:1"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn status_job_and_quarantine_take_the_api_options_after_their_arguments() {
    let id = jr_protocol::AssignmentId::for_task("https://forge.test", 42);
    let api = status_api(BTreeMap::from([
        (
            "/api/status".to_owned(),
            serde_json::json!({"backends": [], "quarantined": 0}),
        ),
        (
            format!("/api/assignments/{id}"),
            serde_json::json!({"assignment": id.to_string(), "timeline": []}),
        ),
        (
            "/api/quarantine".to_owned(),
            serde_json::json!({"count": 0, "recent": []}),
        ),
    ]));
    let url = api.url.as_str();
    let status = json_of(&["status", "--status-url", url, "--json"]);
    assert_eq!(status["quarantined"], 0);
    let by_id = json_of(&["job", &id.to_string(), "--json", "--status-url", url]);
    assert_eq!(by_id["assignment"], id.to_string());
    let by_task = json_of(&[
        "job",
        "42",
        "--status-url",
        url,
        "--forge",
        "https://forge.test",
        "--json",
    ]);
    assert_eq!(by_task["assignment"], id.to_string());
    let quarantine = json_of(&["quarantine", "list", "--status-url", url, "--json"]);
    assert_eq!(quarantine["count"], 0);
    let quarantine = json_of(&["quarantine", "--json", "list", "--status-url", url]);
    assert_eq!(quarantine["count"], 0);
    // Text when --json is absent.
    let out = jr(&["status", "--status-url", url]);
    assert!(out.status.success());
    assert!(serde_json::from_slice::<serde_json::Value>(&out.stdout).is_err());
    assert_eq!(
        api.paths.lock().expect("lock").len(),
        6,
        "every command asked the API given after its arguments"
    );
}

#[test]
fn health_and_decode_accept_the_common_options_too() {
    let api = status_api(BTreeMap::from([(
        "/healthz".to_owned(),
        serde_json::json!({}),
    )]));
    let out = jr(&[
        "health",
        &format!("{}/healthz", api.url),
        "--timeout-secs",
        "3",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = jr(&["health", &format!("{}/missing", api.url), "--json"]);
    assert!(!out.status.success(), "a 404 is not healthy");
    let out = jr(&["decode", "/nonexistent/message", "--json"]);
    assert!(!out.status.success());
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("unexpected argument"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn nats_credentials_and_nkey_files_are_read_and_named_when_missing() {
    for (option, says) in [
        (
            "--creds",
            "reading the NATS credentials /nonexistent/jr.creds",
        ),
        ("--nkey", "reading the nkey seed /nonexistent/jr.creds"),
    ] {
        let out = jr(&[
            "burst",
            "show",
            "--server",
            "nats://127.0.0.1:1",
            option,
            "/nonexistent/jr.creds",
        ]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{option}: {err}");
    }
}
