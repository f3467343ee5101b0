//! Mutual TLS for pd's internal gRPC links (router -> workers, prefill -> decode KV), with
//! rustls through tonic. Every process gets the same three PEM files: its certificate, its
//! key and the CA that signed every pd certificate. A server asks each client for a
//! certificate from that CA (no certificate, or one from another CA: the handshake fails); a
//! client checks the server's certificate against the CA for the name `SERVER_NAME`, whatever
//! address it dialled (workers are addressed by IP or pod DNS name; one certificate with that
//! name serves a whole pool).

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The DNS name every pd certificate carries and every client expects.
pub const SERVER_NAME: &str = "pd.internal";

/// Where a process's certificate, key and CA are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("reading the TLS {what} {}: {e}", path.display()))?;
    if !String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
        return Err(format!("the TLS {what} {} is not PEM", path.display()));
    }
    Ok(bytes)
}

/// The TLS flags of every pd binary (`#[command(flatten)]`), declared once.
#[derive(Debug, Clone, clap::Args)]
pub struct TlsArgs {
    /// Mutual TLS on the internal gRPC links: this process's certificate (PEM; with --tls-key
    /// and --tls-ca; its name must be `pd.internal`).
    #[arg(long, env = "PD_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "PD_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA that signed every pd certificate (PEM): peers must present one of its certificates.
    #[arg(long, env = "PD_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The files, checked (`TlsFiles::from_flags`); None: plaintext.
    pub fn files(&self) -> Result<Option<TlsFiles>, String> {
        TlsFiles::from_flags(self.tls_cert.clone(), self.tls_key.clone(), self.tls_ca.clone())
    }
}

impl TlsFiles {
    /// From the `--tls-cert`, `--tls-key` and `--tls-ca` flags: all three (TLS on every
    /// internal link), or none (plaintext); anything else names what is missing.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
    ) -> Result<Option<Self>, String> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => {
                let files = TlsFiles { cert, key, ca };
                // Read once now, so a bad file fails at start with its name, not at the first call.
                files.identity()?;
                read("CA", &files.ca)?;
                Ok(Some(files))
            }
            (cert, key, ca) => {
                let missing: Vec<&str> =
                    [("--tls-cert", cert.is_none()), ("--tls-key", key.is_none()), ("--tls-ca", ca.is_none())]
                        .iter()
                        .filter(|(_, m)| *m)
                        .map(|(f, _)| *f)
                        .collect();
                Err(format!("TLS needs --tls-cert, --tls-key and --tls-ca together; missing {}", missing.join(", ")))
            }
        }
    }

    fn identity(&self) -> Result<Identity, String> {
        Ok(Identity::from_pem(read("certificate", &self.cert)?, read("key", &self.key)?))
    }

    fn ca(&self) -> Result<Certificate, String> {
        Ok(Certificate::from_pem(read("CA", &self.ca)?))
    }

    /// A server that requires a client certificate signed by the CA.
    pub fn server(&self) -> Result<ServerTlsConfig, String> {
        Ok(ServerTlsConfig::new().identity(self.identity()?).client_ca_root(self.ca()?))
    }

    /// A client that presents its certificate and trusts servers signed by the CA as
    /// `SERVER_NAME`.
    pub fn client(&self) -> Result<ClientTlsConfig, String> {
        Ok(ClientTlsConfig::new().identity(self.identity()?).ca_certificate(self.ca()?).domain_name(SERVER_NAME))
    }
}

/// The URL scheme of a gRPC link with or without TLS.
pub fn scheme(tls: bool) -> &'static str {
    if tls {
        "https"
    } else {
        "http"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_three_files_or_none_and_bad_files_are_named() {
        assert_eq!(TlsFiles::from_flags(None, None, None), Ok(None));
        let err = TlsFiles::from_flags(Some("c".into()), None, None).expect_err("partial");
        assert!(err.contains("--tls-key, --tls-ca"), "{err}");
        let dir = std::env::temp_dir().join(format!("pd-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate").expect("write");
        let err = TlsFiles::from_flags(Some(junk.clone()), Some(junk.clone()), Some(junk.clone())).expect_err("junk");
        assert!(err.contains("not PEM") && err.contains("junk.pem"), "{err}");
        let err = TlsFiles::from_flags(Some(dir.join("none")), Some(junk.clone()), Some(junk)).expect_err("missing");
        assert!(err.contains("reading the TLS certificate"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
