//! One shard's journal in the state directory, `shard-<index>.journal`: started afresh from
//! the allocations the shard holds once it has adopted what it was given, then appended to
//! after every request that changed an allocation, before its answer leaves (one `write` of
//! what the engine reports, [`Journal::record`]), and rewritten whole when it has grown to
//! several times what it holds. A tmpfs (`emptyDir`, `medium: Memory`) keeps it across a
//! crash of the process; no `fsync`: a reboot ends the calls anyway.

use super::{private_file, StateCounts};
use crate::proto::persist::MonotonicEpoch;
use crate::proto::persist::{encode_entry, encode_header, JournalEntry, JournalHeader};
use crate::proto::ratelimit::LogLimiter;
use crate::proto::Engine;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// A journal is rewritten once it is this many times longer than when last written whole...
const GROWTH: u64 = 4;
/// ... and at least this long.
const REWRITE_AT: u64 = 256 << 10;

/// The journal of the allocations no shard has taken yet ([`super::Unplaced`]), read back as
/// shard 0's.
pub(crate) const UNPLACED: &str = "unplaced.journal";

/// The journal files in `dir`, with the shard index each names, in index order.
pub(crate) fn files(dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut files: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            if name == UNPLACED {
                return Some((0, entry.path()));
            }
            let index = name.strip_prefix("shard-")?.strip_suffix(".journal")?;
            Some((index.parse().ok()?, entry.path()))
        })
        .collect();
    files.sort();
    files
}

/// The path of shard `index`'s journal in `dir`.
pub(crate) fn path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("shard-{index}.journal"))
}

/// Writes a journal of `header` and `entries` at `path` whole: to a new file that then
/// replaces the old one, so that a crash meanwhile leaves one or the other. The file, open at
/// its end, and its length. An entry too large to encode is left out.
pub(crate) fn write_whole(
    path: &Path,
    header: &JournalHeader,
    entries: impl IntoIterator<Item = JournalEntry>,
) -> io::Result<(File, u64)> {
    let mut bytes = Vec::new();
    encode_header(header, &mut bytes);
    for entry in entries {
        let _ = encode_entry(&entry, &mut bytes);
    }
    let fresh = path.with_extension("journal.new");
    let mut file = private_file(&fresh, true)?;
    file.write_all(&bytes)?;
    std::fs::rename(&fresh, path)?;
    Ok((file, bytes.len() as u64))
}

/// One shard's journal, open for appending.
pub(crate) struct Journal {
    path: PathBuf,
    file: File,
    header: JournalHeader,
    epoch: MonotonicEpoch,
    /// Bytes written since it was last written whole, and its length then.
    len: u64,
    whole: u64,
    buf: Vec<u8>,
    counts: Arc<StateCounts>,
    log: LogLimiter,
}

impl Journal {
    /// Starts shard `index`'s journal in `dir` afresh from what `engine` holds (written to a
    /// new file that then replaces the old one whole, so a crash meanwhile leaves one or the
    /// other); what the engine reported changed before is in it already.
    pub(crate) fn start(
        dir: &Path,
        index: usize,
        boot_id: [u8; 16],
        epoch: MonotonicEpoch,
        counts: Arc<StateCounts>,
        engine: &mut Engine,
    ) -> io::Result<Journal> {
        while engine.poll_persist(epoch).is_some() {}
        let path = path(dir, index);
        let header = JournalHeader { boot_id };
        let records = engine.allocation_records(epoch);
        let (file, len) = write_whole(&path, &header, records.into_iter().map(JournalEntry::Put))?;
        Ok(Journal {
            path,
            file,
            header,
            epoch,
            len,
            whole: len,
            buf: Vec::new(),
            counts,
            log: LogLimiter::default(),
        })
    }

    /// Writes what `engine` reports changed since the last call, in one write; rewrites the
    /// journal whole when it has grown too long. A failed write is counted and logged
    /// (rate-limited): the calls go on, and only a restart would lose them.
    pub(crate) fn record(&mut self, engine: &mut Engine, now: Instant) {
        self.buf.clear();
        while let Some(entry) = engine.poll_persist(self.epoch) {
            if encode_entry(&entry, &mut self.buf).is_err() {
                self.failed(now, &io::Error::other("an allocation too large to record"));
            }
        }
        if self.buf.is_empty() {
            return;
        }
        let written = self.file.write_all(&self.buf);
        if let Err(e) = written {
            self.failed(now, &e);
            return;
        }
        self.len += self.buf.len() as u64;
        if self.len > REWRITE_AT && self.len > GROWTH * self.whole {
            let records = engine.allocation_records(self.epoch);
            let entries = records.into_iter().map(JournalEntry::Put);
            match write_whole(&self.path, &self.header, entries) {
                Ok((file, len)) => (self.file, self.len, self.whole) = (file, len, len),
                Err(e) => self.failed(now, &e),
            }
        }
    }

    fn failed(&mut self, now: Instant, e: &io::Error) {
        self.counts.write_error();
        if let Some(suppressed) = self.log.allow(now) {
            tracing::warn!(
                target: "stunnerd",
                "cannot write the journal {}: {e} (its allocations would not survive a restart){suppressed}",
                self.path.display()
            );
        }
    }
}
