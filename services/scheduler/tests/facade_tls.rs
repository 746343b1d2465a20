//! The facade over TLS: SPIFFE mTLS identities issued with rcgen, token mode over TLS, and the
//! refusal of plain HTTP.

mod facade_support;

use std::sync::Arc;

use facade_support::*;
use jr_facade::{AuthMode, AuthRefusal, Facade, FacadeError, TlsSettings, serve};
use jr_forge::proto::runner::v1::{FetchTaskRequest, FetchTaskResponse};
use jr_forge::{Code, parse_connect_error};
use jr_protocol::AssignmentId;
use prost::Message;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

const TRUST_DOMAIN: &str = "ci.example.org";

struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer =
            CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("CA");
        Ca { issuer }
    }

    fn der(&self) -> CertificateDer<'static> {
        self.issuer.der().clone()
    }

    /// A leaf certificate with the given SANs and key usage.
    fn leaf(
        &self,
        sans: Vec<SanType>,
        usage: ExtendedKeyUsagePurpose,
    ) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        (cert.der().clone(), key)
    }

    fn executor_cert(&self, spiffe: &str) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
        self.leaf(
            vec![SanType::URI(spiffe.try_into().expect("uri"))],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }
}

fn server_tls(ca: &Ca, trust: &Ca) -> TlsSettings {
    let (cert, key) = ca.leaf(
        vec![SanType::DnsName("localhost".try_into().expect("dns"))],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    TlsSettings {
        cert_chain: vec![cert],
        key,
        client_trust_bundle: vec![trust.der()],
    }
}

/// An HTTPS client trusting `ca`, presenting `identity` if given.
fn https_client(
    ca: &Ca,
    identity: Option<(CertificateDer<'static>, PrivateKeyDer<'static>)>,
) -> reqwest::Client {
    install_crypto();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).expect("root");
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots);
    let config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(vec![cert], key)
            .expect("client auth"),
        None => builder.with_no_client_auth(),
    };
    reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .build()
        .expect("client")
}

/// A raw Connect FetchTask call. `Err` = transport failure (e.g. TLS refused).
async fn fetch_task(
    http: &reqwest::Client,
    url: &str,
    id: AssignmentId,
    token: Option<&str>,
) -> Result<Result<FetchTaskResponse, Code>, reqwest::Error> {
    let mut request = http
        .post(format!(
            "{url}/api/actions/runner.v1.RunnerService/FetchTask"
        ))
        .header("content-type", "application/proto")
        .header("x-runner-uuid", id.to_string())
        .body(
            FetchTaskRequest {
                tasks_version: 0,
                ..Default::default()
            }
            .encode_to_vec(),
        );
    if let Some(token) = token {
        request = request.header("x-runner-token", token);
    }
    let answer = request.send().await?;
    let ok = answer.status().is_success();
    let body = answer.bytes().await?;
    Ok(if ok {
        Ok(FetchTaskResponse::decode(body).expect("FetchTaskResponse"))
    } else {
        Err(parse_connect_error(&body).expect("Connect error body").code)
    })
}

fn spiffe_for(id: AssignmentId) -> String {
    format!("spiffe://{TRUST_DOMAIN}/jetrunner/executor/{id}")
}

#[tokio::test]
async fn spiffe_certificate_naming_the_assignment_is_accepted() {
    let ca = Ca::new("jetrunner test CA");
    let h = start_with(AuthMode::Spiffe, Some(server_tls(&ca, &ca))).await;
    let id = add_assignment(&h, 61, None);
    let client = https_client(&ca, Some(ca.executor_cert(&spiffe_for(id))));
    let reply = fetch_task(&client, &h.url, id, None)
        .await
        .expect("TLS")
        .expect("FetchTask");
    assert_eq!(
        reply.task.map(|t| t.id),
        Some(61),
        "no token hash needed with SPIFFE"
    );
    let record = h.ledger.record(id).expect("record");
    assert_eq!(record.claimed_by.as_deref(), Some(spiffe_for(id).as_str()));
    h.stop().await;
}

#[tokio::test]
async fn spiffe_certificate_for_another_assignment_is_refused() {
    let ca = Ca::new("jetrunner test CA");
    let h = start_with(AuthMode::Spiffe, Some(server_tls(&ca, &ca))).await;
    let id = add_assignment(&h, 62, None);
    let other = AssignmentId::for_task("http://forge.test", 63);
    let client = https_client(&ca, Some(ca.executor_cert(&spiffe_for(other))));
    let answer = fetch_task(&client, &h.url, id, None)
        .await
        .expect("TLS passes");
    assert_eq!(answer.map(|r| r.task.is_some()), Err(Code::Unauthenticated));
    // The right assignment in a foreign trust domain is refused too.
    let foreign = https_client(
        &ca,
        Some(ca.executor_cert(&format!("spiffe://elsewhere.org/ns/ci/{id}"))),
    );
    let answer = fetch_task(&foreign, &h.url, id, None)
        .await
        .expect("TLS passes");
    assert_eq!(answer.map(|r| r.task.is_some()), Err(Code::Unauthenticated));
    // The right assignment under another path of the trust domain (another workload's
    // identity that happens to end in the id) is refused.
    let elsewhere = https_client(
        &ca,
        Some(ca.executor_cert(&format!("spiffe://{TRUST_DOMAIN}/ns/other/sa/{id}"))),
    );
    let answer = fetch_task(&elsewhere, &h.url, id, None)
        .await
        .expect("TLS passes");
    assert_eq!(answer.map(|r| r.task.is_some()), Err(Code::Unauthenticated));
    assert_eq!(
        h.facade.stats().auth_refused(AuthRefusal::SpiffeMismatch),
        3
    );
    assert!(!h.ledger.record(id).expect("record").view.claimed);
    h.stop().await;
}

#[tokio::test]
async fn certificate_from_another_ca_or_none_is_refused_at_tls_level() {
    let ca = Ca::new("jetrunner test CA");
    let rogue = Ca::new("rogue CA");
    let h = start_with(AuthMode::Spiffe, Some(server_tls(&ca, &ca))).await;
    let id = add_assignment(&h, 64, None);
    let impostor = https_client(&ca, Some(rogue.executor_cert(&spiffe_for(id))));
    assert!(
        fetch_task(&impostor, &h.url, id, None).await.is_err(),
        "foreign CA refused in the handshake"
    );
    let anonymous = https_client(&ca, None);
    assert!(
        fetch_task(&anonymous, &h.url, id, Some("x")).await.is_err(),
        "SPIFFE-only mode requires a certificate"
    );
    assert!(!h.ledger.record(id).expect("record").view.claimed);
    h.stop().await;
}

#[tokio::test]
async fn both_mode_accepts_a_token_without_certificate_but_checks_a_presented_one() {
    let ca = Ca::new("jetrunner test CA");
    let rogue = Ca::new("rogue CA");
    let h = start_with(AuthMode::Both, Some(server_tls(&ca, &ca))).await;
    let by_token = add_assignment(&h, 65, Some("tok-65"));
    let anonymous = https_client(&ca, None);
    let reply = fetch_task(&anonymous, &h.url, by_token, Some("tok-65"))
        .await
        .expect("TLS")
        .expect("FetchTask");
    assert_eq!(reply.task.map(|t| t.id), Some(65));
    assert_eq!(
        fetch_task(&anonymous, &h.url, by_token, None)
            .await
            .expect("TLS")
            .map(|r| r.task.is_some()),
        Err(Code::Unauthenticated),
        "neither credential"
    );

    let by_cert = add_assignment(&h, 66, None);
    let wrong_cert = https_client(&ca, Some(ca.executor_cert(&spiffe_for(by_token))));
    assert_eq!(
        fetch_task(&wrong_cert, &h.url, by_cert, None)
            .await
            .expect("TLS")
            .map(|r| r.task.is_some()),
        Err(Code::Unauthenticated),
        "a presented certificate must name the assignment"
    );
    let impostor = https_client(&ca, Some(rogue.executor_cert(&spiffe_for(by_cert))));
    assert!(
        fetch_task(&impostor, &h.url, by_cert, None).await.is_err(),
        "still refused at TLS level"
    );
    let right_cert = https_client(&ca, Some(ca.executor_cert(&spiffe_for(by_cert))));
    let reply = fetch_task(&right_cert, &h.url, by_cert, None)
        .await
        .expect("TLS")
        .expect("FetchTask");
    assert_eq!(reply.task.map(|t| t.id), Some(66));
    h.stop().await;
}

#[tokio::test]
async fn token_mode_over_tls_serves_the_executor() {
    let ca = Ca::new("jetrunner test CA");
    let h = start_with(AuthMode::Token, Some(server_tls(&ca, &ca))).await;
    let id = add_assignment(&h, 67, Some("tok-67"));
    let client = https_client(&ca, None);
    let reply = fetch_task(&client, &h.url, id, Some("tok-67"))
        .await
        .expect("TLS")
        .expect("FetchTask");
    assert_eq!(reply.task.map(|t| t.id), Some(67));
    // Plain HTTP to the TLS port does not get an answer.
    let plain_url = h.url.replace("https://localhost", "http://127.0.0.1");
    assert!(
        fetch_task(&reqwest::Client::new(), &plain_url, id, Some("tok-67"))
            .await
            .is_err()
    );
    h.stop().await;
}

#[tokio::test]
async fn plain_http_is_refused_unless_configured() {
    install_crypto();
    let (forge_url, _forge) = start_forge().await;
    for (mode, insecure, expected) in [
        (AuthMode::Token, false, "plain_http_refused"),
        (AuthMode::Spiffe, true, "spiffe_without_trust_bundle"),
        (AuthMode::Both, true, "spiffe_without_trust_bundle"),
    ] {
        let facade = Arc::new(
            Facade::new(
                settings(mode, &forge_url, sealer(), insecure),
                Arc::new(jr_facade::MemoryLedger::new()),
            )
            .expect("facade"),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let result = serve(listener, facade, None, std::future::pending::<()>()).await;
        let err: FacadeError = result.expect_err("refused");
        assert_eq!(err.kind(), expected, "{mode:?}");
    }
    // A SPIFFE mode without a trust bundle is refused as well.
    let ca = Ca::new("jetrunner test CA");
    let mut tls = server_tls(&ca, &ca);
    tls.client_trust_bundle.clear();
    let facade = Arc::new(
        Facade::new(
            settings(AuthMode::Spiffe, &forge_url, sealer(), false),
            Arc::new(jr_facade::MemoryLedger::new()),
        )
        .expect("facade"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let err = serve(listener, facade, Some(tls), std::future::pending::<()>())
        .await
        .expect_err("refused");
    assert_eq!(err.kind(), "spiffe_without_trust_bundle");
}

#[tokio::test]
async fn tls_settings_load_from_pem() {
    let ca = Ca::new("jetrunner test CA");
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &ca.issuer).expect("sign");
    let settings = TlsSettings::from_pem(
        cert.pem().as_bytes(),
        key.serialize_pem().as_bytes(),
        Some(ca.issuer.pem().as_bytes()),
    )
    .expect("PEM");
    assert_eq!(settings.cert_chain.len(), 1);
    assert_eq!(settings.client_trust_bundle, vec![ca.der()]);
    settings
        .server_config(AuthMode::Both)
        .expect("server config");
    assert!(TlsSettings::from_pem(b"garbage", key.serialize_pem().as_bytes(), None).is_err());
}
