//! The state directory (`--state-dir`): what lets a restarted process carry on the calls of
//! the one before it. [`StateDir::open`] takes the directory for this process alone (a lock
//! file another process cannot take while this one lives), keeps the nonce key there (so
//! that a client's nonce stays valid across the restart) and reads the journals the last
//! process left ([`StateDir::restore`]): the allocations to re-create, each with its relay
//! sockets bound again on their ports before any shard serves (`Restoring`). Each shard
//! then keeps its own journal (`journal::Journal`).
//!
//! The failure it prevents: a crash, an OOM kill or an in-place update ends every call, since
//! the allocations lived only in memory. What a file holds is what integrity checks need
//! (the nonce key, the Allocate successes): the directory is 0700 and its files 0600, and
//! nothing of them is logged or shown in `/status`.

pub(crate) mod journal;

use super::socket::relay_socket_at;
use crate::proto::persist::{decode, replay, AdoptError, AllocationRecord, DecodeError};
use crate::proto::persist::{encode_entry, JournalEntry, JournalHeader};
use crate::proto::persist::{MonotonicEpoch, JOURNAL_VERSION};
use crate::proto::Family;
use metrics::{counter, describe_counter};
use socket2::Socket;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The lock file: flock'ed by the process that holds the directory, and its pid.
const LOCK: &str = "lock";
/// The nonce key, 32 bytes.
const NONCE_KEY: &str = "nonce-key";
/// How the last process spread its clients over shards: `shards <n> sockets <m>`.
const LAYOUT: &str = "layout";

/// Where a restored allocation's adoption ended, as `uturn_restored_allocations_total`'s
/// `outcome` label: adopted, or each [`AdoptError`].
pub(crate) const OUTCOMES: [&str; 7] = [
    "adopted",
    "expired",
    "listener_gone",
    "connection_ended",
    "exists",
    "no_relay",
    "quota",
];

/// The index of `result` in [`OUTCOMES`].
pub(crate) fn outcome(result: Result<(), AdoptError>) -> usize {
    match result {
        Ok(()) => 0,
        Err(AdoptError::Expired) => 1,
        Err(AdoptError::ListenerGone) => 2,
        Err(AdoptError::ConnectionEnded) => 3,
        Err(AdoptError::Exists) => 4,
        Err(AdoptError::NoRelay) => 5,
        Err(AdoptError::UserQuotaReached | AdoptError::AllocationCapReached) => 6,
    }
}

/// Why journal entries (or whole files) were not read, as
/// `uturn_state_records_skipped_total`'s `reason` label, by the indices below.
const SKIPPED: [&str; 4] = ["corrupt", "torn", "version", "other_boot"];
const CORRUPT: usize = 0;
const TORN: usize = 1;
const VERSION: usize = 2;
const OTHER_BOOT: usize = 3;

/// What the state directory's users count, shared by the shards and read at each scrape.
#[derive(Default)]
pub struct StateCounts {
    restored: [AtomicU64; OUTCOMES.len()],
    skipped: [AtomicU64; SKIPPED.len()],
    write_errors: AtomicU64,
    /// Shards that still hold allocations to adopt (`/ready` waits for none).
    restoring: AtomicUsize,
}

impl StateCounts {
    /// Counts a restored allocation's outcome ([`outcome`]).
    pub(crate) fn restored(&self, outcome: usize) {
        self.restored[outcome].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a journal write that failed.
    pub(crate) fn write_error(&self) {
        self.write_errors.fetch_add(1, Ordering::Relaxed);
    }

    fn skipped(&self, reason: usize, n: usize) {
        self.skipped[reason].fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A shard starts with allocations to adopt.
    pub(crate) fn restoring(&self) {
        self.restoring.fetch_add(1, Ordering::Relaxed);
    }

    /// A shard adopted (or dropped) every allocation it was given.
    pub(crate) fn restored_all(&self) {
        self.restoring.fetch_sub(1, Ordering::Relaxed);
    }

    /// Whether every shard has adopted what it was given.
    pub fn done(&self) -> bool {
        self.restoring.load(Ordering::Relaxed) == 0
    }

    /// Records the counters for a scrape.
    pub fn record(&self, recorder: &dyn metrics::Recorder) {
        metrics::with_local_recorder(recorder, || {
            describe_counter!(
                "uturn_restored_allocations_total",
                "Allocations a previous process left in the state directory, by what came of them"
            );
            for (i, outcome) in OUTCOMES.iter().enumerate() {
                let n = self.restored[i].load(Ordering::Relaxed);
                counter!("uturn_restored_allocations_total", "outcome" => *outcome).absolute(n);
            }
            describe_counter!(
                "uturn_state_records_skipped_total",
                "Journal entries (or files) of the state directory not read, by why"
            );
            for (i, reason) in SKIPPED.iter().enumerate() {
                let n = self.skipped[i].load(Ordering::Relaxed);
                counter!("uturn_state_records_skipped_total", "reason" => *reason).absolute(n);
            }
            describe_counter!(
                "uturn_state_write_errors_total",
                "Journal writes to the state directory that failed"
            );
            let n = self.write_errors.load(Ordering::Relaxed);
            counter!("uturn_state_write_errors_total").absolute(n);
        });
    }
}

/// An allocation a previous process left, its relay sockets bound again: what a shard adopts.
pub(crate) struct Restoring {
    /// The allocation as recorded.
    pub record: AllocationRecord,
    /// Its relay sockets bound again on their recorded ports (a family whose port could not
    /// be had yet is missing: the shard tries again, see [`bind_relays`]).
    pub sockets: Vec<(Family, Socket, u16)>,
}

/// The state directory, held by this process.
pub struct StateDir {
    path: PathBuf,
    /// Holds the flock for the process's life (released by the kernel however it exits).
    _lock: File,
    boot_id: [u8; 16],
    counts: Arc<StateCounts>,
}

impl StateDir {
    /// Takes `path` for this process: created 0700 if missing, refused if another user owns
    /// it or another process holds it.
    pub fn open(path: &Path) -> Result<StateDir, String> {
        let named = |what: &str, e: std::io::Error| {
            format!("state directory {}: {what}: {e}", path.display())
        };
        std::fs::create_dir_all(path).map_err(|e| named("cannot create it", e))?;
        let meta = std::fs::metadata(path).map_err(|e| named("cannot read it", e))?;
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if !meta.is_dir() || meta.uid() != euid {
            return Err(format!(
                "state directory {}: not a directory of this process's user (uid {euid}); \
                 give stunnerd a directory of its own (--state-dir)",
                path.display()
            ));
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| named("cannot make it private (0700)", e))?;
        let lock = private_file(&path.join(LOCK), false).map_err(|e| named("lock file", e))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(format!(
                "state directory {} is in use by another stunnerd (pid {}): each process needs \
                 a state directory of its own",
                path.display(),
                holder(&path.join(LOCK))
            ));
        }
        let mut owner = &lock;
        lock.set_len(0).map_err(|e| named("lock file", e))?;
        writeln!(owner, "{}", std::process::id()).map_err(|e| named("lock file", e))?;
        Ok(StateDir {
            path: path.to_path_buf(),
            _lock: lock,
            boot_id: boot_id(),
            counts: Arc::new(StateCounts::default()),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The kernel's boot id, which a journal's monotonic deadlines belong to.
    pub(crate) fn boot_id(&self) -> [u8; 16] {
        self.boot_id
    }

    /// What its users count.
    pub fn counts(&self) -> &Arc<StateCounts> {
        &self.counts
    }

    /// The nonce key the last process kept here, or a new random one kept from now on.
    pub fn nonce_key(&self) -> Result<[u8; 32], String> {
        let path = self.path.join(NONCE_KEY);
        let mut key = [0u8; 32];
        if let Ok(mut file) = File::open(&path) {
            if file.read_exact(&mut key).is_ok() {
                return Ok(key);
            }
        }
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut key);
        let written = private_file(&path, true).and_then(|mut f| f.write_all(&key));
        written.map_err(|e| format!("state directory {}: nonce key: {e}", path.display()))?;
        Ok(key)
    }

    /// Records that this process runs `shards` shards with `sockets` SO_REUSEPORT sockets per
    /// TURN-UDP listener; whether the last process did otherwise (with allocations to carry
    /// on), which it says: the kernel's hash then sends clients to other shards than the ones
    /// that held them, so each allocation waits (`Unplaced`) for its client's next datagram.
    pub fn note_layout(&self, shards: usize, sockets: usize, carried: usize) -> bool {
        let path = self.path.join(LAYOUT);
        let now = format!("shards {shards} sockets {sockets}");
        let before = std::fs::read_to_string(&path).unwrap_or_default();
        let before = before.trim();
        let changed = carried > 0 && !before.is_empty() && before != now;
        if changed {
            tracing::info!(
                target: "stunnerd",
                "state directory {}: the last process ran {before:?}, this one {now:?}: each \
                 allocation is adopted by the shard its client's next datagram reaches",
                self.path.display()
            );
        }
        let written = private_file(&path, true).and_then(|mut f| writeln!(f, "{now}"));
        if written.is_err() {
            self.counts.write_error();
        }
        changed
    }

    /// The allocations the journals here leave live at `epoch`, each given to shard (the
    /// shard that kept it, modulo `shards`) with its relay sockets bound again; journal
    /// entries skipped are counted, files this process cannot read are set aside.
    pub fn restore(&self, shards: usize, epoch: MonotonicEpoch) -> RestoredState {
        let mut restored = RestoredState {
            by_shard: (0..shards).map(|_| Vec::new()).collect(),
            found: 0,
        };
        let now_ns = epoch.ns_at(epoch.instant);
        for (index, path) in journal::files(&self.path) {
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            for record in self.records(&path, &bytes, now_ns) {
                restored.found += 1;
                let sockets = bind_relays(&record, &[]);
                restored.by_shard[index % shards].push(Restoring { record, sockets });
            }
        }
        restored
    }

    /// The live records of one journal's `bytes`, read at `now_ns`.
    fn records(&self, path: &Path, bytes: &[u8], now_ns: u64) -> Vec<AllocationRecord> {
        let decoded = match decode(bytes) {
            Ok(decoded) => decoded,
            Err(DecodeError::UnknownVersion(version)) => {
                tracing::warn!(
                    target: "stunnerd",
                    "state file {} has format version {version}, this stunnerd reads \
                     {JOURNAL_VERSION}: its allocations are not carried on (kept as .unread)",
                    path.display()
                );
                self.counts.skipped(VERSION, 1);
                let _ = std::fs::rename(path, path.with_extension("unread"));
                return Vec::new();
            }
            Err(_) => {
                self.counts.skipped(CORRUPT, 1);
                return Vec::new();
            }
        };
        self.counts.skipped(CORRUPT, decoded.corrupt);
        self.counts.skipped(TORN, decoded.torn);
        match decoded.header {
            Some(header) if header.boot_id == self.boot_id => replay(decoded.entries, now_ns),
            Some(_) => {
                self.counts.skipped(OTHER_BOOT, decoded.entries.len());
                Vec::new()
            }
            None => Vec::new(),
        }
    }
}

/// The pid the lock file names. A holder that has just taken the lock may not have written it
/// yet (two processes started at once): it is waited for, up to 200 ms.
fn holder(lock: &Path) -> String {
    for _ in 0..40 {
        let pid = std::fs::read_to_string(lock).unwrap_or_default();
        if !pid.trim().is_empty() {
            return pid.trim().to_string();
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    "unknown".into()
}

/// Allocations whose shard is not known until their client's next datagram reaches one (the
/// last process spread its clients over another layout): held with their relay sockets, taken
/// by the first shard that hears from the client, dropped when their deadline passes. Their
/// journal, `unplaced.journal`, holds them until then (a crash meanwhile keeps them too).
#[derive(Default)]
pub(crate) struct Unplaced {
    waiting: AtomicUsize,
    held: std::sync::Mutex<Held>,
}

#[derive(Default)]
struct Held {
    records: std::collections::HashMap<(String, SocketAddr), Restoring>,
    journal: Option<(PathBuf, File)>,
}

impl Unplaced {
    /// Holds `records`, journaled in `dir`.
    pub(crate) fn hold(&self, dir: &StateDir, records: Vec<Restoring>) {
        let Ok(mut held) = self.held.lock() else {
            return;
        };
        let path = dir.path.join(journal::UNPLACED);
        let header = JournalHeader {
            boot_id: dir.boot_id,
        };
        let entries = records.iter().map(|r| JournalEntry::Put(r.record.clone()));
        match journal::write_whole(&path, &header, entries) {
            Ok((file, _)) => held.journal = Some((path, file)),
            Err(_) => dir.counts.write_error(),
        }
        for restoring in records {
            let key = (restoring.record.listener.clone(), restoring.record.client);
            held.records.insert(key, restoring);
        }
        self.waiting.store(held.records.len(), Ordering::Relaxed);
    }

    /// Whether any allocation waits (one load: the per-packet test).
    #[inline]
    pub(crate) fn waiting(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0
    }

    /// The allocation of `client` on listener `listener`, if it waits (its journal says it
    /// is taken: the shard that takes it journals it from now on).
    pub(crate) fn take(&self, listener: &str, client: SocketAddr) -> Option<Restoring> {
        let mut held = self.held.lock().ok()?;
        let taken = held.records.remove(&(listener.to_owned(), client))?;
        let delete = JournalEntry::Delete {
            listener: listener.to_owned(),
            client,
        };
        let mut bytes = Vec::new();
        if let (Ok(()), Some((_, file))) = (encode_entry(&delete, &mut bytes), &mut held.journal) {
            let _ = file.write_all(&bytes);
        }
        held.settle(&self.waiting);
        Some(taken)
    }

    /// Drops (and counts as expired) what ended by `now_ns`.
    pub(crate) fn expire(&self, now_ns: u64, counts: &StateCounts) {
        if let Ok(mut held) = self.held.lock() {
            let before = held.records.len();
            held.records.retain(|_, r| r.record.expires_at_ns > now_ns);
            for _ in held.records.len()..before {
                counts.restored(outcome(Err(AdoptError::Expired)));
            }
            held.settle(&self.waiting);
        }
    }
}

impl Held {
    /// Publishes how many wait; with none, the journal goes.
    fn settle(&mut self, waiting: &AtomicUsize) {
        waiting.store(self.records.len(), Ordering::Relaxed);
        if self.records.is_empty() {
            if let Some((path, _)) = self.journal.take() {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// What [`StateDir::restore`] found.
pub struct RestoredState {
    /// The allocations to adopt, by the shard that adopts them.
    pub(crate) by_shard: Vec<Vec<Restoring>>,
    /// Live allocations found in the journals.
    pub found: usize,
}

/// `record`'s relay sockets, bound again on their ports, but for the families of `bound`.
/// One that cannot be had now is tried again when a shard adopts the record: a socket the
/// process opened meanwhile for a moment (a port check, a route lookup) may have held its port.
pub(crate) fn bind_relays(
    record: &AllocationRecord,
    bound: &[(Family, Socket, u16)],
) -> Vec<(Family, Socket, u16)> {
    Family::ALL
        .into_iter()
        .filter(|family| bound.iter().all(|(f, _, _)| f != family))
        .filter_map(|family| {
            let port = record.relays.get(family)?;
            let socket = relay_socket_at(family, port, record.dont_fragment).ok()?;
            Some((family, socket, port))
        })
        .collect()
}

/// Opens (or, with `new`, creates afresh) a file only this process's user may read.
pub(crate) fn private_file(path: &Path, new: bool) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(new)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(file)
}

/// The monotonic clock now, with the instant it was read at.
pub fn monotonic_epoch() -> MonotonicEpoch {
    MonotonicEpoch {
        instant: Instant::now(),
        monotonic_ns: super::sys::monotonic_ns(),
    }
}

/// `/proc/sys/kernel/random/boot_id` as 16 bytes (zeros if unreadable).
fn boot_id() -> [u8; 16] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let hex: Vec<u8> = text.trim().bytes().filter(u8::is_ascii_hexdigit).collect();
    let mut id = [0u8; 16];
    for (i, pair) in hex.chunks(2).take(16).enumerate() {
        let digits = std::str::from_utf8(pair).unwrap_or("0");
        id[i] = u8::from_str_radix(digits, 16).unwrap_or(0);
    }
    id
}

#[cfg(test)]
mod tests;
