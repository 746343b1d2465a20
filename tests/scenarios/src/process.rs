//! jetrunner's service binaries run as real processes: spawned with a generated config, waited
//! on through `/readyz`, killed with SIGKILL and restarted.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

/// The directory holding the workspace's binaries (`target/<profile>`), found from the running
/// test or tool executable; `JR_BIN_DIR` overrides it.
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("JR_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe()?;
    let mut dir = exe
        .parent()
        .context("executable has no directory")?
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    Ok(dir)
}

pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let path = bin_dir()?.join(name);
    if !path.exists() {
        bail!(
            "{} not built: run `cargo build --workspace --bins` first",
            path.display()
        );
    }
    Ok(path)
}

pub struct ServiceProcess {
    pub name: String,
    binary: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    pub ops_port: u16,
    child: Option<Child>,
    pub restarts: u32,
}

impl ServiceProcess {
    pub fn new(
        name: &str,
        binary: PathBuf,
        args: Vec<String>,
        log_dir: &Path,
        ops_port: u16,
    ) -> Self {
        Self {
            name: name.to_owned(),
            binary,
            args,
            env: vec![("RUST_LOG".into(), "info".into())],
            log: log_dir.join(format!("{name}.log")),
            ops_port,
            child: None,
            restarts: 0,
        }
    }

    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Drops `key` from the environment of the next spawn.
    pub fn remove_env(&mut self, key: &str) {
        self.env.retain(|(k, _)| k != key);
    }

    pub fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(&self.binary)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", self.binary.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL, as a crash or an OOM kill would.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill9();
        self.restarts += 1;
        self.spawn()
    }

    /// Exit status if the process has ended on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    pub async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let url = format!("http://127.0.0.1:{}/readyz", self.ops_port);
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                bail!(
                    "{} exited with {status} before it was ready:\n{}",
                    self.name,
                    self.log_tail(40)
                );
            }
            if let Ok(r) = client.get(&url).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "{} not ready after {timeout:?}:\n{}",
                    self.name,
                    self.log_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// OS process id while running (for CPU and memory figures from /proc).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A port for a service to listen on later. Taken below the kernel's ephemeral range
/// (32768–60999 by default), in sequence from a random start: a port the OS hands out for
/// `bind(0)` — to the fakes, which start after the ports are chosen — is never one of these,
/// and two calls in one process never return the same port.
pub fn free_port() -> anyhow::Result<u16> {
    use std::sync::atomic::{AtomicU16, Ordering};
    const FIRST: u16 = 20_000;
    const SPAN: u16 = 12_000;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    if NEXT.load(Ordering::Relaxed) == 0 {
        let start = FIRST + rand::random::<u16>() % SPAN;
        let _ = NEXT.compare_exchange(0, start, Ordering::Relaxed, Ordering::Relaxed);
    }
    for _ in 0..SPAN {
        let candidate = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + candidate.wrapping_sub(FIRST) % SPAN;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no free port between {FIRST} and {}", FIRST + SPAN)
}
