//! Stateless nonces: nothing is stored per client before it authenticates.
//!
//! A nonce is `<issued-at, 8 hex digits of unix seconds><HMAC-SHA256(key, issued-at ‖ client
//! address) truncated to 12 bytes, hex>`. It is bound to the client's transport address and
//! is valid for at most [`NONCE_LIFETIME_SECS`].

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::SocketAddr;

/// How long a nonce stays valid (RFC 8656 recommends an hour at most).
pub const NONCE_LIFETIME_SECS: u64 = 3600;

const MAC_LEN: usize = 12;
/// Length of a nonce string: 8 hex digits of time plus 24 hex digits of MAC.
pub const NONCE_LEN: usize = 8 + 2 * MAC_LEN;

/// Issues and checks nonces under one secret key.
#[derive(Clone)]
pub struct NonceIssuer {
    key: [u8; 32],
}

/// The verdict on a nonce sent by a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonceCheck {
    /// Issued by us, for this client, less than an hour ago.
    Valid,
    /// Not one of ours, for another client, from the future, or too old: answer 438.
    Stale,
}

impl NonceIssuer {
    /// An issuer with the given secret key (random per process).
    pub fn new(key: [u8; 32]) -> Self {
        NonceIssuer { key }
    }

    fn mac(&self, issued_at: u32, client: SocketAddr) -> [u8; MAC_LEN] {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key");
        mac.update(&issued_at.to_be_bytes());
        match client {
            SocketAddr::V4(v4) => mac.update(&v4.ip().octets()),
            SocketAddr::V6(v6) => mac.update(&v6.ip().octets()),
        }
        mac.update(&client.port().to_be_bytes());
        let full = mac.finalize().into_bytes();
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&full[..MAC_LEN]);
        out
    }

    /// A fresh nonce for `client` at `now_unix`, written as ASCII hex into `out`.
    pub fn issue(&self, now_unix: u64, client: SocketAddr) -> [u8; NONCE_LEN] {
        let issued_at = now_unix as u32;
        let mut out = [0u8; NONCE_LEN];
        hex_into(&issued_at.to_be_bytes(), &mut out[..8]);
        hex_into(&self.mac(issued_at, client), &mut out[8..]);
        out
    }

    /// Checks a nonce a client sent back.
    pub fn check(&self, nonce: &str, now_unix: u64, client: SocketAddr) -> NonceCheck {
        let bytes = nonce.as_bytes();
        if bytes.len() != NONCE_LEN {
            return NonceCheck::Stale;
        }
        let Some(issued_at) = std::str::from_utf8(&bytes[..8])
            .ok()
            .and_then(|t| u32::from_str_radix(t, 16).ok())
        else {
            return NonceCheck::Stale;
        };
        let issued_at_unix = u64::from(issued_at);
        if issued_at_unix > now_unix || now_unix - issued_at_unix > NONCE_LIFETIME_SECS {
            return NonceCheck::Stale;
        }
        let mut expected = [0u8; 2 * MAC_LEN];
        hex_into(&self.mac(issued_at, client), &mut expected);
        // Constant-time compare: the MAC is the secret-derived part.
        let diff = expected
            .iter()
            .zip(&bytes[8..])
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff == 0 {
            NonceCheck::Valid
        } else {
            NonceCheck::Stale
        }
    }
}

fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0x0f)];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonce_is_bound_to_client_and_time() {
        let issuer = NonceIssuer::new([7; 32]);
        let alice: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let bob: SocketAddr = "10.0.0.1:5001".parse().unwrap();
        let nonce = issuer.issue(1_000_000, alice);
        let nonce = std::str::from_utf8(&nonce).unwrap();
        assert_eq!(issuer.check(nonce, 1_000_000, alice), NonceCheck::Valid);
        assert_eq!(issuer.check(nonce, 1_003_600, alice), NonceCheck::Valid);
        assert_eq!(issuer.check(nonce, 1_003_601, alice), NonceCheck::Stale);
        assert_eq!(issuer.check(nonce, 999_999, alice), NonceCheck::Stale);
        assert_eq!(issuer.check(nonce, 1_000_000, bob), NonceCheck::Stale);
        assert_eq!(
            NonceIssuer::new([8; 32]).check(nonce, 1_000_000, alice),
            NonceCheck::Stale
        );
        assert_eq!(issuer.check("garbage", 1_000_000, alice), NonceCheck::Stale);
        assert_eq!(
            issuer.check(&"z".repeat(NONCE_LEN), 1_000_000, alice),
            NonceCheck::Stale
        );
    }
}
