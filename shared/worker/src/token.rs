//! Per-attempt executor tokens. A token is derived from the worker's secret key and the
//! (assignment, attempt) pair, so a redelivered assignment, or a restarted worker, arrives at
//! the same token as the workload already holds; only its hash ever leaves the worker.

use base64::Engine;
use hmac::{Hmac, Mac};
use jr_protocol::AssignmentId;
use sha2::{Digest, Sha256};

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
}

/// Lower-case hex SHA-256 of a token: what `workload-requested`/`workload-created` carry.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
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
        assert_eq!(
            token_hash("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(TokenKey::from_base64("c2hvcnQ=").is_err());
    }
}
