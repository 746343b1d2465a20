//! Plain atomic counters; the scheduler exports a [`FacadeStats`] snapshot to Prometheus.

use std::sync::atomic::{AtomicU64, Ordering};

/// Why a call was refused as `unauthenticated`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AuthRefusal {
    /// No `x-runner-uuid` header.
    MissingUuid,
    /// `x-runner-uuid` is not a UUID.
    InvalidUuid,
    /// Token mode and no `x-runner-token`.
    MissingToken,
    /// The token's hash differs from the attempt's published hash.
    WrongToken,
    /// SPIFFE mode and the connection has no client certificate.
    MissingClientCertificate,
    /// The client certificate carries no `spiffe://` URI SAN.
    NoSpiffeId,
    /// The SPIFFE id is in another trust domain or names another assignment.
    SpiffeMismatch,
    /// No assignment with this id exists (the facade can check every token itself, so an
    /// executor of jetrunner's never asks before its assignment is stored).
    UnknownAssignment,
}

impl AuthRefusal {
    pub const ALL: [AuthRefusal; 8] = [
        AuthRefusal::MissingUuid,
        AuthRefusal::InvalidUuid,
        AuthRefusal::MissingToken,
        AuthRefusal::WrongToken,
        AuthRefusal::MissingClientCertificate,
        AuthRefusal::NoSpiffeId,
        AuthRefusal::SpiffeMismatch,
        AuthRefusal::UnknownAssignment,
    ];

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthRefusal::MissingUuid => "missing_uuid",
            AuthRefusal::InvalidUuid => "invalid_uuid",
            AuthRefusal::MissingToken => "missing_token",
            AuthRefusal::WrongToken => "wrong_token",
            AuthRefusal::MissingClientCertificate => "missing_client_certificate",
            AuthRefusal::NoSpiffeId => "no_spiffe_id",
            AuthRefusal::SpiffeMismatch => "spiffe_mismatch",
            AuthRefusal::UnknownAssignment => "unknown_assignment",
        }
    }

    fn index(self) -> usize {
        match self {
            AuthRefusal::MissingUuid => 0,
            AuthRefusal::InvalidUuid => 1,
            AuthRefusal::MissingToken => 2,
            AuthRefusal::WrongToken => 3,
            AuthRefusal::MissingClientCertificate => 4,
            AuthRefusal::NoSpiffeId => 5,
            AuthRefusal::SpiffeMismatch => 6,
            AuthRefusal::UnknownAssignment => 7,
        }
    }
}

/// A point-in-time copy of the facade's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FacadeStats {
    /// `unauthenticated` answers, by reason (every [`AuthRefusal`] is listed, zeros included).
    pub auth_refusals: Vec<(AuthRefusal, u64)>,
    /// FetchTask answered "no task" because the assignment or its token hash is not visible yet.
    pub fetches_pending: u64,
    /// Claims this facade won (and delivered the task for).
    pub claims_won: u64,
    /// Claims refused by the ledger because another caller had claimed first.
    pub claims_lost: u64,
    /// Calls refused with `permission_denied` (another assignment's task id, not claimed, Register).
    pub permission_denied: u64,
    /// Calls after the task became terminal that were not idempotent re-sends.
    pub refused_after_terminal: u64,
    /// `terminal` facts this facade created.
    pub terminals_published: u64,
    /// Final UpdateTask calls answered without the forge: the task's final result was already
    /// accepted (here, or recorded in the ledger), so a retried final never reaches it twice.
    pub finals_answered_here: u64,
    /// Finals that reached a replica which had not served their attempt, and that the forge
    /// (asked with a heartbeat) already held: another replica forwarded them and stopped
    /// before recording the terminal. Recorded, not forwarded again.
    pub finals_found_at_forge: u64,
    /// `executor-finished` facts published.
    pub executor_finished_published: u64,
    /// UpdateTask/UpdateLog calls forwarded to the forge (whatever the answer).
    pub forwarded_calls: u64,
    /// Forwarded calls the forge (or the network) answered with an error.
    pub forward_errors: u64,
    /// Artifact/cache requests proxied to the forge.
    pub proxied_requests: u64,
    /// Proxied requests that failed before the forge answered.
    pub proxy_errors: u64,
    /// Ledger lookups or publishes that failed.
    pub ledger_errors: u64,
    /// Calls refused because their assignment exceeded its calls per second.
    pub rate_limited: u64,
    /// Requests whose body did not arrive within the body timeout.
    pub body_timeouts: u64,
}

impl FacadeStats {
    /// The refusal count for one reason.
    pub fn auth_refused(&self, reason: AuthRefusal) -> u64 {
        self.auth_refusals
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }

    /// All refusals together.
    pub fn auth_refused_total(&self) -> u64 {
        self.auth_refusals.iter().map(|(_, n)| n).sum()
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    auth_refusals: [AtomicU64; AuthRefusal::ALL.len()],
    pub fetches_pending: AtomicU64,
    pub claims_won: AtomicU64,
    pub claims_lost: AtomicU64,
    pub permission_denied: AtomicU64,
    pub refused_after_terminal: AtomicU64,
    pub terminals_published: AtomicU64,
    pub finals_answered_here: AtomicU64,
    pub finals_found_at_forge: AtomicU64,
    pub executor_finished_published: AtomicU64,
    pub forwarded_calls: AtomicU64,
    pub forward_errors: AtomicU64,
    pub proxied_requests: AtomicU64,
    pub proxy_errors: AtomicU64,
    pub ledger_errors: AtomicU64,
    /// Calls refused because their assignment exceeded `max_calls_per_second`.
    pub rate_limited: AtomicU64,
    /// Requests whose body did not arrive within `body_timeout`.
    pub body_timeouts: AtomicU64,
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    pub fn refused(&self, reason: AuthRefusal) {
        bump(&self.auth_refusals[reason.index()]);
    }

    pub fn snapshot(&self) -> FacadeStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FacadeStats {
            auth_refusals: AuthRefusal::ALL
                .into_iter()
                .map(|r| (r, get(&self.auth_refusals[r.index()])))
                .collect(),
            fetches_pending: get(&self.fetches_pending),
            claims_won: get(&self.claims_won),
            claims_lost: get(&self.claims_lost),
            permission_denied: get(&self.permission_denied),
            refused_after_terminal: get(&self.refused_after_terminal),
            terminals_published: get(&self.terminals_published),
            finals_answered_here: get(&self.finals_answered_here),
            finals_found_at_forge: get(&self.finals_found_at_forge),
            executor_finished_published: get(&self.executor_finished_published),
            forwarded_calls: get(&self.forwarded_calls),
            forward_errors: get(&self.forward_errors),
            proxied_requests: get(&self.proxied_requests),
            proxy_errors: get(&self.proxy_errors),
            ledger_errors: get(&self.ledger_errors),
            rate_limited: get(&self.rate_limited),
            body_timeouts: get(&self.body_timeouts),
        }
    }
}
