//! A real `nats-server` for tests (feature `testing`): own port, own store directory, hard kill
//! and restart on the same port and store. The binary is taken from `$NATS_SERVER_BIN` or `PATH`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

mod cluster;

pub use cluster::NatsCluster;

const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// The NATS a test system runs on: one server, or a three-node JetStream cluster.
pub enum TestNats {
    Single(NatsServer),
    Cluster(NatsCluster),
}

impl TestNats {
    /// The URL services are configured with: one server's, or every node's comma-separated.
    pub fn url(&self) -> String {
        match self {
            TestNats::Single(s) => s.url(),
            TestNats::Cluster(c) => c.urls(),
        }
    }

    /// The client port of the (first) server.
    pub fn port(&self) -> u16 {
        match self {
            TestNats::Single(s) => s.port(),
            TestNats::Cluster(c) => c.port(0),
        }
    }

    /// The process ids of the running servers (one, or every running node of the cluster).
    pub fn pids(&self) -> Vec<u32> {
        match self {
            TestNats::Single(s) => s.pid().into_iter().collect(),
            TestNats::Cluster(c) => (0..c.len()).filter_map(|i| c.pid(i)).collect(),
        }
    }

    /// The monitoring URL of the (first) server.
    pub fn monitor_url(&self) -> String {
        match self {
            TestNats::Single(s) => s.monitor_url(),
            TestNats::Cluster(c) => c.monitor_url(0),
        }
    }

    /// The monitoring URL of every server.
    pub fn monitor_urls(&self) -> Vec<String> {
        match self {
            TestNats::Single(s) => vec![s.monitor_url()],
            TestNats::Cluster(c) => (0..c.len()).map(|i| c.monitor_url(i)).collect(),
        }
    }

    /// Every server's log so far.
    pub fn log(&self) -> String {
        match self {
            TestNats::Single(s) => s.log(),
            TestNats::Cluster(c) => c.log(),
        }
    }

    /// SIGKILL of the server, or of every node of the cluster.
    pub fn kill(&mut self) {
        match self {
            TestNats::Single(s) => s.kill(),
            TestNats::Cluster(c) => (0..c.len()).for_each(|i| c.kill(i)),
        }
    }

    /// Starts what [`Self::kill`] stopped again, with the same ports and stores.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        match self {
            TestNats::Single(s) => s.restart().await,
            TestNats::Cluster(c) => {
                for i in 0..c.len() {
                    c.restart(i).await?;
                }
                c.wait_for_meta_leader(Duration::from_secs(30))
                    .await
                    .map(|_| ())
            }
        }
    }

    pub fn cluster(&self) -> Option<&NatsCluster> {
        match self {
            TestNats::Cluster(c) => Some(c),
            TestNats::Single(_) => None,
        }
    }

    pub fn cluster_mut(&mut self) -> Option<&mut NatsCluster> {
        match self {
            TestNats::Cluster(c) => Some(c),
            TestNats::Single(_) => None,
        }
    }
}

pub struct NatsServer {
    port: u16,
    monitor_port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// A configuration file (`-c`), when the server runs with users.
    config: Option<PathBuf>,
}

/// The service users a server started with [`NatsServer::start_with_users`] knows.
#[derive(Clone, Debug)]
pub struct ServiceUsers {
    /// `(role, password)` of every jetrunner service.
    pub services: Vec<(crate::permissions::Role, String)>,
    /// The full-rights user that connections without credentials are (`no_auth_user`): the
    /// test harness, fakes and inspections.
    pub admin: String,
}

impl ServiceUsers {
    /// The password of `role`'s user.
    pub fn password(&self, role: &crate::permissions::Role) -> Option<&str> {
        self.services
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, p)| p.as_str())
    }
}

fn random_password() -> String {
    use rand::Rng as _;
    let mut rng = rand::rng();
    (0..24)
        .map(|_| {
            let i = rng.random_range(0..36u8);
            char::from(if i < 10 { b'0' + i } else { b'a' + i - 10 })
        })
        .collect()
}

/// Fresh users for every service of a deployment with `backends` plus the full-rights `admin`
/// that connections without credentials are, and the server configuration text declaring them.
pub(crate) fn service_users(backends: &[jr_protocol::BackendName]) -> (ServiceUsers, String) {
    use crate::permissions::{NatsUser, Password, Role, authorization_block};
    let users = ServiceUsers {
        services: Role::all(backends)
            .into_iter()
            .map(|role| (role, random_password()))
            .collect(),
        admin: "admin".to_owned(),
    };
    let mut list: Vec<NatsUser> = users
        .services
        .iter()
        .map(|(role, password)| {
            NatsUser::service(role, backends, Password::Literal(password.clone()))
        })
        .collect();
    list.push(NatsUser {
        user: users.admin.clone(),
        password: Password::Literal(random_password()),
        permissions: None,
    });
    let text = format!(
        "{}no_auth_user: {}\n",
        authorization_block(&list),
        users.admin
    );
    (users, text)
}

pub(crate) fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub(crate) fn healthy(monitor_port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], monitor_port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let request = "GET /healthz?js-enabled-only=true HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.starts_with("HTTP/1.1 200") || response.starts_with("HTTP/1.0 200")
}

/// Starts `nats-server` (`NATS_SERVER_BIN`, else the one on `PATH`) with `args`, logging to `log`.
pub(crate) fn spawn_nats_server(
    args: &[std::ffi::OsString],
    log: &std::path::Path,
) -> std::io::Result<std::process::Child> {
    let binary: PathBuf = std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"));
    Command::new(&binary)
        .args(args)
        .arg("-l")
        .arg(log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| std::io::Error::new(e.kind(), format!("starting {}: {e}", binary.display())))
}

impl NatsServer {
    /// Starts a JetStream-enabled server on free ports with a fresh store and waits until
    /// JetStream answers.
    pub async fn start() -> std::io::Result<NatsServer> {
        Self::start_in(tempfile::tempdir()?, None).await
    }

    /// Starts a server in `dir`, on fresh ports each try: a port found free can be taken by
    /// another process (a parallel test's server, say) before this server binds it, so a
    /// server that does not come up is tried again on other ports, up to three times.
    async fn start_in(
        dir: tempfile::TempDir,
        config: Option<PathBuf>,
    ) -> std::io::Result<NatsServer> {
        let mut server = NatsServer {
            port: 0,
            monitor_port: 0,
            dir,
            child: None,
            config,
        };
        let mut tries = 0;
        loop {
            tries += 1;
            server.port = free_port()?;
            server.monitor_port = free_port()?;
            if server.monitor_port == server.port {
                continue;
            }
            match server.spawn().await {
                Ok(()) => return Ok(server),
                Err(e) if tries >= 3 => return Err(e),
                Err(e) => eprintln!("nats-server did not start ({e}); trying other ports"),
            }
        }
    }

    /// Starts a server whose clients must be one of the jetrunner service users of a
    /// deployment with `backends`, each limited to its subjects
    /// ([`crate::permissions::permissions`], fresh random passwords), or the full-rights user
    /// `admin`, which every connection without credentials is. Permission violations are
    /// written to the server log ([`Self::log`]).
    pub async fn start_with_users(
        backends: &[jr_protocol::BackendName],
    ) -> std::io::Result<(NatsServer, ServiceUsers)> {
        let (users, text) = service_users(backends);
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("nats.conf");
        std::fs::write(&config, text)?;
        let server = Self::start_in(dir, Some(config)).await?;
        Ok((server, users))
    }

    /// The server's log so far (permission violations are logged as `Permissions Violation`).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nats.log")).unwrap_or_default()
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:<monitor port>` (for `/jsz?consumers=true`).
    pub fn monitor_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.monitor_port)
    }

    pub fn store_dir(&self) -> &Path {
        self.dir.path()
    }

    /// SIGKILL: no lame-duck mode, no flush; what a crashed node looks like.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port with the same store (after [`Self::kill`]).
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.kill();
        self.spawn().await
    }

    /// The process id of the server while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    async fn spawn(&mut self) -> std::io::Result<()> {
        let store = self.dir.path().join("jetstream");
        let log = self.dir.path().join("nats.log");
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        // The port may linger briefly after a kill; retry the spawn until it binds.
        loop {
            let mut args: Vec<std::ffi::OsString> = Vec::new();
            if let Some(config) = &self.config {
                args.extend(["-c".into(), config.into()]);
            }
            args.extend(
                ["-js", "-a", "127.0.0.1", "-p", &self.port.to_string()]
                    .map(std::ffi::OsString::from),
            );
            args.extend(["-m".into(), self.monitor_port.to_string().into()]);
            args.extend(["-sd".into(), store.clone().into()]);
            let mut child = spawn_nats_server(&args, &log)?;
            loop {
                if healthy(self.monitor_port) {
                    self.child = Some(child);
                    return Ok(());
                }
                if let Ok(Some(_exited)) = child.try_wait() {
                    break;
                }
                if tokio::time::Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("nats-server not ready; see {}", log.display()),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(std::io::Error::other(format!(
                    "nats-server keeps exiting; see {}",
                    log.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}
