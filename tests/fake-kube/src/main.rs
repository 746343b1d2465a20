//! `fake-kube`: the fake Kubernetes API server as a process, for the demo and scenarios.
//! Each Pod "runs" `--executor-cmd` as a child process with the Pod's resolved environment.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use futures::FutureExt as _;
use jr_fake_kube::{ExitStatus, FakeKube, PodRun, PodRunner, SimConfig};

#[derive(Parser, Debug)]
#[command(about = "A fake Kubernetes API server (Pods, Secrets, watch) with simulated Pods")]
struct Args {
    #[arg(long, default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// Command each Pod runs (with the Pod's env). Without it Pods stay Running until deleted.
    #[arg(long)]
    executor_cmd: Option<String>,
    /// Pending → Running delay in milliseconds.
    #[arg(long, default_value_t = 200)]
    start_delay_ms: u64,
    /// Don't simulate a kubelet at all (Pods stay Pending).
    #[arg(long)]
    passive: bool,
}

fn process_runner(cmd: String) -> PodRunner {
    Arc::new(move |run: PodRun| {
        let cmd = cmd.clone();
        async move {
            let mut child = tokio::process::Command::new(&cmd);
            child.envs(&run.env).kill_on_drop(true);
            match child.status().await {
                Ok(status) => ExitStatus { exit_code: status.code().unwrap_or(137), reason: None },
                Err(error) => {
                    tracing::warn!(pod = %run.name, %error, cmd, "cannot start the executor command");
                    ExitStatus::failed(128)
                }
            }
        }
        .boxed()
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let config = SimConfig {
        simulate: !args.passive,
        start_delay: Duration::from_millis(args.start_delay_ms),
        runner: args.executor_cmd.map(process_runner),
        ..SimConfig::default()
    };
    let kube = FakeKube::start_on(args.listen, config)
        .await
        .context("start the fake API server")?;
    println!("fake-kube listening on {}", kube.url());
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("install the SIGTERM handler")?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result.context("wait for ctrl-c")?,
        _ = terminate.recv() => {}
    }
    drop(kube);
    Ok(())
}
