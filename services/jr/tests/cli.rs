//! `jr decode` turns a message body into JSON for people and refuses garbage clearly.

use std::io::Write;
use std::process::{Command, Stdio};

use jr_protocol::{AssignmentId, BackendName, Envelope, Message, Released};

fn run_decode(input: &[u8]) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_jr"))
        .arg("decode")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("jr runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("write");
    child.wait_with_output().expect("jr exits")
}

#[test]
fn decode_prints_a_message_as_json() {
    let id = AssignmentId::for_task("https://forge", 5);
    let envelope = Envelope::new(
        "released:x",
        1_700_000_000_000,
        id,
        2,
        Message::Released(Released {
            backend: BackendName::new("pod").expect("name"),
            workload: "jr-x-2".into(),
        }),
    );
    let out = run_decode(&jr_protocol::encode(&envelope));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["kind"], "released");
    assert_eq!(json["assignment_id"], id.to_string());
    assert_eq!(json["attempt"], 2);
    assert_eq!(json["body"]["workload"], "jr-x-2");
}

#[test]
fn decode_refuses_garbage_with_a_clear_error() {
    let out = run_decode(b"not cbor at all");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a jetrunner message"));
}
