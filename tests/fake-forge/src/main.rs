//! `fake-forge`: runs the fake Gitea RunnerService for the demo and the benchmark.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use jr_fake_forge::{Behaviour, Config, ErrorStyle, FakeForge, JobSpec};

#[derive(Debug, Parser)]
#[command(about = "A fake Gitea/Forgejo Actions RunnerService")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Global registration token (random if not given).
    #[arg(long, env = "FAKE_FORGE_REGISTRATION_TOKEN")]
    registration_token: Option<String>,
    /// Jobs to enqueue at start.
    #[arg(long, default_value_t = 0)]
    jobs: u32,
    /// Share of the start-up jobs that run on `vm` (the rest on `pod`).
    #[arg(long, default_value_t = 0.3)]
    vm_share: f64,
    /// Steps per start-up job.
    #[arg(long, default_value_t = 3)]
    steps: u32,
    /// Error style: gitea or forgejo.
    #[arg(long, default_value = "gitea")]
    error_style: ErrorStyle,
    /// Run the zombie/endless/abandoned reapers every this many seconds (0 = never).
    #[arg(long, default_value_t = 30)]
    reap_every_secs: u64,
}

/// Job `i` goes to `vm` when the running count of vm jobs crosses an integer, which spreads
/// the vm jobs evenly through the queue.
fn is_vm_job(i: u32, share: f64) -> bool {
    let share = share.clamp(0.0, 1.0);
    (f64::from(i + 1) * share).floor() > (f64::from(i) * share).floor()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let config = Config {
        listen: args.listen,
        registration_token: args.registration_token.clone(),
        behaviour: Behaviour {
            error_style: args.error_style,
            ..Behaviour::default()
        },
        reap_interval: (args.reap_every_secs > 0)
            .then(|| Duration::from_secs(args.reap_every_secs)),
        ..Config::default()
    };
    let forge = FakeForge::start(config).await?;
    for i in 0..args.jobs {
        let label = if is_vm_job(i, args.vm_share) {
            "vm"
        } else {
            "pod"
        };
        forge.enqueue_job(JobSpec {
            name: format!("job-{i}"),
            runs_on: vec![label.to_owned()],
            steps: args.steps,
            ..JobSpec::default()
        });
    }
    println!("{}", forge.url());
    println!("registration token: {}", forge.registration_token());
    shutdown_signal().await?;
    forge.shutdown().await?;
    Ok(())
}

/// SIGINT (Ctrl-C) or SIGTERM (process supervisors, `kill`).
async fn shutdown_signal() -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r,
        _ = term.recv() => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::is_vm_job;

    #[test]
    fn vm_share_is_spread_evenly() {
        let vm = (0..10).filter(|&i| is_vm_job(i, 0.3)).count();
        assert_eq!(vm, 3);
        assert!(!(0..10).any(|i| is_vm_job(i, 0.0)));
        assert!((0..10).all(|i| is_vm_job(i, 1.0)));
    }
}
