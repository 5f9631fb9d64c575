//! Certificates for TURN-TLS (rustls, TLS 1.2 and 1.3) and TURN-DTLS listeners: decoding the
//! config's base64 PEM, building server contexts, and the self-signed certificate a TURN URI
//! config gets.

use base64::Engine as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use std::sync::Arc;
use std::time::Duration;

/// A TLS or DTLS handshake must finish within this (as stunnerd), or the connection or
/// session is closed.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The PEM text behind a config's base64 `cert` or `key` (line breaks in the base64 are
/// ignored, as stunnerd's Go decoder does).
pub fn decode_pem(base64_pem: &str) -> Result<Vec<u8>, String> {
    let compact: String = base64_pem.split_whitespace().collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact)
        .map_err(|e| format!("not base64: {e}"))
}

/// Why a listener's certificate and key cannot serve, by the config field to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MaterialError {
    /// `cert` is not base64, or holds no certificate that loads.
    Cert(String),
    /// `key` is not base64, or holds no private key that loads.
    Key(String),
    /// Both load, but the key is not the certificate's.
    Mismatch(String),
    /// The TLS library failed with material that loaded (not the config's doing).
    Setup(String),
}

impl MaterialError {
    /// The listener field to fix: `cert`, or `key` (also for a mismatch: the usual mistake is
    /// a key left over from the previous rotation).
    pub fn field(&self) -> &'static str {
        match self {
            MaterialError::Cert(_) => "cert",
            MaterialError::Key(_) | MaterialError::Mismatch(_) | MaterialError::Setup(_) => "key",
        }
    }

    fn fix(&self) -> &'static str {
        match self {
            MaterialError::Cert(_) => {
                "set cert to the base64 of the PEM certificate chain, leaf first (e.g. base64 \
                 -w0 tls.crt)"
            }
            MaterialError::Key(_) => {
                "set key to the base64 of the PEM private key (PKCS#8, PKCS#1 or SEC1; e.g. \
                 base64 -w0 tls.key)"
            }
            MaterialError::Mismatch(_) => {
                "set key to the private key of this cert: rotate the cert and the key together \
                 (a Kubernetes TLS Secret's tls.crt and tls.key)"
            }
            MaterialError::Setup(_) => "check the certificate and key type (RSA, ECDSA, Ed25519)",
        }
    }
}

impl std::fmt::Display for MaterialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = match self {
            MaterialError::Cert(why)
            | MaterialError::Key(why)
            | MaterialError::Mismatch(why)
            | MaterialError::Setup(why) => why,
        };
        write!(f, "{why}: {}", self.fix())
    }
}

/// A TURN-TLS listener's rustls config from the config's base64 `cert` and `key`: what the
/// listener serves with, and what a new config is checked with before it is applied.
pub fn server_config_from_base64(
    cert_base64: &str,
    key_base64: &str,
) -> Result<Arc<ServerConfig>, MaterialError> {
    let cert_pem =
        decode_pem(cert_base64).map_err(|e| MaterialError::Cert(format!("cert is {e}")))?;
    let key_pem = decode_pem(key_base64).map_err(|e| MaterialError::Key(format!("key is {e}")))?;
    server_config_from_pem(&cert_pem, &key_pem)
}

/// A rustls server config (TLS 1.2 and 1.3, no client certificates) for a PEM certificate
/// chain and key.
pub fn server_config_from_pem(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<ServerConfig>, MaterialError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| MaterialError::Cert(format!("cannot read the TLS certificate: {e}")))?;
    if certs.is_empty() {
        return Err(MaterialError::Cert(
            "the TLS certificate PEM holds no CERTIFICATE block".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| MaterialError::Key(format!("cannot read the TLS private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| MaterialError::Setup(format!("TLS setup failed: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| match e {
            rustls::Error::InconsistentKeys(_) => MaterialError::Mismatch(format!(
                "the TLS private key does not match the certificate ({e})"
            )),
            rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented => {
                MaterialError::Cert(format!("cannot use the TLS certificate: {e}"))
            }
            _ => MaterialError::Key(format!("cannot use the TLS private key: {e}")),
        })?;
    Ok(Arc::new(config))
}

/// One certificate of a listener's chain, as the validity checks read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainCertificate {
    /// Its subject, e.g. `CN=turn.example.com, O=Example`.
    pub subject: String,
    /// Start of validity (notBefore), in seconds since the Unix epoch.
    pub not_before: i64,
    /// End of validity (notAfter), in seconds since the Unix epoch.
    pub not_after: i64,
}

/// Every certificate of `cert_base64` (a listener's base64 PEM chain: the leaf first, then
/// its intermediates), in order; `None` if it does not parse or holds none.
pub fn certificate_chain(cert_base64: &str) -> Option<Vec<ChainCertificate>> {
    let pem = decode_pem(cert_base64).ok()?;
    let chain = openssl::x509::X509::stack_from_pem(&pem).ok()?;
    let epoch = openssl::asn1::Asn1Time::from_unix(0).ok()?;
    let unix = |time: &openssl::asn1::Asn1TimeRef| {
        let since = epoch.diff(time).ok()?;
        Some(i64::from(since.days) * 86_400 + i64::from(since.secs))
    };
    let chain = chain
        .iter()
        .map(|cert| {
            Some(ChainCertificate {
                subject: subject_line(cert.subject_name()),
                not_before: unix(cert.not_before())?,
                not_after: unix(cert.not_after())?,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    (!chain.is_empty()).then_some(chain)
}

/// A certificate's subject as one line: `CN=…, O=…`, in the certificate's order.
fn subject_line(name: &openssl::x509::X509NameRef) -> String {
    let entries: Vec<String> =
        name.entries()
            .map(|entry| {
                let key = entry
                    .object()
                    .nid()
                    .short_name()
                    .map_or_else(|_| entry.object().to_string(), str::to_owned);
                let value = entry.data().to_string().unwrap_or_else(|_| {
                    String::from_utf8_lossy(entry.data().as_slice()).into_owned()
                });
                format!("{key}={value}")
            })
            .collect();
    if entries.is_empty() {
        "(empty subject)".into()
    } else {
        entries.join(", ")
    }
}

/// A fresh self-signed certificate and key for `host` (an IP address or DNS name), as PEM:
/// ECDSA P-256, valid for a year. stunnerd generates RSA-4096 for a TURN URI config; P-256 is
/// as widely accepted by TLS and DTLS clients and takes milliseconds instead of seconds.
pub fn self_signed(host: &str) -> Result<(String, String), String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    self_signed_between(host, now, now + 365 * 86_400)
}

/// [`self_signed`], valid from `not_before` until `not_after` (seconds since the Unix epoch).
pub fn self_signed_between(
    host: &str,
    not_before: i64,
    not_after: i64,
) -> Result<(String, String), String> {
    certificate_between(host, not_before, not_after, None, false)
}

/// A CA certificate's PEM and its key's PEM, to sign another certificate with.
#[derive(Debug, Clone, Copy)]
pub struct Issuer<'a> {
    /// The CA's certificate, PEM.
    pub cert: &'a str,
    /// The CA's private key, PEM.
    pub key: &'a str,
}

/// A fresh ECDSA P-256 certificate (CN=`host`) and key, as PEM, valid from `not_before` until
/// `not_after` (seconds since the Unix epoch), signed by `issuer` or else self-signed: a CA
/// (basicConstraints CA:TRUE, `host` a name) if `ca`, else a server certificate for `host`
/// (an IP address or DNS name). With a CA's `issuer`, the pieces of a chain (root,
/// intermediates, leaf), for tests and tools.
pub fn certificate_between(
    host: &str,
    not_before: i64,
    not_after: i64,
    issuer: Option<Issuer<'_>>,
    ca: bool,
) -> Result<(String, String), String> {
    use openssl::asn1::Asn1Time;
    use openssl::bn::{BigNum, MsbOption};
    use openssl::ec::{EcGroup, EcKey};
    use openssl::hash::MessageDigest;
    use openssl::nid::Nid;
    use openssl::pkey::PKey;
    use openssl::x509::extension::{BasicConstraints, KeyUsage, SubjectAlternativeName};
    use openssl::x509::{X509NameBuilder, X509};
    let build = || -> Result<(String, String), openssl::error::ErrorStack> {
        let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
        let key = PKey::from_ec_key(EcKey::generate(&group)?)?;
        let mut name = X509NameBuilder::new()?;
        name.append_entry_by_nid(Nid::COMMONNAME, host)?;
        let name = name.build();
        let signer = match issuer {
            Some(issuer) => Some((
                X509::from_pem(issuer.cert.as_bytes())?,
                PKey::private_key_from_pem(issuer.key.as_bytes())?,
            )),
            None => None,
        };
        let mut cert = X509::builder()?;
        cert.set_version(2)?;
        let mut serial = BigNum::new()?;
        serial.rand(127, MsbOption::MAYBE_ZERO, false)?;
        let serial = serial.to_asn1_integer()?;
        cert.set_serial_number(&serial)?;
        cert.set_subject_name(&name)?;
        match &signer {
            Some((ca, _)) => cert.set_issuer_name(ca.subject_name())?,
            None => cert.set_issuer_name(&name)?,
        }
        cert.set_pubkey(&key)?;
        let (from, until) = (
            Asn1Time::from_unix(not_before as libc::time_t)?,
            Asn1Time::from_unix(not_after as libc::time_t)?,
        );
        cert.set_not_before(&from)?;
        cert.set_not_after(&until)?;
        if ca {
            cert.append_extension(BasicConstraints::new().critical().ca().build()?)?;
            let usage = KeyUsage::new()
                .critical()
                .key_cert_sign()
                .crl_sign()
                .build()?;
            cert.append_extension(usage)?;
        } else {
            let mut san = SubjectAlternativeName::new();
            if host.parse::<std::net::IpAddr>().is_ok() {
                san.ip(host);
            } else {
                san.dns(host);
            }
            let context = cert.x509v3_context(signer.as_ref().map(|(ca, _)| &**ca), None);
            let san = san.build(&context)?;
            cert.append_extension(san)?;
        }
        match &signer {
            Some((_, ca_key)) => cert.sign(ca_key, MessageDigest::sha256())?,
            None => cert.sign(&key, MessageDigest::sha256())?,
        }
        let cert = cert.build();
        Ok((
            String::from_utf8_lossy(&cert.to_pem()?).into_owned(),
            String::from_utf8_lossy(&key.private_key_to_pem_pkcs8()?).into_owned(),
        ))
    };
    build().map_err(|e| format!("cannot generate a certificate: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_is_read_certificate_by_certificate_leaf_first() {
        let (root, root_key) =
            certificate_between("uturn test root", 1_600_000_000, 1_900_000_000, None, true)
                .unwrap();
        let by_root = Issuer {
            cert: &root,
            key: &root_key,
        };
        let (intermediate, intermediate_key) = certificate_between(
            "uturn test intermediate",
            1_650_000_000,
            1_750_000_000,
            Some(by_root),
            true,
        )
        .unwrap();
        let by_intermediate = Issuer {
            cert: &intermediate,
            key: &intermediate_key,
        };
        let (leaf, leaf_key) = certificate_between(
            "127.0.0.1",
            1_700_000_000,
            1_800_000_123,
            Some(by_intermediate),
            false,
        )
        .unwrap();
        let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{leaf}{intermediate}"));
        let chain = certificate_chain(&b64).unwrap();
        assert_eq!(
            chain,
            [
                ChainCertificate {
                    subject: "CN=127.0.0.1".into(),
                    not_before: 1_700_000_000,
                    not_after: 1_800_000_123,
                },
                ChainCertificate {
                    subject: "CN=uturn test intermediate".into(),
                    not_before: 1_650_000_000,
                    not_after: 1_750_000_000,
                },
            ]
        );
        // The chain serves (the key is the leaf's), and the intermediate verifies the leaf.
        let chain_pem = format!("{leaf}{intermediate}");
        server_config_from_pem(chain_pem.as_bytes(), leaf_key.as_bytes()).unwrap();
        super::super::dtls::context_from_pem(chain_pem.as_bytes(), leaf_key.as_bytes()).unwrap();
        let pem = |pem: &str| openssl::x509::X509::from_pem(pem.as_bytes()).unwrap();
        let (leaf, intermediate, root) = (pem(&leaf), pem(&intermediate), pem(&root));
        assert!(leaf.verify(&intermediate.public_key().unwrap()).unwrap());
        assert!(intermediate.verify(&root.public_key().unwrap()).unwrap());
        assert_eq!(
            leaf.issuer_name().to_der().unwrap(),
            intermediate.subject_name().to_der().unwrap()
        );
        assert_eq!(certificate_chain("bm90IGEgY2VydA=="), None);
    }

    #[test]
    fn a_self_signed_certificate_serves_tls_and_dtls() {
        let (cert, key) = self_signed("127.0.0.1").unwrap();
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"));
        server_config_from_pem(cert.as_bytes(), key.as_bytes()).unwrap();
        super::super::dtls::context_from_pem(cert.as_bytes(), key.as_bytes()).unwrap();
        let encoded = base64::engine::general_purpose::STANDARD.encode(&cert);
        assert_eq!(decode_pem(&encoded).unwrap(), cert.as_bytes());
    }

    #[test]
    fn a_key_of_another_certificate_is_a_mismatch_for_tls_and_dtls() {
        let (cert, _) = self_signed("127.0.0.1").unwrap();
        let (_, other_key) = self_signed("127.0.0.1").unwrap();
        let err = server_config_from_pem(cert.as_bytes(), other_key.as_bytes()).unwrap_err();
        assert!(matches!(err, MaterialError::Mismatch(_)), "{err}");
        assert_eq!(err.field(), "key");
        let err = super::super::dtls::context_from_pem(cert.as_bytes(), other_key.as_bytes())
            .err()
            .unwrap();
        assert!(matches!(err, MaterialError::Mismatch(_)), "{err}");
        assert!(
            err.to_string()
                .contains("rotate the cert and the key together"),
            "{err}"
        );
    }

    #[test]
    fn base64_material_is_checked_field_by_field() {
        let (cert, key) = self_signed("127.0.0.1").unwrap();
        let encode = |pem: &str| base64::engine::general_purpose::STANDARD.encode(pem);
        let (cert, key) = (encode(&cert), encode(&key));
        server_config_from_base64(&cert, &key).unwrap();
        super::super::dtls::gate_from_base64(&cert, &key)
            .ok()
            .unwrap();
        let not_a_cert = encode("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        for (cert, key, field) in [
            ("%%%", key.as_str(), "cert"),
            (not_a_cert.as_str(), key.as_str(), "cert"),
            (cert.as_str(), "%%%", "key"),
            (cert.as_str(), cert.as_str(), "key"),
        ] {
            let tls = server_config_from_base64(cert, key).unwrap_err();
            let dtls = super::super::dtls::gate_from_base64(cert, key)
                .err()
                .unwrap();
            assert_eq!(
                (tls.field(), dtls.field()),
                (field, field),
                "{tls} / {dtls}"
            );
        }
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let err = server_config_from_pem(b"nope", b"nope").unwrap_err();
        assert_eq!(err.field(), "cert");
        assert!(err.to_string().contains("certificate"), "{err}");
        assert!(decode_pem("%%%").unwrap_err().contains("base64"));
    }
}
