//! The facade when its ledger fails: nothing is lost, the executor is told to retry, and
//! Declare never fails for a ledger hiccup (act_runner would give up).

mod facade_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use axum::body::Body;
use facade_support::*;
use http::{Request, StatusCode};
use jr_facade::{AssignmentView, AuthMode, Facade, Ledger, LedgerError, MemoryLedger, router};
use jr_forge::proto::runner::v1::{
    DeclareRequest, FetchTaskRequest, FetchTaskResponse, Result as ForgeResult, TaskState,
    UpdateTaskRequest,
};
use jr_forge::{Code, parse_connect_error};
use jr_protocol::{AssignmentId, Terminal};
use prost::Message;
use tower::ServiceExt;

const TOKEN: &str = "tok";

/// A MemoryLedger whose lookups can be switched off and whose terminal publishes can fail.
#[derive(Default)]
struct FlakyLedger {
    inner: MemoryLedger,
    lookups_down: AtomicBool,
    terminal_failures: AtomicU32,
}

fn down() -> LedgerError {
    LedgerError::unavailable(std::io::Error::other("jetstream down"))
}

impl Ledger for FlakyLedger {
    async fn lookup(&self, id: AssignmentId) -> Result<Option<AssignmentView>, LedgerError> {
        if self.lookups_down.load(Ordering::SeqCst) {
            return Err(down());
        }
        self.inner.lookup(id).await
    }

    async fn publish_claimed(
        &self,
        view: &AssignmentView,
        executor: &str,
    ) -> Result<bool, LedgerError> {
        self.inner.publish_claimed(view, executor).await
    }

    async fn publish_terminal(
        &self,
        view: &AssignmentView,
        terminal: Terminal,
    ) -> Result<bool, LedgerError> {
        let failures = self.terminal_failures.load(Ordering::SeqCst);
        if failures > 0 {
            self.terminal_failures.store(failures - 1, Ordering::SeqCst);
            return Err(down());
        }
        self.inner.publish_terminal(view, terminal).await
    }

    async fn publish_executor_finished(&self, view: &AssignmentView) -> Result<(), LedgerError> {
        self.inner.publish_executor_finished(view).await
    }

    async fn warm_binding(
        &self,
        backend: &jr_protocol::BackendName,
        warm: AssignmentId,
    ) -> Result<Option<jr_bus::warm::WarmBinding>, LedgerError> {
        if self.lookups_down.load(Ordering::SeqCst) {
            return Err(down());
        }
        self.inner.warm_binding(backend, warm).await
    }
}

/// One Connect call through the router. Returns the status and body.
async fn call(
    app: &axum::Router,
    id: AssignmentId,
    method: &str,
    message: &impl Message,
) -> (StatusCode, Vec<u8>) {
    let request = Request::post(format!("/api/actions/runner.v1.RunnerService/{method}"))
        .header("content-type", "application/proto")
        .header("x-runner-uuid", id.to_string())
        .header("x-runner-token", TOKEN)
        .body(Body::from(message.encode_to_vec()))
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    (status, body.to_vec())
}

fn code(body: &[u8]) -> Code {
    parse_connect_error(body).expect("Connect error").code
}

#[tokio::test]
async fn ledger_failures_ask_the_executor_to_retry_and_lose_nothing() {
    install_crypto();
    let (forge_url, forge) = start_forge().await;
    let sealer = sealer();
    let ledger = Arc::new(FlakyLedger::default());
    let facade = Arc::new(
        Facade::new(
            settings(AuthMode::Token, &forge_url, sealer.clone(), true),
            ledger.clone(),
        )
        .expect("facade"),
    );
    let app = router(facade.clone());

    let id = AssignmentId::for_task("http://forge.test", 71);
    ledger.inner.insert(AssignmentView {
        id,
        backend: jr_protocol::BackendName::new("vm").expect("backend"),
        attempt: 1,
        forge_task_id: 71,
        sealed_task: sealer
            .seal(
                jr_seal::SealScope::new(
                    id,
                    &jr_protocol::BackendName::new("vm").expect("backend"),
                    71,
                ),
                &task(71).encode_to_vec(),
            )
            .expect("seal"),
        token_hash: Some(jr_protocol::TokenHash::of_token(TOKEN)),
        claimed: false,
        terminal: false,
        trace: None,
    });

    ledger.lookups_down.store(true, Ordering::SeqCst);
    let (status, _) = call(&app, id, "Declare", &DeclareRequest::default()).await;
    assert_eq!(status, StatusCode::OK, "Declare survives a ledger outage");
    let (status, body) = call(&app, id, "FetchTask", &FetchTaskRequest::default()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(code(&body), Code::Unavailable);
    assert!(!ledger.inner.record(id).expect("record").view.claimed);

    ledger.lookups_down.store(false, Ordering::SeqCst);
    let (status, body) = call(&app, id, "FetchTask", &FetchTaskRequest::default()).await;
    assert_eq!(status, StatusCode::OK);
    let reply = FetchTaskResponse::decode(body.as_slice()).expect("reply");
    assert_eq!(reply.task.map(|t| t.id), Some(71));

    // The forge accepts the final result but recording it fails: the executor must retry.
    ledger.terminal_failures.store(1, Ordering::SeqCst);
    let final_state = UpdateTaskRequest {
        state: Some(TaskState {
            id: 71,
            result: ForgeResult::Success as i32,
            ..TaskState::default()
        }),
        outputs: Default::default(),
    };
    let (status, body) = call(&app, id, "UpdateTask", &final_state).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(code(&body), Code::Unavailable);
    assert!(ledger.inner.record(id).expect("record").terminal.is_none());
    let (status, _) = call(&app, id, "UpdateTask", &final_state).await;
    assert_eq!(status, StatusCode::OK, "the retry goes through");
    assert!(ledger.inner.record(id).expect("record").terminal.is_some());
    // The liveness check before the claim, then the executor's two final reports.
    assert_eq!(forge.lock().expect("lock").update_tasks.len(), 3);
    assert_eq!(facade.stats().terminals_published, 1);
    assert!(facade.stats().ledger_errors >= 2);
}
