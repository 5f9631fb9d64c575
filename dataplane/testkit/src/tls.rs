//! Certificates for the TLS and DTLS listeners, and the one a server serves.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A self-signed certificate for `localhost` and 127.0.0.1 and its key, as PEM files.
pub struct Certificate {
    /// The certificate.
    pub cert: PathBuf,
    /// The private key.
    pub key: PathBuf,
}

/// Writes a self-signed P-256 certificate (CN=localhost) into `dir`.
pub fn self_signed_cert(dir: &Path) -> Certificate {
    use openssl::asn1::Asn1Time;
    use openssl::bn::BigNum;
    use openssl::ec::{EcGroup, EcKey};
    use openssl::hash::MessageDigest;
    use openssl::nid::Nid;
    use openssl::pkey::PKey;
    use openssl::x509::extension::SubjectAlternativeName;
    use openssl::x509::{X509Builder, X509NameBuilder};

    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    let key = PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap();
    let mut name = X509NameBuilder::new().unwrap();
    name.append_entry_by_nid(Nid::COMMONNAME, "localhost")
        .unwrap();
    let name = name.build();
    let mut x509 = X509Builder::new().unwrap();
    x509.set_version(2).unwrap();
    let serial = BigNum::from_u32(1).unwrap().to_asn1_integer().unwrap();
    x509.set_serial_number(&serial).unwrap();
    x509.set_subject_name(&name).unwrap();
    x509.set_issuer_name(&name).unwrap();
    x509.set_pubkey(&key).unwrap();
    x509.set_not_before(&Asn1Time::days_from_now(0).unwrap())
        .unwrap();
    x509.set_not_after(&Asn1Time::days_from_now(1).unwrap())
        .unwrap();
    let san = SubjectAlternativeName::new()
        .dns("localhost")
        .ip("127.0.0.1")
        .build(&x509.x509v3_context(None, None))
        .unwrap();
    x509.append_extension(san).unwrap();
    x509.sign(&key, MessageDigest::sha256()).unwrap();
    let cert = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    std::fs::write(&cert, x509.build().to_pem().unwrap()).unwrap();
    std::fs::write(&key_path, key.private_key_to_pem_pkcs8().unwrap()).unwrap();
    Certificate {
        cert,
        key: key_path,
    }
}

/// The subject of [`chain_between`]'s intermediate.
pub const INTERMEDIATE_SUBJECT: &str = "CN=uturn test intermediate";

/// A certificate chain for 127.0.0.1 as a listener serves it, PEM (the leaf, then the
/// intermediate that issued it), and the leaf's key: the leaf valid over `leaf`, the
/// intermediate ([`INTERMEDIATE_SUBJECT`]) over `intermediate` (each `(notBefore, notAfter)`
/// in Unix seconds), under a root valid ten years either side of now (not in the chain, as
/// servers leave the root out).
pub fn chain_between(leaf: (i64, i64), intermediate: (i64, i64)) -> (String, String) {
    use uturn_dataplane::io::tls::{certificate_between, Issuer};
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let decade = 3653 * 86_400;
    let (root, root_key) =
        certificate_between("uturn test root", now - decade, now + decade, None, true).unwrap();
    let name = INTERMEDIATE_SUBJECT.trim_start_matches("CN=");
    let by_root = Issuer {
        cert: &root,
        key: &root_key,
    };
    let (middle, middle_key) =
        certificate_between(name, intermediate.0, intermediate.1, Some(by_root), true).unwrap();
    let by_middle = Issuer {
        cert: &middle,
        key: &middle_key,
    };
    let (leaf, leaf_key) =
        certificate_between("127.0.0.1", leaf.0, leaf.1, Some(by_middle), false).unwrap();
    (format!("{leaf}{middle}"), leaf_key)
}

/// The server certificate (PEM) `openssl s_client` sees on 127.0.0.1:`port`, over DTLS 1.2
/// if `dtls`, else TLS.
pub fn served_certificate(port: u16, dtls: bool) -> Option<String> {
    let mut command = Command::new("timeout");
    command.args(["10", "openssl", "s_client"]);
    if dtls {
        command.arg("-dtls1_2");
    }
    let output = command
        .args(["-connect", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::null())
        .output()
        .expect("openssl (apt-get install openssl)");
    let text = String::from_utf8_lossy(&output.stdout);
    let begin = text.find("-----BEGIN CERTIFICATE-----")?;
    let end = text[begin..].find("-----END CERTIFICATE-----")? + begin;
    Some(text[begin..end + "-----END CERTIFICATE-----".len()].to_string() + "\n")
}
