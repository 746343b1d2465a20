//! The leader lease on a real nats-server: one of several replicas acts at a time, a clean stop
//! hands over at the standby's next look, and a holder that dies is replaced once its lease is
//! free (and not before).

mod common;

use std::time::{Duration, Instant};

use jr_bus::async_nats::jetstream::kv;
use jr_bus::lease::{Leadership, LeaseSpec, spawn_lease};
use jr_lease::Policy;
use tokio_util::sync::CancellationToken;

const TTL_MS: u64 = 1500;
const SKEW_MS: u64 = 100;

async fn bucket(bus: &jr_bus::Bus) -> kv::Store {
    bus.jetstream()
        .create_key_value(kv::Config {
            bucket: "JR_LEASE_TEST".to_owned(),
            history: 1,
            ..Default::default()
        })
        .await
        .expect("bucket")
}

fn spec(store: &kv::Store, me: &str) -> LeaseSpec {
    LeaseSpec {
        store: store.clone(),
        key: "lease.test".to_owned(),
        me: me.to_owned(),
        policy: Policy::new(TTL_MS, SKEW_MS).expect("policy"),
    }
}

/// The replica acting now, if any; fails if two act at once.
fn the_one_acting(replicas: &[Leadership]) -> Option<usize> {
    let acting: Vec<usize> = replicas
        .iter()
        .enumerate()
        .filter(|(_, l)| l.acting().is_some())
        .map(|(i, _)| i)
        .collect();
    assert!(
        acting.len() <= 1,
        "replicas {acting:?} act at the same time"
    );
    acting.first().copied()
}

/// Samples the replicas every 10 ms until `until`; fails if two act at once. Returns the index
/// of the replica that acted last, if any.
async fn watch_exclusive(replicas: &[Leadership], until: Instant) -> Option<usize> {
    let mut last = None;
    while Instant::now() < until {
        last = the_one_acting(replicas).or(last);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    last
}

async fn wait_for_leader(replicas: &[Leadership], within: Duration) -> usize {
    let start = Instant::now();
    loop {
        if let Some(i) = the_one_acting(replicas) {
            return i;
        }
        assert!(start.elapsed() < within, "no replica acts after {within:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn one_replica_acts_and_a_clean_stop_hands_over_at_once() {
    let (_server, bus) = common::server_and_bus().await;
    let store = bucket(&bus).await;
    let stops: Vec<CancellationToken> = (0..3).map(|_| CancellationToken::new()).collect();
    let replicas: Vec<Leadership> = (0..3)
        .map(|i| spawn_lease(spec(&store, &format!("r{i}")), stops[i].clone()))
        .collect();
    let leader = wait_for_leader(&replicas, Duration::from_secs(3)).await;
    // Renewals keep the same replica acting, well past several TTLs.
    let still = watch_exclusive(
        &replicas,
        Instant::now() + Duration::from_millis(3 * TTL_MS),
    )
    .await;
    assert_eq!(still, Some(leader), "the leader kept renewing");
    let term = replicas[leader].acting().expect("acting");

    stops[leader].cancel();
    let stopped = Instant::now();
    let mut others: Vec<Leadership> = replicas.clone();
    others.remove(leader);
    let next = wait_for_leader(&others, Duration::from_secs(3)).await;
    let handover = stopped.elapsed();
    assert!(
        replicas[leader].acting().is_none(),
        "the stopped replica no longer acts"
    );
    assert!(
        handover < Duration::from_millis(TTL_MS),
        "a clean stop hands over before the TTL runs out (took {handover:?})"
    );
    assert!(
        others[next].acting().expect("acting") > term,
        "the new holder's term is higher"
    );
    for s in &stops {
        s.cancel();
    }
}

#[tokio::test]
async fn a_dead_holder_is_replaced_only_once_its_lease_is_free() {
    let (_server, bus) = common::server_and_bus().await;
    let store = bucket(&bus).await;
    let policy = Policy::new(TTL_MS, SKEW_MS).expect("policy");
    // The holder: a keeper task aborted (like kill -9), so it never gives the lease up.
    let (tx, rx_holder) = tokio::sync::watch::channel(None);
    let holder_stop = CancellationToken::new();
    let holder_task = tokio::spawn(jr_bus::lease::keep_lease(
        spec(&store, "holder"),
        tx,
        holder_stop.clone(),
    ));
    let start = Instant::now();
    while rx_holder.borrow().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "holder never held"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let standby_stop = CancellationToken::new();
    let standby = spawn_lease(spec(&store, "standby"), standby_stop.clone());
    tokio::time::sleep(Duration::from_millis(TTL_MS)).await;
    assert!(
        standby.acting().is_none(),
        "the standby waits while the holder renews"
    );

    holder_task.abort();
    let died = Instant::now();
    let holder_until = rx_holder.borrow().expect("held").acting_until;
    let last_renewal = store
        .entry("lease.test")
        .await
        .expect("read")
        .expect("lease");
    let lease: jr_lease::Lease = serde_json::from_slice(&last_renewal.value).expect("lease json");
    // Never before the lease is free by the standby's clock…
    let mut standby_waiting = standby.clone();
    let took_over = loop {
        if standby_waiting.acting().is_some() {
            break jr_protocol::now_ms();
        }
        assert!(
            died.elapsed() < Duration::from_millis(3 * TTL_MS),
            "the standby never took over"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(
        took_over >= lease.free_from(&policy),
        "taken over at {took_over}, before the dead holder's lease was free at {}",
        lease.free_from(&policy)
    );
    assert!(
        holder_until < took_over,
        "the dead holder could act until {holder_until}, the standby took over at {took_over}"
    );
    // …and soon after it (one look interval plus a write).
    assert!(
        took_over <= lease.free_from(&policy) + 500,
        "taken over at {took_over}, long after the lease was free at {}",
        lease.free_from(&policy)
    );
    standby_waiting.until_acting(&standby_stop).await;
    standby_stop.cancel();
    holder_stop.cancel();
}
