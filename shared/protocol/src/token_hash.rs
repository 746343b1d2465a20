//! The published form of a per-attempt executor token. Workers publish it in
//! `workload-requested` and `workload-created` before the workload starts; a facade without the
//! token keys checks a presented token against it. The token itself never leaves the worker.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Lower-case hex SHA-256 of an executor token's UTF-8 bytes (64 characters). On the wire it is
/// a plain string.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TokenHash(String);

impl TokenHash {
    /// The hash of `token`.
    pub fn of_token(token: &str) -> Self {
        Self(hex::encode(Sha256::digest(token.as_bytes())))
    }

    /// A hash as someone published it, taken as it is (what decoding a message does too): it
    /// need not be well-formed, so compare it, never trust its shape.
    pub fn from_published(hash: impl Into<String>) -> Self {
        Self(hash.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for TokenHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The hash, not the token: it is public on the bus anyway.
impl fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenHash({})", self.0)
    }
}

impl From<TokenHash> for String {
    fn from(hash: TokenHash) -> String {
        hash.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_lower_hex_sha256_of_the_token() {
        assert_eq!(
            TokenHash::of_token("abc").as_str(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // A token as workers derive them: 64 hex characters of an HMAC.
        assert_eq!(
            TokenHash::of_token("3f1c7a2b9e0d4c5a8b6f1e2d3c4b5a69788796a5b4c3d2e1f0a9b8c7d6e5f405")
                .as_str(),
            "e2be7c5f66554fea692208a52272cd72a757b8922b4d8c05854fbc4428835cba"
        );
    }

    #[test]
    fn serializes_as_a_plain_string() {
        let hash = TokenHash::of_token("abc");
        let json = serde_json::to_string(&hash).expect("json");
        assert_eq!(
            json,
            "\"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\""
        );
        let mut cbor = Vec::new();
        ciborium::into_writer(&hash, &mut cbor).expect("cbor");
        let mut plain = Vec::new();
        ciborium::into_writer(hash.as_str(), &mut plain).expect("cbor");
        assert_eq!(cbor, plain);
        let back: TokenHash = ciborium::from_reader(plain.as_slice()).expect("decodes");
        assert_eq!(back, hash);
        // Whatever a publisher wrote is read as it is.
        let odd: TokenHash = serde_json::from_str("\"not-a-hash\"").expect("any string");
        assert_eq!(odd, TokenHash::from_published("not-a-hash"));
    }
}
