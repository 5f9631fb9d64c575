//! Certificates for TURN-TLS (rustls, TLS 1.2 and 1.3) and TURN-DTLS listeners: decoding the
//! config's base64 PEM, building server contexts, and the self-signed certificate a TURN URI
//! config gets.

use base64::Engine as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use std::sync::Arc;

/// The PEM text behind a config's base64 `cert` or `key` (line breaks in the base64 are
/// ignored, as stunnerd's Go decoder does).
pub fn decode_pem(base64_pem: &str) -> Result<Vec<u8>, String> {
    let compact: String = base64_pem.split_whitespace().collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact)
        .map_err(|e| format!("not base64: {e}"))
}

/// A rustls server config (TLS 1.2 and 1.3, no client certificates) for a PEM certificate
/// chain and key.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot read the TLS certificate: {e}"))?;
    if certs.is_empty() {
        return Err("the TLS certificate PEM holds no CERTIFICATE block".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| format!("cannot read the TLS private key: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("cannot use the TLS certificate and key: {e}"))?;
    Ok(Arc::new(config))
}

/// A fresh self-signed certificate and key for `host` (an IP address or DNS name), as PEM:
/// ECDSA P-256, valid for a year. stunnerd generates RSA-4096 for a TURN URI config; P-256 is
/// as widely accepted by TLS and DTLS clients and takes milliseconds instead of seconds.
pub fn self_signed(host: &str) -> Result<(String, String), String> {
    use openssl::asn1::Asn1Time;
    use openssl::bn::{BigNum, MsbOption};
    use openssl::ec::{EcGroup, EcKey};
    use openssl::hash::MessageDigest;
    use openssl::nid::Nid;
    use openssl::pkey::PKey;
    use openssl::x509::extension::SubjectAlternativeName;
    use openssl::x509::{X509NameBuilder, X509};
    let build = || -> Result<(String, String), openssl::error::ErrorStack> {
        let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
        let key = PKey::from_ec_key(EcKey::generate(&group)?)?;
        let mut name = X509NameBuilder::new()?;
        name.append_entry_by_nid(Nid::COMMONNAME, host)?;
        let name = name.build();
        let mut cert = X509::builder()?;
        cert.set_version(2)?;
        let mut serial = BigNum::new()?;
        serial.rand(127, MsbOption::MAYBE_ZERO, false)?;
        let serial = serial.to_asn1_integer()?;
        cert.set_serial_number(&serial)?;
        cert.set_subject_name(&name)?;
        cert.set_issuer_name(&name)?;
        cert.set_pubkey(&key)?;
        let (from, until) = (Asn1Time::days_from_now(0)?, Asn1Time::days_from_now(365)?);
        cert.set_not_before(&from)?;
        cert.set_not_after(&until)?;
        let mut san = SubjectAlternativeName::new();
        if host.parse::<std::net::IpAddr>().is_ok() {
            san.ip(host);
        } else {
            san.dns(host);
        }
        let san = san.build(&cert.x509v3_context(None, None))?;
        cert.append_extension(san)?;
        cert.sign(&key, MessageDigest::sha256())?;
        let cert = cert.build();
        Ok((
            String::from_utf8_lossy(&cert.to_pem()?).into_owned(),
            String::from_utf8_lossy(&key.private_key_to_pem_pkcs8()?).into_owned(),
        ))
    };
    build().map_err(|e| format!("cannot generate a self-signed certificate: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_self_signed_certificate_serves_tls_and_dtls() {
        let (cert, key) = self_signed("127.0.0.1").unwrap();
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"));
        server_config(cert.as_bytes(), key.as_bytes()).unwrap();
        super::super::dtls::context(cert.as_bytes(), key.as_bytes()).unwrap();
        let encoded = base64::engine::general_purpose::STANDARD.encode(&cert);
        assert_eq!(decode_pem(&encoded).unwrap(), cert.as_bytes());
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let err = server_config(b"nope", b"nope").unwrap_err();
        assert!(err.contains("certificate"), "{err}");
        assert!(decode_pem("%%%").unwrap_err().contains("base64"));
    }
}
