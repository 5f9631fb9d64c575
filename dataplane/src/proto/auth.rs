//! Authentication: RFC 8489 §9.2 long-term credentials over stateless nonces, with the
//! challenges (401, 438) that carry the realm and a nonce.

use super::error::{Challenge, RequestError};
use super::nonce::{NonceCheck, NonceIssuer, NONCE_LEN};
use std::net::SocketAddr;
use std::time::Instant;
use stun_proto::types::attribute::{
    AttributeStaticType, MessageIntegrity, MessageIntegritySha256, Nonce, Realm, Username,
};
use stun_proto::types::message::{
    IntegrityAlgorithm, IntegrityKey, LongTermKeyCredentials, Message,
};
use uturn_shared::auth::AuthError;
use uturn_shared::snapshot::Snapshot;

/// An authenticated request: who sent it and the key its response is signed with.
pub(super) struct Authenticated {
    pub(super) username: String,
    /// Whose quota an allocation it makes counts against.
    pub(super) user_id: String,
    pub(super) integrity: IntegrityKey,
}

/// Checks credentials and nonces, and issues challenges.
pub(super) struct Authenticator {
    nonces: NonceIssuer,
    /// An instant and the unix time (seconds) it corresponds to: wall-clock time for nonces
    /// and ephemeral credentials comes from the `now` the engine is given.
    epoch: Instant,
    epoch_unix: u64,
}

impl Authenticator {
    /// An authenticator issuing nonces under `nonce_key`; `epoch` is `epoch_unix` seconds.
    pub(super) fn new(nonce_key: [u8; 32], epoch: Instant, epoch_unix: u64) -> Authenticator {
        Authenticator {
            nonces: NonceIssuer::new(nonce_key),
            epoch,
            epoch_unix,
        }
    }

    fn unix_now(&self, now: Instant) -> u64 {
        self.epoch_unix + now.saturating_duration_since(self.epoch).as_secs()
    }

    /// The realm and a fresh nonce for `from`.
    fn challenge(&self, now: Instant, snap: &Snapshot, from: SocketAddr) -> Challenge {
        Challenge {
            realm: snap.auth.realm().to_owned(),
            nonce: self.nonces.issue(self.unix_now(now), from),
        }
    }

    /// RFC 8489 §9.2.4: long-term credential checks, in the RFC's order.
    pub(super) fn authenticate(
        &self,
        now: Instant,
        snap: &Snapshot,
        from: SocketAddr,
        msg: &Message<'_>,
    ) -> Result<Authenticated, RequestError> {
        if !msg.has_attribute(MessageIntegrity::TYPE)
            && !msg.has_attribute(MessageIntegritySha256::TYPE)
        {
            return Err(RequestError::Unauthenticated(
                self.challenge(now, snap, from),
            ));
        }
        let (Ok(username), Ok(_realm), Ok(nonce)) = (
            msg.attribute::<Username>(),
            msg.attribute::<Realm>(),
            msg.attribute::<Nonce>(),
        ) else {
            return Err(RequestError::MissingCredentialAttributes);
        };
        let unix_now = self.unix_now(now);
        if self.nonces.check(nonce.nonce(), unix_now, from) == NonceCheck::Stale {
            return Err(RequestError::StaleNonce(self.challenge(now, snap, from)));
        }
        // RFC 8489 §9.2.4: a 401 to a request that used a valid nonce repeats that nonce, so
        // the client sees its credentials, not the nonce, were refused and does not loop.
        let refused = || {
            let mut echoed = [0u8; NONCE_LEN];
            echoed.copy_from_slice(nonce.nonce().as_bytes());
            RequestError::CredentialsRefused(Challenge {
                realm: snap.auth.realm().to_owned(),
                nonce: echoed,
            })
        };
        let credentials = match snap.auth.credentials(username.username(), unix_now) {
            Ok(c) => c,
            // auth type none: TURN is off; 400 so that clients do not retry (as stunnerd).
            Err(AuthError::TurnDisabled) => return Err(RequestError::TurnDisabled),
            Err(_) => return Err(refused()),
        };
        let integrity = LongTermKeyCredentials::new(
            username.username().to_owned(),
            credentials.password,
            snap.auth.realm().to_owned(),
        )
        .make_key(IntegrityAlgorithm::Sha1);
        if msg.validate_integrity_with_key(&integrity).is_err() {
            return Err(refused());
        }
        Ok(Authenticated {
            username: username.username().to_owned(),
            user_id: credentials.user_id,
            integrity,
        })
    }
}
