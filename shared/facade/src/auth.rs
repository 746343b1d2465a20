//! Who is calling: the executor token and/or the SPIFFE id of its client certificate, checked
//! against the assignment named by `x-runner-uuid`.

use http::HeaderMap;
use jr_forge::wire::{HEADER_RUNNER_TOKEN, HEADER_RUNNER_UUID};
use jr_protocol::{AssignmentId, TokenHash};
use rustls_pki_types::CertificateDer;
use subtle::ConstantTimeEq;
use x509_parser::extensions::GeneralName;

use super::stats::{AuthRefusal, bump};
use super::{AssignmentView, Facade, Ledger};

/// What the TLS layer proved about the peer. [`super::serve`] puts one into the extensions of
/// every request; a request without one counts as [`ClientIdentity::Anonymous`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientIdentity {
    /// Plain HTTP, or TLS without a client certificate.
    Anonymous,
    /// A verified client certificate without exactly one `spiffe://` URI SAN.
    CertificateWithoutSpiffeId,
    /// The SPIFFE id of a verified client certificate.
    Spiffe(SpiffeId),
}

impl ClientIdentity {
    /// Reads the SPIFFE id from the leaf of a (verified) client certificate chain.
    pub fn from_peer_certificates(chain: Option<&[CertificateDer<'_>]>) -> ClientIdentity {
        let Some(leaf) = chain.and_then(|c| c.first()) else {
            return ClientIdentity::Anonymous;
        };
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(leaf.as_ref()) else {
            return ClientIdentity::CertificateWithoutSpiffeId;
        };
        let uris: Vec<&str> = match cert.subject_alternative_name() {
            Ok(Some(san)) => san
                .value
                .general_names
                .iter()
                .filter_map(|name| match name {
                    GeneralName::URI(uri) if uri.starts_with("spiffe://") => Some(*uri),
                    _ => None,
                })
                .collect(),
            Ok(None) | Err(_) => Vec::new(),
        };
        // The SPIFFE X.509-SVID spec allows exactly one URI SAN.
        match uris.as_slice() {
            [uri] => SpiffeId::parse(uri).map_or(
                ClientIdentity::CertificateWithoutSpiffeId,
                ClientIdentity::Spiffe,
            ),
            _ => ClientIdentity::CertificateWithoutSpiffeId,
        }
    }
}

/// `spiffe://<trust-domain>/<path>`, with a non-empty path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpiffeId {
    trust_domain: String,
    path: String,
}

impl SpiffeId {
    pub fn parse(uri: &str) -> Option<SpiffeId> {
        let rest = uri.strip_prefix("spiffe://")?;
        let (trust_domain, path) = rest.split_once('/')?;
        let domain_ok = !trust_domain.is_empty()
            && trust_domain
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-._".contains(c));
        let path_ok = !path.is_empty()
            && path
                .split('/')
                .all(|seg| !seg.is_empty() && seg != "." && seg != "..");
        (domain_ok && path_ok && !path.contains(['?', '#'])).then(|| SpiffeId {
            trust_domain: trust_domain.to_owned(),
            path: path.to_owned(),
        })
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The last path segment: the assignment id for executor certificates.
    pub fn last_segment(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }

    /// The path without its leading `/`.
    pub fn path(&self) -> &str {
        &self.path
    }
}

impl std::fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "spiffe://{}/{}", self.trust_domain, self.path)
    }
}

/// The caller's credentials, taken from one request.
#[derive(Debug)]
pub(crate) struct Caller {
    pub uuid: Option<String>,
    pub token: Option<String>,
    pub identity: ClientIdentity,
}

impl Caller {
    pub fn from_request(headers: &HeaderMap, identity: Option<&ClientIdentity>) -> Caller {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        Caller {
            uuid: text(HEADER_RUNNER_UUID),
            token: text(HEADER_RUNNER_TOKEN),
            identity: identity.cloned().unwrap_or(ClientIdentity::Anonymous),
        }
    }
}

/// The outcome of authenticating a caller that was not refused.
#[derive(Debug)]
pub(crate) enum Authenticated {
    /// The caller is the executor of this assignment's current attempt.
    Ready {
        view: AssignmentView,
        /// `token`, or the SPIFFE id: recorded in `claimed`.
        executor: String,
    },
    /// The assignment (or its token hash) is not visible yet; it may become so (the worker
    /// publishes the hash before the workload starts), so the caller must not be told it is
    /// unauthenticated: act_runner gives up when its first call is refused.
    Pending,
    /// A warm executor (its token is the one of its warm identity under a backend's key) that
    /// is not bound to a current attempt: it waits for a job.
    Warm { warm: AssignmentId },
}

/// What a call needs to know about its assignment besides who may call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Need {
    /// Only the caller's identity (Declare): `claimed` and `terminal` are not read.
    Identity,
    /// The task's progress too (`claimed`, `terminal`).
    Progress,
}

/// Failure to authenticate: a definite refusal, or the ledger could not be asked.
#[derive(Debug)]
pub(crate) enum AuthFailure {
    Refused(AuthRefusal),
    Ledger(super::LedgerError),
}

impl<L: Ledger> Facade<L> {
    pub(crate) async fn authenticate(
        &self,
        caller: &Caller,
        need: Need,
    ) -> Result<Authenticated, AuthFailure> {
        let result = self.check_caller(caller, need).await;
        match &result {
            Err(AuthFailure::Refused(reason)) => {
                self.counters.refused(*reason);
                tracing::info!(reason = reason.as_str(), uuid = ?caller.uuid, "facade refused caller");
            }
            Err(AuthFailure::Ledger(err)) => {
                bump(&self.counters.ledger_errors);
                tracing::warn!(error = %err, kind = err.kind(), "ledger lookup failed");
            }
            Ok(_) => {}
        }
        result
    }

    async fn check_caller(
        &self,
        caller: &Caller,
        need: Need,
    ) -> Result<Authenticated, AuthFailure> {
        let refuse = |reason| Err(AuthFailure::Refused(reason));
        let mode = self.settings.mode;
        let Some(uuid) = caller.uuid.as_deref() else {
            return refuse(AuthRefusal::MissingUuid);
        };
        let Ok(id) = uuid.parse::<AssignmentId>() else {
            return refuse(AuthRefusal::InvalidUuid);
        };

        // A presented certificate must name this assignment, whatever the mode needs.
        let mut spiffe_proven = None;
        if mode.uses_spiffe() {
            match &caller.identity {
                ClientIdentity::Spiffe(spiffe) => {
                    let domain_ok = self
                        .settings
                        .trust_domain
                        .as_deref()
                        .is_none_or(|td| td == spiffe.trust_domain());
                    let expected = self
                        .settings
                        .spiffe_path
                        .replace("{assignment}", &id.to_string());
                    let names_us = spiffe.path() == expected.trim_start_matches('/');
                    if !(domain_ok && names_us) {
                        return refuse(AuthRefusal::SpiffeMismatch);
                    }
                    spiffe_proven = Some(spiffe.to_string());
                }
                ClientIdentity::CertificateWithoutSpiffeId => {
                    return refuse(AuthRefusal::NoSpiffeId);
                }
                ClientIdentity::Anonymous if !mode.uses_token() => {
                    return refuse(AuthRefusal::MissingClientCertificate);
                }
                ClientIdentity::Anonymous => {}
            }
        }
        let token = if mode.uses_token() {
            caller.token.as_deref()
        } else {
            None
        };
        if spiffe_proven.is_none() && token.is_none() {
            return refuse(AuthRefusal::MissingToken);
        }
        if let Some(token) = token
            && let Some(warm) = self.warm_caller(id, token, spiffe_proven.clone()).await?
        {
            return Ok(warm);
        }

        let found = match need {
            Need::Identity => self.ledger.identify(id).await,
            Need::Progress => self.ledger.lookup(id).await,
        };
        let Some(view) = found.map_err(AuthFailure::Ledger)? else {
            // With a token key for every backend the facade needs nothing from the bus to check
            // an executor, and a workload exists only for a stored assignment: an unknown id
            // is not one of ours. Without the keys, the hash may simply not be visible yet.
            if self.settings.mode.uses_token() && !self.settings.token_keys.is_empty() {
                return refuse(AuthRefusal::UnknownAssignment);
            }
            return Ok(Authenticated::Pending);
        };
        if view.id != id {
            return Err(AuthFailure::Ledger(super::LedgerError::Invalid(format!(
                "lookup of {id} returned {}",
                view.id
            ))));
        }
        if let Some(token) = token
            && let Some(key) = self.settings.token_keys.get(&view.backend)
        {
            // The owner of the secret checks it: the token of this attempt, recomputed.
            let expected = key.token(view.id, view.attempt);
            if !bool::from(token.as_bytes().ct_eq(expected.as_bytes())) {
                return refuse(AuthRefusal::WrongToken);
            }
        } else if let Some(token) = token {
            match &view.token_hash {
                Some(expected) => {
                    let presented = TokenHash::of_token(token);
                    let presented = presented.as_str();
                    let expected = expected.as_str().trim().to_ascii_lowercase();
                    if !bool::from(presented.as_bytes().ct_eq(expected.as_bytes())) {
                        return refuse(AuthRefusal::WrongToken);
                    }
                }
                None if spiffe_proven.is_none() => return Ok(Authenticated::Pending),
                None => {}
            }
        }
        let executor = spiffe_proven.unwrap_or_else(|| "token".to_owned());
        Ok(Authenticated::Ready { view, executor })
    }

    /// A warm executor: `token` is the token of attempt 0 of `id` under one backend's key
    /// (real attempts start at 1, so no job's executor holds such a token). It is the executor
    /// of the attempt its backend's worker bound it to, while that attempt is current;
    /// otherwise it waits. `None`: not a warm executor's token.
    async fn warm_caller(
        &self,
        id: AssignmentId,
        token: &str,
        spiffe: Option<String>,
    ) -> Result<Option<Authenticated>, AuthFailure> {
        // Backends may share a key: every backend whose key made this token is asked, and
        // only the one whose worker bound this warm id has a record of it.
        let backends: Vec<&jr_protocol::BackendName> = self
            .settings
            .token_keys
            .iter()
            .filter(|(_, key)| {
                let expected = key.token(id, 0);
                bool::from(token.as_bytes().ct_eq(expected.as_bytes()))
            })
            .map(|(backend, _)| backend)
            .collect();
        if backends.is_empty() {
            return Ok(None);
        }
        let waiting = Authenticated::Warm { warm: id };
        let mut found = None;
        for backend in backends {
            if let Some(binding) = self
                .ledger
                .warm_binding(backend, id)
                .await
                .map_err(AuthFailure::Ledger)?
            {
                found = Some((backend.clone(), binding));
                break;
            }
        }
        let Some((backend, binding)) = found else {
            return Ok(Some(waiting));
        };
        let Some(view) = self
            .ledger
            .lookup(binding.assignment)
            .await
            .map_err(AuthFailure::Ledger)?
        else {
            return Ok(Some(waiting));
        };
        if view.backend != backend {
            // A binding to another backend's job: never handed out (the other backend may be
            // trusted with more).
            tracing::warn!(warm = %id, %backend, assignment = %view.id, job_backend = %view.backend, "warm binding names another backend's assignment; ignored");
            return Ok(Some(waiting));
        }
        if view.id != binding.assignment || view.attempt != binding.attempt {
            // Superseded (the reconciler replaced the attempt): this executor has no job.
            return Ok(Some(waiting));
        }
        let executor = spiffe.unwrap_or_else(|| format!("warm:{id}"));
        Ok(Some(Authenticated::Ready { view, executor }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spiffe_ids_parse_strictly() {
        let id = SpiffeId::parse("spiffe://example.org/ns/ci/assignment/abc").expect("valid");
        assert_eq!(id.trust_domain(), "example.org");
        assert_eq!(id.last_segment(), "abc");
        assert_eq!(id.to_string(), "spiffe://example.org/ns/ci/assignment/abc");
        for bad in [
            "spiffe://example.org",
            "spiffe://example.org/",
            "spiffe:///x",
            "spiffe://Example.org/x",
            "spiffe://example.org/a//b",
            "spiffe://example.org/a/../b",
            "spiffe://example.org/a?x",
            "https://example.org/a",
        ] {
            assert_eq!(SpiffeId::parse(bad), None, "{bad}");
        }
    }
}
