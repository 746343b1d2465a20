//! `fake-github`: the fake scale set service as a process (demo, compose, scenarios).

use std::net::SocketAddr;

use clap::Parser;

#[derive(Parser)]
#[command(about = "A strict fake of GitHub's runner scale set service")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// The personal access token it accepts.
    #[arg(long, env = "FAKE_GITHUB_PAT")]
    pat: String,
    /// How long a message poll is held when there is nothing, in milliseconds.
    #[arg(long, default_value_t = 50_000)]
    poll_hold_ms: u64,
    /// GitHub Enterprise Server style: jobs are offered and must be acquired.
    #[arg(long)]
    acquire_step: bool,
    /// github.com as seen since 2025: job messages carry `runnerRequestId` 0 and name the job
    /// by `jobId` only.
    #[arg(long)]
    zero_request_ids: bool,
    /// Jobs to queue (pushes to `acme/app`), one every `--job-every-ms`, for the demo and
    /// `docker compose up`.
    #[arg(long, default_value_t = 0)]
    jobs: usize,
    #[arg(long, default_value_t = 2_000)]
    job_every_ms: u64,
    /// The `runs-on` of the queued jobs (the scale set's name).
    #[arg(long, default_value = "jetrunner")]
    job_label: String,
    /// A runner silent this long while it runs a job is lost and its job fails (as GitHub does
    /// when a runner stops renewing its job); 0: never.
    #[arg(long, default_value_t = 60)]
    runner_lost_after_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let fake = jr_fake_github::FakeGitHub::start_on(args.listen, &args.pat).await?;
    fake.set_poll_hold(std::time::Duration::from_millis(args.poll_hold_ms));
    fake.set_acquire_step(args.acquire_step);
    fake.set_zero_request_ids(args.zero_request_ids);
    fake.set_runner_lost_after(
        (args.runner_lost_after_secs > 0)
            .then(|| std::time::Duration::from_secs(args.runner_lost_after_secs)),
    );
    println!("fake-github listening on {}", fake.url());
    if args.jobs > 0 {
        let (queue, label) = (fake.clone(), args.job_label.clone());
        let every = std::time::Duration::from_millis(args.job_every_ms);
        tokio::spawn(async move {
            for _ in 0..args.jobs {
                queue.enqueue(jr_fake_github::JobSpec::push(&[label.as_str()]));
                tokio::time::sleep(every).await;
            }
        });
    }
    tokio::signal::ctrl_c().await?;
    Ok(())
}
