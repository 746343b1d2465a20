//! Forges as independent intakes, with the whole system: a GitHub-only deployment (no `[forge]`)
//! runs its jobs; GitHub jobs keep running while Gitea is down for a minute, and Gitea's run as
//! soon as it is back; Gitea jobs keep running while GitHub refuses the configured token, and
//! GitHub's run once it accepts it again. The scheduler never exits meanwhile, and the intake
//! that does not work is reported (`/readyz` details, `jetrunner_intake_up`, the status API)
//! with the cause. Needs `cargo build --workspace --bins` first.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use jr_scenarios::{GITHUB_PAT, System, SystemSpec};

/// What the system says about intake `intake`: `(readyz detail, intake_up, status API error)`.
async fn intake_report(
    system: &System,
    intake: &str,
) -> (Option<String>, Option<String>, Option<String>) {
    let get = |url: String| async move {
        match reqwest::get(&url).await {
            Ok(response) => response.text().await.ok(),
            Err(_) => None,
        }
    };
    let ops = system.ports.scheduler_ops;
    let detail = get(format!("http://127.0.0.1:{ops}/readyz"))
        .await
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| {
            v["details"][format!("intake.{intake}")]
                .as_str()
                .map(str::to_owned)
        });
    let prefix = format!("jetrunner_intake_up{{intake=\"{intake}\",");
    let up = get(format!("http://127.0.0.1:{ops}/metrics"))
        .await
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with(&prefix))
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_owned)
        });
    let error = get(format!(
        "http://127.0.0.1:{}/api/status",
        system.ports.status
    ))
    .await
    .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    .and_then(|v| {
        v["intakes"].as_array().and_then(|all| {
            all.iter()
                .find(|i| i["registration"] == intake)
                .map(|i| i["error"].as_str().unwrap_or_default().to_owned())
        })
    });
    (detail, up, error)
}

/// Waits until `intake` is reported down everywhere with `cause` in its error.
async fn reported_down(system: &System, intake: &str, cause: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (detail, up, error) = intake_report(system, intake).await;
        let said = |t: &Option<String>| t.as_deref().is_some_and(|t| t.contains(cause));
        if said(&detail) && up.as_deref() == Some("0") && said(&error) {
            println!(
                "intake {intake} reported down: {}",
                detail.unwrap_or_default()
            );
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "intake {intake} not reported down with {cause:?}: /readyz {detail:?}, up {up:?}, \
             status API {error:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits until `intake` is reported up again (its error gone).
async fn reported_up(system: &System, intake: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (detail, up, error) = intake_report(system, intake).await;
        if detail.is_none() && up.as_deref() == Some("1") && error.as_deref() == Some("") {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "intake {intake} not reported up: /readyz {detail:?}, up {up:?}, status API {error:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn finish_and_check(system: &mut System, gitea: bool) -> anyhow::Result<()> {
    let waited = async {
        if gitea {
            system.wait_all_final(Duration::from_secs(180)).await?;
        }
        system.wait_github_final(Duration::from_secs(180)).await?;
        system.wait_no_workloads(Duration::from_secs(90)).await
    }
    .await;
    if let Err(e) = waited {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let mut violations = system.violations();
    violations.extend(system.github_violations(&HashSet::new()));
    violations.extend(system.github_bus_violations().await?);
    anyhow::ensure!(violations.is_empty(), "{violations:#?}\n{}", system.logs());
    anyhow::ensure!(
        system.scheduler.exited().is_none(),
        "the scheduler exited\n{}",
        system.logs()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deployment_without_a_gitea_forge_runs_github_jobs() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        github: true,
        no_gitea: true,
        ..Default::default()
    })
    .await?;
    let jobs = system.enqueue_github(6);
    finish_and_check(&mut system, false).await?;
    let forge = system.forge.snapshot();
    anyhow::ensure!(
        forge.runners.is_empty(),
        "a runner was registered at a forge that is not configured: {:?}",
        forge.runners
    );
    println!("{} GitHub jobs ran with no [forge] configured", jobs.len());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn github_jobs_run_while_gitea_is_down_and_gitea_jobs_run_once_it_is_back()
-> anyhow::Result<()> {
    // The forge answers 500 to every call from the start: registration, Ping, Declare.
    let mut system = System::start(SystemSpec {
        github: true,
        forge_faults: Some(jr_fake_forge::FaultConfig {
            error_rate: 1.0,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await?;
    let down = Instant::now();
    system.enqueue("pod", 3, &[("JR_FAKE_DURATION_MS", "200")]);
    system.enqueue("vm", 2, &[("JR_FAKE_DURATION_MS", "200")]);
    system.enqueue_github(8);
    if let Err(e) = system.wait_github_final(Duration::from_secs(90)).await {
        anyhow::bail!(
            "GitHub jobs did not run while Gitea was down: {e}\n{}",
            system.logs()
        );
    }
    let github_done = down.elapsed();
    reported_down(&system, "pod", "injected fault").await?;
    reported_down(&system, "vm", "injected fault").await?;
    let forge = system.forge.snapshot();
    anyhow::ensure!(
        forge.tasks.is_empty() && forge.runners.is_empty(),
        "the forge was down, yet {} tasks and {} runners",
        forge.tasks.len(),
        forge.runners.len()
    );
    // A minute of outage in all, then Gitea is back.
    if let Some(rest) = Duration::from_secs(60).checked_sub(down.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    anyhow::ensure!(
        system.scheduler.exited().is_none(),
        "the scheduler exited\n{}",
        system.logs()
    );
    system
        .forge
        .set_faults(jr_fake_forge::FaultConfig::default());
    let back = Instant::now();
    reported_up(&system, "pod").await?;
    reported_up(&system, "vm").await?;
    finish_and_check(&mut system, true).await?;
    println!(
        "Gitea down {:.0} s: 8 GitHub jobs final {:.1} s into it; Gitea's 5 jobs final {:.1} s after it was back",
        back.duration_since(down).as_secs_f64(),
        github_done.as_secs_f64(),
        back.elapsed().as_secs_f64()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gitea_jobs_run_while_github_refuses_the_token_and_github_jobs_run_once_it_accepts_it()
-> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        github: true,
        github_refuses_token: true,
        ..Default::default()
    })
    .await?;
    let refused = Instant::now();
    system.enqueue_github(4);
    let gitea_jobs = [
        system.enqueue_ids("pod", 4, &[("JR_FAKE_DURATION_MS", "200")]),
        system.enqueue_ids("vm", 3, &[("JR_FAKE_DURATION_MS", "200")]),
    ]
    .concat();
    if let Err(e) = system
        .wait_jobs_final(&gitea_jobs, Duration::from_secs(90))
        .await
    {
        anyhow::bail!(
            "Gitea jobs did not run while GitHub refused the token: {e}\n{}",
            system.logs()
        );
    }
    let gitea_done = refused.elapsed();
    reported_down(&system, "github.gh", "401").await?;
    // Twenty seconds of refusal in all (several retries), then the token is accepted again
    // (renewed at GitHub): the scale set is made and its jobs run.
    if let Some(rest) = Duration::from_secs(20).checked_sub(refused.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    let github = system.github.as_ref().expect("github");
    anyhow::ensure!(
        github.jobs().iter().all(|j| j.runner.is_none()),
        "a GitHub job got a runner while GitHub refused the token"
    );
    anyhow::ensure!(
        system.scheduler.exited().is_none(),
        "the scheduler exited\n{}",
        system.logs()
    );
    github.set_pat(GITHUB_PAT);
    let fixed = Instant::now();
    reported_up(&system, "github.gh").await?;
    finish_and_check(&mut system, true).await?;
    println!(
        "GitHub refused the token {:.0} s: 7 Gitea jobs final {:.1} s into it; 4 GitHub jobs final {:.1} s after the fix",
        fixed.duration_since(refused).as_secs_f64(),
        gitea_done.as_secs_f64(),
        fixed.elapsed().as_secs_f64()
    );
    Ok(())
}
