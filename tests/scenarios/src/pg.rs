//! PostgreSQL for scenarios: an own throw-away cluster (initdb under a temp dir) that a scenario
//! may kill and restart, started as the `postgres` user when running as root.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

pub struct PgCluster {
    dir: tempfile::TempDir,
    port: u16,
    bin: PathBuf,
    running: bool,
}

fn pg_bin() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<PathBuf> = std::fs::read_dir(root)
        .with_context(|| format!("no PostgreSQL server binaries under {}", root.display()))?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .context("no initdb found; install postgresql or set PG_BIN")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0"))
        .unwrap_or(false)
}

/// Runs a PostgreSQL tool, as the `postgres` user when we are root (initdb refuses root).
fn run_pg(bin: &Path, tool: &str, args: &[String]) -> anyhow::Result<()> {
    let exe = bin.join(tool);
    let status = if is_root() {
        let mut line = shell_quote(&exe.display().to_string());
        for a in args {
            line.push(' ');
            line.push_str(&shell_quote(a));
        }
        Command::new("su")
            .args(["postgres", "-s", "/bin/sh", "-c", &line])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()?
    } else {
        Command::new(&exe)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()?
    };
    if !status.status.success() {
        bail!("{tool} failed: {}", String::from_utf8_lossy(&status.stderr));
    }
    Ok(())
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

impl PgCluster {
    pub async fn start() -> anyhow::Result<Self> {
        let bin = pg_bin()?;
        let dir = tempfile::Builder::new().prefix("jr-pg-").tempdir()?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if is_root() {
            Command::new("chown")
                .args(["-R", "postgres", &dir.path().display().to_string()])
                .status()?;
        }
        let data = dir.path().join("data").display().to_string();
        run_pg(
            &bin,
            "initdb",
            &[
                "-D".into(),
                data,
                "-A".into(),
                "trust".into(),
                "-U".into(),
                "postgres".into(),
                "--no-sync".into(),
            ],
        )?;
        let mut cluster = Self {
            dir,
            port,
            bin,
            running: false,
        };
        cluster.start_server().await?;
        Ok(cluster)
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub async fn start_server(&mut self) -> anyhow::Result<()> {
        let data = self.dir.path().join("data").display().to_string();
        let log = self.dir.path().join("pg.log").display().to_string();
        // fsync off only skips the disk flush: a killed server (the scenarios' "crash") still
        // keeps every acknowledged commit, as a production server with default settings does.
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        run_pg(
            &self.bin,
            "pg_ctl",
            &[
                "-D".into(),
                data,
                "-o".into(),
                opts,
                "-l".into(),
                log,
                "-w".into(),
                "start".into(),
            ],
        )?;
        self.running = true;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if tokio::time::Instant::now() > deadline {
                bail!("postgres did not accept connections on {}", self.port);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Stops the server at once (`-m immediate`: no checkpoint, like a crash).
    pub fn kill(&mut self) -> anyhow::Result<()> {
        let data = self.dir.path().join("data").display().to_string();
        run_pg(
            &self.bin,
            "pg_ctl",
            &[
                "-D".into(),
                data,
                "-m".into(),
                "immediate".into(),
                "stop".into(),
            ],
        )?;
        self.running = false;
        Ok(())
    }

    pub async fn create_database(&self, name: &str) -> anyhow::Result<()> {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&self.url("postgres")).await?;
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut conn)
            .await?;
        Ok(())
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.running {
            let _ = self.kill();
        }
    }
}
