//! The JSON the replicas write to JetStream KV matches `schemas/kv.cddl`.

use std::collections::BTreeSet;

use jr_lease::{Lease, Policy, Slots, SlotsRequest, SlotsStep, hold_slots};

const SCHEMA: &str = include_str!("../../../schemas/kv.cddl");

fn check(json: &str) -> Result<(), String> {
    cddl::validate_json_from_str(SCHEMA, json, None).map_err(|e| format!("{json}: {e}"))
}

#[test]
fn leases_and_slot_records_match_the_schema() {
    let lease = Lease {
        holder: "scheduler-7f9c_1a2b".into(),
        renewed_at: 1_700_000_000_000,
        ttl_ms: 6_000,
        term: 3,
    };
    check(&serde_json::to_string(&lease).expect("encode")).expect("lease");

    let policy = Policy::new(6_000, 500).expect("policy");
    let none = BTreeSet::new();
    let req = SlotsRequest {
        me: "pod-worker_0a1b2c3d",
        want: 4,
        capacity: 8,
        now: 1_700_000_000_000,
        joined: false,
        known: &none,
        done_with: &none,
    };
    let SlotsStep::Write { record, .. } = hold_slots(&Slots::default(), &req, &policy) else {
        panic!("a first write");
    };
    check(&serde_json::to_string(&record).expect("encode")).expect("slots");

    // A record that is not one is refused (the check can fail).
    for bad in [
        r#"{"held": {"a": {"slots": 1, "renewed_at": 0}}}"#,
        r#"{"holder": "a", "renewed_at": 0, "ttl_ms": 0}"#,
        r#"{"slots": 1}"#,
    ] {
        assert!(check(bad).is_err(), "{bad} was accepted");
    }
}

/// The intake records of `JR_INTAKES` (written by the scheduler, shared/bus src/intake.rs): the
/// stored corpus record matches the schema, and a record with an unknown reason does not.
#[test]
fn intake_records_match_the_schema() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/wire-corpus/v1/kv/intake-status.json");
    let stored = std::fs::read_to_string(&path).expect("corpus file");
    check(&stored).expect("intake record");
    let bad = stored.replace("\"no-worker\"", "\"asleep\"");
    assert_ne!(bad, stored);
    assert!(check(&bad).is_err(), "{bad} was accepted");
}
