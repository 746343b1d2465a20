//! Decode-time checks on what a message may carry, so nothing that reaches a consumer can make
//! it (or the projection in Postgres) fail later: no NUL in any string (Postgres `text` refuses
//! it), bounded string lengths and list sizes (an index key has a size limit; memory too), and
//! times and counters within what the projection stores (`timestamptz` ends in the year 294276,
//! `integer` at 2^31 - 1). A message outside these bounds is refused at decode as
//! [`crate::DecodeError::Invalid`]; nothing is silently rewritten.

use crate::message::*;

/// Latest accepted time: 9999-12-31T23:59:59.999Z in unix milliseconds. Any real clock is far
/// below it, and every such value converts to a Postgres `timestamptz`.
pub const MAX_TIME_MS: u64 = 253_402_300_799_999;
/// Highest attempt number (the projection stores attempts as `integer`).
pub const MAX_ATTEMPT: u32 = i32::MAX as u32;
/// Longest accepted run-time bound: 10 years.
pub const MAX_DURATION_SECS: u64 = 10 * 366 * 24 * 60 * 60;
/// Identifiers and names (message id, workload, worker id, token hash, executor, key id, ...).
pub const MAX_NAME_BYTES: usize = 512;
/// Free text (reasons, repository, job name, forge URL, trace state).
pub const MAX_TEXT_BYTES: usize = 4096;
/// Labels per assignment.
pub const MAX_LABELS: usize = 64;

/// Why a decoded envelope is refused.
pub(crate) fn check(envelope: &Envelope) -> Result<(), String> {
    name("id", &envelope.id)?;
    time("occurred_at", envelope.occurred_at)?;
    attempt("attempt", envelope.attempt)?;
    if let Some(trace) = &envelope.trace {
        name("trace.traceparent", &trace.traceparent)?;
        if let Some(state) = &trace.tracestate {
            text("trace.tracestate", state)?;
        }
    }
    match &envelope.message {
        Message::Assignment(a) => {
            text("forge_instance", &a.forge_instance)?;
            if let Some(p) = &a.provider {
                name("provider", p)?;
            }
            if a.labels.len() > MAX_LABELS {
                return Err(format!(
                    "labels: {} labels, at most {MAX_LABELS} accepted",
                    a.labels.len()
                ));
            }
            for l in &a.labels {
                name("labels", l)?;
            }
            text("repository", &a.repository)?;
            text("job_name", &a.job_name)?;
            if a.max_duration_secs > MAX_DURATION_SECS {
                return Err(format!(
                    "max_duration_secs: {} is above {MAX_DURATION_SECS}",
                    a.max_duration_secs
                ));
            }
            time("fetched_at", a.fetched_at)?;
            name("sealed_task.key_id", &a.sealed_task.key_id)?;
        }
        Message::WorkloadRequested(r) => {
            name("workload", &r.workload)?;
            name("token_hash", r.token_hash.as_str())?;
            name("worker_id", &r.worker_id)?;
        }
        Message::WorkloadCreated(c) => {
            name("workload", &c.workload)?;
            name("token_hash", c.token_hash.as_str())?;
            name("worker_id", &c.worker_id)?;
        }
        Message::WorkloadObserved(o) => {
            name("workload", &o.workload)?;
            if let Some(r) = &o.reason {
                text("reason", r)?;
            }
        }
        Message::Claimed(c) => name("executor", &c.executor)?,
        Message::Terminal(t) => {
            if let Some(r) = &t.reason {
                text("reason", r)?;
            }
        }
        Message::ExecutorFinished(_) => {}
        Message::Released(r) => name("workload", &r.workload)?,
        Message::Redispatched(r) => {
            attempt("next_attempt", r.next_attempt)?;
            text("reason", &r.reason)?;
        }
        Message::TaskFailed(f) => text("reason", &f.reason)?,
        Message::DeleteWorkload(d) => {
            name("workload", &d.workload)?;
            text("reason", &d.reason)?;
        }
        Message::FailTask(f) => text("reason", &f.reason)?,
        Message::Redispatch(r) => {
            attempt("next_attempt", r.next_attempt)?;
            text("reason", &r.reason)?;
        }
    }
    Ok(())
}

fn string(field: &str, value: &str, max: usize) -> Result<(), String> {
    if value.contains('\0') {
        return Err(format!("{field}: contains a NUL character"));
    }
    if value.len() > max {
        return Err(format!(
            "{field}: {} bytes, at most {max} accepted",
            value.len()
        ));
    }
    Ok(())
}

fn name(field: &str, value: &str) -> Result<(), String> {
    string(field, value, MAX_NAME_BYTES)
}

fn text(field: &str, value: &str) -> Result<(), String> {
    string(field, value, MAX_TEXT_BYTES)
}

fn time(field: &str, ms: u64) -> Result<(), String> {
    if ms > MAX_TIME_MS {
        return Err(format!(
            "{field}: {ms} ms is after 9999-12-31 (at most {MAX_TIME_MS})"
        ));
    }
    Ok(())
}

fn attempt(field: &str, n: u32) -> Result<(), String> {
    if n > MAX_ATTEMPT {
        return Err(format!("{field}: {n} is above {MAX_ATTEMPT}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AssignmentId, BackendName, decode, encode};

    fn released(workload: &str, occurred_at: u64) -> Envelope {
        Envelope::new(
            "m-1",
            occurred_at,
            AssignmentId::for_task("https://forge.example", 1),
            1,
            Message::Released(Released {
                backend: BackendName::new("pod").unwrap_or_else(|e| panic!("{e}")),
                workload: workload.to_owned(),
            }),
        )
    }

    fn refused(envelope: &Envelope) -> Option<String> {
        match decode(&encode(envelope)) {
            Err(crate::DecodeError::Invalid { reason, .. }) => Some(reason),
            Err(other) => panic!("unexpected error {other}"),
            Ok(_) => None,
        }
    }

    #[test]
    fn nul_in_a_string_is_refused() {
        let reason = refused(&released("pod\0x", 1)).unwrap_or_default();
        assert!(reason.contains("NUL"), "{reason}");
        assert!(refused(&released("pod-x", 1)).is_none());
    }

    #[test]
    fn times_postgres_cannot_store_are_refused() {
        assert!(refused(&released("w", MAX_TIME_MS)).is_none());
        assert!(refused(&released("w", MAX_TIME_MS + 1)).is_some());
        assert!(refused(&released("w", u64::MAX)).is_some());
    }

    #[test]
    fn lengths_are_bounded() {
        assert!(refused(&released(&"w".repeat(MAX_NAME_BYTES), 1)).is_none());
        assert!(refused(&released(&"w".repeat(MAX_NAME_BYTES + 1), 1)).is_some());
        let mut e = released("w", 1);
        e.attempt = MAX_ATTEMPT + 1;
        assert!(refused(&e).is_some());
    }

    proptest::proptest! {
        /// Any string without NUL within the bound passes; any string with a NUL is refused.
        #[test]
        fn nul_decides(prefix in "[^\u{0}]{0,40}", suffix in "[^\u{0}]{0,40}", nul: bool) {
            let workload = if nul { format!("{prefix}\0{suffix}") } else { format!("{prefix}{suffix}") };
            proptest::prop_assert_eq!(refused(&released(&workload, 5)).is_some(), nul);
        }
    }
}
