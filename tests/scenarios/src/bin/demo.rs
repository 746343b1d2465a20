//! `demo`: all of jetrunner on this machine with the simulated forge and backends. Queues jobs,
//! shows them flowing per backend, and says where to look. The Pod backend has two providers
//! (namespaces `east` and `west`, weights 2:1) and a burst-tier provider (`cloud`) that takes
//! half of the eligible jobs once both are full; the burst switch is set at start as an
//! operator would with `jr burst set on:50`. Next to the Gitea forge, a fake GitHub serves a
//! runner scale set (`[[forge]] kind = "github"`) whose jobs run on runners in Pods.

use std::time::Duration;

use clap::Parser;
use jr_fake_forge::Status;
use jr_scenarios::system::JOBS_NAMESPACE;
use jr_scenarios::{System, SystemSpec};

/// The Pod backend's providers: name, namespace, weight, max_runners, tier.
const PROVIDERS: [(&str, &str, u32, usize, &str); 3] = [
    ("east", JOBS_NAMESPACE, 2, 3, "default"),
    ("west", "jetrunner-jobs-west", 1, 2, "default"),
    ("cloud", "jetrunner-jobs-cloud", 1, 3, "burst"),
];

fn providers_toml(capacity: usize) -> String {
    PROVIDERS
        .iter()
        .map(|(name, namespace, weight, max, tier)| {
            let max = (*max).min(capacity.max(1));
            format!(
                "\n[[backend.pod.providers]]\nname = \"{name}\"\nweight = {weight}\nmax_runners = {max}\ntier = \"{tier}\"\nkubernetes = {{ namespace = \"{namespace}\" }}\n"
            )
        })
        .collect()
}

/// Pods created so far in each provider's namespace.
fn per_provider(system: &System) -> Vec<(&'static str, usize)> {
    let created = system.kube.records().created;
    PROVIDERS
        .iter()
        .map(|(name, namespace, ..)| {
            let n = created
                .iter()
                .filter(|p| p.split_once('/').is_some_and(|(ns, _)| ns == *namespace))
                .count();
            (*name, n)
        })
        .collect()
}

#[derive(Parser)]
#[command(about = "Run jetrunner locally on a simulated forge, Kubernetes and OpenSandbox")]
struct Args {
    /// Jobs to queue.
    #[arg(long, default_value = "60")]
    jobs: u32,
    /// Share of jobs that run in microVMs (runs-on: vm); the rest run in Pods.
    #[arg(long, default_value = "0.3")]
    vm_share: f64,
    #[arg(long, default_value = "8")]
    pod_capacity: usize,
    /// The burst switch set at start (`off`, `on`, `on:<percent>`).
    #[arg(long, default_value = "on:50")]
    burst: String,
    #[arg(long, default_value = "3")]
    vm_capacity: usize,
    /// Simulated job duration in milliseconds.
    #[arg(long, default_value = "1500")]
    job_ms: u64,
    /// GitHub jobs to queue at the fake GitHub's scale set (their runners run in Pods).
    #[arg(long, default_value = "10")]
    github_jobs: usize,
    /// Exit once every job is done instead of waiting for Ctrl-C.
    #[arg(long)]
    exit_when_done: bool,
}

#[derive(Default)]
struct Row {
    /// Still waiting at the forge.
    queued: usize,
    /// Fetched by jetrunner: waiting in JetStream for a slot, or running.
    running: usize,
    /// Of those, waiting in JetStream for a free slot (the worker consumer's pending count).
    waiting: Option<u64>,
    done: usize,
    failed: usize,
}

/// Queue depth per backend from the reconciler's status API.
async fn queue_depths(client: &reqwest::Client, status_port: u16) -> Vec<(String, u64)> {
    let url = format!("http://127.0.0.1:{status_port}/api/status");
    let Ok(response) = client.get(url).send().await else {
        return Vec::new();
    };
    let Ok(json) = response.json::<serde_json::Value>().await else {
        return Vec::new();
    };
    json["backends"]
        .as_array()
        .map(|b| {
            b.iter()
                .filter_map(|b| Some((b["name"].as_str()?.to_owned(), b["queue_depth"].as_u64()?)))
                .collect()
        })
        .unwrap_or_default()
}

fn progress(system: &System) -> (Row, Row) {
    let snapshot = system.forge.snapshot();
    let (mut pod, mut vm) = (Row::default(), Row::default());
    for job in &snapshot.jobs {
        let row = if job.runs_on.iter().any(|l| l == "vm") {
            &mut vm
        } else {
            &mut pod
        };
        match &job.status {
            Status::Waiting => row.queued += 1,
            Status::Running => row.running += 1,
            Status::Done(jr_fake_forge::Outcome::Success) => row.done += 1,
            Status::Done(_) => row.failed += 1,
        }
    }
    (pod, vm)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt().with_env_filter("warn").init();
    println!(
        "starting NATS, PostgreSQL, the simulated forge/Kubernetes/OpenSandbox and the four services…"
    );
    let mut system = System::start(SystemSpec {
        pod_capacity: args.pod_capacity,
        vm_capacity: args.vm_capacity,
        extra_toml: providers_toml(args.pod_capacity),
        github: args.github_jobs > 0,
        ..Default::default()
    })
    .await?;
    // What `jr burst set <value>` does.
    let admin = async_nats::connect(system.nats.url()).await?;
    let js = async_nats::jetstream::new(admin);
    let bucket = match js.get_key_value("JR_PLACEMENT").await {
        Ok(b) => b,
        Err(_) => {
            js.create_key_value(async_nats::jetstream::kv::Config {
                bucket: "JR_PLACEMENT".into(),
                history: 10,
                ..Default::default()
            })
            .await?
        }
    };
    bucket.put("burst", args.burst.clone().into()).await?;
    let vm_jobs = (f64::from(args.jobs) * args.vm_share).round() as u32;
    let duration = args.job_ms.to_string();
    system.enqueue(
        "pod",
        args.jobs - vm_jobs,
        &[("JR_FAKE_DURATION_MS", &duration)],
    );
    system.enqueue("vm", vm_jobs, &[("JR_FAKE_DURATION_MS", &duration)]);
    system.enqueue_github(args.github_jobs);
    let p = system.ports;
    println!();
    println!("  status page      http://127.0.0.1:{}/", p.status);
    println!(
        "  status API       http://127.0.0.1:{}/api/status",
        p.status
    );
    println!(
        "  metrics          http://127.0.0.1:{{{},{},{},{}}}/metrics  (scheduler, pod-worker, vm-worker, reconciler)",
        p.scheduler_ops, p.pod_ops, p.vm_ops, p.reconciler_ops
    );
    println!("  facade           http://127.0.0.1:{}/", p.facade);
    println!("  fake forge       {}/_fake/stats", system.forge.url());
    if let Some(github) = &system.github {
        println!(
            "  fake GitHub      {}   (GET /_fake/jobs/<id>; the scale set is `jetrunner`)",
            github.url()
        );
    }
    println!(
        "  NATS             {}   monitoring {}/jsz?consumers=true",
        system.nats.url(),
        system.nats.monitor_url()
    );
    println!(
        "                   with the NATS CLI (github.com/nats-io/natscli, not packaged): nats -s {} stream ls",
        system.nats.url()
    );
    println!("  PostgreSQL       {}", system.database_url);
    println!(
        "  service logs     {}   (copied to {} when the demo stops)",
        system.dir.path().display(),
        kept_logs_dir().display()
    );
    // `jr` by its full path: it is built with the demo, not installed.
    let jr = jr_scenarios::process::binary("jr")?;
    let status_url = format!("http://127.0.0.1:{}", p.status);
    println!(
        "  burst switch     {}   ({} burst --server {} set off|on|on:<percent>)",
        args.burst,
        jr.display(),
        system.nats.url()
    );
    println!(
        "  jobs             {} jobs --status-url {status_url}   (--backend pod, --state failed, --json …)",
        jr.display()
    );
    println!(
        "  status           {} status --status-url {status_url}",
        jr.display()
    );
    println!();
    let started = std::time::Instant::now();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()?;
    loop {
        let (mut pod, mut vm) = progress(&system);
        for (backend, depth) in queue_depths(&client, p.status).await {
            match backend.as_str() {
                "pod" => pod.waiting = Some(depth),
                "vm" => vm.waiting = Some(depth),
                _ => {}
            }
        }
        let waiting = |r: &Row| r.waiting.map_or_else(|| "?".to_owned(), |w| w.to_string());
        let providers: Vec<String> = per_provider(&system)
            .iter()
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        print!(
            "\r[{:>5.1}s] pod: {:>3} at forge {:>3} fetched ({:>3} waiting for a slot) {:>3} done {:>3} failed [{}] | vm: {:>3} at forge {:>3} fetched ({:>3} waiting) {:>3} done {:>3} failed ",
            started.elapsed().as_secs_f64(),
            pod.queued,
            pod.running,
            waiting(&pod),
            pod.done,
            pod.failed,
            providers.join(", "),
            vm.queued,
            vm.running,
            waiting(&vm),
            vm.done,
            vm.failed
        );
        let (github_done, github_open) = github_progress(&system);
        if system.github.is_some() {
            print!("| github: {github_open:>3} open {github_done:>3} done ");
        }
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        let all_done = pod.queued + pod.running + vm.queued + vm.running == 0 && github_open == 0;
        if all_done {
            println!();
            // Deleting the last workloads takes a moment after the last result.
            let cleaned = system.wait_no_workloads(Duration::from_secs(30)).await;
            let mut violations = system.violations();
            violations.extend(system.github_violations(&Default::default()));
            if cleaned.is_ok() && violations.is_empty() {
                println!(
                    "all {} jobs (and {github_done} GitHub jobs) finished in {:.1}s; every Pod and VM was deleted.",
                    args.jobs,
                    started.elapsed().as_secs_f64()
                );
                let placed: Vec<String> = per_provider(&system)
                    .iter()
                    .map(|(name, n)| format!("{name} {n}"))
                    .collect();
                println!(
                    "Pods per provider: {} (east:west weights 2:1; cloud is the burst tier)",
                    placed.join(", ")
                );
            } else {
                println!("finished with problems: {violations:?}");
            }
            if args.exit_when_done {
                return keep(&system);
            }
            println!("still running for you to look around; Ctrl-C to stop.");
            tokio::signal::ctrl_c().await?;
            return keep(&system);
        }
        if system
            .services_mut()
            .iter_mut()
            .any(|s| s.exited().is_some())
        {
            println!();
            anyhow::bail!("a service stopped:\n{}", system.logs());
        }
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return keep(&system),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// GitHub jobs completed, and not yet completed, at the fake GitHub.
fn github_progress(system: &System) -> (usize, usize) {
    let Some(github) = &system.github else {
        return (0, 0);
    };
    let jobs = github.jobs();
    let done = jobs
        .iter()
        .filter(|j| matches!(j.state, jr_fake_github::JobState::Completed { .. }))
        .count();
    (done, jobs.len() - done)
}

/// Where the services' logs are kept when the demo stops (its own folder goes with it).
fn kept_logs_dir() -> std::path::PathBuf {
    std::env::temp_dir().join("jr-scenario-logs-demo")
}

/// Copies the services' logs out of the demo's folder before it is removed, and says where.
fn keep(system: &System) -> anyhow::Result<()> {
    let kept = jr_scenarios::chaos::keep_logs(system, "demo")?;
    println!();
    println!("the services' logs are kept in {}", kept.display());
    Ok(())
}
