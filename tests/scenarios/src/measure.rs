//! What the benchmark (`src/bin/bench.rs`) measures with: latency summaries, CPU time and peak
//! memory of processes from `/proc`, reading a whole stream back after a run, and pairing the
//! lifecycle timestamps the streams carry (fetch → workload created, final result → released).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use futures::StreamExt as _;
use jr_protocol::{AssignmentId, Envelope, Kind, Message, WorkloadPhase, subject};
use jr_store::testkit::Builder;

/// Unix time in milliseconds (the unit of `occurred_at` and `fetched_at`).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Count, median, 99th percentile and maximum of a set of samples (same unit as the samples).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    pub count: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

impl Summary {
    /// `None` for no samples. Percentiles are nearest-rank: the smallest sample with at least
    /// q·n samples at or below it.
    pub fn of(samples: impl IntoIterator<Item = f64>) -> Option<Summary> {
        let mut sorted: Vec<f64> = samples.into_iter().filter(|v| !v.is_nan()).collect();
        sorted.sort_by(f64::total_cmp);
        let mean = sorted.iter().sum::<f64>() / sorted.len().max(1) as f64;
        Some(Summary {
            mean,
            count: sorted.len(),
            p50: percentile(&sorted, 0.50)?,
            p99: percentile(&sorted, 0.99)?,
            max: *sorted.last()?,
        })
    }
}

/// Nearest-rank percentile of ascending `sorted` (`q` in 0..=1).
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted
        .get(rank.saturating_sub(1).min(sorted.len() - 1))
        .copied()
}

/// CPU time of one process in clock ticks, from `/proc/<pid>/stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTicks {
    /// utime + stime of the process itself.
    pub own: u64,
    /// cutime + cstime: children it has waited for (Postgres backends that exited).
    pub reaped_children: u64,
    pub ppid: u32,
}

/// Parses the fields the benchmark needs from the text of `/proc/<pid>/stat`. The command name
/// in parentheses may contain spaces, so fields are counted after the last `)`.
pub fn parse_stat(text: &str) -> Option<CpuTicks> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state(3) ppid(4) … utime(14) stime(15) cutime(16) cstime(17), 1-based in proc(5).
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(CpuTicks {
        own: field(14)? + field(15)?,
        reaped_children: field(16)? + field(17)?,
        ppid: u32::try_from(field(4)?).ok()?,
    })
}

pub fn read_cpu(pid: u32) -> Option<CpuTicks> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The KiB value of the line starting with `key` in `/proc/<pid>/status` or `/proc/meminfo` text
/// (`VmHWM:\t  5120 kB`).
pub fn parse_kib(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `VmHWM`: the peak resident set of a process, in KiB.
/// Resident set size now (`VmRSS`), KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    parse_kib(
        &std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?,
        "VmRSS:",
    )
}

pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    parse_kib(
        &std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?,
        "VmHWM:",
    )
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on every Linux this runs on if that fails).
pub fn clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Processes whose command line (split into arguments) satisfies `matches`.
pub fn find_pids(matches: impl Fn(&[String]) -> bool) -> Vec<u32> {
    all_pids()
        .into_iter()
        .filter(|pid| {
            let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<String> = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            !args.is_empty() && matches(&args)
        })
        .collect()
}

/// `args` contain `flag` immediately followed by `value` (e.g. `-p 4222`).
pub fn has_arg_pair(args: &[String], flag: &str, value: &str) -> bool {
    args.windows(2).any(|w| w[0] == flag && w[1] == value)
}

/// CPU ticks of a process tree's root plus its children: its own time, the children it reaped,
/// and the live children's own time (how a Postgres postmaster and its backends add up).
pub fn tree_ticks(root: u32) -> Option<u64> {
    let root_ticks = read_cpu(root)?;
    let live_children: u64 = all_pids()
        .into_iter()
        .filter_map(read_cpu)
        .filter(|t| t.ppid == root)
        .map(|t| t.own)
        .sum();
    Some(root_ticks.own + root_ticks.reaped_children + live_children)
}

/// One message read back from a stream.
#[derive(Clone, Debug)]
pub struct Stored {
    pub seq: u64,
    pub subject: String,
    pub envelope: Envelope,
}

/// Every decodable message of `stream` from the first to the last sequence at call time.
/// Undecodable messages are counted in the second value, not returned.
pub async fn read_stream(
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> anyhow::Result<(Vec<Stored>, usize)> {
    let mut handle = js
        .get_stream(stream)
        .await
        .with_context(|| format!("stream {stream}"))?;
    let last = handle.info().await?.state.last_sequence;
    let mut out = Vec::new();
    let mut undecodable = 0;
    if last == 0 {
        return Ok((out, undecodable));
    }
    let consumer = handle
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .with_context(|| format!("reading {stream}: no message for 10 s"))?;
        let message = next.with_context(|| format!("reading {stream}: consumer ended"))??;
        let seq = message
            .info()
            .map_err(|e| anyhow::anyhow!("message info: {e}"))?
            .stream_sequence;
        match jr_protocol::decode(&message.payload) {
            Ok(envelope) => out.push(Stored {
                seq,
                subject: message.subject.to_string(),
                envelope,
            }),
            Err(_) => undecodable += 1,
        }
        if seq >= last {
            return Ok((out, undecodable));
        }
    }
}

/// Per-assignment latencies read from the streams after a run, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LifecycleLatencies {
    /// `Assignment.fetched_at` (attempt 1) → `workload-created` of attempt 1.
    pub fetch_to_created: Vec<f64>,
    /// `workload-created` → `claimed` of the same attempt (workload start + executor claim).
    pub created_to_claimed: Vec<f64>,
    /// `Assignment.fetched_at` (attempt 1) → `claimed` of attempt 1: how long a job waits from
    /// the forge to its executor.
    pub fetch_to_claimed: Vec<f64>,
    /// `workload-created` → `released` of the same attempt: how long a capacity slot was held.
    pub created_to_released: Vec<f64>,
    /// `terminal` → `released` of the terminal's attempt.
    pub terminal_to_released: Vec<f64>,
    /// `claimed` → `terminal` of the same attempt (the job's run as the executor reports it).
    pub claimed_to_terminal: Vec<f64>,
    /// Attempt-1 `fetched_at` stamps, earliest and latest (unix ms): the dispatch window.
    pub fetch_window: Option<(u64, u64)>,
    /// Attempt-1 assignments with no `workload-created` of attempt 1.
    pub missing_created: usize,
    /// Terminal markers with no `released` of their attempt.
    pub missing_released: usize,
    /// Latest `released.occurred_at` seen (unix ms).
    pub last_released_at: Option<u64>,
}

/// Pairs lifecycle timestamps. Duplicates (redeliveries, re-publishes) count once: the earliest
/// `workload-created`/`released` of an attempt and the first terminal of an assignment are used.
pub fn lifecycle_latencies(assignments: &[Envelope], events: &[Envelope]) -> LifecycleLatencies {
    let mut fetched: BTreeMap<AssignmentId, u64> = BTreeMap::new();
    for e in assignments {
        if let (Message::Assignment(a), 1) = (&e.message, e.attempt) {
            fetched.entry(e.assignment_id).or_insert(a.fetched_at);
        }
    }
    let mut created: BTreeMap<(AssignmentId, u32), u64> = BTreeMap::new();
    let mut released: BTreeMap<(AssignmentId, u32), u64> = BTreeMap::new();
    let mut claimed: BTreeMap<(AssignmentId, u32), u64> = BTreeMap::new();
    let mut terminal: BTreeMap<AssignmentId, (u32, u64)> = BTreeMap::new();
    for e in events {
        let key = (e.assignment_id, e.attempt);
        let earliest = |m: &mut BTreeMap<(AssignmentId, u32), u64>| {
            let at = m.entry(key).or_insert(e.occurred_at);
            *at = (*at).min(e.occurred_at);
        };
        match e.kind() {
            Kind::WorkloadCreated => earliest(&mut created),
            Kind::Released => earliest(&mut released),
            Kind::Claimed => earliest(&mut claimed),
            Kind::Terminal => {
                terminal
                    .entry(e.assignment_id)
                    .or_insert((e.attempt, e.occurred_at));
            }
            Kind::Assignment
            | Kind::WorkloadRequested
            | Kind::WorkloadObserved
            | Kind::ExecutorFinished
            | Kind::Redispatched
            | Kind::TaskFailed
            | Kind::DeleteWorkload
            | Kind::FailTask
            | Kind::Redispatch => {}
        }
    }
    let diff = |from: u64, to: u64| to as f64 - from as f64;
    let mut out = LifecycleLatencies {
        last_released_at: released.values().copied().max(),
        ..Default::default()
    };
    for (id, at) in &fetched {
        match created.get(&(*id, 1)) {
            Some(c) => out.fetch_to_created.push(diff(*at, *c)),
            None => out.missing_created += 1,
        }
        if let Some(c) = claimed.get(&(*id, 1)) {
            out.fetch_to_claimed.push(diff(*at, *c));
        }
    }
    for (key, at) in &created {
        if let Some(c) = claimed.get(key) {
            out.created_to_claimed.push(diff(*at, *c));
        }
        if let Some(r) = released.get(key) {
            out.created_to_released.push(diff(*at, *r));
        }
    }
    out.fetch_window = fetched
        .values()
        .copied()
        .min()
        .zip(fetched.values().copied().max());
    for (id, (attempt, at)) in &terminal {
        if let Some(c) = claimed.get(&(*id, *attempt)) {
            out.claimed_to_terminal.push(diff(*c, *at));
        }
        match released.get(&(*id, *attempt)) {
            Some(r) => out.terminal_to_released.push(diff(*at, *r)),
            None => out.missing_released += 1,
        }
    }
    out
}

/// For each `(sequence, sent_at)` the time until a checkpoint at or above it was observed, given
/// checkpoint samples `(observed_at, checkpoint)` in time order (checkpoints never go down).
/// Messages never seen applied are left out (their count is `sent.len() - result.len()`).
pub fn visibility_lags(
    sent: &[(u64, std::time::Instant)],
    samples: &[(std::time::Instant, u64)],
) -> Vec<Duration> {
    sent.iter()
        .filter_map(|(seq, at)| {
            // First sample taken after the send whose checkpoint covers `seq`.
            let from = samples.partition_point(|(t, _)| t < at);
            let rest = &samples[from..];
            let hit = rest.partition_point(|(_, cp)| cp < seq);
            rest.get(hit).map(|(t, _)| t.duration_since(*at))
        })
        .collect()
}

/// Messages of one stream with their stream sequence numbers (1-based).
pub type Sequenced = Vec<(u64, Envelope)>;

fn numbered(messages: Vec<Envelope>) -> Sequenced {
    messages
        .into_iter()
        .zip(1u64..)
        .map(|(e, seq)| (seq, e))
        .collect()
}

fn builder(task: i64, i: usize) -> Builder {
    Builder::new(task, if i % 3 == 2 { "vm" } else { "pod" })
}

/// `count` complete lifecycles (assignment; requested, created, running, claimed, terminal,
/// succeeded, released) interleaved in time as ~25 concurrent jobs would publish them, per
/// stream: what the projector sees from a busy but healthy system.
pub fn complete_lifecycles(first_task: i64, count: usize) -> (Sequenced, Sequenced) {
    let base = 1_700_000_000_000u64;
    let mut assignments = Vec::new();
    let mut events = Vec::new();
    for i in 0..count {
        let b = builder(first_task + i as i64, i);
        let t = base + i as u64 * 10;
        assignments.push(b.assignment(1, t));
        events.push(b.requested(1, t + 2));
        events.push(b.created(1, t + 5));
        events.push(b.observed(1, t + 20, WorkloadPhase::Running, None));
        events.push(b.claimed(1, t + 30));
        events.push(b.terminal(1, t + 230, true));
        events.push(b.observed(1, t + 240, WorkloadPhase::Succeeded, None));
        events.push(b.released(1, t + 250));
    }
    // Stable: one lifecycle's events keep their order when timestamps tie.
    events.sort_by_key(|e| e.occurred_at);
    (numbered(assignments), numbered(events))
}

/// `count` assignments that are all still active at `now_ms`, a quarter each pending, starting,
/// running and finishing (terminal, log still open); most are recent, every 20th is ten minutes
/// old so that timeout rules fire. Returned as (assignment messages, events) in order.
pub fn active_assignments(
    first_task: i64,
    count: usize,
    now_ms: u64,
) -> (Vec<Envelope>, Vec<Envelope>) {
    let mut assignments = Vec::new();
    let mut events = Vec::new();
    for i in 0..count {
        let b = builder(first_task + i as i64, i);
        let t = if i % 20 == 0 {
            now_ms - 600_000
        } else {
            now_ms - (i as u64 % 60) * 1000 - 1000
        };
        assignments.push(b.assignment(1, t));
        let stage = i % 4;
        if stage >= 1 {
            events.push(b.requested(1, t + 2));
            events.push(b.created(1, t + 5));
        }
        if stage >= 2 {
            events.push(b.observed(1, t + 20, WorkloadPhase::Running, None));
            events.push(b.claimed(1, t + 30));
        }
        if stage >= 3 {
            events.push(b.terminal(1, t + 500, false));
        }
    }
    (assignments, events)
}

/// Message `k` of the projection-lag run, stamped `at`: lifecycles of five messages
/// (assignment, created, claimed, terminal with log closed, released) on backend `bench`, which
/// no worker consumes, so the projection sees complete jobs and the planner has next to nothing
/// to do. Returns (0 = JR_ASSIGNMENTS / 1 = JR_EVENTS, subject, envelope).
pub fn lag_message(k: u64, at: u64) -> (usize, String, Envelope) {
    let b = Builder::new(5_000_000 + (k / 5) as i64, "bench");
    let event = |kind: Kind, e: Envelope| (1, subject::event(&b.backend, b.id, kind), e);
    match k % 5 {
        0 => (
            0,
            subject::assignment(&b.backend, b.id),
            b.assignment(1, at),
        ),
        1 => event(Kind::WorkloadCreated, b.created(1, at)),
        2 => event(Kind::Claimed, b.claimed(1, at)),
        3 => event(Kind::Terminal, b.terminal(1, at, true)),
        _ => event(Kind::Released, b.released(1, at)),
    }
}

/// Stored messages per job by kind (`assignment`, `workload-observed`, …), from the decoded
/// streams, most frequent first: where the messages of a lifecycle go.
pub fn per_job_by_kind<'a>(
    envelopes: impl IntoIterator<Item = &'a Envelope>,
    jobs: u32,
) -> Vec<(&'static str, f64)> {
    let mut counts: BTreeMap<&'static str, u64> = BTreeMap::new();
    for e in envelopes {
        *counts.entry(e.kind().as_str()).or_default() += 1;
    }
    #[expect(
        clippy::cast_precision_loss,
        reason = "message counts of a benchmark run"
    )]
    let mut out: Vec<(&'static str, f64)> = counts
        .into_iter()
        .map(|(kind, n)| (kind, n as f64 / f64::from(jobs.max(1))))
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    out
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use jr_store::MemoryProjection;

    use super::*;

    #[test]
    fn messages_per_job_are_counted_by_kind_most_frequent_first() {
        let (assignments, events) = complete_lifecycles(1, 4);
        let all: Vec<&Envelope> = assignments
            .iter()
            .chain(events.iter())
            .map(|(_, e)| e)
            .collect();
        let by_kind = per_job_by_kind(all, 4);
        assert_eq!(by_kind.first(), Some(&("workload-observed", 2.0)));
        assert_eq!(by_kind.len(), 7, "{by_kind:?}");
        let total: f64 = by_kind.iter().map(|(_, n)| n).sum();
        assert!((total - 8.0).abs() < 1e-9, "{by_kind:?}");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let s = Summary::of((1..=100).map(f64::from)).expect("samples");
        assert_eq!(
            (s.count, s.p50, s.p99, s.max, s.mean),
            (100, 50.0, 99.0, 100.0, 50.5)
        );
        let one = Summary::of([7.0]).expect("one sample");
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
        assert!(Summary::of(std::iter::empty()).is_none());
    }

    #[test]
    fn stat_fields_are_counted_after_a_command_name_with_spaces() {
        let text = "4242 (pod worker) S 17 4242 4242 0 -1 4194560 900 0 0 0 123 45 6 7 20 0 9 0";
        let t = parse_stat(text).expect("parses");
        assert_eq!(
            t,
            CpuTicks {
                own: 168,
                reaped_children: 13,
                ppid: 17
            }
        );
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn peak_rss_comes_from_vmhwm() {
        let status = "Name:\tx\nVmPeak:\t  9000 kB\nVmHWM:\t    5120 kB\nVmRSS:\t 4000 kB\n";
        assert_eq!(parse_kib(status, "VmHWM:"), Some(5120));
        assert_eq!(parse_kib("Name: x\n", "VmHWM:"), None);
    }

    #[test]
    fn this_process_reports_cpu_and_memory() {
        let pid = std::process::id();
        assert!(read_cpu(pid).is_some());
        assert!(peak_rss_kib(pid).is_some_and(|k| k > 0));
        assert!(find_pids(|_| true).contains(&pid));
    }

    #[test]
    fn lifecycle_pairs_first_attempt_dispatch_and_terminal_attempt_release() {
        let a = Builder::new(1, "pod");
        let b = Builder::new(2, "vm");
        // a: fetched at 995 (assignment at 1000 fetched 5 ms before), created at 1040, a
        // redelivered duplicate created later; terminal at 2000, released at 2300.
        let assignments = vec![
            a.assignment(1, 1000),
            b.assignment(1, 1000),
            b.assignment(2, 5000),
        ];
        let events = vec![
            a.created(1, 1040),
            a.created(1, 1090),
            a.claimed(1, 1100),
            a.terminal(1, 2000, true),
            a.released(1, 2300),
            // b: attempt 1 never created; attempt 2 ran; released only for attempt 1.
            b.created(2, 5100),
            b.terminal(2, 6000, true),
            b.released(1, 6100),
        ];
        let l = lifecycle_latencies(&assignments, &events);
        assert_eq!(l.fetch_to_created, vec![45.0]);
        assert_eq!(l.created_to_released, vec![1260.0]);
        assert_eq!(l.created_to_claimed, vec![60.0]);
        assert_eq!(l.missing_created, 1);
        assert_eq!(l.terminal_to_released, vec![300.0]);
        assert_eq!(l.missing_released, 1);
        assert_eq!(l.last_released_at, Some(6100));
    }

    #[test]
    fn lag_is_time_to_the_first_covering_checkpoint_after_the_send() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let samples = vec![
            (at(0), 0),
            (at(5), 1),
            (at(10), 1),
            (at(12), 3),
            (at(20), 3),
        ];
        // seq 1 sent at 0 → seen at 5; seq 2 sent at 6 → seen at 12; seq 3 sent at 11 → 12;
        // seq 4 never applied.
        let sent = vec![(1, at(0)), (2, at(6)), (3, at(11)), (4, at(15))];
        let lags = visibility_lags(&sent, &samples);
        assert_eq!(
            lags,
            vec![
                Duration::from_millis(5),
                Duration::from_millis(6),
                Duration::from_millis(1)
            ]
        );
    }

    #[test]
    fn synthetic_lifecycles_project_as_finished_and_active_ones_stay_open() {
        let (assignments, events) = complete_lifecycles(1, 30);
        assert_eq!((assignments.len(), events.len()), (30, 210));
        let mut projection = MemoryProjection::new();
        projection.apply_batch(jr_protocol::STREAM_ASSIGNMENTS, &assignments);
        projection.apply_batch(jr_protocol::STREAM_EVENTS, &events);
        assert_eq!(projection.records().count(), 30);
        assert!(
            projection.snapshot(now_ms()).assignments.is_empty(),
            "every lifecycle is finished"
        );

        let now = now_ms();
        let (a, e) = active_assignments(100, 40, now);
        let all: Vec<Envelope> = a.into_iter().chain(e).collect();
        assert_eq!(
            MemoryProjection::from_events(&all)
                .snapshot(now)
                .assignments
                .len(),
            40
        );

        let mut lag = MemoryProjection::new();
        for k in 0..10 {
            let (stream, subject, envelope) = lag_message(k, 1_000 + k);
            assert_eq!(
                subject.starts_with("jr.assignment.bench."),
                stream == 0,
                "{subject}"
            );
            lag.apply(k + 1, &envelope);
        }
        assert_eq!(lag.records().count(), 2);
        assert!(
            lag.snapshot(now).assignments.is_empty(),
            "lag lifecycles are finished"
        );
    }
}
