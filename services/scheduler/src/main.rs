use std::process::ExitCode;
use std::sync::Arc;

/// mimalloc instead of the system allocator: every message is decoded, wrapped and encoded
/// in short-lived buffers, and glibc's malloc/free took about a seventh of each service's CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    jr_service::main(
        "scheduler",
        |c| c.scheduler.ops_listen,
        &["nats", "forge", "facade"],
        |p| async move {
            let readiness = p.readiness.clone();
            let ready: jr_scheduler::service::ReadyFn =
                Arc::new(move |check, ok| readiness.set(check, ok));
            jr_scheduler::service::run(p.config, p.bus, ready, Some(&p.metrics), p.shutdown.token())
                .await
        },
    )
}
