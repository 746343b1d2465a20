use std::time::Duration;

/// Boxed source error from async-nats (its error types are generic over a kind enum).
pub type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a JetStream publish failed, as far as the caller needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishFailure {
    /// No PubAck within the JetStream timeout (server down, reconnecting, or slow).
    Timeout,
    /// No stream listens on the subject, or no server answered (typically during a restart).
    NoResponders,
    /// The connection dropped while waiting for the PubAck.
    Disconnected,
    /// Too many PubAcks outstanding on this client.
    Backpressure,
    /// The stream reached a limit (`max_msgs`, `max_bytes`, per-subject limit) and discards new
    /// messages, or the server's JetStream storage is exhausted. Backpressure: the same publish
    /// lands once space frees (messages age out, an operator raises the limit).
    StreamFull,
    /// The server refused an expectation header (e.g. `Nats-Expected-Last-Subject-Sequence`).
    WrongLastSequence,
    /// Anything else (oversized message, invalid subject, server error code).
    Other,
}

impl PublishFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            PublishFailure::Timeout => "timeout",
            PublishFailure::NoResponders => "no-responders",
            PublishFailure::Disconnected => "disconnected",
            PublishFailure::Backpressure => "backpressure",
            PublishFailure::StreamFull => "stream-full",
            PublishFailure::WrongLastSequence => "wrong-last-sequence",
            PublishFailure::Other => "other",
        }
    }

    fn is_transient(self) -> bool {
        match self {
            PublishFailure::Timeout
            | PublishFailure::NoResponders
            | PublishFailure::Disconnected
            | PublishFailure::Backpressure
            | PublishFailure::StreamFull => true,
            PublishFailure::WrongLastSequence | PublishFailure::Other => false,
        }
    }
}

/// Every failure of the bus, named after the operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("reading NATS credentials: {0}")]
    Credentials(#[source] std::io::Error),
    #[error("connecting to NATS at {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: Source,
    },
    #[error("declaring stream {stream}: {source}")]
    DeclareStream {
        stream: String,
        transient: bool,
        #[source]
        source: Source,
    },
    #[error("declaring consumer {stream}/{durable}: {source}")]
    DeclareConsumer {
        stream: String,
        durable: String,
        transient: bool,
        #[source]
        source: Source,
    },
    #[error("publishing to {subject}: {failure:?}: {source}")]
    Publish {
        subject: String,
        failure: PublishFailure,
        #[source]
        source: Source,
    },
    #[error("reading the last message of {stream}/{subject}: {source}")]
    ReadLast {
        stream: String,
        subject: String,
        transient: bool,
        #[source]
        source: Source,
    },
    #[error("last message of {stream}/{subject} is not a jetrunner envelope: {source}")]
    DecodeLast {
        stream: String,
        subject: String,
        #[source]
        source: jr_protocol::DecodeError,
    },
    #[error("binding consumer {stream}/{durable}: {source}")]
    BindConsumer {
        stream: String,
        durable: String,
        #[source]
        source: Source,
    },
    #[error("pulling from {stream}/{durable}: {source}")]
    Pull {
        stream: String,
        durable: String,
        #[source]
        source: Source,
    },
    #[error("reading consumer info {stream}/{durable}: {source}")]
    ConsumerInfo {
        stream: String,
        durable: String,
        #[source]
        source: Source,
    },
    #[error("key-value bucket {bucket}: {source}")]
    KeyValue {
        bucket: String,
        #[source]
        source: Source,
    },
    #[error("shutdown requested before the operation completed")]
    ShutDown,
    #[error("operation timed out after {0:?}")]
    TimedOut(Duration),
}

impl BusError {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BusError::Credentials(_) => "credentials",
            BusError::Connect { .. } => "connect",
            BusError::DeclareStream { .. } => "declare-stream",
            BusError::DeclareConsumer { .. } => "declare-consumer",
            BusError::Publish { .. } => "publish",
            BusError::ReadLast { .. } => "read-last",
            BusError::DecodeLast { .. } => "decode-last",
            BusError::BindConsumer { .. } => "bind-consumer",
            BusError::Pull { .. } => "pull",
            BusError::ConsumerInfo { .. } => "consumer-info",
            BusError::KeyValue { .. } => "key-value",
            BusError::ShutDown => "shut-down",
            BusError::TimedOut(_) => "timed-out",
        }
    }

    /// True when retrying the same call later can succeed (NATS down, restarting, slow).
    pub fn is_transient(&self) -> bool {
        match self {
            BusError::Publish { failure, .. } => failure.is_transient(),
            BusError::ReadLast { transient, .. }
            | BusError::DeclareStream { transient, .. }
            | BusError::DeclareConsumer { transient, .. } => *transient,
            BusError::Connect { .. }
            | BusError::BindConsumer { .. }
            | BusError::Pull { .. }
            | BusError::ConsumerInfo { .. }
            | BusError::KeyValue { .. }
            | BusError::TimedOut(_) => true,
            BusError::Credentials(_) | BusError::DecodeLast { .. } | BusError::ShutDown => false,
        }
    }

    /// The publish failure class, when this is a publish error.
    pub fn publish_failure(&self) -> Option<PublishFailure> {
        match self {
            BusError::Publish { failure, .. } => Some(*failure),
            _ => None,
        }
    }
}
