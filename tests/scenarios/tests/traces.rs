//! One trace per job: with `telemetry.otlp_endpoint` pointing at an in-process OTLP/HTTP
//! receiver, every span the four services record about a job (fetch and dispatch, the worker's
//! consume, create and events, the facade's calls, the reconciler's commands) carries that job's
//! trace id, and each job has a trace of its own. Needs `cargo build --workspace --bins` first;
//! run with `--test-threads=1`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use jr_scenarios::{System, SystemSpec};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

/// One received span: its service, name, trace id and `assignment` attribute.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    name: String,
    trace: Vec<u8>,
    assignment: Option<String>,
}

type Received = Arc<Mutex<Vec<Span>>>;

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> Option<String> {
    match value?.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        other => Some(format!("{other:?}")),
    }
}

async fn receive(State(received): State<Received>, body: bytes::Bytes) -> &'static str {
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return "";
    };
    let mut spans = Vec::new();
    for resource_spans in &request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| r.attributes.iter())
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| text(kv.value.as_ref()))
            .unwrap_or_default();
        for scope in &resource_spans.scope_spans {
            for span in &scope.spans {
                spans.push(Span {
                    service: service.clone(),
                    name: span.name.clone(),
                    trace: span.trace_id.clone(),
                    assignment: span
                        .attributes
                        .iter()
                        .find(|kv| kv.key == "assignment")
                        .and_then(|kv| text(kv.value.as_ref())),
                });
            }
        }
    }
    if let Ok(mut all) = received.lock() {
        all.extend(spans);
    }
    ""
}

fn spans_of(received: &Received, id: &str) -> Vec<Span> {
    received
        .lock()
        .map(|all| {
            all.iter()
                .filter(|s| s.assignment.as_deref() == Some(id))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// What each job's trace must hold: (service, span name); `worker` is the job's backend's.
const EXPECTED: [(&str, &str); 6] = [
    ("jetrunner-scheduler", "job"),
    ("worker", "consume"),
    ("worker", "create workload"),
    ("worker", "worker event"),
    ("jetrunner-scheduler", "facade call"),
    ("jetrunner-reconciler", "reconciler command"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_job_is_one_trace_across_the_four_services() -> anyhow::Result<()> {
    let received: Received = Arc::default();
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let receiver = tokio::spawn(async move { axum::serve(listener, app).await });

    let mut system = System::start(SystemSpec {
        // Appended right after the generated `[telemetry]` table, so these keys belong to it.
        extra_toml: format!("otlp_endpoint = \"{endpoint}\"\n"),
        ..Default::default()
    })
    .await?;
    let mut jobs = Vec::new();
    for (backend, n) in [("pod", 2), ("vm", 1)] {
        for job in system.forge.enqueue_jobs(
            jr_fake_forge::JobSpec {
                repo: "acme/widgets".into(),
                name: format!("build-{backend}"),
                runs_on: vec![backend.into()],
                steps: 2,
                ..Default::default()
            },
            n,
        ) {
            jobs.push((job, format!("jetrunner-{backend}-worker")));
        }
    }
    if let Err(e) = system.wait_all_final(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    system.wait_no_workloads(Duration::from_secs(60)).await?;
    let snapshot = system.forge.snapshot();
    // (assignment id, its worker's service name)
    let ids: Vec<(String, String)> = jobs
        .iter()
        .filter_map(|(j, worker)| {
            let task = snapshot.job(*j)?.task_ids.first().copied()?;
            let id = jr_protocol::AssignmentId::for_task(system.forge.url(), task).to_string();
            Some((id, worker.clone()))
        })
        .collect();
    anyhow::ensure!(ids.len() == jobs.len(), "a job without a task");

    // Spans arrive in batches (the exporters flush every few seconds).
    let complete = |id: &str, worker: &str| {
        let spans = spans_of(&received, id);
        EXPECTED.iter().all(|(service, name)| {
            let service = if *service == "worker" {
                worker
            } else {
                service
            };
            spans
                .iter()
                .any(|s| s.service == service && s.name == *name)
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !ids.iter().all(|(id, worker)| complete(id, worker)) {
        if tokio::time::Instant::now() >= deadline {
            let seen: BTreeMap<&String, BTreeSet<(String, String)>> = ids
                .iter()
                .map(|(id, _)| {
                    let spans = spans_of(&received, id);
                    (id, spans.into_iter().map(|s| (s.service, s.name)).collect())
                })
                .collect();
            anyhow::bail!("spans missing; per job: {seen:#?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let mut traces = BTreeSet::new();
    for (id, worker) in &ids {
        let spans = spans_of(&received, id);
        let ids_of_trace: BTreeSet<&Vec<u8>> = spans.iter().map(|s| &s.trace).collect();
        assert_eq!(
            ids_of_trace.len(),
            1,
            "job {id} spans {} traces: {:#?}",
            ids_of_trace.len(),
            spans
                .iter()
                .map(|s| (&s.service, &s.name, hex(&s.trace)))
                .collect::<Vec<_>>()
        );
        let trace = ids_of_trace.into_iter().next().cloned().unwrap_or_default();
        assert!(
            trace.iter().any(|b| *b != 0),
            "job {id}: an invalid trace id"
        );
        // Every service's spans about the job.
        let services: BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
        for service in ["jetrunner-scheduler", worker, "jetrunner-reconciler"] {
            assert!(services.contains(service), "job {id}: no {service} span");
        }
        traces.insert(trace);
    }
    assert_eq!(traces.len(), ids.len(), "jobs share a trace");
    receiver.abort();
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
