//! A TCP proxy standing in for a Kubernetes Service in front of several replicas: each
//! accepted connection goes to the next replica (round robin) that accepts a connection, so a
//! dead replica is skipped and its clients' next connections reach a live one.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::{TcpListener, TcpStream};

/// Listens on `127.0.0.1:port` and forwards to `127.0.0.1:<each of targets>`.
pub async fn spawn(port: u16, targets: Vec<u16>) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    let next = Arc::new(AtomicUsize::new(0));
    Ok(tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                continue;
            };
            let (targets, next) = (targets.clone(), next.clone());
            tokio::spawn(async move {
                let start = next.fetch_add(1, Ordering::Relaxed);
                for i in 0..targets.len() {
                    let target = targets[(start + i) % targets.len()];
                    if let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target)).await {
                        let _ = inbound.set_nodelay(true);
                        let _ = outbound.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        return;
                    }
                }
                // No replica accepts: the client sees the connection close, as with a Service
                // without ready endpoints.
            });
        }
    }))
}
