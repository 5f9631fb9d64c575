//! `-c file://PATH -w`: follow a config file.
//!
//! The file is polled (metadata every 200 ms, contents at least every 5 s) rather than watched
//! with inotify: a Kubernetes ConfigMap mount replaces the file by swapping a symlink, which
//! inotify on the path misses, and a missing file is simply waited for. Duplicate and empty
//! contents are skipped; an invalid config is logged with its field and value and skipped, so
//! the running config stays.

use crate::outbox::Outbox;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use uturn_shared::config::{parse_config, StunnerConfig};

const POLL: Duration = Duration::from_millis(200);
const REREAD: Duration = Duration::from_secs(5);
const WAIT_LOG: Duration = Duration::from_secs(10);

/// What identifies one version of the file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Signature {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_nsec: i128,
    ctime_nsec: i128,
}

fn signature(meta: &std::fs::Metadata) -> Signature {
    Signature {
        dev: meta.dev(),
        ino: meta.ino(),
        len: meta.len(),
        mtime_nsec: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        ctime_nsec: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
    }
}

/// Sends every new valid config the file holds, until the receiver goes away.
pub async fn watch(path: PathBuf, configs: Outbox<Box<StunnerConfig>>) {
    let mut last_signature = None;
    let mut last_read = Instant::now();
    let mut last_text: Option<String> = None;
    let mut waiting_since_log: Option<Instant> = None;
    while !configs.is_closed() {
        match std::fs::metadata(&path) {
            Err(_) => {
                last_signature = None;
                if waiting_since_log.is_none_or(|t| t.elapsed() >= WAIT_LOG) {
                    tracing::info!(target: "stunnerd", "Waiting for config file {:?}", path.display().to_string());
                    waiting_since_log = Some(Instant::now());
                }
            }
            Ok(meta) => {
                waiting_since_log = None;
                let sig = signature(&meta);
                if Some(sig) != last_signature || last_read.elapsed() >= REREAD {
                    last_signature = Some(sig);
                    last_read = Instant::now();
                    match std::fs::read_to_string(&path) {
                        Ok(text) if text.trim().is_empty() => {
                            tracing::debug!(target: "stunnerd", "ignoring empty config file {:?}", path.display().to_string());
                        }
                        Ok(text) if last_text.as_deref() == Some(text.as_str()) => {}
                        Ok(text) => {
                            match parse_config(&text) {
                                Ok(config) => {
                                    tracing::info!(target: "stunnerd", "config file {:?} changed: applying it", path.display().to_string());
                                    let _ = configs.send(Box::new(config));
                                }
                                Err(e) => tracing::warn!(
                                    target: "stunnerd",
                                    "ignoring invalid config in {:?} (the running config stays): {e}",
                                    path.display().to_string()
                                ),
                            }
                            last_text = Some(text);
                        }
                        Err(e) => {
                            last_signature = None;
                            tracing::debug!(target: "stunnerd", "cannot read config file {:?}: {e}", path.display().to_string());
                        }
                    }
                }
            }
        }
        tokio::time::sleep(POLL).await;
    }
}
