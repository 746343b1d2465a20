//! Sealing of forge tasks: only the scheduler holds the keys, so NATS operators and workers see
//! routing fields but never the workflow, context or secrets. XChaCha20-Poly1305 with a random
//! 192-bit nonce; the associated data binds the assignment id, the backend and the forge task id,
//! so a sealed task cannot be replayed under another assignment, and clear routing fields naming
//! another forge task or backend make it fail to open.

use std::collections::BTreeMap;

use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use jr_protocol::{Assignment, AssignmentId, BackendName, SealedTask};
use rand::RngCore;

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("seal key {0:?}: not base64 of exactly 32 bytes")]
    BadKey(String),
    #[error("no seal key with id {0:?}")]
    UnknownKey(String),
    #[error(
        "sealed task does not open with key {0:?} (tampered, or sealed for another assignment)"
    )]
    Open(String),
    #[error("no seal keys configured")]
    NoKeys,
}

/// What a sealed task is bound to: its associated data.
#[derive(Clone, Copy, Debug)]
pub struct SealScope<'a> {
    pub assignment: AssignmentId,
    pub backend: &'a BackendName,
    pub forge_task_id: i64,
}

impl<'a> SealScope<'a> {
    pub fn new(assignment: AssignmentId, backend: &'a BackendName, forge_task_id: i64) -> Self {
        Self {
            assignment,
            backend,
            forge_task_id,
        }
    }

    /// The scope an assignment's clear fields claim for its sealed task.
    pub fn of(assignment_id: AssignmentId, assignment: &'a Assignment) -> Self {
        Self::new(assignment_id, &assignment.backend, assignment.forge_task_id)
    }

    fn aad(&self) -> Vec<u8> {
        let mut aad = b"jr-seal-v2\0".to_vec();
        aad.extend_from_slice(self.assignment.0.as_bytes());
        aad.extend_from_slice(self.backend.as_str().as_bytes());
        aad.push(0);
        aad.extend_from_slice(&self.forge_task_id.to_be_bytes());
        aad
    }
}

fn record_aad(purpose: &str) -> Vec<u8> {
    let mut aad = b"jr-record-v1\0".to_vec();
    aad.extend_from_slice(purpose.as_bytes());
    aad
}

/// The scheduler's keyring: one current key for sealing, any listed key for opening.
pub struct Sealer {
    current: String,
    keys: BTreeMap<String, XChaCha20Poly1305>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("current", &self.current)
            .field("keys", &self.keys.keys())
            .finish()
    }
}

impl Sealer {
    /// `keys`: key id → base64 of 32 bytes; `current`: the id used to seal new tasks.
    pub fn new(current: &str, keys: &BTreeMap<String, String>) -> Result<Self, SealError> {
        if keys.is_empty() {
            return Err(SealError::NoKeys);
        }
        let mut ciphers = BTreeMap::new();
        for (id, b64) in keys {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|_| SealError::BadKey(id.clone()))?;
            let cipher = XChaCha20Poly1305::new_from_slice(&raw)
                .map_err(|_| SealError::BadKey(id.clone()))?;
            if raw.len() != 32 {
                return Err(SealError::BadKey(id.clone()));
            }
            ciphers.insert(id.clone(), cipher);
        }
        if !ciphers.contains_key(current) {
            return Err(SealError::UnknownKey(current.to_owned()));
        }
        Ok(Self {
            current: current.to_owned(),
            keys: ciphers,
        })
    }

    /// A fresh random key, base64 (for development configs and tests).
    pub fn generate_key() -> String {
        let mut key = [0u8; 32];
        rand::rng().fill_bytes(&mut key);
        base64::engine::general_purpose::STANDARD.encode(key)
    }

    pub fn seal(&self, scope: SealScope<'_>, plaintext: &[u8]) -> Result<SealedTask, SealError> {
        self.seal_aad(&scope.aad(), plaintext)
    }

    pub fn open(&self, scope: SealScope<'_>, sealed: &SealedTask) -> Result<Vec<u8>, SealError> {
        self.open_aad(&scope.aad(), sealed)
    }

    /// Seals a record the scheduler keeps on the bus for its replicas (e.g. registered runner
    /// credentials), bound to `purpose`: it opens only for the same purpose.
    pub fn seal_record(&self, purpose: &str, plaintext: &[u8]) -> Result<SealedTask, SealError> {
        self.seal_aad(&record_aad(purpose), plaintext)
    }

    pub fn open_record(&self, purpose: &str, sealed: &SealedTask) -> Result<Vec<u8>, SealError> {
        self.open_aad(&record_aad(purpose), sealed)
    }

    fn seal_aad(&self, aad: &[u8], plaintext: &[u8]) -> Result<SealedTask, SealError> {
        let cipher = self
            .keys
            .get(&self.current)
            .ok_or_else(|| SealError::UnknownKey(self.current.clone()))?;
        let mut nonce = [0u8; 24];
        rand::rng().fill_bytes(&mut nonce);
        let ciphertext = cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: plaintext,
                    aad,
                },
            )
            .map_err(|_| SealError::Open(self.current.clone()))?;
        Ok(SealedTask {
            key_id: self.current.clone(),
            nonce: nonce.to_vec(),
            ciphertext,
        })
    }

    fn open_aad(&self, aad: &[u8], sealed: &SealedTask) -> Result<Vec<u8>, SealError> {
        let cipher = self
            .keys
            .get(&sealed.key_id)
            .ok_or_else(|| SealError::UnknownKey(sealed.key_id.clone()))?;
        if sealed.nonce.len() != 24 {
            return Err(SealError::Open(sealed.key_id.clone()));
        }
        cipher
            .decrypt(
                XNonce::from_slice(&sealed.nonce),
                Payload {
                    msg: &sealed.ciphertext,
                    aad,
                },
            )
            .map_err(|_| SealError::Open(sealed.key_id.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(name: &str) -> BackendName {
        BackendName::new(name).expect("backend name")
    }

    fn keys(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn sealed_task_opens_only_for_its_assignment() {
        let k = Sealer::generate_key();
        let s = Sealer::new("k1", &keys(&[("k1", &k)])).expect("keyring");
        let (pod, vm) = (backend("pod"), backend("vm"));
        let a = AssignmentId::for_task("f", 1);
        let sealed = s
            .seal(SealScope::new(a, &pod, 1), b"secret task")
            .expect("seal");
        assert!(!sealed.ciphertext.windows(6).any(|w| w == b"secret"));
        assert_eq!(
            s.open(SealScope::new(a, &pod, 1), &sealed).expect("open"),
            b"secret task"
        );
        // Another assignment, another backend or another forge task in the clear fields: the
        // seal does not open.
        for wrong in [
            SealScope::new(AssignmentId::for_task("f", 2), &pod, 1),
            SealScope::new(a, &vm, 1),
            SealScope::new(a, &pod, 2),
        ] {
            assert!(matches!(s.open(wrong, &sealed), Err(SealError::Open(_))));
        }
        let mut tampered = sealed.clone();
        tampered.ciphertext[0] ^= 1;
        assert!(s.open(SealScope::new(a, &pod, 1), &tampered).is_err());
    }

    #[test]
    fn rotated_keyring_still_opens_old_assignments() {
        let (old, new) = (Sealer::generate_key(), Sealer::generate_key());
        let before = Sealer::new("old", &keys(&[("old", &old)])).expect("keyring");
        let pod = backend("pod");
        let a = SealScope::new(AssignmentId::for_task("f", 9), &pod, 9);
        let sealed = before.seal(a, b"x").expect("seal");
        let after = Sealer::new("new", &keys(&[("old", &old), ("new", &new)])).expect("keyring");
        assert_eq!(after.open(a, &sealed).expect("old key still listed"), b"x");
        assert_eq!(after.seal(a, b"y").expect("seal").key_id, "new");
    }

    #[test]
    fn a_sealed_record_opens_only_for_its_purpose() {
        let s = Sealer::new("k1", &keys(&[("k1", &Sealer::generate_key())])).expect("keyring");
        let sealed = s
            .seal_record("runner-credentials/pod", b"token")
            .expect("seal");
        assert_eq!(
            s.open_record("runner-credentials/pod", &sealed)
                .expect("open"),
            b"token"
        );
        assert!(s.open_record("runner-credentials/vm", &sealed).is_err());
        let a = AssignmentId::for_task("f", 1);
        assert!(
            s.open(SealScope::new(a, &backend("pod"), 1), &sealed)
                .is_err()
        );
    }

    #[test]
    fn bad_keys_are_refused() {
        assert!(matches!(
            Sealer::new("k", &keys(&[("k", "c2hvcnQ=")])),
            Err(SealError::BadKey(_))
        ));
        assert!(matches!(
            Sealer::new("x", &keys(&[("k", &Sealer::generate_key())])),
            Err(SealError::UnknownKey(_))
        ));
    }
}
