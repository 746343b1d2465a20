//! The KV records of leases and shared capacity as this version writes them, kept in
//! `tests/wire-corpus/v1/kv/` for every later build to read (see that directory's README), and a
//! record with fields a later version added still reads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use jr_lease::{Holding, Lease, Slots};

fn dir() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/wire-corpus/v1/kv")
}

fn lease() -> Lease {
    Lease {
        holder: "scheduler-0f3a9c21".into(),
        renewed_at: 1_700_000_000_000,
        ttl_ms: 10_000,
        term: 4,
    }
}

fn slots() -> Slots {
    Slots {
        held: BTreeMap::from([
            (
                "pod-worker_1a2b3c4d".to_owned(),
                Holding {
                    slots: 3,
                    renewed_at: 1_700_000_000_500,
                    ttl_ms: 15_000,
                    owns: BTreeSet::from([
                        "pod-worker_1a2b3c4d".to_owned(),
                        "pod-worker_99aa88bb".to_owned(),
                    ]),
                },
            ),
            (
                "pod-worker_5e6f7a8b".to_owned(),
                Holding {
                    slots: 2,
                    renewed_at: 1_700_000_000_900,
                    ttl_ms: 15_000,
                    owns: BTreeSet::new(),
                },
            ),
        ]),
    }
}

/// `JR_WRITE_CORPUS=1 cargo test -p jr-lease --test corpus` writes the files (new versions only).
fn write_when_asked() {
    if std::env::var_os("JR_WRITE_CORPUS").is_none() {
        return;
    }
    std::fs::create_dir_all(dir()).expect("corpus directory");
    let write = |name: &str, bytes: Vec<u8>| std::fs::write(dir().join(name), bytes).expect(name);
    write("lease.json", serde_json::to_vec(&lease()).expect("lease"));
    write("slots.json", serde_json::to_vec(&slots()).expect("slots"));
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn the_lease_and_capacity_records_of_the_corpus_keep_reading() {
    write_when_asked();
    let lease_read: Lease = serde_json::from_slice(&read("lease.json")).expect("lease record");
    assert_eq!(lease_read, lease());
    let slots_read: Slots = serde_json::from_slice(&read("slots.json")).expect("slots record");
    assert_eq!(slots_read, slots());
}

#[test]
fn records_with_fields_added_later_still_read() {
    let mut value: serde_json::Value = serde_json::to_value(lease()).expect("lease");
    value["added_later"] = 1.into();
    assert_eq!(
        serde_json::from_value::<Lease>(value).expect("lease"),
        lease()
    );
    let mut value: serde_json::Value = serde_json::to_value(slots()).expect("slots");
    value["added_later"] = 1.into();
    value["held"]["pod-worker_5e6f7a8b"]["added_later_too"] = true.into();
    assert_eq!(
        serde_json::from_value::<Slots>(value).expect("slots"),
        slots()
    );
}
