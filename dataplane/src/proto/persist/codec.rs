//! The journal's bytes: a header, then length-prefixed, checksummed entries.
//!
//! ```text
//! header  magic "uturnAJ\n" (8) | version u32 | boot id (16) | CRC-32 of the 28 before (u32)
//! entry   body length u32 | CRC-32 of the length's 4 bytes and the body (u32) | body
//! Put     tag 1 | listener str | client addr | relays u8 (bit 0 IPv4, bit 1 IPv6), then a
//!         u16 port for each bit set | dont_fragment u8 | username str | user_id str |
//!         expires_at_ns u64 | Allocate transaction id (12) | Allocate response bytes |
//!         via u8 (0, or 1 and an addr) | permissions: count u16, each ip, expires_at_ns u64 |
//!         channels: count u16, each number u16, peer addr, expires_at_ns u64
//! Delete  tag 2 | listener str | client addr
//! ```
//!
//! Integers are big-endian; a str or bytes field is a u16 length and its bytes (a str UTF-8),
//! an ip a family byte (4 or 6) and the address's bytes, an addr an ip and a u16 port. A body
//! holds one entry and nothing after it.
//!
//! The failure it prevents: a journal cut short by a crash, or a disk that flipped a bit, must
//! cost the one entry it touched, never the process (a panic in a restart loop) nor the other
//! entries. Nothing here panics on any input: every read is bounds-checked, an entry whose
//! checksum or body is bad is skipped, and an entry cut short at the end stops the reading.

use super::{AllocationRecord, ChannelRecord, JournalEntry, PermissionRecord, RelayPorts};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use stun_proto::types::message::TransactionId;

/// The journal's first bytes.
pub const JOURNAL_MAGIC: [u8; 8] = *b"uturnAJ\n";
/// The format version this code writes and reads.
pub const JOURNAL_VERSION: u32 = 1;
/// The longest entry body written or read: far above an allocation at the permission and
/// channel caps, so a length above it is a corrupt one.
pub const MAX_RECORD_LEN: usize = 1 << 20;

const HEADER_LEN: usize = 32;
const FRAME_LEN: usize = 8;
const TAG_PUT: u8 = 1;
const TAG_DELETE: u8 = 2;

/// What a journal's header says besides its format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalHeader {
    /// The kernel's boot id when the journal was started: its monotonic deadlines mean
    /// nothing after another boot.
    pub boot_id: [u8; 16],
}

/// Why a byte buffer is no journal this code can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// It does not start with [`JOURNAL_MAGIC`].
    NotAJournal,
    /// Its format version is not [`JOURNAL_VERSION`].
    UnknownVersion(u32),
    /// Its header's checksum does not match.
    CorruptHeader,
}

/// Why an entry could not be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodeError {
    /// A string, byte field or list longer than a u16 count, or a body over
    /// [`MAX_RECORD_LEN`].
    TooLarge,
}

/// What [`decode`] read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// The header; `None` for an empty journal or one cut short inside its header.
    pub header: Option<JournalHeader>,
    /// The entries that read whole, in order.
    pub entries: Vec<JournalEntry>,
    /// Entries skipped: a bad checksum, a body that does not decode, or a length no entry
    /// has (the reading stops there: nothing after it can be found).
    pub corrupt: usize,
    /// 1 if the journal ends inside an entry (or its header): a write cut short.
    pub torn: usize,
}

/// Appends the journal's header to `out`.
pub fn encode_header(header: &JournalHeader, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&JOURNAL_MAGIC);
    out.extend_from_slice(&JOURNAL_VERSION.to_be_bytes());
    out.extend_from_slice(&header.boot_id);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// Appends `entry`, framed, to `out`; on an error `out` is as it was.
pub fn encode_entry(entry: &JournalEntry, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(&[0; FRAME_LEN]);
    let body = match entry {
        JournalEntry::Put(record) => put_body(record, out),
        JournalEntry::Delete { listener, client } => delete_body(listener, *client, out),
    };
    let len = out.len() - start - FRAME_LEN;
    if body.is_err() || len > MAX_RECORD_LEN {
        out.truncate(start);
        return Err(EncodeError::TooLarge);
    }
    let len = (len as u32).to_be_bytes();
    out[start..start + 4].copy_from_slice(&len);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&len);
    crc.update(&out[start + FRAME_LEN..]);
    out[start + 4..start + FRAME_LEN].copy_from_slice(&crc.finalize().to_be_bytes());
    Ok(())
}

/// Reads a journal: its header, then every entry that reads whole (see [`Decoded`]).
pub fn decode(buf: &[u8]) -> Result<Decoded, DecodeError> {
    let mut decoded = Decoded {
        header: None,
        entries: Vec::new(),
        corrupt: 0,
        torn: 0,
    };
    let magic_seen = buf.len().min(JOURNAL_MAGIC.len());
    if buf[..magic_seen] != JOURNAL_MAGIC[..magic_seen] {
        return Err(DecodeError::NotAJournal);
    }
    let Some((header, mut rest)) = buf.split_at_checked(HEADER_LEN) else {
        decoded.torn = usize::from(!buf.is_empty());
        return Ok(decoded);
    };
    let version = u32::from_be_bytes([header[8], header[9], header[10], header[11]]);
    let crc = u32::from_be_bytes([header[28], header[29], header[30], header[31]]);
    if crc32fast::hash(&header[..28]) != crc {
        return Err(DecodeError::CorruptHeader);
    }
    if version != JOURNAL_VERSION {
        return Err(DecodeError::UnknownVersion(version));
    }
    let mut boot_id = [0; 16];
    boot_id.copy_from_slice(&header[12..28]);
    decoded.header = Some(JournalHeader { boot_id });
    while !rest.is_empty() {
        let Some((frame, after)) = rest.split_at_checked(FRAME_LEN) else {
            decoded.torn = 1;
            break;
        };
        let len_bytes = [frame[0], frame[1], frame[2], frame[3]];
        let len = u32::from_be_bytes(len_bytes) as usize;
        if len > MAX_RECORD_LEN {
            decoded.corrupt += 1;
            break;
        }
        let Some((body, after)) = after.split_at_checked(len) else {
            decoded.torn = 1;
            break;
        };
        rest = after;
        let crc = u32::from_be_bytes([frame[4], frame[5], frame[6], frame[7]]);
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&len_bytes);
        hasher.update(body);
        match (hasher.finalize() == crc).then(|| entry(body)).flatten() {
            Some(entry) => decoded.entries.push(entry),
            None => decoded.corrupt += 1,
        }
    }
    Ok(decoded)
}

/// A Put's body: the record's fields, in the order [`read_put`] reads them.
fn put_body(record: &AllocationRecord, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    out.push(TAG_PUT);
    put_bytes(out, record.listener.as_bytes())?;
    put_addr(out, record.client);
    let relays = record.relays;
    out.push(u8::from(relays.v4.is_some()) | u8::from(relays.v6.is_some()) << 1);
    for port in [relays.v4, relays.v6].into_iter().flatten() {
        out.extend_from_slice(&port.to_be_bytes());
    }
    out.push(u8::from(record.dont_fragment));
    put_bytes(out, record.username.as_bytes())?;
    put_bytes(out, record.user_id.as_bytes())?;
    out.extend_from_slice(&record.expires_at_ns.to_be_bytes());
    out.extend_from_slice(&u128::from(record.allocate_txid).to_be_bytes()[4..]);
    put_bytes(out, &record.allocate_response)?;
    match record.via {
        Some(via) => {
            out.push(1);
            put_addr(out, via);
        }
        None => out.push(0),
    }
    put_count(out, record.permissions.len())?;
    for permission in &record.permissions {
        put_ip(out, permission.ip);
        out.extend_from_slice(&permission.expires_at_ns.to_be_bytes());
    }
    put_count(out, record.channels.len())?;
    for channel in &record.channels {
        out.extend_from_slice(&channel.number.to_be_bytes());
        put_addr(out, channel.peer);
        out.extend_from_slice(&channel.expires_at_ns.to_be_bytes());
    }
    Ok(())
}

/// A Delete's body.
fn delete_body(listener: &str, client: SocketAddr, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    out.push(TAG_DELETE);
    put_bytes(out, listener.as_bytes())?;
    put_addr(out, client);
    Ok(())
}

fn put_count(out: &mut Vec<u8>, count: usize) -> Result<(), EncodeError> {
    let count = u16::try_from(count).map_err(|_| EncodeError::TooLarge)?;
    out.extend_from_slice(&count.to_be_bytes());
    Ok(())
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) -> Result<(), EncodeError> {
    put_count(out, bytes.len())?;
    out.extend_from_slice(bytes);
    Ok(())
}

fn put_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(ip) => {
            out.push(4);
            out.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.push(6);
            out.extend_from_slice(&ip.octets());
        }
    }
}

fn put_addr(out: &mut Vec<u8>, addr: SocketAddr) {
    put_ip(out, addr.ip());
    out.extend_from_slice(&addr.port().to_be_bytes());
}

/// The entry `body` holds, if it holds one whole and nothing more.
fn entry(body: &[u8]) -> Option<JournalEntry> {
    let mut reader = Reader(body);
    let entry = match reader.u8()? {
        TAG_PUT => JournalEntry::Put(read_put(&mut reader)?),
        TAG_DELETE => JournalEntry::Delete {
            listener: reader.string()?,
            client: reader.addr()?,
        },
        _ => return None,
    };
    reader.0.is_empty().then_some(entry)
}

/// A Put's record, read in the order [`put_body`] writes it.
fn read_put(reader: &mut Reader<'_>) -> Option<AllocationRecord> {
    let listener = reader.string()?;
    let client = reader.addr()?;
    let relay_flags = reader.u8()?;
    if relay_flags > 0b11 {
        return None;
    }
    let relays = RelayPorts {
        v4: reader.u16_if(relay_flags & 1 != 0)?,
        v6: reader.u16_if(relay_flags & 2 != 0)?,
    };
    let dont_fragment = match reader.u8()? {
        0 => false,
        1 => true,
        _ => return None,
    };
    let username = reader.string()?;
    let user_id = reader.string()?;
    let expires_at_ns = reader.u64()?;
    let mut txid = [0; 16];
    txid[4..].copy_from_slice(reader.take(12)?);
    let allocate_response = reader.bytes()?.to_vec();
    let via = match reader.u8()? {
        0 => None,
        1 => Some(reader.addr()?),
        _ => return None,
    };
    let mut permissions = Vec::new();
    for _ in 0..reader.u16()? {
        permissions.push(PermissionRecord {
            ip: reader.ip()?,
            expires_at_ns: reader.u64()?,
        });
    }
    let mut channels = Vec::new();
    for _ in 0..reader.u16()? {
        channels.push(ChannelRecord {
            number: reader.u16()?,
            peer: reader.addr()?,
            expires_at_ns: reader.u64()?,
        });
    }
    Some(AllocationRecord {
        listener,
        client,
        relays,
        dont_fragment,
        username,
        user_id,
        expires_at_ns,
        allocate_txid: TransactionId::from(u128::from_be_bytes(txid)),
        allocate_response,
        permissions,
        channels,
        via,
    })
}

/// The unread rest of a body; every read is checked against it.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (taken, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(taken)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.array()?))
    }

    /// A u16 if `present`: `Some(None)` if not, `None` if it does not read.
    fn u16_if(&mut self, present: bool) -> Option<Option<u16>> {
        if present {
            self.u16().map(Some)
        } else {
            Some(None)
        }
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.array()?))
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = self.u16()?;
        self.take(usize::from(len))
    }

    fn string(&mut self) -> Option<String> {
        std::str::from_utf8(self.bytes()?).ok().map(str::to_owned)
    }

    fn ip(&mut self) -> Option<IpAddr> {
        match self.u8()? {
            4 => Some(Ipv4Addr::from(self.array::<4>()?).into()),
            6 => Some(Ipv6Addr::from(self.array::<16>()?).into()),
            _ => None,
        }
    }

    fn addr(&mut self) -> Option<SocketAddr> {
        Some(SocketAddr::new(self.ip()?, self.u16()?))
    }
}

#[cfg(test)]
mod tests;
