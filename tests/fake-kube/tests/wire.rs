//! The fake API server's HTTP behaviour, checked on the wire.

use std::time::Duration;

use jr_fake_kube::{FakeKube, SimConfig};
use serde_json::{Value, json};

fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

fn pod(name: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "jetrunner", "team": "a"}},
           "spec": {"containers": [{"name": "c", "image": "x"}]}})
}

#[tokio::test]
async fn create_conflict_and_missing_objects_answer_with_status_bodies() {
    let kube = FakeKube::start(SimConfig::passive())
        .await
        .expect("fake kube");
    let http = http();
    let pods = format!("{}/api/v1/namespaces/ns/pods", kube.url());
    let created = http
        .post(&pods)
        .json(&pod("p1"))
        .send()
        .await
        .expect("create");
    assert_eq!(created.status(), 201);
    let again = http
        .post(&pods)
        .json(&pod("p1"))
        .send()
        .await
        .expect("create again");
    assert_eq!(again.status(), 409);
    let status: Value = again.json().await.expect("status body");
    assert_eq!(
        (status["kind"].as_str(), status["reason"].as_str()),
        (Some("Status"), Some("AlreadyExists"))
    );

    let missing = http
        .delete(format!("{pods}/nope"))
        .send()
        .await
        .expect("delete");
    assert_eq!(missing.status(), 404);
    let status: Value = missing.json().await.expect("status body");
    assert_eq!(status["reason"], "NotFound");

    kube.set_unavailable(true);
    let down = http.get(&pods).send().await.expect("list during outage");
    assert_eq!(down.status(), 503);
    kube.set_unavailable(false);

    let deleted = http
        .delete(format!("{pods}/p1"))
        .send()
        .await
        .expect("delete");
    assert_eq!(deleted.status(), 200);
    let records = kube.records();
    assert_eq!(
        (records.created.len(), records.live, records.max_live),
        (1, 0, 1)
    );
}

#[tokio::test]
async fn list_filters_by_label_selector_and_reports_the_resource_version() {
    let kube = FakeKube::start(SimConfig::passive())
        .await
        .expect("fake kube");
    kube.create_pod("ns", pod("a")).expect("a");
    kube.create_pod("ns", json!({"metadata": {"name": "b", "labels": {"team": "b"}}, "spec": {"containers": [{"name": "c"}]}}))
        .expect("b");
    kube.create_pod("other", pod("c")).expect("c");
    let list: Value = http()
        .get(format!("{}/api/v1/namespaces/ns/pods?labelSelector=team%3Da,app.kubernetes.io/managed-by%3Djetrunner", kube.url()))
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("list body");
    let names: Vec<&str> = list["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, vec!["a"]);
    assert_eq!(
        list["metadata"]["resourceVersion"],
        json!(kube.resource_version().to_string())
    );
}

async fn get_json(url: String) -> (u16, Value) {
    let answer = http().get(url).send().await.expect("request");
    let status = answer.status().as_u16();
    (status, answer.json().await.expect("JSON body"))
}

#[tokio::test]
async fn lists_are_paginated_with_limit_and_continue() {
    let kube = FakeKube::start(SimConfig {
        watch_history: 2,
        ..SimConfig::passive()
    })
    .await
    .expect("fake kube");
    for name in ["a", "b", "c", "d", "e"] {
        kube.create_pod("ns", pod(name)).expect("pod");
    }
    let base = format!(
        "{}/api/v1/namespaces/ns/pods?labelSelector=team%3Da",
        kube.url()
    );
    let (mut names, mut token, mut pages) = (Vec::new(), None::<String>, 0);
    loop {
        let url = match &token {
            Some(t) => format!("{base}&limit=2&continue={t}"),
            None => format!("{base}&limit=2"),
        };
        let (status, list) = get_json(url).await;
        assert_eq!(status, 200, "{list}");
        pages += 1;
        let items = list["items"].as_array().expect("items");
        assert!(items.len() <= 2, "a page holds at most `limit` items");
        names.extend(
            items
                .iter()
                .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned)),
        );
        match list["metadata"]["continue"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => break,
        }
    }
    assert_eq!(names, ["a", "b", "c", "d", "e"]);
    assert_eq!(pages, 3);

    // A token from before the compacted history is refused; the client must start over.
    let (_, first) = get_json(format!("{base}&limit=2")).await;
    let stale = first["metadata"]["continue"]
        .as_str()
        .expect("more pages")
        .to_owned();
    for name in ["f", "g", "h"] {
        kube.create_pod("ns", pod(name)).expect("pod");
    }
    let (status, body) = get_json(format!("{base}&limit=2&continue={stale}")).await;
    assert_eq!((status, body["reason"].as_str()), (410, Some("Expired")));
    let (status, _) = get_json(format!("{base}&limit=2&continue=not-a-token")).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn watch_replays_events_after_the_given_version_and_ends_at_its_timeout() {
    let kube = FakeKube::start(SimConfig::passive())
        .await
        .expect("fake kube");
    kube.create_pod("ns", pod("early")).expect("early");
    let since = kube.resource_version();
    kube.create_pod("ns", pod("late")).expect("late");
    kube.mark_running("ns", "late").expect("running");
    kube.delete_pod("ns", "early").expect("delete");

    let url = format!(
        "{}/api/v1/namespaces/ns/pods?watch=true&resourceVersion={since}&timeoutSeconds=1",
        kube.url()
    );
    let body = tokio::time::timeout(Duration::from_secs(10), async {
        http()
            .get(url)
            .send()
            .await
            .expect("watch")
            .text()
            .await
            .expect("watch body")
    })
    .await
    .expect("the watch ends after timeoutSeconds");
    let events: Vec<(String, String)> = body
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("one JSON event per line"))
        .map(|e| {
            (
                e["type"].as_str().unwrap_or_default().to_owned(),
                e["object"]["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect();
    let expected = [
        ("ADDED", "late"),
        ("MODIFIED", "late"),
        ("DELETED", "early"),
    ];
    assert_eq!(
        events,
        expected.map(|(t, n)| (t.to_owned(), n.to_owned())).to_vec()
    );
}

#[tokio::test]
async fn a_watch_from_a_compacted_version_is_410_gone() {
    let kube = FakeKube::start(SimConfig {
        watch_history: 2,
        ..SimConfig::passive()
    })
    .await
    .expect("fake kube");
    kube.create_pod("ns", pod("first")).expect("pod");
    let since = kube.resource_version();
    for name in ["a", "b", "c", "d"] {
        kube.create_pod("ns", pod(name)).expect("pod");
    }
    let url = format!(
        "{}/api/v1/namespaces/ns/pods?watch=true&resourceVersion={since}&timeoutSeconds=1",
        kube.url()
    );
    let answer = http().get(url).send().await.expect("watch");
    assert_eq!(answer.status(), 410);
    let status: Value = answer.json().await.expect("status body");
    assert_eq!(status["reason"], "Expired");
    assert_eq!(status["code"], 410);

    // A recent version still replays.
    let recent = kube.resource_version() - 1;
    let url = format!(
        "{}/api/v1/namespaces/ns/pods?watch=true&resourceVersion={recent}&timeoutSeconds=1",
        kube.url()
    );
    let body = http()
        .get(url)
        .send()
        .await
        .expect("watch")
        .text()
        .await
        .expect("body");
    assert_eq!(body.lines().count(), 1, "{body}");
}

#[tokio::test]
async fn records_count_jetrunner_secrets_and_remember_faulted_pods() {
    let kube = FakeKube::start(SimConfig::passive())
        .await
        .expect("fake kube");
    kube.create_pod("ns", pod("a")).expect("a");
    kube.create_pod("ns", pod("b")).expect("b");
    kube.create_secret(
        "ns",
        json!({"metadata": {"name": "s1", "labels": {"app.kubernetes.io/managed-by": "jetrunner"}},
               "stringData": {"token": "t"}}),
    )
    .expect("jetrunner secret");
    kube.create_secret(
        "ns",
        json!({"metadata": {"name": "s2"}, "stringData": {"other": "x"}}),
    )
    .expect("foreign secret");
    assert_eq!(kube.records().secrets, 1, "only jetrunner's Secrets count");
    assert!(kube.faulted_pods().is_empty());
    kube.evict("ns", "b").expect("evict");
    kube.mark_failed_before_start("ns", "a").expect("fail");
    assert_eq!(
        kube.faulted_pods(),
        vec![
            ("ns/b".to_owned(), "evict"),
            ("ns/a".to_owned(), "fail-before-start")
        ]
    );
}

#[tokio::test]
async fn a_pod_quota_refuses_creates_beyond_it_until_a_pod_finishes() {
    let kube = FakeKube::start(SimConfig::passive())
        .await
        .expect("fake kube");
    kube.set_pod_quota("ns", Some(2));
    let http = http();
    let pods = format!("{}/api/v1/namespaces/ns/pods", kube.url());
    for name in ["q1", "q2"] {
        let created = http
            .post(&pods)
            .json(&pod(name))
            .send()
            .await
            .expect("create");
        assert_eq!(created.status(), 201);
    }
    let refused = http
        .post(&pods)
        .json(&pod("q3"))
        .send()
        .await
        .expect("create");
    assert_eq!(refused.status(), 403);
    let status: Value = refused.json().await.expect("status body");
    assert!(
        status["message"]
            .as_str()
            .is_some_and(|m| m.contains("exceeded quota")),
        "{status}"
    );
    // Other namespaces are not limited; a finished Pod no longer counts.
    kube.create_pod("other", pod("q4"))
        .expect("other namespace");
    kube.mark_exited(
        "ns",
        "q1",
        &jr_fake_kube::ExitStatus {
            exit_code: 0,
            reason: None,
        },
    )
    .expect("q1 exits");
    let created = http
        .post(&pods)
        .json(&pod("q3"))
        .send()
        .await
        .expect("create");
    assert_eq!(created.status(), 201);
}
