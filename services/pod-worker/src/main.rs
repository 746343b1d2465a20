use std::process::ExitCode;

fn main() -> ExitCode {
    jr_service::main(
        "pod-worker",
        |c| {
            c.pod_worker
                .ops_listen
                .unwrap_or_else(|| std::net::SocketAddr::from(([0, 0, 0, 0], 9102)))
        },
        &["worker"],
        pod_worker::service::run,
    )
}
