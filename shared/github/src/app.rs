//! GitHub App authentication: an RS256 JWT signed with the App's private key, exchanged for an
//! installation access token (kept until five minutes before it expires).

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::rand::SystemRandom;
use ring::signature::{RSA_PKCS1_SHA256, RsaKeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{PrivatePkcs1KeyDer, PrivatePkcs8KeyDer};

use crate::GitHubError;

/// An installation token is replaced this long before it expires.
const TOKEN_MARGIN_SECS: i64 = 300;

/// A parsed App key.
pub(crate) struct AppKey {
    key: RsaKeyPair,
}

impl std::fmt::Debug for AppKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AppKey(<secret>)")
    }
}

impl AppKey {
    /// Reads a PEM private key, PKCS#1 (`BEGIN RSA PRIVATE KEY`, what GitHub hands out) or
    /// PKCS#8 (`BEGIN PRIVATE KEY`).
    pub fn from_pem(pem: &str) -> Result<AppKey, GitHubError> {
        let bad = |e: String| GitHubError::Config(format!("GitHub App private key: {e}"));
        let key = if let Ok(der) = PrivatePkcs1KeyDer::from_pem_slice(pem.as_bytes()) {
            RsaKeyPair::from_der(der.secret_pkcs1_der()).map_err(|e| bad(e.to_string()))?
        } else if let Ok(der) = PrivatePkcs8KeyDer::from_pem_slice(pem.as_bytes()) {
            RsaKeyPair::from_pkcs8(der.secret_pkcs8_der()).map_err(|e| bad(e.to_string()))?
        } else {
            return Err(bad("not a PEM RSA private key".into()));
        };
        Ok(AppKey { key })
    }

    /// A JWT for the App `issuer` (client id or App id): issued a minute in the past against
    /// clock drift, valid nine minutes from then (GitHub allows ten).
    pub fn jwt(&self, issuer: &str, now: u64) -> Result<String, GitHubError> {
        let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256","typ":"JWT"}"#);
        let iat = now.saturating_sub(60);
        let claims = serde_json::json!({"iat": iat, "exp": iat + 540, "iss": issuer});
        let payload = URL_SAFE_NO_PAD.encode(claims.to_string().as_bytes());
        let signed = format!("{header}.{payload}");
        let mut signature = vec![0; self.key.public().modulus_len()];
        self.key
            .sign(
                &RSA_PKCS1_SHA256,
                &SystemRandom::new(),
                signed.as_bytes(),
                &mut signature,
            )
            .map_err(|_| GitHubError::Config("GitHub App private key cannot sign".into()))?;
        Ok(format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature)))
    }
}

/// An installation token and when it must be replaced (unix seconds).
pub(crate) struct InstallationToken {
    pub token: String,
    pub renew_at: i64,
}

impl InstallationToken {
    pub fn parse(token: String, expires_at: &str) -> Result<InstallationToken, GitHubError> {
        let at =
            time::OffsetDateTime::parse(expires_at, &time::format_description::well_known::Rfc3339)
                .map_err(|e| GitHubError::Decode {
                    op: "installation token",
                    detail: format!("expires_at {expires_at:?}: {e}"),
                })?;
        Ok(InstallationToken {
            token,
            renew_at: at.unix_timestamp() - TOKEN_MARGIN_SECS,
        })
    }

    pub fn fresh(&self) -> bool {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        i64::try_from(now).unwrap_or(i64::MAX) < self.renew_at
    }
}
