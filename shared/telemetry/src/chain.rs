//! An error with everything under it, for logs and status pages.

/// `error` followed by each of its sources, `: `-separated, each said once: many errors (the
/// bus's among them) already print their source in their own message, others (a transport
/// error of the forge client, say) do not, and the source is what tells why.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("forge transport error")]
    struct Outer(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("reading consumer info: {0}")]
    struct SaysItsSource(#[source] std::io::Error);

    #[test]
    fn sources_are_appended_once() {
        let io =
            || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        assert_eq!(
            error_chain(&Outer(io())),
            "forge transport error: connection refused"
        );
        assert_eq!(
            error_chain(&SaysItsSource(io())),
            "reading consumer info: connection refused"
        );
    }
}
