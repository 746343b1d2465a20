//! The wire format's guarantees: every kind round-trips, v1 golden bytes keep decoding, the CDDL
//! in schemas/ describes what the code writes, and garbage never panics.

use jr_protocol::*;
use proptest::prelude::*;

fn id() -> AssignmentId {
    AssignmentId::for_task("https://forge.example", 1234)
}

fn pod() -> BackendName {
    BackendName::new("pod").expect("valid name")
}

/// One sample of every kind, with optional fields both set and unset across the set.
fn samples() -> Vec<Envelope> {
    let messages = vec![
        Message::Assignment(Assignment {
            forge_instance: "https://forge.example".into(),
            forge_task_id: 1234,
            backend: pod(),
            provider: Some("default".into()),
            placement: Some("default policy: at most trusted".into()),
            labels: vec!["pod".into(), "self-hosted".into()],
            repository: "acme/widgets".into(),
            workflow: None,
            job_name: "build".into(),
            max_duration_secs: 10_800,
            fetched_at: 1_700_000_000_000,
            sealed_task: SealedTask {
                key_id: "k1".into(),
                nonce: vec![7; 24],
                ciphertext: vec![1, 2, 3],
            },
        }),
        Message::WorkloadRequested(WorkloadRequested {
            backend: pod(),
            workload: "jr-x-1".into(),
            token_hash: TokenHash::from_published("ab".repeat(32)),
            worker_id: "pod-worker-0".into(),
        }),
        Message::WorkloadCreated(WorkloadCreated {
            backend: pod(),
            workload: "jr-x-1".into(),
            token_hash: TokenHash::of_token("per-attempt-token"),
            worker_id: "pod-worker-0".into(),
            warm: None,
        }),
        Message::WorkloadCreated(WorkloadCreated {
            backend: pod(),
            workload: "jr-c0ffee00-0000-4000-8000-000000000001-0".into(),
            token_hash: TokenHash::of_token("warm-token"),
            worker_id: "pod-worker-0".into(),
            warm: Some(AssignmentId(uuid::Uuid::from_u128(
                0xc0ffee00_0000_4000_8000_000000000001,
            ))),
        }),
        Message::WorkloadObserved(WorkloadObserved {
            backend: pod(),
            workload: "jr-x-1".into(),
            phase: WorkloadPhase::Failed,
            reason: Some("evicted".into()),
        }),
        Message::Claimed(Claimed {
            forge_task_id: 1234,
            executor: "token".into(),
        }),
        Message::Terminal(Terminal {
            forge_task_id: 1234,
            result: TaskResult::Success,
            source: TerminalSource::Executor,
            log_closed: true,
            reason: None,
        }),
        Message::ExecutorFinished(ExecutorFinished {
            forge_task_id: 1234,
        }),
        Message::Released(Released {
            backend: pod(),
            workload: "jr-x-1".into(),
        }),
        Message::Redispatched(Redispatched {
            next_attempt: 2,
            reason: "failed before claim".into(),
        }),
        Message::TaskFailed(TaskFailed {
            forge_task_id: 1234,
            reason: "workload lost".into(),
        }),
        Message::DeleteWorkload(DeleteWorkload {
            backend: pod(),
            workload: "jr-x-1".into(),
            reason: "terminal".into(),
        }),
        Message::FailTask(FailTask {
            forge_task_id: 1234,
            backend: pod(),
            reason: "pod evicted".into(),
        }),
        Message::Redispatch(Redispatch {
            backend: pod(),
            next_attempt: 2,
            reason: "workload failed before claim: evicted".into(),
        }),
    ];
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let mut e = Envelope::new(format!("msg-{i}"), 1_700_000_000_000 + i as u64, id(), 1, m);
            if i % 2 == 0 {
                e.trace = Some(TraceContext {
                    traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                    tracestate: None,
                });
            }
            e
        })
        .collect()
}

#[test]
fn every_kind_round_trips() {
    let samples = samples();
    let kinds: std::collections::BTreeSet<&str> =
        samples.iter().map(|e| e.kind().as_str()).collect();
    assert_eq!(kinds.len(), Kind::ALL.len(), "a sample of every kind");
    for e in samples {
        let back = decode(&encode(&e)).unwrap_or_else(|err| panic!("{}: {err}", e.kind()));
        assert_eq!(back, e);
    }
}

#[test]
fn every_kind_matches_the_cddl_schema() {
    let cddl = include_str!("../../../schemas/messages.cddl");
    for e in samples() {
        let bytes = encode(&e);
        if let Err(err) = cddl::validate_cbor_from_slice(cddl, &bytes, None) {
            panic!("{} does not match schemas/messages.cddl: {err}", e.kind());
        }
    }
}

#[test]
fn the_cddl_schema_rejects_a_wrong_body() {
    let cddl = include_str!("../../../schemas/messages.cddl");
    let mut e = samples().remove(4); // claimed
    e.message = Message::Released(Released {
        backend: pod(),
        workload: "w".into(),
    });
    let mut bytes = encode(&e);
    // Relabel the released body as "claimed": same length ("released" vs "claimed" differ), so
    // rebuild through a generic value instead of patching bytes.
    let mut value: ciborium::Value = ciborium::from_reader(bytes.as_slice()).expect("cbor");
    if let ciborium::Value::Map(entries) = &mut value {
        for (k, v) in entries.iter_mut() {
            if k.as_text() == Some("kind") {
                *v = ciborium::Value::Text("claimed".into());
            }
        }
    }
    bytes.clear();
    ciborium::into_writer(&value, &mut bytes).expect("write");
    assert!(cddl::validate_cbor_from_slice(cddl, &bytes, None).is_err());
    assert!(matches!(
        decode(&bytes),
        Err(DecodeError::Body {
            kind: Kind::Claimed,
            ..
        })
    ));
}

/// Encoded with schema_version 1 and frozen: if this stops decoding, old messages in the streams
/// would become unreadable.
const GOLDEN_CLAIMED_V1: &str = "a86e736368656d615f76657273696f6e01646b696e6467636c61696d6564626964656d73672d346b6f63637572726564\
5f61741b0000018bcfe568046d61737369676e6d656e745f6964782437373831636231342d653461392d353534332d61\
3938312d33373337623034633162663867617474656d707401657472616365a16b7472616365706172656e7478373030\
2d30616637363531393136636434336464383434386562323131633830333139632d6237616436623731363932303333\
33312d303164626f6479a26d666f7267655f7461736b5f69641904d2686578656375746f7265746f6b656e";

#[test]
fn golden_v1_bytes_keep_decoding() {
    let bytes = hex::decode(GOLDEN_CLAIMED_V1).expect("hex");
    let e = decode(&bytes).expect("golden v1 message decodes");
    assert_eq!(e.schema_version, 1);
    assert_eq!(e.id, "msg-4");
    assert_eq!(e.assignment_id, id());
    assert_eq!(
        e.message,
        Message::Claimed(Claimed {
            forge_task_id: 1234,
            executor: "token".into()
        })
    );
    assert_eq!(encode(&e), bytes, "encoding is stable");
}

#[test]
fn unknown_version_and_kind_are_typed_errors() {
    let mut e = samples().remove(0);
    e.schema_version = 99;
    assert!(matches!(
        decode(&encode(&e)),
        Err(DecodeError::UnsupportedVersion(99))
    ));
}

#[test]
fn json_rendering_hides_sealed_bytes() {
    let e = samples().remove(0);
    let json = to_json(&e);
    assert_eq!(json["kind"], "assignment");
    assert_eq!(json["body"]["sealed_task"]["sealed_bytes"], 3);
    assert!(json["body"]["sealed_task"].get("ciphertext").is_none());
}

proptest! {
    #[test]
    fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn decoding_mutated_messages_never_panics(index in 0usize..13, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut bytes = encode(&samples()[index]);
        for (pos, val) in flips {
            let len = bytes.len();
            bytes[pos % len] ^= val;
        }
        let _ = decode(&bytes);
    }

    #[test]
    fn truncated_messages_are_errors(index in 0usize..13, cut in 1usize..64) {
        let bytes = encode(&samples()[index]);
        let keep = bytes.len().saturating_sub(cut);
        prop_assert!(decode(&bytes[..keep]).is_err());
    }
}

#[test]
fn queue_time_is_taken_from_the_jobs_time_limit() {
    let Some(Message::Assignment(mut a)) = samples().into_iter().next().map(|e| e.message) else {
        panic!("the first sample is an assignment");
    };
    a.fetched_at = 1_000_000;
    a.max_duration_secs = 3600;
    assert_eq!(a.remaining_secs(1_000_000), 3600);
    assert_eq!(a.remaining_secs(1_000_000 + 600_000), 3000);
    assert_eq!(a.remaining_secs(1_000_000 + 7_200_000), 0);
    // A clock behind the fetch time takes nothing away.
    assert_eq!(a.remaining_secs(0), 3600);
}

/// The golden corpus: the bytes this version's encoder wrote for every sample, one file per
/// message (`tests/wire-corpus/v1/<kind>-<n>.cbor`), kept for every later build to decode.
fn corpus_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/wire-corpus/v1")
}

/// `(file name, sample)`: the samples numbered within their kind.
fn corpus_samples() -> Vec<(String, Envelope)> {
    let mut seen: std::collections::BTreeMap<&'static str, usize> = Default::default();
    samples()
        .into_iter()
        .map(|e| {
            let kind = e.kind().as_str();
            let n = seen.entry(kind).or_default();
            *n += 1;
            (format!("{kind}-{n}.cbor"), e)
        })
        .collect()
}

/// Writes the corpus (`JR_WRITE_CORPUS=1 cargo test -p jr-protocol --test wire corpus`); run it
/// only to add a new version's directory, never to rewrite released files.
fn write_corpus_when_asked() {
    if std::env::var_os("JR_WRITE_CORPUS").is_none() {
        return;
    }
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).expect("corpus directory");
    for (name, e) in corpus_samples() {
        std::fs::write(dir.join(name), encode(&e)).expect("write corpus file");
    }
}

#[test]
fn the_golden_corpus_of_every_kind_keeps_decoding() {
    write_corpus_when_asked();
    let dir = corpus_dir();
    for (name, expected) in corpus_samples() {
        let path = dir.join(&name);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (a new sample or kind needs its corpus file: JR_WRITE_CORPUS=1)",
                path.display()
            )
        });
        let decoded = decode(&bytes).unwrap_or_else(|e| panic!("{name} no longer decodes: {e}"));
        assert_eq!(decoded, expected, "{name} decodes to something else");
    }
    // Every kind there is has a file: a kind added without one fails here.
    let files: Vec<String> = std::fs::read_dir(&dir)
        .expect("corpus directory")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    for kind in Kind::ALL {
        assert!(
            files
                .iter()
                .any(|f| f.starts_with(&format!("{}-", kind.as_str()))),
            "no corpus file for {}",
            kind.as_str()
        );
    }
}

/// Adds `key: 1` to a CBOR map.
fn with_extra_field(map: &mut ciborium::Value, key: &str) {
    let ciborium::Value::Map(entries) = map else {
        panic!("not a map: {map:?}");
    };
    entries.push((
        ciborium::Value::Text(key.into()),
        ciborium::Value::Integer(1.into()),
    ));
}

#[test]
fn a_message_with_fields_added_by_a_later_version_still_decodes() {
    for e in samples() {
        let mut value: ciborium::Value =
            ciborium::from_reader(encode(&e).as_slice()).expect("CBOR");
        with_extra_field(&mut value, "added_later");
        if let ciborium::Value::Map(entries) = &mut value
            && let Some((_, body)) = entries
                .iter_mut()
                .find(|(k, _)| k.as_text() == Some("body"))
            && matches!(body, ciborium::Value::Map(_))
        {
            with_extra_field(body, "added_later_too");
        }
        let mut bytes = Vec::new();
        ciborium::into_writer(&value, &mut bytes).expect("re-encode");
        let decoded =
            decode(&bytes).unwrap_or_else(|err| panic!("{} with unknown fields: {err}", e.kind()));
        assert_eq!(decoded, e);
    }
}
