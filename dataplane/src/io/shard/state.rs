//! The shard's part of the state directory ([`crate::io::state`]): the allocations a previous
//! process left it, adopted once their listeners run, and its journal, started afresh once
//! they are and written after every request that changed an allocation.

use super::listeners::Listeners;
use super::relays::Relays;
use crate::io::driver::Driver;
use crate::io::state::journal::{self, Journal};
use crate::io::state::{bind_relays, outcome, Restoring, StateCounts, Unplaced};
use crate::proto::persist::{placement, MonotonicEpoch, Placement, RelayPorts};
use crate::proto::{Engine, ListenerId};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uturn_shared::snapshot::Snapshot;

/// What a shard starts from in the state directory.
pub(in crate::io) struct ShardState {
    /// The directory.
    pub dir: PathBuf,
    /// The boot its journal's deadlines belong to.
    pub boot_id: [u8; 16],
    /// This process's reading of the monotonic clock.
    pub epoch: MonotonicEpoch,
    /// Shared counters.
    pub counts: Arc<StateCounts>,
    /// How many shards this process runs (journals of shards beyond are adopted modulo it).
    pub shards: usize,
    /// The allocations this shard adopts, taken when it starts.
    pub restoring: Mutex<Vec<Restoring>>,
    /// The allocations no shard holds until their client's next datagram reaches one (the
    /// last process ran another layout), shared by the shards.
    pub unplaced: Option<Arc<Unplaced>>,
}

/// The shard's adoptions still to do and its journal.
pub(super) struct State {
    index: usize,
    setup: Arc<ShardState>,
    pending: Vec<Restoring>,
    /// When the first config with listeners ran (adoption waits for its listeners from then).
    since: Option<Instant>,
    /// Adoption is over and the journal was started (or could not be: counted and logged).
    started: bool,
    /// When the unplaced allocations are next checked for their end.
    next_expiry: Instant,
    journal: Option<Journal>,
}

impl State {
    /// Shard `index`'s part, from `setup`; the engine records its changes from now on.
    pub(super) fn new(index: usize, setup: &Arc<ShardState>, engine: &mut Engine) -> State {
        engine.enable_persist();
        let pending = setup
            .restoring
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default();
        State {
            index,
            setup: setup.clone(),
            pending,
            since: None,
            started: false,
            next_expiry: Instant::now(),
            journal: None,
        }
    }

    /// After each request that changed an allocation, before its answer leaves.
    pub(super) fn record(&mut self, engine: &mut Engine, now: Instant) {
        if let Some(journal) = self.journal.as_mut() {
            journal.record(engine, now);
        }
    }

    /// Once a tick, after the listeners are reconciled: adopts what waits (once the config
    /// has listeners), starts the journal once nothing does, writes what changed since.
    pub(super) fn tick<D: Driver>(
        &mut self,
        engine: &mut Engine,
        relays: &mut Relays<D::Watch>,
        listeners: &Listeners<D::Watch>,
        snap: &Snapshot,
        driver: &D,
        now: Instant,
    ) {
        if !self.started {
            if !self.pending.is_empty() {
                if snap.listeners.is_empty() {
                    // The zero config a watching process starts from: the real one comes.
                    return;
                }
                self.since.get_or_insert(now);
                self.adopt(engine, relays, listeners, snap, driver, now);
                if !self.pending.is_empty() {
                    return;
                }
                self.setup.counts.restored_all();
            }
            self.started = true;
            self.start(engine);
        }
        self.record(engine, now);
        if let Some(unplaced) = self.setup.unplaced.as_ref().filter(|u| u.waiting()) {
            if now >= self.next_expiry {
                self.next_expiry = now + Duration::from_secs(1);
                unplaced.expire(self.setup.epoch.ns_at(now), &self.setup.counts);
            }
        }
    }

    /// Adopts each waiting allocation whose listener runs on this shard; drops those whose
    /// listener is gone (or has not opened here in time: [`placement`] decides).
    fn adopt<D: Driver>(
        &mut self,
        engine: &mut Engine,
        relays: &mut Relays<D::Watch>,
        listeners: &Listeners<D::Watch>,
        snap: &Snapshot,
        driver: &D,
        now: Instant,
    ) {
        let since = self.since.unwrap_or(now);
        let counts = &self.setup.counts;
        let epoch = self.setup.epoch;
        for restoring in std::mem::take(&mut self.pending) {
            let record = &restoring.record;
            let spec = snap.listeners.iter().find(|l| l.name == record.listener);
            let id = listeners.udp_id_of(&record.listener);
            let protocol = spec.map(|s| s.protocol);
            let id = match (placement(protocol, id.is_some(), since, now), id) {
                (Placement::Adopt, Some(id)) => id,
                (Placement::Wait, _) => {
                    self.pending.push(restoring);
                    continue;
                }
                (Placement::Drop(error), _) => {
                    counts.restored(outcome(Err(error)));
                    continue;
                }
                // `placement` adopts only what is open.
                (Placement::Adopt, None) => continue,
            };
            let mut to = Adopting {
                engine: &mut *engine,
                relays: &mut *relays,
                snap,
                driver,
                now,
            };
            adopt_one(restoring, id, &mut to, epoch, counts);
        }
    }

    /// Whether allocations wait for their client's next datagram to pick their shard (the
    /// per-packet test: one load).
    #[inline]
    pub(super) fn unplaced_waiting(&self) -> bool {
        self.setup.unplaced.as_ref().is_some_and(|u| u.waiting())
    }

    /// `client` sent a datagram on UDP listener `id` (called `name`): if its allocation
    /// waits unplaced, this shard adopts it now, before the datagram is served.
    pub(super) fn place<D: Driver>(
        &mut self,
        to: &mut Adopting<'_, D>,
        name: &str,
        id: ListenerId,
        client: SocketAddr,
    ) {
        let Some(unplaced) = &self.setup.unplaced else {
            return;
        };
        if to.engine.has_allocation(id, client) {
            return;
        }
        let Some(restoring) = unplaced.take(name, client) else {
            return;
        };
        let (epoch, counts) = (self.setup.epoch, &self.setup.counts);
        adopt_one(restoring, id, to, epoch, counts);
        self.record(to.engine, to.now);
    }

    /// Starts the journal afresh from what the engine holds, and removes the journals of
    /// shards beyond this process's count that this shard adopted from.
    fn start(&mut self, engine: &mut Engine) {
        let setup = &self.setup;
        let started = Journal::start(
            &setup.dir,
            self.index,
            setup.boot_id,
            setup.epoch,
            setup.counts.clone(),
            engine,
        );
        match started {
            Ok(journal) => self.journal = Some(journal),
            Err(e) => {
                setup.counts.write_error();
                tracing::warn!(
                    target: "stunnerd",
                    "shard {}: cannot start its journal in {}: {e} (its allocations would not survive a restart)",
                    self.index,
                    setup.dir.display()
                );
            }
        }
        for (index, path) in journal::files(&setup.dir) {
            if index >= setup.shards && index % setup.shards == self.index {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

impl<D: Driver> super::Shard<D> {
    /// Before a UDP client's datagram is served: if its allocation waits unplaced (the last
    /// process ran another layout), this shard, which the kernel now sends it to, adopts it.
    /// Without a state directory, or once every allocation is placed, one test.
    #[inline]
    pub(super) fn place_unplaced(&mut self, now: Instant, id: ListenerId, client: SocketAddr) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        if !state.unplaced_waiting() {
            return;
        }
        let Some(listener) = self.listeners.get(id) else {
            return;
        };
        let mut to = Adopting {
            engine: &mut self.engine,
            relays: &mut self.relays,
            snap: self.snapshots.serving(),
            driver: &self.driver,
            now,
        };
        state.place(&mut to, &listener.spec.name, id, client);
    }
}

/// What adopting an allocation touches: the shard's engine and relay sockets, the snapshot
/// it serves, its driver, and the time.
pub(super) struct Adopting<'a, D: Driver> {
    pub engine: &'a mut Engine,
    pub relays: &'a mut Relays<D::Watch>,
    pub snap: &'a Snapshot,
    pub driver: &'a D,
    pub now: Instant,
}

/// Adopts `restoring` on listener `id`: its relay sockets (bound again if they could not be
/// before) watched under the ids the engine gives, its outcome counted.
fn adopt_one<D: Driver>(
    restoring: Restoring,
    id: ListenerId,
    to: &mut Adopting<'_, D>,
    epoch: MonotonicEpoch,
    counts: &StateCounts,
) {
    let mut sockets = restoring.sockets;
    let retried = bind_relays(&restoring.record, &sockets);
    sockets.extend(retried);
    let bound = sockets
        .iter()
        .fold(RelayPorts::default(), |ports, &(family, _, port)| {
            ports.with(family, port)
        });
    let (snap, now) = (to.snap, to.now);
    match to
        .engine
        .adopt(restoring.record, id, bound, snap, now, epoch)
    {
        Ok(ids) => {
            for (family, socket, port) in sockets {
                if let Some(&relay) = ids.iter().find(|r| r.family() == family) {
                    if let Err(e) = to.relays.adopt(relay, socket, port, to.driver) {
                        tracing::warn!(target: "stunnerd", "restored relay socket on port {port} not watched: {e}");
                    }
                }
            }
            counts.restored(outcome(Ok(())));
        }
        Err(error) => counts.restored(outcome(Err(error))),
    }
}
