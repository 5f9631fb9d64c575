//! Which snapshot a shard serves packets under, and which one its listeners were last
//! reconciled to.

use arc_swap::{ArcSwap, Cache};
use std::sync::Arc;
use uturn_shared::snapshot::Snapshot;

/// A shard's view of the published snapshots.
pub(super) struct Snapshots {
    cache: Cache<Arc<ArcSwap<Snapshot>>, Arc<Snapshot>>,
    /// The snapshot the shard's listeners were last reconciled to (on a tick).
    reconciled: Arc<Snapshot>,
    /// The generation of `reconciled` once every listener of it opened; `None` while one
    /// still waits (see [`Snapshots::pending_reconcile`]).
    complete: Option<u64>,
    /// What is known of the newest snapshot, when it is newer than `reconciled`.
    newer: Option<NewerSnapshot>,
}

/// A snapshot newer than the reconciled one, compared once rather than per packet.
#[derive(Clone, Copy)]
struct NewerSnapshot {
    generation: u64,
    /// Whether it runs the same listeners as the reconciled snapshot.
    same_listeners: bool,
}

impl Snapshots {
    /// A view of `published`; nothing is reconciled yet.
    pub(super) fn new(published: &Arc<ArcSwap<Snapshot>>) -> Snapshots {
        Snapshots {
            cache: Cache::new(published.clone()),
            reconciled: published.load_full(),
            complete: None,
            newer: None,
        }
    }

    /// The newest snapshot if it runs the listeners this shard runs, so that new endpoints,
    /// credentials and quotas apply at once; else the reconciled one until the next tick. A
    /// listener about to restart must not serve under the snapshot of its next run: it would
    /// accept, say, the credentials of a new realm, and the allocations made with them would
    /// end with the restart a moment later.
    pub(super) fn serving(&mut self) -> &Snapshot {
        let Snapshots {
            cache,
            reconciled,
            newer,
            ..
        } = self;
        let latest: &Snapshot = cache.load();
        if latest.generation != reconciled.generation {
            let same_listeners = match *newer {
                Some(known) if known.generation == latest.generation => known.same_listeners,
                _ => {
                    let same_listeners = latest.same_listener_runs(reconciled);
                    *newer = Some(NewerSnapshot {
                        generation: latest.generation,
                        same_listeners,
                    });
                    same_listeners
                }
            };
            if !same_listeners {
                return reconciled;
            }
        }
        latest
    }

    /// The newest snapshot, if the listeners are not yet reconciled to it completely. A
    /// listener that must wait for another run's sockets to close is tried again on the next
    /// tick.
    pub(super) fn pending_reconcile(&mut self) -> Option<Arc<Snapshot>> {
        let latest = self.cache.load();
        (self.complete != Some(latest.generation)).then(|| latest.clone())
    }

    /// The listeners were reconciled to `snap`: `complete` if every one of them opened.
    pub(super) fn reconciled(&mut self, snap: Arc<Snapshot>, complete: bool) {
        self.complete = complete.then_some(snap.generation);
        self.reconciled = snap;
    }
}
