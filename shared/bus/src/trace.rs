//! W3C trace context through NATS headers. The bus always speaks W3C
//! `traceparent`/`tracestate`, independent of the global propagator, because that is the
//! contract on the wire (docs/architecture.md, "Subjects and streams").

use async_nats::HeaderMap;
use jr_protocol::TraceContext;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct MapInjector(Vec<(String, String)>);

impl Injector for MapInjector {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_owned(), value));
    }
}

struct HeaderExtractor<'a> {
    headers: Option<&'a HeaderMap>,
    fallback: Option<&'a TraceContext>,
}

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let from_header = self.headers.and_then(|h| h.get(key)).map(|v| v.as_str());
        from_header.or_else(|| {
            let trace = self.fallback?;
            match key {
                jr_protocol::header::TRACEPARENT => Some(trace.traceparent.as_str()),
                jr_protocol::header::TRACESTATE => trace.tracestate.as_deref(),
                _ => None,
            }
        })
    }

    fn keys(&self) -> Vec<&str> {
        vec![
            jr_protocol::header::TRACEPARENT,
            jr_protocol::header::TRACESTATE,
        ]
    }
}

/// The W3C context of the current tracing span, if it has a valid OpenTelemetry context
/// (i.e. the OTel layer is installed and the span is sampled or recording).
pub fn current_trace_context() -> Option<TraceContext> {
    let cx = tracing::Span::current().context();
    let mut injector = MapInjector(Vec::new());
    TraceContextPropagator::new().inject_context(&cx, &mut injector);
    let mut trace = None::<TraceContext>;
    let mut state = None;
    for (key, value) in injector.0 {
        match key.as_str() {
            jr_protocol::header::TRACEPARENT => {
                trace = Some(TraceContext {
                    traceparent: value,
                    tracestate: None,
                })
            }
            jr_protocol::header::TRACESTATE if !value.is_empty() => state = Some(value),
            _ => {}
        }
    }
    trace.map(|t| TraceContext {
        tracestate: state,
        ..t
    })
}

/// Writes `traceparent`/`tracestate` headers for `trace`.
pub(crate) fn insert_headers(headers: &mut HeaderMap, trace: &TraceContext) {
    headers.insert(jr_protocol::header::TRACEPARENT, trace.traceparent.as_str());
    if let Some(state) = &trace.tracestate {
        headers.insert(jr_protocol::header::TRACESTATE, state.as_str());
    }
}

/// The remote parent carried by a message: headers first, then the envelope's own copy.
pub fn extract_context(
    headers: Option<&HeaderMap>,
    envelope_trace: Option<&TraceContext>,
) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&HeaderExtractor {
        headers,
        fallback: envelope_trace,
    })
}

/// Makes `span` a child of the remote context `trace` (a job's trace, carried by its
/// assignment); without one the span stays as created. Create such spans with
/// `parent: None`, so a span with no known job starts a trace of its own instead of joining a
/// long-lived task span.
pub fn follow(span: &tracing::Span, trace: Option<&TraceContext>) {
    if let Some(trace) = trace {
        // Fails only when no OpenTelemetry layer is installed; the span is then a log span.
        let _ = span.set_parent(extract_context(None, Some(trace)));
    }
}

/// Trace contexts of jobs by assignment, for messages a service publishes later, outside the
/// span that received the job (a worker's events, the reconciler's commands). Best effort and
/// bounded: a restarted service, or one holding more than [`TraceBook::LIMIT`] jobs, starts new
/// traces for what it no longer knows.
#[derive(Clone, Debug, Default)]
pub struct TraceBook(
    std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<jr_protocol::AssignmentId, TraceContext>>,
    >,
);

impl TraceBook {
    pub const LIMIT: usize = 100_000;

    /// Remembers `trace` for `id` unless one is known already.
    pub fn remember(&self, id: jr_protocol::AssignmentId, trace: Option<TraceContext>) {
        let Some(trace) = trace else { return };
        if let Ok(mut map) = self.0.lock() {
            if map.len() >= Self::LIMIT {
                map.clear();
            }
            map.entry(id).or_insert(trace);
        }
    }

    pub fn get(&self, id: jr_protocol::AssignmentId) -> Option<TraceContext> {
        self.0.lock().ok().and_then(|map| map.get(&id).cloned())
    }

    pub fn forget(&self, id: jr_protocol::AssignmentId) {
        if let Ok(mut map) = self.0.lock() {
            map.remove(&id);
        }
    }
}
