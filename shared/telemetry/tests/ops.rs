use std::sync::Arc;
use std::time::Duration;

use jr_telemetry::prometheus_client::metrics::counter::Counter;
use jr_telemetry::{Metrics, OpsServer, Readiness, Shutdown};

struct Running {
    base: String,
    shutdown: Shutdown,
    server: tokio::task::JoinHandle<Result<(), jr_telemetry::TelemetryError>>,
    client: reqwest::Client,
}

async fn start(metrics: Arc<Metrics>, readiness: Readiness) -> Running {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = OpsServer::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("binds");
    let base = format!("http://{}", server.local_addr().expect("addr"));
    let shutdown = Shutdown::new();
    let server = tokio::spawn(server.run(metrics, readiness, shutdown.clone()));
    Running {
        base,
        shutdown,
        server,
        client: reqwest::Client::new(),
    }
}

impl Running {
    async fn get(&self, path: &str) -> (u16, String) {
        let response = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("response");
        (
            response.status().as_u16(),
            response.text().await.expect("body"),
        )
    }

    async fn stop(self) {
        self.shutdown.trigger();
        tokio::time::timeout(Duration::from_secs(5), self.server)
            .await
            .expect("server stops on shutdown")
            .expect("no panic")
            .expect("clean exit");
    }
}

#[tokio::test]
async fn readyz_follows_the_readiness_flags() {
    let readiness = Readiness::new();
    readiness.register("nats");
    readiness.register("consumers");
    let ops = start(Arc::new(Metrics::new()), readiness.clone()).await;

    assert_eq!(ops.get("/healthz").await.0, 200);
    let (status, body) = ops.get("/readyz").await;
    assert_eq!(status, 503);
    let body: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(body["not_ready"], serde_json::json!(["consumers", "nats"]));

    readiness.set("nats", true);
    let (status, body) = ops.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(
        body.contains("consumers") && !body.contains("nats"),
        "{body}"
    );

    readiness.set("consumers", true);
    let (status, body) = ops.get("/readyz").await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).expect("json")["ready"],
        true
    );

    // A detail informs without making the service unready, and can be cleared.
    readiness.set_detail(
        "intake.shared",
        Some("backend pod: no live worker".to_owned()),
    );
    let (status, body) = ops.get("/readyz").await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(
        json["details"]["intake.shared"],
        "backend pod: no live worker"
    );
    readiness.set_detail("intake.shared", None);
    let (_, body) = ops.get("/readyz").await;
    assert!(!body.contains("intake.shared"), "{body}");

    readiness.set("nats", false);
    assert_eq!(
        ops.get("/readyz").await.0,
        503,
        "readiness can be lost again"
    );
    assert_eq!(
        ops.get("/healthz").await.0,
        200,
        "health does not depend on readiness"
    );
    ops.stop().await;
}

#[tokio::test]
async fn metrics_exposes_a_registered_counter() {
    let metrics = Arc::new(Metrics::with_prefix("jr"));
    let redispatches = Counter::<u64>::default();
    metrics.register(
        "redispatches",
        "Assignments redispatched",
        redispatches.clone(),
    );
    redispatches.inc_by(3);
    let ops = start(metrics, Readiness::new()).await;

    let (status, body) = ops.get("/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("jr_redispatches_total 3"), "{body}");
    assert!(
        body.trim_end().ends_with("# EOF"),
        "OpenMetrics terminator: {body}"
    );
    ops.stop().await;
}
