//! TURN authentication as stunnerd does it: static (`plaintext`), ephemeral TURN REST
//! (`longterm`) and `none`, with the long-term key `MD5(username:realm:password)` on the
//! configured realm.

use crate::config::{AuthConfig, AuthType};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use md5::{Digest, Md5};

/// Why a username was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    /// Static auth: the username is not the configured one.
    InvalidUsername,
    /// Ephemeral auth: no integer expiry in the username, or expiry 0.
    InvalidTimeWindowed(String),
    /// Ephemeral auth: the expiry lies in the past.
    Expired(String),
    /// Auth type `none`: TURN is disabled, only Binding is served.
    TurnDisabled,
}

impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AuthError::InvalidUsername => {
                write!(f, "static auth request: failed: invalid username")
            }
            AuthError::InvalidTimeWindowed(u) => write!(f, "invalid time-windowed username {u:?}"),
            AuthError::Expired(u) => write!(f, "expired time-windowed username {u:?}"),
            AuthError::TurnDisabled => {
                write!(f, "authentication disabled: TURN is off (auth type none)")
            }
        }
    }
}

impl std::error::Error for AuthError {}

/// The credentials that authenticate one username: the password the long-term key derives
/// from and the user-id used for quotas and events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The password (static: configured; ephemeral: base64(HMAC-SHA1(secret, username))).
    pub password: String,
    /// The user-id: the username, or the part after the expiry for `<expiry>:<user>`.
    pub user_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    Static { username: String, password: String },
    Ephemeral { secret: String },
    Disabled,
}

/// Looks up credentials for a username under the running auth config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authenticator {
    mode: Mode,
    realm: String,
}

impl Authenticator {
    /// Builds the authenticator of a validated auth config.
    pub fn from_config(config: &AuthConfig) -> Self {
        let credential = |key: &str| config.credentials.get(key).cloned().unwrap_or_default();
        let mode = match config.auth_type {
            AuthType::Static => Mode::Static {
                username: credential("username"),
                password: credential("password"),
            },
            AuthType::Ephemeral => Mode::Ephemeral {
                secret: credential("secret"),
            },
            AuthType::None => Mode::Disabled,
        };
        Authenticator {
            mode,
            realm: config.realm.clone(),
        }
    }

    /// The configured realm: sent in challenges and used for every long-term key.
    pub fn realm(&self) -> &str {
        &self.realm
    }

    /// Resolves the credentials of `username` at wall-clock time `now_unix` (seconds).
    pub fn credentials(&self, username: &str, now_unix: u64) -> Result<Credentials, AuthError> {
        match &self.mode {
            Mode::Static {
                username: configured,
                password,
            } => {
                if username != configured {
                    return Err(AuthError::InvalidUsername);
                }
                Ok(Credentials {
                    password: password.clone(),
                    user_id: username.to_owned(),
                })
            }
            Mode::Ephemeral { secret } => {
                let parts: Vec<&str> = username.split(':').collect();
                let Some((position, expiry)) = parts
                    .iter()
                    .enumerate()
                    .find_map(|(i, part)| crate::go::atoi(part).map(|ts| (i, ts)))
                else {
                    return Err(AuthError::InvalidTimeWindowed(username.to_owned()));
                };
                if expiry == 0 {
                    return Err(AuthError::InvalidTimeWindowed(username.to_owned()));
                }
                if expiry < 0 || (expiry as u64) < now_unix {
                    return Err(AuthError::Expired(username.to_owned()));
                }
                let user_id = if parts.len() == 2 && position == 0 {
                    parts[1].to_owned()
                } else {
                    username.to_owned()
                };
                Ok(Credentials {
                    password: ephemeral_password(secret, username),
                    user_id,
                })
            }
            Mode::Disabled => Err(AuthError::TurnDisabled),
        }
    }
}

/// The TURN REST password of `username`: `base64(HMAC-SHA1(secret, username))`.
pub fn ephemeral_password(secret: &str, username: &str) -> String {
    let Ok(mut mac) = Hmac::<sha1::Sha1>::new_from_slice(secret.as_bytes()) else {
        // HMAC takes keys of any length; this branch cannot be reached.
        return String::new();
    };
    mac.update(username.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

/// A TURN REST username valid until `expiry_unix`: `"<expiry>:<user_id>"`.
pub fn ephemeral_username(expiry_unix: u64, user_id: &str) -> String {
    format!("{expiry_unix}:{user_id}")
}

/// The RFC 5389 long-term credential key: `MD5(username ":" realm ":" password)`.
pub fn long_term_key(username: &str, realm: &str, password: &str) -> [u8; 16] {
    let mut md5 = Md5::new();
    md5.update(username.as_bytes());
    md5.update(b":");
    md5.update(realm.as_bytes());
    md5.update(b":");
    md5.update(password.as_bytes());
    md5.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn auth(auth_type: AuthType, creds: &[(&str, &str)]) -> Authenticator {
        Authenticator::from_config(&AuthConfig {
            auth_type,
            realm: "stunner.l7mp.io".into(),
            credentials: creds
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            lifetime: String::new(),
        })
    }

    #[test]
    fn static_matches_username_exactly() {
        let a = auth(
            AuthType::Static,
            &[("username", "user1"), ("password", "pa$$")],
        );
        let creds = a.credentials("user1", 0).unwrap();
        assert_eq!(creds.password, "pa$$");
        assert_eq!(creds.user_id, "user1");
        assert_eq!(a.credentials("User1", 0), Err(AuthError::InvalidUsername));
        assert_eq!(a.credentials("", 0), Err(AuthError::InvalidUsername));
    }

    #[test]
    fn ephemeral_follows_turn_rest() {
        let a = auth(AuthType::Ephemeral, &[("secret", "my-secret")]);
        let now = 1_700_000_000;
        let user = ephemeral_username(now + 3600, "alice");
        let creds = a.credentials(&user, now).unwrap();
        assert_eq!(creds.user_id, "alice");
        assert_eq!(creds.password, ephemeral_password("my-secret", &user));
        // Position does not matter; user-id is then the whole username.
        let swapped = format!("alice:{}", now + 10);
        assert_eq!(a.credentials(&swapped, now).unwrap().user_id, swapped);
        assert!(matches!(
            a.credentials(&format!("{}:bob", now - 1), now),
            Err(AuthError::Expired(_))
        ));
        assert!(matches!(
            a.credentials("-5:bob", now),
            Err(AuthError::Expired(_))
        ));
        assert!(matches!(
            a.credentials("bob", now),
            Err(AuthError::InvalidTimeWindowed(_))
        ));
        assert!(matches!(
            a.credentials("0:bob", now),
            Err(AuthError::InvalidTimeWindowed(_))
        ));
        assert!(matches!(
            a.credentials("12a:bob", now),
            Err(AuthError::InvalidTimeWindowed(_))
        ));
    }

    #[test]
    fn ephemeral_password_is_base64_hmac_sha1() {
        // Vector from Python's hmac/hashlib/base64 modules.
        let p = ephemeral_password("secret", "1681490135:user-id");
        assert_eq!(p, "nfD/hukhxkg5VZsV5I9zo9/mIpQ=");
    }

    #[test]
    fn none_disables_turn() {
        let a = auth(AuthType::None, &[]);
        assert_eq!(a.credentials("x", 0), Err(AuthError::TurnDisabled));
    }

    #[test]
    fn long_term_key_is_rfc5389_md5() {
        // Vector from Python's hashlib: MD5("user:realm:pass").
        let key = long_term_key("user", "realm", "pass");
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "8493fbc53ba582fb4c044c456bdc40eb");
    }
}
