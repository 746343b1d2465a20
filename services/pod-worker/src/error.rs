//! The pod-worker library's error type (template problems found at start-up or at create time).
//! Kubernetes call failures are reported as [`jr_worker::BackendError`] instead.

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum PodWorkerError {
    /// A key the runner block does not know (the path names it, e.g. `resources.limit`).
    #[error("runner block{layer}: unknown key `{key}`", layer = layer_suffix(.layer))]
    UnknownKey { layer: Option<String>, key: String },
    #[error("runner block{layer}: invalid value for `{key}`: {message}", layer = layer_suffix(.layer))]
    InvalidValue {
        layer: Option<String>,
        key: String,
        message: String,
    },
    #[error("runner block{layer}: missing required key `{key}`", layer = layer_suffix(.layer))]
    MissingKey { layer: Option<String>, key: String },
    /// A key jetrunner sets itself (executor env, jetrunner labels).
    #[error("runner block{layer}: `{key}` is reserved for jetrunner", layer = layer_suffix(.layer))]
    ReservedKey { layer: Option<String>, key: String },
    #[error("no runner block for provider `{provider}` (known providers: {known})")]
    UnknownProvider { provider: String, known: String },
}

fn layer_suffix(layer: &Option<String>) -> String {
    layer
        .as_ref()
        .map(|l| format!(" of provider `{l}`"))
        .unwrap_or_default()
}

impl PodWorkerError {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PodWorkerError::UnknownKey { .. } => "unknown_key",
            PodWorkerError::InvalidValue { .. } => "invalid_value",
            PodWorkerError::MissingKey { .. } => "missing_key",
            PodWorkerError::ReservedKey { .. } => "reserved_key",
            PodWorkerError::UnknownProvider { .. } => "unknown_provider",
        }
    }

    /// The same error, attributed to a provider's layered block.
    pub(crate) fn in_provider(self, provider: Option<&str>) -> Self {
        let layer = provider.map(str::to_owned);
        match self {
            PodWorkerError::UnknownKey { key, .. } => PodWorkerError::UnknownKey { layer, key },
            PodWorkerError::InvalidValue { key, message, .. } => PodWorkerError::InvalidValue {
                layer,
                key,
                message,
            },
            PodWorkerError::MissingKey { key, .. } => PodWorkerError::MissingKey { layer, key },
            PodWorkerError::ReservedKey { key, .. } => PodWorkerError::ReservedKey { layer, key },
            other @ PodWorkerError::UnknownProvider { .. } => other,
        }
    }
}
