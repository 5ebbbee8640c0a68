//! What the PostgreSQL and RabbitMQ connections share about TLS: reading a
//! CA file, and telling a handshake that cannot succeed from a network
//! failure worth retrying.

use std::error::Error;
use std::path::Path;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The TLS provider of every connection idem makes (PostgreSQL, and the
/// OTLP exporter's; lapin's is built on the same): `ring`, which builds
/// with no C toolchain beyond a compiler. rustls deprecates its default
/// provider since 0.23.48 because ring has no post-quantum key exchange
/// (X25519MLKEM768); idem's connections go to a database, a broker and a
/// collector of the deployment's own, and keep ring until it has one or
/// idem moves to aws-lc-rs with lapin.
#[allow(deprecated)]
pub fn provider() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// Why a CA file cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot use the CA file {path}: {reason}")]
pub struct CaFileError {
    /// The file.
    pub path: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A PEM file of CA certificates, read and checked to hold at least one: its
/// text, and the certificates.
pub fn ca_file(path: &Path) -> Result<(String, Vec<CertificateDer<'static>>), CaFileError> {
    let unusable = |reason: String| CaFileError {
        path: path.display().to_string(),
        reason,
    };
    let pem = std::fs::read_to_string(path).map_err(|error| unusable(error.to_string()))?;
    let certificates = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| unusable(error.to_string()))?;
    if certificates.is_empty() {
        return Err(unusable("no certificate in it".into()));
    }
    Ok((pem, certificates))
}

/// What went wrong when a TLS handshake failed for a reason a retry cannot
/// fix (the certificate does not verify, the protocol does not match), found
/// anywhere in `error`'s chain. `None` for anything else.
pub fn refusal(error: &(dyn Error + 'static)) -> Option<String> {
    let mut cause = Some(error);
    while let Some(current) = cause {
        if let Some(tls) = current.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        // io::Error hides the error it wraps from source().
        cause = match current.downcast_ref::<std::io::Error>() {
            Some(io) => io.get_ref().map(|inner| inner as &(dyn Error + 'static)),
            None => current.source(),
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rustls_error_inside_an_io_error_is_a_refusal() {
        let wrapped = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        assert_eq!(
            refusal(&wrapped).as_deref(),
            Some("invalid peer certificate: UnknownIssuer")
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(refusal(&reset), None);
    }

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        let missing = ca_file(Path::new("/nonexistent/idem-ca.pem"));
        assert!(missing.is_err());
        let file = std::env::temp_dir().join(format!("idem-unit-{}-ca.pem", std::process::id()));
        std::fs::write(&file, "not a certificate\n").ok();
        let empty = ca_file(&file);
        std::fs::remove_file(&file).ok();
        assert_eq!(
            empty.map_err(|e| e.reason),
            Err("no certificate in it".to_owned())
        );
    }
}
