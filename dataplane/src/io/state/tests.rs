//! The state directory on real files: held by one process, private, and read back whatever a
//! crash or a bad disk left in it.

use super::journal as path;
use super::*;
use crate::proto::persist::{encode_entry, encode_header, JournalEntry, JournalHeader};
use crate::proto::persist::{RelayPorts, JOURNAL_MAGIC};
use std::time::Duration;
use stun_proto::types::message::TransactionId;

fn fresh(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("uturn-state-{label}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A record of `client` on listener `l` that ends an hour after `epoch`, its relay on a port
/// the kernel gives now (so that binding it again succeeds).
fn record(client: &str, epoch: MonotonicEpoch) -> AllocationRecord {
    let port = std::net::UdpSocket::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    AllocationRecord {
        listener: "l".into(),
        client: client.parse().unwrap(),
        relays: RelayPorts::default().with(Family::V4, port),
        dont_fragment: false,
        username: "u".into(),
        user_id: "u".into(),
        expires_at_ns: epoch.ns_at(epoch.instant + Duration::from_secs(3600)),
        allocate_txid: TransactionId::generate(),
        allocate_response: vec![1, 2, 3],
        permissions: Vec::new(),
        channels: Vec::new(),
        via: None,
    }
}

fn journal(boot_id: [u8; 16], records: &[AllocationRecord]) -> Vec<u8> {
    let mut bytes = Vec::new();
    encode_header(&JournalHeader { boot_id }, &mut bytes);
    for record in records {
        encode_entry(&JournalEntry::Put(record.clone()), &mut bytes).unwrap();
    }
    bytes
}

fn skipped(dir: &StateDir) -> [u64; 4] {
    std::array::from_fn(|i| dir.counts.skipped[i].load(Ordering::Relaxed))
}

#[test]
fn a_held_directory_is_refused_naming_its_holder_and_is_private() {
    let path = fresh("held");
    let held = StateDir::open(&path).unwrap();
    let refused = StateDir::open(&path).err().unwrap();
    assert!(refused.contains("in use by another stunnerd"), "{refused}");
    assert!(
        refused.contains(&format!("pid {}", std::process::id())),
        "{refused}"
    );
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o700);
    let key = held.nonce_key().unwrap();
    assert_eq!(mode(&path.join(NONCE_KEY)), 0o600);
    assert_eq!(mode(&path.join(LOCK)), 0o600);
    drop(held);
    // The next holder gets the same nonce key.
    let next = StateDir::open(&path).unwrap();
    assert_eq!(next.nonce_key().unwrap(), key);
    let _ = std::fs::remove_dir_all(&path);
}

#[test]
fn corrupt_torn_foreign_and_other_version_journals_cost_only_themselves() {
    let path = fresh("bad");
    let dir = StateDir::open(&path).unwrap();
    let epoch = monotonic_epoch();
    let boot = dir.boot_id();
    // Shard 0: two records, the second's body flipped, then a third cut short.
    let (a, b, c) = (
        record("192.0.2.1:1000", epoch),
        record("192.0.2.2:1000", epoch),
        record("192.0.2.3:1000", epoch),
    );
    let mut bytes = journal(boot, &[a.clone(), b]);
    let flip = bytes.len() - 5;
    bytes[flip] ^= 0xff;
    let whole = journal(boot, &[c]);
    bytes.extend_from_slice(&whole[32..whole.len() - 3]);
    std::fs::write(path::path(&path, 0), &bytes).unwrap();
    // Shard 1: another boot's. Shard 2: a version this code does not read.
    let d = record("192.0.2.4:1000", epoch);
    std::fs::write(path::path(&path, 1), journal([9; 16], &[d])).unwrap();
    let mut other = JOURNAL_MAGIC.to_vec();
    other.extend_from_slice(&99u32.to_be_bytes());
    other.extend_from_slice(&boot);
    let crc = crc32fast::hash(&other);
    other.extend_from_slice(&crc.to_be_bytes());
    other.resize(64, 0);
    std::fs::write(path::path(&path, 2), &other).unwrap();
    let restored = dir.restore(2, epoch);
    assert_eq!(restored.found, 1);
    assert_eq!(restored.by_shard[0].len(), 1);
    assert_eq!(restored.by_shard[0][0].record, a);
    assert_eq!(restored.by_shard[0][0].sockets.len(), 1);
    assert!(restored.by_shard[1].is_empty());
    assert_eq!(skipped(&dir), [1, 1, 1, 1]);
    assert!(path.join("shard-2.unread").exists());
    let _ = std::fs::remove_dir_all(&path);
}

#[test]
fn journals_of_shards_beyond_the_count_go_to_a_shard_modulo_it_and_expired_ones_to_none() {
    let path = fresh("modulo");
    let dir = StateDir::open(&path).unwrap();
    let epoch = monotonic_epoch();
    let boot = dir.boot_id();
    let mut expired = record("192.0.2.9:1000", epoch);
    expired.expires_at_ns = epoch.ns_at(epoch.instant) - 1;
    let live = record("192.0.2.3:1000", epoch);
    std::fs::write(
        path::path(&path, 3),
        journal(boot, &[expired, live.clone()]),
    )
    .unwrap();
    let restored = dir.restore(2, epoch);
    assert_eq!(restored.found, 1);
    assert_eq!(restored.by_shard[1].len(), 1);
    assert_eq!(restored.by_shard[1][0].record, live);
    let _ = std::fs::remove_dir_all(&path);
}
