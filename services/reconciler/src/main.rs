use std::process::ExitCode;

/// mimalloc instead of the system allocator: every message is decoded, wrapped and encoded
/// in short-lived buffers, and glibc's malloc/free took about a seventh of each service's CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    jr_service::main(
        "reconciler",
        |c| c.reconciler.ops_listen,
        &["database", "projection"],
        reconciler::service::run,
    )
}
