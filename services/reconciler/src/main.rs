use std::process::ExitCode;

fn main() -> ExitCode {
    jr_service::main(
        "reconciler",
        |c| c.reconciler.ops_listen,
        &["database", "projection"],
        reconciler::service::run,
    )
}
