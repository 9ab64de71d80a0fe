//! TLS for provider and token endpoints: public roots plus `ORCA_PUSH_CA_FILE`, ALPN h2.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("ORCA_PUSH_CA_FILE: cannot read PEM certificates from {path}: {reason}")]
    CaFile { path: String, reason: String },
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// Root store: the webpki public roots, plus every certificate in `extra_ca_file`.
pub fn root_store(extra_ca_file: Option<&Path>) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_ca_file {
        let ca_error = |reason: String| TlsError::CaFile {
            path: path.display().to_string(),
            reason,
        };
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| ca_error(e.to_string()))?
            .collect::<Result<_, _>>()
            .map_err(|e| ca_error(e.to_string()))?;
        if certs.is_empty() {
            return Err(ca_error("no certificate in the file".into()));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| ca_error(e.to_string()))?;
        }
    }
    Ok(roots)
}

/// A client config that offers only HTTP/2 (APNs requires it).
pub fn h2_client_config(
    roots: rustls::RootCertStore,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}
