//! Metadata on a sandbox becomes Kubernetes labels (Kubernetes runtime), so keys and values must follow label
//! syntax, and the list filter is a query string nested inside one query parameter.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// Prefix the server reserves for itself; metadata keys under it are refused (400).
pub const RESERVED_PREFIX: &str = "opensandbox.io/";

const MAX_NAME: usize = 63;
const MAX_PREFIX: usize = 253;

/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at most 63 characters, non-empty.
fn is_label_name(s: &str) -> bool {
    let bytes = s.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            bytes.len() <= MAX_NAME
                && first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// A DNS-1123 subdomain: dot-separated lowercase labels of `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_PREFIX
        && s.split('.').all(|part| {
            let bytes = part.as_bytes();
            match (bytes.first(), bytes.last()) {
                (Some(first), Some(last)) => {
                    bytes.len() <= MAX_NAME
                        && (first.is_ascii_lowercase() || first.is_ascii_digit())
                        && (last.is_ascii_lowercase() || last.is_ascii_digit())
                        && bytes
                            .iter()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                }
                _ => false,
            }
        })
}

/// Why a metadata key or value cannot be sent, or `None` when it is acceptable.
pub fn label_key_problem(key: &str) -> Option<&'static str> {
    if key.starts_with(RESERVED_PREFIX) {
        return Some("the opensandbox.io/ prefix is reserved");
    }
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if prefix.is_some_and(|p| !is_dns_subdomain(p)) {
        return Some("key prefix must be a DNS subdomain of at most 253 characters");
    }
    if !is_label_name(name) {
        return Some(
            "key name must be 1-63 characters of [A-Za-z0-9-_.], alphanumeric at both ends",
        );
    }
    None
}

pub fn is_label_value(value: &str) -> bool {
    value.is_empty() || is_label_name(value)
}

/// Turns any string into a valid label value. Valid input is returned unchanged; anything else is
/// mapped to the label charset, shortened, and suffixed with a hash of the original so that two
/// different inputs do not collapse onto one value. Deterministic, so filters built from the same
/// input match what was written.
pub fn sanitize_label_value(raw: &str) -> String {
    if is_label_value(raw) {
        return raw.to_owned();
    }
    let digest = Sha256::digest(raw.as_bytes());
    let hash = hex::encode(&digest[..4]);
    let mapped: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(MAX_NAME - hash.len() - 1)
        .collect();
    let head = mapped.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if head.is_empty() {
        hash
    } else {
        format!("{head}-{hash}")
    }
}

/// Percent-encodes everything except RFC 3986 unreserved characters.
pub(crate) fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The inner value of the `metadata` list parameter: `k1=v1&k2=v2` with each key and value
/// percent-encoded. The HTTP client encodes the result once more as the parameter value.
pub fn encode_metadata_filter(filter: &BTreeMap<String, String>) -> String {
    filter
        .iter()
        .map(|(k, v)| format!("{}={}", percent_encode(k), percent_encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_label_syntax() {
        assert_eq!(label_key_problem("jetrunner.dev/assignment"), None);
        assert_eq!(label_key_problem("worker"), None);
        assert!(label_key_problem("opensandbox.io/id").is_some());
        assert!(label_key_problem("Bad_Prefix/x").is_some());
        assert!(label_key_problem("x/-bad").is_some());
        assert!(label_key_problem("").is_some());
        assert!(label_key_problem(&"a".repeat(64)).is_some());
    }

    #[test]
    fn jetrunner_keys_are_valid_sandbox_metadata_keys() {
        let keys = jr_protocol::labels::ALL
            .iter()
            .chain(jr_protocol::labels::legacy_sandbox::ALL.iter());
        for key in keys {
            assert_eq!(label_key_problem(key), None, "{key}");
        }
    }

    #[test]
    fn values_follow_label_syntax() {
        assert!(is_label_value(""));
        assert!(is_label_value("0b7f9a0e-2f7e-4a55-9d8c-2d5e7f7e8a11"));
        assert!(is_label_value("vm-worker-1"));
        assert!(!is_label_value("-x"));
        assert!(!is_label_value("x y"));
        assert!(!is_label_value(&"a".repeat(64)));
    }

    #[test]
    fn sanitizing_keeps_valid_values_and_repairs_the_rest() {
        assert_eq!(sanitize_label_value("vm-worker-1"), "vm-worker-1");
        for raw in [
            "host/name:1",
            "-leading",
            "trailing-",
            "ü",
            &"x".repeat(100),
            "a b",
        ] {
            let clean = sanitize_label_value(raw);
            assert!(is_label_value(&clean), "{raw:?} -> {clean:?}");
            assert_ne!(clean, "");
        }
        assert_ne!(sanitize_label_value("a b"), sanitize_label_value("a:b"));
        assert_eq!(sanitize_label_value("a b"), sanitize_label_value("a b"));
    }

    #[test]
    fn metadata_filter_encodes_each_key_and_value() {
        let filter = BTreeMap::from([
            ("jetrunner.dev/attempt".to_owned(), "2".to_owned()),
            ("jetrunner.dev/worker".to_owned(), "vm-1".to_owned()),
        ]);
        assert_eq!(
            encode_metadata_filter(&filter),
            "jetrunner.dev%2Fattempt=2&jetrunner.dev%2Fworker=vm-1"
        );
    }
}
