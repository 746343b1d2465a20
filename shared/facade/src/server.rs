//! The facade's listener: TLS (rustls, ring) with optional SPIFFE client certificates, an accept
//! loop over hyper-util's auto (HTTP/1.1 + HTTP/2) connection builder, and graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use rustls::RootCertStore;
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls_pki_types::pem::{Error as PemError, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use super::auth::ClientIdentity;
use super::{AuthMode, Facade, FacadeError, Ledger, router};

/// A TLS handshake that takes longer is dropped (slow or stuck clients).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long open connections may finish their requests after shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed accept (e.g. out of file descriptors) before accepting again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The facade's server certificate and, for SPIFFE mode, the CAs that issue executor
/// certificates.
pub struct TlsSettings {
    pub cert_chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    /// Trust bundle for client certificates; required when the mode uses SPIFFE.
    pub client_trust_bundle: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for TlsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSettings")
            .field("cert_chain", &self.cert_chain.len())
            .field("key", &"<redacted>")
            .field("client_trust_bundle", &self.client_trust_bundle.len())
            .finish()
    }
}

impl TlsSettings {
    /// From PEM text: certificate chain, private key (PKCS#8, PKCS#1 or SEC1), optional bundle.
    pub fn from_pem(
        cert_chain_pem: &[u8],
        key_pem: &[u8],
        trust_bundle_pem: Option<&[u8]>,
    ) -> Result<TlsSettings, FacadeError> {
        let certs = |pem: &[u8], what: &str| {
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| FacadeError::TlsConfig(format!("{what}: {e}")))?;
            if certs.is_empty() {
                return Err(FacadeError::TlsConfig(format!(
                    "{what}: no certificate in PEM"
                )));
            }
            Ok(certs)
        };
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| match e {
            PemError::NoItemsFound => FacadeError::TlsConfig("private key: no key in PEM".into()),
            e => FacadeError::TlsConfig(format!("private key: {e}")),
        })?;
        Ok(TlsSettings {
            cert_chain: certs(cert_chain_pem, "certificate chain")?,
            key,
            client_trust_bundle: trust_bundle_pem
                .map(|pem| certs(pem, "trust bundle"))
                .transpose()?
                .unwrap_or_default(),
        })
    }

    /// [`TlsSettings::from_pem`] reading the files (the `facade.tls_*` config keys).
    pub fn from_pem_files(
        cert_chain: &Path,
        key: &Path,
        trust_bundle: Option<&Path>,
    ) -> Result<TlsSettings, FacadeError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| FacadeError::ReadPem {
                path: path.display().to_string(),
                source,
            })
        };
        let bundle = trust_bundle.map(read).transpose()?;
        TlsSettings::from_pem(&read(cert_chain)?, &read(key)?, bundle.as_deref())
    }

    /// The rustls configuration for `mode`: client certificates are verified against the bundle
    /// in SPIFFE modes, and may be absent at the TLS level only when tokens are accepted too.
    pub fn server_config(&self, mode: AuthMode) -> Result<ServerConfig, FacadeError> {
        let tls_err = |e: rustls::Error| FacadeError::TlsConfig(e.to_string());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(tls_err)?;
        let builder = if mode.uses_spiffe() {
            if self.client_trust_bundle.is_empty() {
                return Err(FacadeError::SpiffeWithoutTrustBundle);
            }
            let mut roots = RootCertStore::empty();
            for ca in &self.client_trust_bundle {
                roots.add(ca.clone()).map_err(tls_err)?;
            }
            let mut verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            if mode.uses_token() {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier
                .build()
                .map_err(|e| FacadeError::TlsConfig(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut config = builder
            .with_single_cert(self.cert_chain.clone(), self.key.clone_key())
            .map_err(tls_err)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// Serves the facade on `listener` until `shutdown` completes, then lets open connections
/// finish (up to a drain timeout). Without `tls` it serves plain HTTP only if
/// `insecure_plain_http` is set and the mode is token-only.
pub async fn serve<L: Ledger>(
    listener: TcpListener,
    facade: Arc<Facade<L>>,
    tls: Option<TlsSettings>,
    shutdown: impl Future,
) -> Result<(), FacadeError> {
    let mode = facade.settings().mode;
    let acceptor = match tls {
        Some(tls) => Some(TlsAcceptor::from(Arc::new(tls.server_config(mode)?))),
        None if mode.uses_spiffe() => return Err(FacadeError::SpiffeWithoutTrustBundle),
        None if !facade.settings().insecure_plain_http => {
            return Err(FacadeError::PlainHttpRefused);
        }
        None => {
            tracing::warn!("facade serves plain HTTP (insecure_plain_http)");
            None
        }
    };
    // At most `max_connections` open connections: beyond that the accept loop waits and new
    // connections queue in the listen backlog instead of costing memory here.
    let slots = Arc::new(tokio::sync::Semaphore::new(
        facade.settings().limits.max_connections,
    ));
    let app = router(facade);
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = async {
                let slot = slots.clone().acquire_owned().await;
                (listener.accept().await, slot)
            } => match accepted {
                (Ok((stream, peer)), Ok(slot)) => {
                    let served = serve_connection(
                        stream, peer, acceptor.clone(), app.clone(), stopping.clone(),
                    );
                    connections.spawn(async move {
                        served.await;
                        drop(slot);
                    });
                }
                (Ok(_), Err(_)) => {
                    tracing::error!("facade connection slots closed");
                    break;
                }
                (Err(err), _) => {
                    tracing::warn!(error = %err, "facade accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
            Some(done) = connections.join_next(), if !connections.is_empty() => {
                if let Err(err) = done {
                    tracing::error!(error = %err, "facade connection task failed");
                }
            }
        }
    }
    let _ = stop.send(true);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = connections.len(),
            "facade connections still open after drain timeout; aborting"
        );
        connections.abort_all();
    }
    Ok(())
}

async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    acceptor: Option<TlsAcceptor>,
    app: Router,
    stopping: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let Some(acceptor) = acceptor else {
        drive(stream, ClientIdentity::Anonymous, app, stopping).await;
        return;
    };
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(err)) => {
            tracing::info!(%peer, error = %err, "facade TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::info!(%peer, "facade TLS handshake timed out");
            return;
        }
    };
    let identity = ClientIdentity::from_peer_certificates(tls.get_ref().1.peer_certificates());
    drive(tls, identity, app, stopping).await;
}

/// Runs HTTP on one connection, tagging every request with the connection's client identity.
async fn drive<I>(io: I, identity: ClientIdentity, app: Router, mut stopping: watch::Receiver<bool>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = tower::service_fn(move |mut request: http::Request<Incoming>| {
        request.extensions_mut().insert(identity.clone());
        app.clone().oneshot(request)
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The timer enables hyper's header read timeout, so idle half-open requests are dropped.
    builder.http1().timer(TokioTimer::new());
    let connection = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(err) = result {
                tracing::debug!(error = %err, "facade connection ended with an error");
            }
        }
        _ = async { stopping.wait_for(|stop| *stop).await.map(|_| ()) } => {
            connection.as_mut().graceful_shutdown();
            if let Err(err) = connection.await {
                tracing::debug!(error = %err, "facade connection ended with an error during shutdown");
            }
        }
    }
}
