//! Projection consistency: the Postgres projection must equal the fold of the streams.
//!
//! [`check_projection`] reads every message of `JR_ASSIGNMENTS` and `JR_EVENTS` with an ordered
//! consumer, folds each stream (with its stream sequences) into a [`MemoryProjection`] — the
//! reference fold the SQL store shares — waits until the reconciler's checkpoints reach the same
//! sequences, and compares every [`AssignmentRecord`] field by field. A message applied twice, or
//! skipped, or applied out of order in a way the fold does not tolerate, shows up as a difference.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use jr_bus::async_nats::{self, jetstream};
use jr_protocol::{AssignmentId, Envelope, STREAM_ASSIGNMENTS, STREAM_EVENTS};
use jr_store::{AssignmentRecord, MemoryProjection, Store};

/// The two projected streams, in the order the reconciler projects them.
pub const PROJECTED_STREAMS: [&str; 2] = [STREAM_ASSIGNMENTS, STREAM_EVENTS];

/// Every decodable message of `stream` with its sequence, from the first up to the stream's last
/// sequence at the time of the call. Undecodable messages are skipped (as the projector does)
/// and counted in the second value.
pub async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
) -> anyhow::Result<(Vec<(u64, Envelope)>, u64)> {
    let mut out = Vec::new();
    let mut undecodable = 0;
    for (seq, payload) in raw_messages(js, stream).await? {
        match jr_protocol::decode(&payload) {
            Ok(envelope) => out.push((seq, envelope)),
            Err(_) => undecodable += 1,
        }
    }
    Ok((out, undecodable))
}

/// The names of every stream on the server (jetrunner's and the KV buckets').
pub async fn stream_names(js: &jetstream::Context) -> anyhow::Result<Vec<String>> {
    let mut names = js.stream_names();
    let mut out = Vec::new();
    while let Some(name) = names.next().await {
        out.push(name.map_err(|e| anyhow::anyhow!("stream names: {e}"))?);
    }
    Ok(out)
}

/// Every message body of `stream` (headers left out) with its sequence, from the first up to
/// the stream's last sequence at the time of the call.
pub async fn raw_messages(
    js: &jetstream::Context,
    stream: &str,
) -> anyhow::Result<Vec<(u64, Vec<u8>)>> {
    let handle = js
        .get_stream(stream)
        .await
        .with_context(|| format!("stream {stream}"))?;
    let info = handle
        .get_info()
        .await
        .with_context(|| format!("info of {stream}"))?;
    let last = info.state.last_sequence;
    let mut out = Vec::new();
    if info.state.messages == 0 {
        return Ok(out);
    }
    // A work-queue stream (JR_COMMANDS) takes no ordered consumer: its messages are read one
    // by one (a sequence acknowledged since is gone).
    if info.config.retention == jetstream::stream::RetentionPolicy::WorkQueue {
        for seq in info.state.first_sequence..=last {
            if let Ok(message) = handle.get_raw_message(seq).await {
                out.push((seq, message.payload.to_vec()));
            }
        }
        return Ok(out);
    }
    let consumer = handle
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .with_context(|| format!("ordered consumer on {stream}"))?;
    let mut messages = consumer.messages().await?;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .with_context(|| format!("{stream}: no message after {} of {last}", out.len()))?;
        let message = next
            .with_context(|| format!("{stream}: ordered consumer ended"))?
            .map_err(|e| anyhow::anyhow!("{stream}: {e}"))?;
        let info = message
            .info()
            .map_err(|e| anyhow::anyhow!("message info: {e}"))?;
        let (seq, pending) = (info.stream_sequence, info.pending);
        out.push((seq, message.payload.to_vec()));
        // The last sequence may be gone (a key's older revision, an expired lease).
        if seq >= last || pending == 0 {
            return Ok(out);
        }
    }
}

/// The reference projection of both streams as they are now, and each stream's last sequence.
pub async fn fold_streams(
    js: &jetstream::Context,
) -> anyhow::Result<(MemoryProjection, BTreeMap<String, u64>)> {
    let mut projection = MemoryProjection::new();
    let mut last = BTreeMap::new();
    for stream in PROJECTED_STREAMS {
        let (items, _) = read_stream(js, stream).await?;
        let stats = projection.apply_batch(stream, &items);
        if stats.skipped != 0 {
            anyhow::bail!("{stream}: {} messages out of sequence order", stats.skipped);
        }
        last.insert(stream.to_owned(), projection.checkpoint(stream));
    }
    Ok((projection, last))
}

/// What a consistency check found.
#[derive(Debug, Default)]
pub struct ConsistencyReport {
    pub assignments: usize,
    /// Stream → sequence both projections were compared at.
    pub checkpoints: BTreeMap<String, u64>,
    /// Human-readable differences; empty when the projections agree.
    pub differences: Vec<String>,
}

impl ConsistencyReport {
    pub fn is_consistent(&self) -> bool {
        self.differences.is_empty()
    }
}

async fn checkpoints(store: &Store) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for stream in PROJECTED_STREAMS {
        out.insert(stream.to_owned(), store.checkpoint(stream).await?);
    }
    Ok(out)
}

/// Waits until the Postgres projection has applied everything that is in the streams, with
/// nothing new arriving meanwhile, and compares it with the reference fold. `Err` only when no
/// stable point was reached within `timeout` (or NATS/Postgres could not be read); differences
/// are returned in the report.
pub async fn check_projection(
    nats_url: &str,
    database_url: &str,
    timeout: Duration,
) -> anyhow::Result<ConsistencyReport> {
    let client = async_nats::connect(jr_bus::server_urls(nats_url).as_slice())
        .await
        .context("connecting to NATS")?;
    let js = jetstream::new(client);
    let store = Store::connect(database_url)
        .await
        .context("connecting to the projection")?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let (reference, expected) = fold_streams(&js).await?;
        let before = checkpoints(&store).await?;
        if before == expected {
            let records = store.records().await?;
            let after = checkpoints(&store).await?;
            if after == expected {
                let differences = compare(reference.records(), &records);
                return Ok(ConsistencyReport {
                    assignments: records.len(),
                    checkpoints: expected,
                    differences,
                });
            }
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!(
                "the projection did not catch up within {timeout:?}: streams at {expected:?}, projection at {before:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Field-by-field differences between the reference records and the stored ones.
pub fn compare<'a>(
    reference: impl IntoIterator<Item = &'a AssignmentRecord>,
    stored: &[AssignmentRecord],
) -> Vec<String> {
    let reference: BTreeMap<AssignmentId, &AssignmentRecord> =
        reference.into_iter().map(|r| (r.id, r)).collect();
    let stored: BTreeMap<AssignmentId, &AssignmentRecord> =
        stored.iter().map(|r| (r.id, r)).collect();
    let mut out = Vec::new();
    for (id, want) in &reference {
        let Some(got) = stored.get(id) else {
            out.push(format!("{id}: in the streams but not in Postgres"));
            continue;
        };
        if want == got {
            continue;
        }
        let mut field = |name: &str, want: &dyn Debug, got: &dyn Debug| {
            let (want, got) = (format!("{want:?}"), format!("{got:?}"));
            if want != got {
                out.push(format!(
                    "{id}.{name}: streams say {want}, Postgres says {got}"
                ));
            }
        };
        field("state", &want.state(), &got.state());
        field("info", &want.info, &got.info);
        field("attempts", &want.attempts, &got.attempts);
        field("workloads", &want.workloads, &got.workloads);
        field("claim", &want.claim, &got.claim);
        field("terminal", &want.terminal, &got.terminal);
        field("failure", &want.failure, &got.failure);
        field("redispatches", &want.redispatches, &got.redispatches);
        field("updated_at", &want.updated_at, &got.updated_at);
    }
    for id in stored.keys().filter(|id| !reference.contains_key(id)) {
        out.push(format!("{id}: in Postgres but in neither stream"));
    }
    out
}

/// Nothing is left to happen to it: no live workload, and the task is final (records without
/// routing information are orphans, which are done once their workloads are gone).
pub fn is_settled(record: &AssignmentRecord) -> bool {
    record.live_workloads().next().is_none()
        && (record.info.is_none() || record.state().is_finished())
}

/// Waits until every record of the projection [`is_settled`] (the workers' last observations and
/// releases are projected); returns the records.
pub async fn wait_projection_settled(
    database_url: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<AssignmentRecord>> {
    let store = Store::connect(database_url)
        .await
        .context("connecting to the projection")?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let open: Vec<(AssignmentId, jr_store::AssignmentState)> = match store.records().await {
            Ok(records) => {
                let open: Vec<_> = records
                    .iter()
                    .filter(|r| !is_settled(r))
                    .map(|r| (r.id, r.state()))
                    .collect();
                if open.is_empty() {
                    return Ok(records);
                }
                open
            }
            Err(e) if tokio::time::Instant::now() > deadline => return Err(e.into()),
            Err(_) => Vec::new(),
        };
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("projection not settled after {timeout:?}: {open:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the projection's checkpoints stop moving and equal the streams' last sequences
/// (nothing in flight), then returns every table as JSON ([`Store::dump_rows`]).
pub async fn settled_dump(
    nats_url: &str,
    database_url: &str,
    timeout: Duration,
) -> anyhow::Result<serde_json::Value> {
    let report = check_projection(nats_url, database_url, timeout).await?;
    if !report.is_consistent() {
        anyhow::bail!("projection inconsistent: {:#?}", report.differences);
    }
    let store = Store::connect(database_url).await?;
    let dump = store.dump_rows().await?;
    if checkpoints(&store).await? != report.checkpoints {
        anyhow::bail!("the streams moved while dumping the projection");
    }
    Ok(dump)
}

/// The paths at which two JSON values differ (at most `limit`), for readable assertion messages.
pub fn json_differences(a: &serde_json::Value, b: &serde_json::Value, limit: usize) -> Vec<String> {
    fn walk(
        path: &str,
        a: &serde_json::Value,
        b: &serde_json::Value,
        out: &mut Vec<String>,
        limit: usize,
    ) {
        use serde_json::Value;
        if out.len() >= limit {
            return;
        }
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for key in keys {
                    let (va, vb) = (
                        x.get(key).unwrap_or(&Value::Null),
                        y.get(key).unwrap_or(&Value::Null),
                    );
                    walk(&format!("{path}.{key}"), va, vb, out, limit);
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                    walk(&format!("{path}[{i}]"), va, vb, out, limit);
                }
            }
            (Value::Array(x), Value::Array(y)) => {
                out.push(format!("{path}: {} vs {} entries", x.len(), y.len()))
            }
            _ if a == b => {}
            _ => out.push(format!("{path}: {a} vs {b}")),
        }
    }
    let mut out = Vec::new();
    walk("", a, b, &mut out, limit);
    out
}
