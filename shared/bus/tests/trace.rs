mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use jr_bus::{CancellationToken, ConsumerOptions, ConsumerSpec, Disposition};
use jr_protocol::STREAM_EVENTS;
use opentelemetry::trace::{TraceContextExt, TraceId, TracerProvider as _};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

fn trace_id_of(span: &tracing::Span) -> TraceId {
    span.context().span().span_context().trace_id()
}

#[tokio::test]
async fn traceparent_travels_from_publisher_span_to_consumer_span() {
    // Spans get real OpenTelemetry ids (nothing is exported).
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let (_server, bus) = server_and_bus().await;
    let id = new_assignment();
    let subject = released_subject(id);

    let producer = tracing::info_span!("producer");
    let producer_trace = trace_id_of(&producer);
    assert_ne!(producer_trace, TraceId::INVALID);
    bus.publish(&subject, &released(id, "traced"))
        .instrument(producer.clone())
        .await
        .expect("published");

    let stream = bus
        .jetstream()
        .get_stream(STREAM_EVENTS)
        .await
        .expect("stream");
    let raw = stream
        .get_last_raw_message_by_subject(&subject)
        .await
        .expect("stored");
    let traceparent = raw
        .headers
        .get("traceparent")
        .expect("traceparent header")
        .to_string();
    assert!(
        traceparent.contains(&producer_trace.to_string()),
        "{traceparent}"
    );
    let stored = jr_protocol::decode(&raw.payload).expect("decodes");
    assert_eq!(stored.trace.map(|t| t.traceparent), Some(traceparent));

    let seen: Arc<Mutex<Option<TraceId>>> = Arc::default();
    let spec = ConsumerSpec::new(STREAM_EVENTS, "traced", vec!["jr.event.>".into()]);
    let shutdown = CancellationToken::new();
    let consumer = {
        let (bus, shutdown, seen) = (bus.clone(), shutdown.clone(), seen.clone());
        tokio::spawn(
            async move {
                let handler = move |_delivery| {
                    let seen = seen.clone();
                    async move {
                        *seen.lock().expect("lock") = Some(trace_id_of(&tracing::Span::current()));
                        Disposition::Ack
                    }
                };
                bus.run_consumer(&spec, handler, ConsumerOptions::default(), shutdown)
                    .await
            }
            .in_current_span(),
        )
    };
    eventually("handler ran", Duration::from_secs(10), || async {
        seen.lock().expect("lock").is_some()
    })
    .await;
    assert_eq!(*seen.lock().expect("lock"), Some(producer_trace));
    shutdown.cancel();
    consumer.await.expect("no panic").expect("clean exit");
}
