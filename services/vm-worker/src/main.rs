use std::process::ExitCode;

fn main() -> ExitCode {
    jr_service::main(
        "vm-worker",
        |c| {
            c.vm_worker
                .ops_listen
                .unwrap_or_else(|| std::net::SocketAddr::from(([0, 0, 0, 0], 9103)))
        },
        &["worker"],
        vm_worker::service::run,
    )
}
