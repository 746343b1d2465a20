//! A three-node JetStream cluster on loopback for tests: every node with its own client,
//! monitoring and route ports and its own store; SIGKILL, restart, SIGSTOP and SIGCONT per node;
//! the current meta, stream and consumer leaders as the nodes' `/jsz` reports them.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use super::{ServiceUsers, free_port, healthy, service_users};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const CLUSTER_NAME: &str = "jr-test";

struct Node {
    name: String,
    port: u16,
    monitor_port: u16,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    paused: bool,
}

/// A JetStream cluster of three `nats-server` processes that know the jetrunner service users
/// (as [`super::NatsServer::start_with_users`]).
pub struct NatsCluster {
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

/// The body of `GET path` from the monitoring port, if the node answers.
fn http_get(port: u16, path: &str) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(300)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.contains(" 200 ").then(|| body.to_owned())
}

impl NatsCluster {
    /// Starts three nodes routed to each other with JetStream on every one, waits until each
    /// answers and a meta leader is elected.
    pub async fn start_with_users(
        backends: &[jr_protocol::BackendName],
    ) -> std::io::Result<(NatsCluster, ServiceUsers)> {
        let (users, auth) = service_users(backends);
        let dir = tempfile::tempdir()?;
        let mut ports = Vec::new();
        for _ in 0..3 {
            ports.push((free_port()?, free_port()?, free_port()?));
        }
        let routes: Vec<String> = ports
            .iter()
            .map(|(_, _, route)| format!("nats-route://127.0.0.1:{route}"))
            .collect();
        let mut nodes = Vec::new();
        for (i, (port, monitor_port, route_port)) in ports.iter().enumerate() {
            let name = format!("n{i}");
            let store = dir.path().join(format!("{name}-store"));
            let config = dir.path().join(format!("{name}.conf"));
            let log = dir.path().join(format!("{name}.log"));
            let text = format!(
                "server_name: {name}\nlisten: \"127.0.0.1:{port}\"\nhttp: \"127.0.0.1:{monitor_port}\"\n\
                 jetstream {{ store_dir: \"{}\" }}\n\
                 cluster {{ name: {CLUSTER_NAME}, listen: \"127.0.0.1:{route_port}\", routes: [{}] }}\n{auth}",
                store.display(),
                routes.join(", ")
            );
            std::fs::write(&config, text)?;
            nodes.push(Node {
                name,
                port: *port,
                monitor_port: *monitor_port,
                config,
                log,
                child: None,
                paused: false,
            });
        }
        let mut cluster = NatsCluster { nodes, _dir: dir };
        for i in 0..cluster.nodes.len() {
            cluster.spawn(i)?;
        }
        for i in 0..cluster.nodes.len() {
            cluster.wait_healthy(i).await?;
        }
        cluster.wait_for_meta_leader(READY_TIMEOUT).await?;
        Ok((cluster, users))
    }

    /// Every node's client URL, comma-separated (as the services' `nats.url` takes them).
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn url(&self, node: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[node].port)
    }

    pub fn port(&self, node: usize) -> u16 {
        self.nodes[node].port
    }

    pub fn monitor_url(&self, node: usize) -> String {
        format!("http://127.0.0.1:{}", self.nodes[node].monitor_port)
    }

    /// The process id of the node's server while it runs.
    pub fn pid(&self, node: usize) -> Option<u32> {
        self.nodes[node].child.as_ref().map(Child::id)
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// `n<i>`: the node's `server_name`.
    pub fn name(&self, node: usize) -> &str {
        &self.nodes[node].name
    }

    /// Every node's log so far, each under a `== n<i> ==` line.
    pub fn log(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                format!(
                    "== {} ==\n{}",
                    n.name,
                    std::fs::read_to_string(&n.log).unwrap_or_default()
                )
            })
            .collect()
    }

    /// `/jsz` with account, stream and consumer details from every node that answers.
    fn jsz_all(&self) -> Vec<serde_json::Value> {
        self.jsz_by_node().into_iter().map(|(_, jsz)| jsz).collect()
    }

    /// `/jsz` of every running node that answers, with the node's index.
    fn jsz_by_node(&self) -> Vec<(usize, serde_json::Value)> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.child.is_some() && !n.paused)
            .filter_map(|(i, n)| {
                http_get(
                    n.monitor_port,
                    "/jsz?accounts=true&streams=true&consumers=true",
                )
                .map(|body| (i, body))
            })
            .filter_map(|(i, body)| serde_json::from_str(&body).ok().map(|jsz| (i, jsz)))
            .collect()
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// The node that is the JetStream meta leader, as a running node reports it.
    pub fn meta_leader(&self) -> Option<usize> {
        self.jsz_all().iter().find_map(|jsz| {
            jsz["meta_cluster"]["leader"]
                .as_str()
                .and_then(|name| self.index_of(name))
        })
    }

    /// The node that leads `stream`.
    pub fn stream_leader(&self, stream: &str) -> Option<usize> {
        self.jsz_all().iter().find_map(|jsz| {
            streams(jsz)
                .find(|s| s["name"].as_str() == Some(stream))
                .and_then(|s| s["cluster"]["leader"].as_str().map(str::to_owned))
                .and_then(|name| self.index_of(&name))
        })
    }

    /// The node that leads the durable `consumer` of `stream`.
    pub fn consumer_leader(&self, stream: &str, consumer: &str) -> Option<usize> {
        self.jsz_all().iter().find_map(|jsz| {
            streams(jsz)
                .filter(|s| s["name"].as_str() == Some(stream))
                .flat_map(|s| s["consumer_detail"].as_array().cloned().unwrap_or_default())
                .find(|c| c["name"].as_str() == Some(consumer))
                .and_then(|c| c["cluster"]["leader"].as_str().map(str::to_owned))
                .and_then(|name| self.index_of(&name))
        })
    }

    /// Every raft group as each running node reports it: the reporting node, the group's name
    /// (`meta`, `stream <name>` — KV buckets are streams `KV_<bucket>` — and
    /// `consumer <stream>/<name>`) and that node's cluster info for it (`leader`, `replicas`).
    fn raft_groups(&self) -> Vec<(usize, String, serde_json::Value)> {
        let mut groups = Vec::new();
        for (node, jsz) in self.jsz_by_node() {
            groups.push((node, "meta".to_owned(), jsz["meta_cluster"].clone()));
            for stream in streams(&jsz) {
                let Some(name) = stream["name"].as_str() else {
                    continue;
                };
                groups.push((node, format!("stream {name}"), stream["cluster"].clone()));
                for consumer in stream["consumer_detail"].as_array().into_iter().flatten() {
                    if let Some(durable) = consumer["name"].as_str() {
                        groups.push((
                            node,
                            format!("consumer {name}/{durable}"),
                            consumer["cluster"].clone(),
                        ));
                    }
                }
            }
        }
        groups
    }

    /// Every raft group's leader (see [`Self::raft_groups`]), mapped to the set of nodes named
    /// as its leader (empty where no answering node knows one).
    pub fn raft_leaders(&self) -> BTreeMap<String, BTreeSet<usize>> {
        self.leaders_of(&self.raft_groups())
    }

    fn leaders_of(
        &self,
        groups: &[(usize, String, serde_json::Value)],
    ) -> BTreeMap<String, BTreeSet<usize>> {
        let mut leaders: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
        for (_, group, cluster) in groups {
            let entry = leaders.entry(group.clone()).or_default();
            if let Some(node) = cluster["leader"].as_str().and_then(|n| self.index_of(n)) {
                entry.insert(node);
            }
        }
        leaders
    }

    /// The replicated raft groups `node` leads now (see [`Self::raft_leaders`]): `meta` and
    /// every stream and consumer some answering node lists with peers. Groups of one replica
    /// (ordered consumers, ephemeral pull consumers) are left out: there is no peer to elect,
    /// so they end with their node and are made anew elsewhere, under another name.
    pub fn led_by(&self, node: usize) -> BTreeSet<String> {
        let groups = self.raft_groups();
        let replicated: BTreeSet<String> = groups
            .iter()
            .filter(|(_, group, cluster)| {
                group == "meta"
                    || cluster["replicas"]
                        .as_array()
                        .is_some_and(|replicas| !replicas.is_empty())
            })
            .map(|(_, group, _)| group.clone())
            .collect();
        self.leaders_of(&groups)
            .into_iter()
            .filter(|(group, leaders)| leaders.contains(&node) && replicated.contains(group))
            .map(|(group, _)| group)
            .collect()
    }

    /// Whether every group of `groups` has a new leader: a running node other than `old` that
    /// names itself the group's leader.
    pub fn all_led_elsewhere(&self, groups: &BTreeSet<String>, old: usize) -> bool {
        self.not_led_elsewhere(groups, old).is_empty()
    }

    /// The groups of `groups` that do not have such a leader yet. Only a leader's own word
    /// counts: a follower that has not heard from the new leader yet still names the old one
    /// (seen for a minute on a node restarted by an earlier fault, while the cluster served).
    pub fn not_led_elsewhere(&self, groups: &BTreeSet<String>, old: usize) -> Vec<String> {
        let mut self_led: BTreeSet<String> = BTreeSet::new();
        for (node, group, cluster) in self.raft_groups() {
            if node != old
                && cluster["leader"].as_str().and_then(|n| self.index_of(n)) == Some(node)
            {
                self_led.insert(group);
            }
        }
        groups
            .iter()
            .filter(|group| !self_led.contains(*group))
            .cloned()
            .collect()
    }

    /// Waits until a meta leader is known; returns it.
    pub async fn wait_for_meta_leader(&self, timeout: Duration) -> std::io::Result<usize> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(leader) = self.meta_leader() {
                return Ok(leader);
            }
            if tokio::time::Instant::now() > deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no JetStream meta leader within {timeout:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `stream` has a leader other than `not` (a new one after a fault); returns it.
    pub async fn wait_for_stream_leader(
        &self,
        stream: &str,
        not: Option<usize>,
        timeout: Duration,
    ) -> std::io::Result<usize> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.stream_leader(stream) {
                Some(leader) if Some(leader) != not => return Ok(leader),
                _ => {}
            }
            if tokio::time::Instant::now() > deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("stream {stream} has no new leader within {timeout:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILL of one node: what a crashed node looks like.
    pub fn kill(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        if let Some(mut child) = n.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        n.paused = false;
    }

    /// Starts a killed node again with its store and waits until it answers.
    pub async fn restart(&mut self, node: usize) -> std::io::Result<()> {
        self.kill(node);
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            self.spawn(node)?;
            match self.wait_healthy(node).await {
                Ok(()) => return Ok(()),
                // The ports may linger briefly after a kill.
                Err(e) if tokio::time::Instant::now() > deadline => return Err(e),
                Err(_) => {
                    self.kill(node);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// SIGSTOP: the node keeps its sockets open but answers nothing, as in a long GC pause or
    /// a partition that leaves connections up.
    pub fn pause(&mut self, node: usize) -> std::io::Result<()> {
        self.signal(node, "-STOP")?;
        self.nodes[node].paused = true;
        Ok(())
    }

    /// SIGCONT after [`Self::pause`].
    pub fn resume(&mut self, node: usize) -> std::io::Result<()> {
        self.signal(node, "-CONT")?;
        self.nodes[node].paused = false;
        Ok(())
    }

    fn signal(&self, node: usize, signal: &str) -> std::io::Result<()> {
        let Some(child) = &self.nodes[node].child else {
            return Err(std::io::Error::other(format!(
                "node {} is not running",
                self.nodes[node].name
            )));
        };
        let status = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "kill {signal} {} failed",
                child.id()
            )))
        }
    }

    fn spawn(&mut self, node: usize) -> std::io::Result<()> {
        let n = &mut self.nodes[node];
        let child = super::spawn_nats_server(&["-c".into(), n.config.clone().into()], &n.log)?;
        n.child = Some(child);
        n.paused = false;
        Ok(())
    }

    async fn wait_healthy(&mut self, node: usize) -> std::io::Result<()> {
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            let n = &mut self.nodes[node];
            if healthy(n.monitor_port) {
                return Ok(());
            }
            let exited = n
                .child
                .as_mut()
                .is_none_or(|c| matches!(c.try_wait(), Ok(Some(_))));
            if exited || tokio::time::Instant::now() > deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("nats-server {} not ready; see {}", n.name, n.log.display()),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn streams(jsz: &serde_json::Value) -> impl Iterator<Item = serde_json::Value> + '_ {
    jsz["account_details"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|a| a["stream_detail"].as_array().cloned().unwrap_or_default())
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}
