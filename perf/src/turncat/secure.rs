//! TLS (rustls, TLS 1.2 and 1.3) and DTLS (OpenSSL, DTLS 1.2) client material: which
//! certificates to trust, or, with `--insecure`, none.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use openssl::ssl::{SslConnector, SslMethod, SslOptions, SslVerifyMode, SslVersion};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// Which server certificates to accept.
#[derive(Debug, Clone, Default)]
pub struct Trust {
    /// Accept any certificate for any name (`-i/--insecure`).
    pub insecure: bool,
    /// A PEM bundle of CA certificates (`--ca`); without it, the system's roots.
    pub ca_file: Option<std::path::PathBuf>,
}

/// The rustls client config for `trust`.
pub fn tls_config(trust: &Trust) -> Result<Arc<ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| format!("TLS setup: {e}"))?;
    let config = if trust.insecure {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate { provider }))
            .with_no_client_auth()
    } else {
        builder
            .with_root_certificates(root_store(trust.ca_file.as_deref())?)
            .with_no_client_auth()
    };
    Ok(Arc::new(config))
}

fn root_store(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let bad = |why: &dyn fmt::Display| {
                format!(
                    "--ca {:?}: {why}: give a PEM file of CA certificates",
                    path.display()
                )
            };
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                .map_err(|e| bad(&e))?
                .collect::<Result<_, _>>()
                .map_err(|e| bad(&e))?;
            if certs.is_empty() {
                return Err(bad(&"no CERTIFICATE block"));
            }
            for cert in certs {
                roots.add(cert).map_err(|e| bad(&e))?;
            }
        }
        None => {
            // Unreadable system certificates only mean fewer roots: the handshake error then
            // says to pass --ca or -i.
            let system = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(system.certs);
        }
    }
    Ok(roots)
}

/// The OpenSSL DTLS 1.2 connector for `trust`.
pub fn dtls_connector(trust: &Trust) -> Result<SslConnector, String> {
    let setup = |e: openssl::error::ErrorStack| format!("DTLS setup: {e}");
    let mut builder = SslConnector::builder(SslMethod::dtls()).map_err(setup)?;
    builder
        .set_min_proto_version(Some(SslVersion::DTLS1_2))
        .map_err(setup)?;
    // The MTU is set on each session (transport::DTLS_MTU), not probed from the socket.
    builder.set_options(SslOptions::NO_QUERY_MTU);
    if trust.insecure {
        builder.set_verify(SslVerifyMode::NONE);
    } else if let Some(path) = &trust.ca_file {
        builder.set_ca_file(path).map_err(|e| {
            format!(
                "--ca {:?}: {e}: give a PEM file of CA certificates",
                path.display()
            )
        })?;
    }
    Ok(builder.build())
}

/// `--insecure`: any certificate, any name. The handshake signature is still checked, so the
/// server holds the key of the certificate it shows.
#[derive(Debug)]
struct AcceptAnyCertificate {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
