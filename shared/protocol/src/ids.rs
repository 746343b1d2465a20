use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use uuid::Uuid;

/// Namespace for deterministic assignment ids (UUID v5 over forge instance + task id).
const ASSIGNMENT_NAMESPACE: Uuid = Uuid::from_u128(0x6a2f_4c1e_9b7d_4e0a_8f3c_5d21_7e90_b4a1);

/// Identity of one forge task inside jetrunner. Deterministic, so a re-fetched task (for example
/// after a lost PubAck) maps to the same assignment and JetStream dedupe catches the repeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AssignmentId(pub Uuid);

impl AssignmentId {
    pub fn for_task(forge_instance: &str, forge_task_id: i64) -> Self {
        let name = format!("{}#{forge_task_id}", forge_instance.trim_end_matches('/'));
        Self(Uuid::new_v5(&ASSIGNMENT_NAMESPACE, name.as_bytes()))
    }
}

impl fmt::Display for AssignmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.as_hyphenated().fmt(f)
    }
}

impl FromStr for AssignmentId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(Self)
    }
}

// Always a text string on the wire (CBOR and JSON alike) so `nats stream view` stays readable.
impl Serialize for AssignmentId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0.as_hyphenated())
    }
}

impl<'de> Deserialize<'de> for AssignmentId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Uuid::parse_str(&text)
            .map(Self)
            .map_err(serde::de::Error::custom)
    }
}

/// A backend name as it appears in subjects (`jr.assignment.<backend>.…`): 1–32 characters of
/// `[a-z0-9-]`, starting with a letter, so it can never inject a subject token.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct BackendName(String);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid name {0:?}: use 1-32 characters of a-z, 0-9 and '-', starting with a letter")]
pub struct InvalidName(pub String);

impl BackendName {
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidName> {
        let name = name.into();
        let valid = (1..=32).contains(&name.len())
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if valid {
            Ok(Self(name))
        } else {
            Err(InvalidName(name))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BackendName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for BackendName {
    type Err = InvalidName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl<'de> Deserialize<'de> for BackendName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::new(text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignment_id_is_deterministic_per_instance_and_task() {
        let a = AssignmentId::for_task("https://forge.example/", 42);
        assert_eq!(a, AssignmentId::for_task("https://forge.example", 42));
        assert_ne!(a, AssignmentId::for_task("https://forge.example", 43));
        assert_ne!(a, AssignmentId::for_task("https://other.example", 42));
        assert_eq!(a.to_string().parse::<AssignmentId>().ok(), Some(a));
    }

    #[test]
    fn backend_names_cannot_carry_subject_tokens() {
        assert!(BackendName::new("pod").is_ok());
        assert!(BackendName::new("vm-2").is_ok());
        for bad in ["", "Pod", "a.b", "a*", "a>", "-a", "1a", &"x".repeat(33)] {
            assert!(BackendName::new(bad).is_err(), "{bad:?} accepted");
        }
    }
}
