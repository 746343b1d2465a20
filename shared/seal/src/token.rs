//! Per-attempt executor tokens. A token is derived from the worker's secret key and the
//! (assignment, attempt) pair, so a redelivered assignment, or a restarted worker, arrives at
//! the same token as the workload already holds; only its hash ever leaves the worker.

use base64::Engine;
use hmac::{Hmac, Mac};
use jr_protocol::{AssignmentId, TokenHash};
use sha2::Sha256;

#[derive(Clone)]
pub struct TokenKey(Vec<u8>);

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(<redacted>)")
    }
}

#[derive(Debug, thiserror::Error)]
#[error("token key must be base64 of at least 32 bytes")]
pub struct BadTokenKey;

impl TokenKey {
    pub fn from_base64(text: &str) -> Result<Self, BadTokenKey> {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(|_| BadTokenKey)?;
        if raw.len() < 32 {
            return Err(BadTokenKey);
        }
        Ok(Self(raw))
    }

    /// The executor token of one attempt (64 hex characters).
    pub fn token(&self, assignment: AssignmentId, attempt: u32) -> String {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .expect("HMAC-SHA256 accepts keys of any length");
        mac.update(assignment.0.as_bytes());
        mac.update(&attempt.to_be_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    /// The hash of [`TokenKey::token`]: what `workload-requested`/`workload-created` carry.
    pub fn token_hash(&self, assignment: AssignmentId, attempt: u32) -> TokenHash {
        TokenHash::of_token(&self.token(assignment, attempt))
    }
}

/// [`TokenHash::of_token`], for callers that hold a token rather than the key.
pub fn token_hash(token: &str) -> TokenHash {
    TokenHash::of_token(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_stable_per_attempt_and_distinct_across_attempts() {
        let key =
            TokenKey::from_base64("ZGV2LXRva2VuLWtleS1kZXYtdG9rZW4ta2V5LWRldiE=").expect("key");
        let a = AssignmentId::for_task("f", 1);
        assert_eq!(key.token(a, 1), key.token(a, 1));
        assert_ne!(key.token(a, 1), key.token(a, 2));
        assert_ne!(
            key.token(a, 1),
            key.token(AssignmentId::for_task("f", 2), 1)
        );
        assert!(TokenKey::from_base64("c2hvcnQ=").is_err());
    }

    /// Tokens and their hashes are part of the contract with the facade (and with workloads
    /// already running when a worker is upgraded): they never change for a given key.
    #[test]
    fn tokens_and_hashes_are_golden() {
        let key =
            TokenKey::from_base64("ZGV2LXRva2VuLWtleS1kZXYtdG9rZW4ta2V5LWRldiE=").expect("key");
        let a: AssignmentId = "6a2f4c1e-9b7d-4e0a-8f3c-5d217e90b4a1"
            .parse()
            .expect("uuid");
        assert_eq!(
            key.token(a, 2),
            "ee0433fc21353015d36b30151689ea57a599052e5292a4e3192d283593e5b1e4"
        );
        assert_eq!(
            key.token_hash(a, 2).as_str(),
            "ae3269ccb31e72771fd47831e9ccfe65855568eb5f32b18c209a11f7a5e24648"
        );
        assert_eq!(key.token_hash(a, 2), token_hash(&key.token(a, 2)));
    }
}
