mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use jr_bus::{
    Bus, BusMetrics, CancellationToken, ConsumerOptions, ConsumerSpec, Disposition, SemaphoreGate,
};
use jr_protocol::STREAM_EVENTS;

fn events_consumer(name: &str) -> ConsumerSpec {
    ConsumerSpec {
        ack_wait: Duration::from_secs(1),
        ..ConsumerSpec::new(STREAM_EVENTS, name, vec!["jr.event.>".into()])
    }
}

/// Declares the consumer, then runs the loop in the background; cancel the token to stop it.
async fn spawn_consumer<H, Fut>(
    bus: &Bus,
    spec: ConsumerSpec,
    opts: ConsumerOptions,
    handler: H,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), jr_bus::BusError>>,
)
where
    H: Fn(jr_bus::Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Disposition> + Send + 'static,
{
    bus.ensure_consumer(&spec).await.expect("consumer declared");
    let shutdown = CancellationToken::new();
    let task = {
        let (bus, shutdown) = (bus.clone(), shutdown.clone());
        tokio::spawn(async move { bus.run_consumer(&spec, handler, opts, shutdown).await })
    };
    (shutdown, task)
}

#[tokio::test]
async fn dispositions_ack_nak_with_delay_and_term_are_applied() {
    let (_server, bus) = server_and_bus().await;
    let (nak_then_ack, term) = (new_assignment(), new_assignment());
    bus.publish(
        &released_subject(nak_then_ack),
        &released(nak_then_ack, "retry-me"),
    )
    .await
    .expect("published");
    bus.publish(&released_subject(term), &released(term, "poison"))
        .await
        .expect("published");

    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let spec = events_consumer("dispositions");
    let (shutdown, task) = spawn_consumer(&bus, spec, ConsumerOptions::default(), {
        let seen = seen.clone();
        move |delivery| {
            let seen = seen.clone();
            async move {
                let id = delivery.envelope.id.clone();
                seen.lock()
                    .expect("lock")
                    .push((id.clone(), delivery.delivered_count));
                match (id.as_str(), delivery.delivered_count) {
                    ("retry-me", 1) => Disposition::Nak(Some(Duration::from_millis(300))),
                    ("retry-me", _) => Disposition::Ack,
                    _ => Disposition::Term("cannot handle".into()),
                }
            }
        }
    })
    .await;

    eventually(
        "retry-me acked on its second delivery",
        Duration::from_secs(10),
        || async { seen.lock().expect("lock").contains(&("retry-me".into(), 2)) },
    )
    .await;
    // Acked and termed messages leave the pending lists; an ignored Term would stay ack-pending
    // until ack_wait (1 s) and then be redelivered.
    eventually("nothing pending", Duration::from_secs(10), || async {
        let counts = bus
            .consumer_info(STREAM_EVENTS, "dispositions")
            .await
            .expect("info");
        counts.num_pending == 0 && counts.num_ack_pending == 0 && counts.ack_floor_stream_seq == 2
    })
    .await;
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.iter().filter(|(id, _)| id == "poison").count(), 1);
    assert_eq!(seen.iter().filter(|(id, _)| id == "retry-me").count(), 2);

    let labels = |d: &'static str| [("consumer", "JR_EVENTS/dispositions"), ("disposition", d)];
    assert_eq!(
        BusMetrics::value(&bus.metrics().dispositions, &labels("ack")),
        1
    );
    assert_eq!(
        BusMetrics::value(&bus.metrics().dispositions, &labels("nak")),
        1
    );
    assert_eq!(
        BusMetrics::value(&bus.metrics().dispositions, &labels("term")),
        1
    );

    shutdown.cancel();
    task.await.expect("no panic").expect("clean exit");
}

#[tokio::test]
async fn garbage_is_termed_and_the_loop_keeps_consuming() {
    let (_server, bus) = server_and_bus().await;
    let (garbage, good) = (new_assignment(), new_assignment());
    bus.jetstream()
        .publish(
            released_subject(garbage),
            vec![0xff, 0x00, 0x13, 0x37].into(),
        )
        .await
        .expect("sent")
        .await
        .expect("stored");
    bus.publish(&released_subject(good), &released(good, "good"))
        .await
        .expect("published");

    let handled: Arc<Mutex<Vec<String>>> = Arc::default();
    let (shutdown, task) = spawn_consumer(
        &bus,
        events_consumer("garbage"),
        ConsumerOptions::default(),
        {
            let handled = handled.clone();
            move |delivery| {
                let handled = handled.clone();
                async move {
                    handled.lock().expect("lock").push(delivery.envelope.id);
                    Disposition::Ack
                }
            }
        },
    )
    .await;
    eventually("good message handled", Duration::from_secs(10), || async {
        handled.lock().expect("lock").as_slice() == ["good"]
    })
    .await;
    eventually(
        "garbage no longer pending",
        Duration::from_secs(10),
        || async {
            let counts = bus
                .consumer_info(STREAM_EVENTS, "garbage")
                .await
                .expect("info");
            counts.num_ack_pending == 0 && counts.num_pending == 0
        },
    )
    .await;
    let undecodable = BusMetrics::value(
        &bus.metrics().undecodable,
        &[("consumer", "JR_EVENTS/garbage"), ("reason", "envelope")],
    );
    assert_eq!(undecodable, 1);
    assert!(!task.is_finished(), "the loop is still running");
    shutdown.cancel();
    task.await.expect("no panic").expect("clean exit");
}

#[tokio::test]
async fn a_gate_with_two_permits_never_pulls_more_than_two_messages() {
    gate_with_two_permits(1).await;
}

#[tokio::test]
async fn batched_pulls_never_take_more_messages_than_the_gate_grants() {
    gate_with_two_permits(8).await;
}

/// Six messages through a gate of two permits, pulling up to `pull_batch` per pull.
async fn gate_with_two_permits(pull_batch: usize) {
    let (_server, bus) = server_and_bus().await;
    for n in 0..6 {
        let id = new_assignment();
        bus.publish(&released_subject(id), &released(id, &format!("m{n}")))
            .await
            .expect("published");
    }
    let in_flight = Arc::new(AtomicUsize::new(0));
    let max_in_flight = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    // Handlers wait here until the test lets them go.
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = Arc::new(SemaphoreGate::new(2));
    let opts = ConsumerOptions::default()
        .concurrency(10)
        .gate(gate.clone())
        .pull_batch(pull_batch);
    let spec = ConsumerSpec {
        ack_wait: Duration::from_secs(30),
        ..events_consumer("gated")
    };
    let (shutdown, task) = spawn_consumer(&bus, spec, opts, {
        let (in_flight, max_in_flight, done, release) = (
            in_flight.clone(),
            max_in_flight.clone(),
            done.clone(),
            release.clone(),
        );
        move |delivery| {
            let (in_flight, max_in_flight, done, release) = (
                in_flight.clone(),
                max_in_flight.clone(),
                done.clone(),
                release.clone(),
            );
            async move {
                assert!(
                    delivery.permit.is_some(),
                    "gated deliveries carry their permit"
                );
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                max_in_flight.fetch_max(now, Ordering::SeqCst);
                release.acquire().await.expect("open").forget();
                in_flight.fetch_sub(1, Ordering::SeqCst);
                done.fetch_add(1, Ordering::SeqCst);
                Disposition::Ack
            }
        }
    })
    .await;

    eventually("two handlers running", Duration::from_secs(10), || async {
        in_flight.load(Ordering::SeqCst) == 2
    })
    .await;
    // Fetch-per-permit: the third message is not pulled, it waits in JetStream.
    let counts = bus
        .consumer_info(STREAM_EVENTS, "gated")
        .await
        .expect("info");
    assert_eq!((counts.num_ack_pending, counts.num_pending), (2, 4));
    assert_eq!(gate.available(), 0);

    release.add_permits(6);
    eventually("all six handled", Duration::from_secs(10), || async {
        done.load(Ordering::SeqCst) == 6
    })
    .await;
    assert_eq!(max_in_flight.load(Ordering::SeqCst), 2);
    // The idle pull holds the permits it could take (one, or both when it pulls in batches)
    // while it waits for a seventh message (each empty pull gives them back and the next takes
    // them again).
    let reserved = pull_batch.min(2);
    eventually(
        "handler slots are free again",
        Duration::from_secs(5),
        || async { gate.available() == 2 - reserved },
    )
    .await;
    shutdown.cancel();
    task.await.expect("no panic").expect("clean exit");
    assert_eq!(gate.available(), 2, "shutdown returns the reserved permit");
}

#[tokio::test]
async fn a_handler_longer_than_ack_wait_is_kept_alive_with_progress() {
    let (_server, bus) = server_and_bus().await;
    let id = new_assignment();
    bus.publish(&released_subject(id), &released(id, "slow"))
        .await
        .expect("published");
    let calls: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let (shutdown, task) =
        spawn_consumer(&bus, events_consumer("slow"), ConsumerOptions::default(), {
            let calls = calls.clone();
            move |delivery| {
                let calls = calls.clone();
                async move {
                    *calls
                        .lock()
                        .expect("lock")
                        .entry(delivery.envelope.id)
                        .or_default() += 1;
                    // 2.5 × ack_wait: without Progress the server would redeliver meanwhile.
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                    Disposition::Ack
                }
            }
        })
        .await;
    eventually("slow message acked", Duration::from_secs(10), || async {
        bus.consumer_info(STREAM_EVENTS, "slow")
            .await
            .expect("info")
            .ack_floor_stream_seq
            == 1
    })
    .await;
    let counts = bus
        .consumer_info(STREAM_EVENTS, "slow")
        .await
        .expect("info");
    assert_eq!(counts.num_redelivered, 0);
    assert_eq!(calls.lock().expect("lock").get("slow"), Some(&1));
    shutdown.cancel();
    task.await.expect("no panic").expect("clean exit");
}

async fn consumer_resumes_after_restart(gated: bool) {
    let (mut server, bus) = server_and_bus().await;
    let handled: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut opts = ConsumerOptions {
        pull_expires: Duration::from_secs(2),
        heartbeat: Duration::from_millis(500),
        ..ConsumerOptions::default()
    };
    if gated {
        opts = opts.gate(Arc::new(SemaphoreGate::new(1)));
    }
    let name = if gated {
        "restart-gated"
    } else {
        "restart-stream"
    };
    let (shutdown, task) = spawn_consumer(&bus, events_consumer(name), opts, {
        let handled = handled.clone();
        move |delivery| {
            let handled = handled.clone();
            async move {
                handled.lock().expect("lock").push(delivery.envelope.id);
                Disposition::Ack
            }
        }
    })
    .await;
    let before = new_assignment();
    bus.publish(&released_subject(before), &released(before, "before"))
        .await
        .expect("published");
    eventually("first message handled", Duration::from_secs(10), || async {
        handled.lock().expect("lock").len() == 1
    })
    .await;

    server.kill();
    server.restart().await.expect("restarts");
    let after = new_assignment();
    let never = CancellationToken::new();
    bus.publish_retrying(&released_subject(after), &released(after, "after"), &never)
        .await
        .expect("published after restart");
    // Well within the 2 s pull expiry + 5 s client backstop: the reconnection itself re-pulls.
    eventually(
        "message published after the restart handled",
        Duration::from_secs(6),
        || async { handled.lock().expect("lock").contains(&"after".to_owned()) },
    )
    .await;
    // A hard kill may lose acks the server had not yet written, so "before" can come back
    // (at-least-once); nothing else may appear.
    let handled = handled.lock().expect("lock").clone();
    assert!(
        handled.iter().all(|id| id == "before" || id == "after"),
        "{handled:?}"
    );
    shutdown.cancel();
    task.await.expect("no panic").expect("clean exit");
}

#[tokio::test]
async fn the_stream_consumer_resumes_after_a_nats_restart() {
    consumer_resumes_after_restart(false).await;
}

#[tokio::test]
async fn the_gated_consumer_resumes_after_a_nats_restart() {
    consumer_resumes_after_restart(true).await;
}

/// A gate that counts how often a consumer asked it for permits.
struct CountingGate {
    inner: SemaphoreGate,
    asked: AtomicUsize,
}

impl jr_bus::Gate for CountingGate {
    fn acquire(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = jr_bus::Permit> + Send + '_>> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        self.inner.acquire()
    }

    fn acquire_many(
        &self,
        max: usize,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<jr_bus::Permit>> + Send + '_>> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        self.inner.acquire_many(max)
    }
}

/// An idle gated consumer gives its permits back after every empty pull: a worker counts
/// them as reserved, so a consumer sitting on them while nothing comes kept the worker from
/// replacing its warm executors (they died idle, the reserved slots stayed taken).
#[tokio::test]
async fn an_empty_gated_pull_gives_its_permits_back() {
    let (_server, bus) = server_and_bus().await;
    let gate = Arc::new(CountingGate {
        inner: SemaphoreGate::new(2),
        asked: AtomicUsize::new(0),
    });
    let opts = ConsumerOptions::default()
        .concurrency(2)
        .gate(gate.clone())
        .pull_batch(2)
        .pull_expires(Duration::from_millis(300));
    let (shutdown, task) = spawn_consumer(&bus, events_consumer("idle-gated"), opts, |_| async {
        Disposition::Ack
    })
    .await;
    eventually(
        "the gate asked again after empty pulls",
        Duration::from_secs(10),
        || async { gate.asked.load(Ordering::SeqCst) >= 3 },
    )
    .await;
    shutdown.cancel();
    task.await.expect("no panic").expect("clean exit");
}
