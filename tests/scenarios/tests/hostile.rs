//! The running system against a publisher with full NATS rights (what a leaked admin credential
//! gives; the services' own users cannot do any of this, see jr-bus's permission test): every
//! check below is made by the service that owns the secret or executes the decision, so none of
//! the forged messages changes a forge task, opens a task, deletes a foreign Pod or stops the
//! projection, and no job secret ever travels on NATS.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use jr_fake_forge::{JobSpec, Outcome, Status};
use jr_forge::proto::runner::v1::FetchTaskRequest;
use jr_forge::{Code, Credentials, ForgeClient};
use jr_protocol::{
    AssignmentId, BackendName, DeleteWorkload, Envelope, FailTask, Kind, Message, WorkloadCreated,
    subject,
};
use jr_scenarios::{System, SystemSpec};

const SECRET: &str = "s3cr3t-value-that-must-never-reach-nats-7f3a";

async fn publish(client: &jr_bus::async_nats::Client, subject: String, envelope: &Envelope) {
    let bytes = jr_protocol::encode(envelope);
    let js = jr_bus::async_nats::jetstream::new(client.clone());
    js.publish(subject, bytes.into())
        .await
        .expect("publish")
        .await
        .expect("stored");
}

async fn publish_raw(client: &jr_bus::async_nats::Client, subject: String, bytes: Vec<u8>) {
    let js = jr_bus::async_nats::jetstream::new(client.clone());
    js.publish(subject, bytes.into())
        .await
        .expect("publish")
        .await
        .expect("stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_messages_change_nothing_and_secrets_never_reach_nats() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 2,
        vm_capacity: 1,
        vm_pool: Some(2),
        ..Default::default()
    })
    .await?;
    let attacker = jr_bus::async_nats::connect(system.nats.url()).await?;

    // Every message on the bus, to search for the secret afterwards.
    let seen: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    {
        let mut all = attacker.subscribe(">").await?;
        let sink = seen.clone();
        tokio::spawn(async move {
            while let Some(m) = all.next().await {
                if let Ok(mut v) = sink.lock() {
                    v.push(m.payload.to_vec());
                }
            }
        });
    }
    let assignments = {
        let mut sub = attacker.subscribe("jr.assignment.>").await?;
        let ids: Arc<Mutex<Vec<(AssignmentId, i64)>>> = Arc::default();
        let sink = ids.clone();
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                if let Ok(e) = jr_protocol::decode(&m.payload)
                    && let Message::Assignment(a) = e.message
                    && let Ok(mut v) = sink.lock()
                {
                    v.push((e.assignment_id, a.forge_task_id));
                }
            }
        });
        ids
    };

    let spec = |name: &str, ms: &str| JobSpec {
        repo: "acme/widgets".into(),
        name: name.into(),
        runs_on: vec!["pod".into()],
        vars: [("JR_FAKE_DURATION_MS".to_owned(), ms.to_owned())].into(),
        secrets: [("DEPLOY_KEY".to_owned(), SECRET.to_owned())].into(),
        steps: 2,
        pull_request_from_fork: None,
    };
    let long = system.forge.enqueue_jobs(spec("long", "4000"), 2);
    let pod = BackendName::new("pod")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let victims = loop {
        let v = assignments.lock().map(|v| v.clone()).unwrap_or_default();
        if v.len() >= 2 {
            break v;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no assignments published"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (victim, victim_task) = victims[0];

    // 1. A planted token hash opens nothing: the facade recomputes the executor token.
    let forged_created = Envelope::new(
        format!("forged:{victim}"),
        jr_protocol::now_ms(),
        victim,
        1,
        Message::WorkloadCreated(WorkloadCreated {
            backend: pod.clone(),
            workload: format!("jr-{victim}-1"),
            token_hash: jr_worker::token_hash("attacker-token"),
            worker_id: "attacker".into(),
            warm: None,
        }),
    );
    publish(
        &attacker,
        subject::event(&pod, victim, Kind::WorkloadCreated),
        &forged_created,
    )
    .await;
    let thief = ForgeClient::new(
        &format!("http://127.0.0.1:{}", system.ports.facade),
        Some(Credentials {
            uuid: victim.to_string(),
            token: "attacker-token".into(),
        }),
        Duration::from_secs(10),
    )?;
    let stolen = thief
        .fetch_task(&FetchTaskRequest {
            tasks_version: 0,
            ..Default::default()
        })
        .await;
    assert_eq!(
        stolen.as_ref().err().and_then(|e| e.code()),
        Some(Code::Unauthenticated),
        "{stolen:?}"
    );

    // 2. A forged fail-task for a real forge task (not the scheduler's decision).
    let forged_fail = Envelope::new(
        format!("forged-fail:{victim}"),
        jr_protocol::now_ms(),
        victim,
        1,
        Message::FailTask(FailTask {
            forge_task_id: victim_task + 1000,
            backend: pod.clone(),
            reason: "attacker says so".into(),
        }),
    );
    publish(
        &attacker,
        subject::command(subject::SCHEDULER_TARGET, Kind::FailTask),
        &forged_fail,
    )
    .await;

    // 3. A delete-workload naming a Pod that is not jetrunner's.
    let namespace = jr_scenarios::system::JOBS_NAMESPACE;
    system.kube.create_pod(
        namespace,
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "payroll-db", "namespace": namespace},
            "spec": {"containers": [{"name": "db", "image": "postgres"}]}
        }),
    )?;
    let forged_delete = Envelope::new(
        "forged-delete:payroll-db",
        jr_protocol::now_ms(),
        victim,
        1,
        Message::DeleteWorkload(DeleteWorkload {
            backend: pod.clone(),
            workload: "payroll-db".into(),
            reason: "attacker".into(),
        }),
    );
    publish(
        &attacker,
        subject::command("pod", Kind::DeleteWorkload),
        &forged_delete,
    )
    .await;

    // 4. Poison for the projection: garbage, and a message with a NUL byte.
    let stray = AssignmentId::for_task("https://elsewhere", 1);
    publish_raw(
        &attacker,
        subject::event(&pod, stray, Kind::WorkloadObserved),
        b"\x00\xffnot cbor".to_vec(),
    )
    .await;
    let mut nul = forged_created.clone();
    nul.id = "nul".into();
    if let Message::WorkloadCreated(c) = &mut nul.message {
        c.worker_id = "evil\u{0}worker".into();
    }
    publish_raw(
        &attacker,
        subject::event(&pod, stray, Kind::WorkloadCreated),
        jr_protocol::encode(&nul),
    )
    .await;

    // 5. Garbage as the last message on a live assignment's subject.
    let (second, _) = victims[1];
    publish_raw(
        &attacker,
        subject::assignment(&pod, second),
        b"garbage".to_vec(),
    )
    .await;

    // More jobs after the attacks: everything still flows.
    let later = system.forge.enqueue_jobs(spec("later", "200"), 3);
    if let Err(e) = system.wait_all_final(Duration::from_secs(120)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let snapshot = system.forge.snapshot();
    for job in long.iter().chain(&later) {
        let view = snapshot.job(*job).expect("job");
        assert_eq!(
            view.status,
            Status::Done(Outcome::Success),
            "job {job:?} ended {:?}",
            view.status
        );
    }
    assert!(
        snapshot
            .tasks
            .iter()
            .all(|t| t.log.iter().all(|l| !l.contains("attacker"))),
        "a forged reason reached a job log"
    );
    assert!(
        system.kube.pod(namespace, "payroll-db").is_some(),
        "a Pod that is not jetrunner's was deleted"
    );
    let quarantine: serde_json::Value = reqwest::get(format!(
        "http://127.0.0.1:{}/api/quarantine",
        system.ports.status
    ))
    .await?
    .json()
    .await?;
    let count = quarantine["count"].as_u64().unwrap_or(0);
    println!("quarantined poison messages: {count}");
    assert!(count >= 2, "poison quarantined: {quarantine}");

    system.wait_no_workloads(Duration::from_secs(60)).await?;
    let leaked: Vec<usize> = seen
        .lock()
        .map(|v| {
            v.iter()
                .enumerate()
                .filter(|(_, m)| m.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()))
                .map(|(i, _)| i)
                .collect()
        })
        .unwrap_or_default();
    let total = seen.lock().map(|v| v.len()).unwrap_or(0);
    println!("NATS messages searched for the job secret: {total}");
    assert!(total > 50, "the bus was observed");
    assert!(leaked.is_empty(), "the job secret travelled on NATS");
    Ok(())
}
