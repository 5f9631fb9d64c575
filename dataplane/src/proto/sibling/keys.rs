//! The keys the pods of one gateway share ([`SiblingKeys`]: a current key messages are sent
//! under, and optionally a next one they are accepted under too, so that the key rotates
//! without a restart), as read from `--sibling-key-file` or `UTURN_SIBLING_KEY`.

use super::TAG_LEN;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The shortest key accepted.
pub const MIN_KEY_LEN: usize = 16;

/// One key the pods of one gateway share.
#[derive(Clone)]
pub struct SiblingKey {
    len: usize,
    /// HMAC-SHA256 keyed once; cloned for each message.
    mac: Hmac<Sha256>,
    /// A hash of the key (domain-separated): tells keys apart, and names them in logs.
    digest: [u8; 32],
}

impl std::fmt::Debug for SiblingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SiblingKey({} bytes)", self.len)
    }
}

impl PartialEq for SiblingKey {
    fn eq(&self, other: &SiblingKey) -> bool {
        self.digest == other.digest
    }
}

/// Why a key (or a key file) was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// A key shorter than [`MIN_KEY_LEN`]: which line of the file (1 or 2), and its length.
    TooShort {
        /// The line (1: the current key, 2: the next).
        line: usize,
        /// Its length in bytes.
        len: usize,
    },
    /// No key at all (an empty file).
    Empty,
    /// More than two keys: how many lines.
    TooManyKeys(usize),
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyError::TooShort { line, len } => write!(
                f,
                "the sibling key on line {line} has {len} bytes: use at least {MIN_KEY_LEN} \
                 random bytes on one line (e.g. head -c 32 /dev/urandom | base64 -w0)"
            ),
            KeyError::Empty => write!(
                f,
                "no sibling key: give the current key on the first line, and optionally the \
                 next key on the second"
            ),
            KeyError::TooManyKeys(n) => write!(
                f,
                "{n} lines of sibling keys: give the current key on the first line and at most \
                 one more (the next key, or the previous one during a rotation) on the second; a \
                 key is one line (base64 -w0 does not wrap it)"
            ),
        }
    }
}

impl std::error::Error for KeyError {}

impl SiblingKey {
    /// A key from its bytes (a final line break ignored, nothing else: a key may hold any
    /// byte but a line break); at least [`MIN_KEY_LEN`] bytes.
    pub fn new(bytes: &[u8]) -> Result<SiblingKey, KeyError> {
        let key = bytes
            .strip_suffix(b"\r\n")
            .or_else(|| bytes.strip_suffix(b"\n"))
            .unwrap_or(bytes);
        SiblingKey::on_line(key, 1)
    }

    fn on_line(key: &[u8], line: usize) -> Result<SiblingKey, KeyError> {
        if key.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort {
                line,
                len: key.len(),
            });
        }
        // HMAC takes a key of any length.
        let mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts any key length");
        let digest = Sha256::new()
            .chain_update(b"uturn sibling key id\0")
            .chain_update(key)
            .finalize();
        Ok(SiblingKey {
            len: key.len(),
            mac,
            digest: digest.into(),
        })
    }

    /// A short public name of the key for logs (the first bytes of a hash of it), so that an
    /// operator can see which keys a pod runs during a rotation without seeing them.
    pub fn id(&self) -> String {
        self.digest[..4]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    pub(super) fn tag(&self, body: &[u8]) -> [u8; TAG_LEN] {
        let mut mac = self.mac.clone();
        mac.update(body);
        let full = mac.finalize().into_bytes();
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&full[..TAG_LEN]);
        tag
    }

    pub(super) fn verifies(&self, body: &[u8], tag: &[u8]) -> bool {
        let mut mac = self.mac.clone();
        mac.update(body);
        mac.verify_truncated_left(tag).is_ok()
    }
}

/// The keys a pod runs: messages are sent under the current key and accepted under it or the
/// next one. Rotating: every pod gets the new key as next (`OLD`, `NEW`), then as current with
/// the old one kept as next (`NEW`, `OLD`), then alone (`NEW`); a pod that has taken a step
/// talks with one that has not, so the pods never split.
#[derive(Debug, Clone, PartialEq)]
pub struct SiblingKeys {
    current: SiblingKey,
    next: Option<SiblingKey>,
}

impl From<SiblingKey> for SiblingKeys {
    fn from(current: SiblingKey) -> SiblingKeys {
        SiblingKeys {
            current,
            next: None,
        }
    }
}

impl SiblingKeys {
    /// The current key and, if given, the next one.
    pub fn new(current: SiblingKey, next: Option<SiblingKey>) -> SiblingKeys {
        SiblingKeys { current, next }
    }

    /// The keys of a key file (or of `UTURN_SIBLING_KEY`): the current key on the first line,
    /// optionally another key accepted too on the second. A line ends at `\n` (a `\r` before
    /// it is dropped too); empty lines are skipped; nothing else is trimmed, so a key may hold
    /// any byte but a line break.
    pub fn parse(text: &[u8]) -> Result<SiblingKeys, KeyError> {
        let lines: Vec<&[u8]> = text
            .split(|b| *b == b'\n')
            .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
            .filter(|line| !line.is_empty())
            .collect();
        match lines.as_slice() {
            [] => Err(KeyError::Empty),
            [current] => Ok(SiblingKey::on_line(current, 1)?.into()),
            [current, next] => Ok(SiblingKeys {
                current: SiblingKey::on_line(current, 1)?,
                next: Some(SiblingKey::on_line(next, 2)?),
            }),
            more => Err(KeyError::TooManyKeys(more.len())),
        }
    }

    /// The key messages are sent under.
    pub fn current(&self) -> &SiblingKey {
        &self.current
    }

    /// The other key messages are accepted under, if any.
    pub fn next(&self) -> Option<&SiblingKey> {
        self.next.as_ref()
    }
}

impl std::fmt::Display for SiblingKeys {
    /// `current <id>, next <id>` (or `next none`), for logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "current {}", self.current.id())?;
        match &self.next {
            Some(next) => write!(f, ", next {}", next.id()),
            None => write!(f, ", next none"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{decode, encode, Kind, SiblingMessage, Stamp, FLAG_QUERY};
    use super::*;
    use std::net::SocketAddr;

    fn key(byte: u8) -> SiblingKey {
        SiblingKey::new(&[byte; 32]).unwrap()
    }

    fn message(payload: &[u8], origin: Option<SocketAddr>) -> SiblingMessage<'_> {
        SiblingMessage {
            kind: Kind::Forward,
            flags: FLAG_QUERY,
            client: "[2001:db8::7]:50000".parse().unwrap(),
            origin,
            listener: "stunner/udp-gateway/udp-listener",
            payload,
        }
    }

    fn stamp(sent_ms: u64) -> Stamp {
        Stamp {
            sent_ms,
            sender: 0x0123_4567_89ab_cdef,
            counter: 7,
        }
    }

    #[test]
    fn keys_are_at_least_16_bytes_and_lose_only_a_final_line_break() {
        assert!(SiblingKey::new(b"short").is_err());
        assert!(SiblingKey::new(b"0123456789abcde\r\n").is_err());
        assert!(
            SiblingKey::new(&[b' '; 16]).is_ok(),
            "keys keep every byte but line breaks"
        );
        let a = SiblingKey::new(b"0123456789abcdef\n").unwrap();
        let b = SiblingKey::new(b"0123456789abcdef").unwrap();
        let mut buf = Vec::new();
        encode(&a, &message(b"x", None), stamp(1), &mut buf).unwrap();
        assert!(decode(&b.clone().into(), &buf, 1).is_ok());
        assert_eq!(format!("{a:?}"), "SiblingKey(16 bytes)");
        assert_eq!(a.id(), b.id());
        assert_eq!(a.id().len(), 8);
        assert_ne!(a.id(), key(1).id());
    }

    #[test]
    fn a_key_file_holds_the_current_key_and_optionally_the_next() {
        let old = "0123456789abcdef0123456789abcdef";
        let new = "fedcba9876543210fedcba9876543210";
        let one = SiblingKeys::parse(format!("{old}\n").as_bytes()).unwrap();
        assert_eq!(
            one.current().id(),
            SiblingKey::new(old.as_bytes()).unwrap().id()
        );
        assert!(one.next().is_none());
        for text in [
            format!("{old}\n{new}\n"),
            format!("{old}\r\n{new}"),
            format!("\n{old}\n\n{new}\n\n"),
        ] {
            let two = SiblingKeys::parse(text.as_bytes()).unwrap();
            assert_eq!(
                (two.current().id(), two.next().map(SiblingKey::id)),
                (
                    SiblingKey::new(old.as_bytes()).unwrap().id(),
                    Some(SiblingKey::new(new.as_bytes()).unwrap().id())
                ),
                "{text:?}"
            );
        }
        assert_eq!(SiblingKeys::parse(b"\n\n"), Err(KeyError::Empty));
        assert_eq!(
            SiblingKeys::parse(format!("{old}\nshort\n").as_bytes()),
            Err(KeyError::TooShort { line: 2, len: 5 })
        );
        assert_eq!(
            SiblingKeys::parse(format!("{old}\n{new}\n{old}").as_bytes()),
            Err(KeyError::TooManyKeys(3))
        );
        let shown = SiblingKeys::parse(format!("{old}\n{new}").as_bytes())
            .unwrap()
            .to_string();
        assert!(
            shown.starts_with("current ") && shown.contains(", next "),
            "{shown}"
        );
        assert!(!shown.contains(old) && !shown.contains(new));
        for error in [
            KeyError::Empty,
            KeyError::TooShort { line: 1, len: 3 },
            KeyError::TooManyKeys(3),
        ] {
            assert!(error.to_string().contains("line"), "{error}");
        }
    }
}
