//! The OTLP exporter really ships spans: an in-test `/v1/traces` receiver decodes them.
//! (Own test binary: `init` installs the process-global subscriber.)

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

type Received = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

async fn receive(State(received): State<Received>, body: bytes::Bytes) -> &'static str {
    if let Ok(request) = ExportTraceServiceRequest::decode(body) {
        received.lock().expect("lock").push(request);
    }
    ""
}

/// `(service.name, span name)` of every received span.
fn spans(received: &Received) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for request in received.lock().expect("lock").iter() {
        for resource_spans in &request.resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    Value::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for scope in &resource_spans.scope_spans {
                for span in &scope.spans {
                    out.push((service.clone(), span.name.clone()));
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_otlp_receiver_with_the_service_name() {
    let received: Received = Arc::default();
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binds");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let receiver = tokio::spawn(async move { axum::serve(listener, app).await });

    let guard = jr_telemetry::init(jr_telemetry::TelemetryConfig {
        service_name: "jr-telemetry-test".into(),
        log_format: jr_telemetry::LogFormat::Pretty,
        filter: "info".into(),
        otlp_endpoint: Some(endpoint),
    })
    .expect("telemetry initialises");
    {
        let span = tracing::info_span!("exported_span", answer = 42);
        let _entered = span.enter();
        tracing::info!("inside the exported span");
    }
    guard.flush_async().await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !spans(&received)
        .iter()
        .any(|(_, name)| name == "exported_span")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "span not received: {:?}",
            spans(&received)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let spans = spans(&received);
    let (service, _) = spans
        .iter()
        .find(|(_, name)| name == "exported_span")
        .expect("present");
    assert_eq!(service, "jr-telemetry-test");

    let second = jr_telemetry::init(jr_telemetry::TelemetryConfig::new("again"));
    assert_eq!(
        second.err().map(|e| e.kind()),
        Some("subscriber"),
        "init is once per process"
    );
    guard.shutdown_async().await;
    receiver.abort();
}
