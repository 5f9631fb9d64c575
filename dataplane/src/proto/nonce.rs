//! Stateless nonces: nothing is stored per client before it authenticates.
//!
//! A nonce is the unpadded base64url of `issued-at (4 bytes, unix seconds) ‖ HMAC-SHA256(key,
//! issued-at ‖ client address) truncated to 8 bytes`: 16 characters. It is bound to the
//! client's transport address and is valid for at most [`NONCE_LIFETIME_SECS`].
//!
//! Short on purpose: a 401 must fit 3x the smallest real Allocate (28 bytes, see
//! `Engine::handle_client`). 64 bits of MAC still take 2^63 online guesses to forge one, and a
//! forged nonce only spares a client the round trip of a 401; the password is still needed.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::SocketAddr;

/// How long a nonce stays valid (RFC 8656 recommends an hour at most).
pub const NONCE_LIFETIME_SECS: u64 = 3600;

const MAC_LEN: usize = 8;
/// Issued-at and MAC, before encoding.
const RAW_LEN: usize = 4 + MAC_LEN;
/// Length of a nonce string: base64 of [`RAW_LEN`] bytes (a multiple of 3: no padding).
pub(super) const NONCE_LEN: usize = RAW_LEN / 3 * 4;

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

    /// A fresh nonce for `client` at `now_unix`, as ASCII.
    pub fn issue(&self, now_unix: u64, client: SocketAddr) -> [u8; NONCE_LEN] {
        let issued_at = now_unix as u32;
        let mut raw = [0u8; RAW_LEN];
        raw[..4].copy_from_slice(&issued_at.to_be_bytes());
        raw[4..].copy_from_slice(&self.mac(issued_at, client));
        let mut out = [0u8; NONCE_LEN];
        let written = URL_SAFE_NO_PAD
            .encode_slice(raw, &mut out)
            .expect("NONCE_LEN is the encoded length of RAW_LEN bytes");
        debug_assert_eq!(written, NONCE_LEN);
        out
    }

    /// Checks a nonce a client sent back.
    pub fn check(&self, nonce: &str, now_unix: u64, client: SocketAddr) -> NonceCheck {
        let mut raw = [0u8; RAW_LEN];
        if nonce.len() != NONCE_LEN || URL_SAFE_NO_PAD.decode_slice(nonce, &mut raw) != Ok(RAW_LEN)
        {
            return NonceCheck::Stale;
        }
        let issued_at = u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]);
        let issued_at_unix = u64::from(issued_at);
        if issued_at_unix > now_unix || now_unix - issued_at_unix > NONCE_LIFETIME_SECS {
            return NonceCheck::Stale;
        }
        // Constant-time compare: the MAC is the secret-derived part.
        let diff = self
            .mac(issued_at, client)
            .iter()
            .zip(&raw[4..])
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff == 0 {
            NonceCheck::Valid
        } else {
            NonceCheck::Stale
        }
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
