//! `fake-sandbox`: the fake OpenSandbox server for the demo. With `--executor-cmd`, every sandbox
//! that becomes Running spawns that program with the sandbox's env (the executor contract), and
//! the program is killed when the sandbox is deleted.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use futures::FutureExt;
use jr_fake_sandbox::{FakeConfig, FakeSandbox, Runner, SandboxRun};

#[derive(Parser, Debug)]
#[command(about = "A fake OpenSandbox Lifecycle server (1.1.1, Kubernetes runtime)")]
struct Args {
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// A pool and its capacity, `name=capacity` (repeatable).
    #[arg(long = "pool", value_parser = parse_pool, default_value = "ci-vm=15")]
    pools: Vec<(String, usize)>,
    /// Required API key (`OPEN-SANDBOX-API-KEY`); without one, auth is off.
    #[arg(long, env = "OPEN_SANDBOX_API_KEY")]
    api_key: Option<String>,
    /// Program started in every Running sandbox with its env.
    #[arg(long)]
    executor_cmd: Option<String>,
    /// Seconds a create waits for a pool slot before 429.
    #[arg(long, default_value_t = 1.0)]
    pool_acquisition_timeout: f64,
    /// Milliseconds a deleted sandbox stays `Stopping`.
    #[arg(long, default_value_t = 1000)]
    stopping_ms: u64,
}

fn parse_pool(raw: &str) -> Result<(String, usize), String> {
    let (name, capacity) = raw.split_once('=').ok_or("expected name=capacity")?;
    let capacity = capacity.parse().map_err(|e| format!("capacity: {e}"))?;
    Ok((name.to_owned(), capacity))
}

fn executor_runner(program: String) -> Runner {
    Arc::new(move |run: SandboxRun| {
        let program = program.clone();
        async move {
            let child = tokio::process::Command::new(&program)
                .envs(&run.env)
                .kill_on_drop(true)
                .spawn();
            match child {
                Ok(mut child) => match child.wait().await {
                    Ok(status) => tracing::info!(sandbox = %run.id, %status, "executor exited; sandbox stays Running"),
                    Err(e) => tracing::warn!(sandbox = %run.id, error = %e, "waiting for the executor failed"),
                },
                Err(e) => tracing::warn!(sandbox = %run.id, error = %e, program, "starting the executor failed"),
            }
        }
        .boxed()
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let config = FakeConfig {
        api_key: args.api_key,
        pools: args.pools.into_iter().collect::<BTreeMap<_, _>>(),
        pool_acquisition_timeout: Duration::try_from_secs_f64(args.pool_acquisition_timeout)
            .context("--pool-acquisition-timeout")?,
        stopping_for: Duration::from_millis(args.stopping_ms),
        runner: args.executor_cmd.map(executor_runner),
        ..FakeConfig::default()
    };
    let server = FakeSandbox::bind(args.listen, config)
        .await
        .context("binding --listen")?;
    tracing::info!(url = %server.base_url(), "fake OpenSandbox server listening");
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    drop(server);
    Ok(())
}
