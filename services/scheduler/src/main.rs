use std::process::ExitCode;

/// mimalloc instead of the system allocator: every message is decoded, wrapped and encoded
/// in short-lived buffers, and glibc's malloc/free took about a seventh of each service's CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    jr_service::main(
        "scheduler",
        |c| c.scheduler.ops_listen,
        &["nats", "facade"],
        |p| async move {
            jr_scheduler::service::run(
                p.config,
                p.bus,
                p.readiness.clone(),
                Some(&p.metrics),
                p.shutdown.token(),
            )
            .await
        },
    )
}
