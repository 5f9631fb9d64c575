//! One shard's logic, whichever IO backend drives it (the contract is [`super::driver`]): a
//! shard-local [`Engine`] and the parts that own what the shard touches.
//!
//! - [`listeners`]: the listeners it runs (sockets, spec, transport), reconciled to each new
//!   snapshot;
//! - [`conns`]: the TCP/TLS connection table;
//! - [`datagrams`]: the receive batches and send queues UDP moves through, and the TURN-DTLS
//!   session tables;
//! - [`relays`]: the allocations' relay sockets, and what the kernel offload relays for them;
//! - [`siblings`]: with `--siblings`, the sibling socket and second-chance forwarding's policy
//!   (`proto::sibling::Forwarding`);
//! - [`counters`]: what it counts, published once per tick;
//! - [`setup`]: what it starts from ([`ShardSetup`]);
//! - [`snapshots`]: which snapshot packets are served under;
//! - [`streams`]: TURN-TCP and TURN-TLS connections, read and written;
//! - [`state`]: with `--state-dir`, the allocations a previous process left and the journal.
//!
//! The shard composes them: it routes a readiness report to the part that owns the socket,
//! hands each TURN message to the engine at one dispatch point, [`Shard::handle_turn`], which
//! also carries out the [`ClientAction`] (the one place a client action becomes sends; a
//! [`PeerAction`] becomes sends in [`Shard::peer_datagram`]). Parts never call back into the
//! shard: a part's method takes what it needs and returns what the shard must do with the
//! others (a miss forwarded or answered here, a sibling's datagram to serve or deliver).
//! TURN-TCP and TURN-TLS connections are read when readable and written when the shard
//! flushes (or, when the client is slow, whenever the socket can take more); TURN-DTLS runs a
//! session per client address over UDP listener sockets. Whatever the transport, the relay
//! side is UDP and the same engine decides.

mod conns;
mod counters;
mod datagrams;
mod listeners;
mod relays;
mod setup;
mod siblings;
mod snapshots;
mod state;
mod streams;

pub(super) use setup::ShardSetup;
pub use siblings::{SiblingCounts, SiblingSetup};
pub(super) use state::ShardState;

use super::driver::{Driver, Readiness, Token, TICK};
use super::metrics::ShardStats;
use super::offload::OffloadTable;
use super::socket::canonical;
use super::stream::Closed;
use crate::proto::ratelimit::LogLimiter;
use crate::proto::sibling::MissAction;
use crate::proto::{
    Arrival, ArrivalKind, Bytes, ClientAction, Engine, ListenerId, ListenerRef, PeerAction,
    PeerArrival, RelayId, PEER_HEADROOM,
};
use conns::ConnTable;
use counters::Counters;
use datagrams::{Batch, DatagramSocket, Datagrams};
use listeners::{ListenerTransport, Listeners};
use relays::Relays;
use siblings::{Inbound, Siblings};
use snapshots::Snapshots;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use uturn_shared::snapshot::Snapshot;
use uturn_udp::{Datagram, RecvBatch, BATCH, MAX_UDP_PAYLOAD};

/// Client datagrams of this size or more are dropped as possibly truncated (as stunnerd).
/// Peer datagrams and stream frames are relayed whole up to the UDP maximum.
const MAX_DATAGRAM: usize = 1600;
/// Scratch for replies and Data indications: room for the largest UDP payload and the
/// indication's header and attributes around it.
const BUFFER: usize = MAX_UDP_PAYLOAD + 256;
/// Batches one readable socket may take before the shard serves the others.
const ROUNDS: usize = 4;
/// How often connections and DTLS sessions are checked for handshake and idle timeouts.
const SWEEP: Duration = Duration::from_secs(1);
/// A TCP/TLS connection or DTLS session with no allocation is closed after this long without
/// a byte from its client, so that silent connections cannot hold descriptors for ever.
const IDLE_WITHOUT_ALLOCATION: Duration = Duration::from_secs(30);
/// Scratch for stream reads and DTLS plaintext.
const SCRATCH: usize = 64 << 10;

/// One shard: the TURN engine and the parts that own its sockets, buffers and counters.
pub(super) struct Shard<D: Driver> {
    index: usize,
    engine: Engine,
    snapshots: Snapshots,
    listeners: Listeners<D::Watch>,
    conns: ConnTable<D::Watch>,
    datagrams: Datagrams,
    relays: Relays<D::Watch>,
    counters: Counters,
    driver: D,
    /// Where the engine writes replies and Data indications.
    out: Box<[u8]>,
    /// Taken while a stream read or a DTLS datagram is handled.
    scratch: Option<Box<[u8]>>,
    next_sweep: Instant,
    /// Warnings about exhausted resources (descriptors, ports), which a client can cause.
    resource_log: LogLimiter,
    /// Second-chance forwarding, if configured.
    siblings: Option<Siblings<D::Watch>>,
    /// The state directory's adoptions and journal, if configured.
    state: Option<state::State>,
}

impl<D: Driver> Shard<D> {
    /// A shard with no listeners yet (they open on the first tick), driven by `driver`.
    pub(super) fn new(setup: &ShardSetup, driver: D) -> Shard<D> {
        let now = Instant::now();
        let mut engine = Engine::new(setup.engine.clone());
        if setup.offload.is_some() {
            engine.enable_offload();
        }
        let siblings = setup.siblings.as_ref();
        let siblings = Siblings::start(siblings, setup.index, &driver, &mut engine, now);
        let state = setup.state.as_ref();
        let state = state.map(|state| state::State::new(setup.index, state, &mut engine));
        Shard {
            index: setup.index,
            engine,
            snapshots: Snapshots::new(&setup.snapshot),
            listeners: Listeners::new(),
            conns: ConnTable::new(setup.admission.clone()),
            datagrams: Datagrams::new(),
            relays: Relays::new(setup.offload.clone().map(OffloadTable::new), now),
            counters: Counters::default(),
            driver,
            out: vec![0u8; BUFFER].into_boxed_slice(),
            scratch: Some(vec![0u8; SCRATCH].into_boxed_slice()),
            next_sweep: now + SWEEP,
            resource_log: Default::default(),
            siblings,
            state,
        }
    }

    /// What waits for this shard's sockets.
    pub(super) fn driver(&self) -> &D {
        &self.driver
    }

    /// Picks up a new snapshot (opening and closing listeners), expires what is due and
    /// publishes the counters.
    pub(super) fn tick(&mut self, setup: &ShardSetup) {
        let now = Instant::now();
        if let Some(snap) = self.snapshots.pending_reconcile() {
            let complete = self.reconcile_listeners(&snap, setup);
            self.snapshots.reconciled(snap, complete);
        }
        if let Some(state) = self.state.as_mut() {
            let (snap, driver) = (self.snapshots.serving(), &self.driver);
            let (engine, relays) = (&mut self.engine, &mut self.relays);
            state.tick(engine, relays, &self.listeners, snap, driver, now);
        }
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
            self.relays.close_released(&mut self.engine);
        }
        if now >= self.next_sweep {
            self.next_sweep = now + SWEEP;
            self.sweep(now);
        }
        if self.relays.offloads() {
            let snap = self.snapshots.serving();
            self.relays
                .tick_offload(&mut self.engine, snap, &self.listeners, now);
            let deltas = self.relays.offload_deltas();
            self.counters.count_offloaded(deltas, snap, &self.listeners);
            self.counters.offload_channels = self.relays.offloaded_channels();
        }
        if let Some(siblings) = self.siblings.as_mut() {
            siblings.tick(now);
        }
        self.counters.publish(
            &setup.stats[self.index],
            &self.engine,
            &self.listeners,
            &self.conns,
            self.siblings.as_ref().map(Siblings::report),
        );
    }

    /// Ticks if `next_tick` has passed (and sets the next one); false once the shard is told
    /// to stop. The backends call it on every wakeup.
    pub(super) fn tick_if_due(&mut self, setup: &ShardSetup, next_tick: &mut Instant) -> bool {
        let now = Instant::now();
        if now >= *next_tick {
            if setup.stop.load(Ordering::Relaxed) {
                return false;
            }
            self.tick(setup);
            *next_tick = now + TICK;
        }
        true
    }

    /// With the kernel offload, carries out in it what the engine reports changed.
    fn sync_offload(&mut self, now: Instant) {
        if self.relays.offloads() {
            let snap = self.snapshots.serving();
            self.relays
                .sync_offload(&mut self.engine, snap, &self.listeners, now);
        }
    }

    /// Closes every socket.
    pub(super) fn shutdown(&mut self, stats: &ShardStats) {
        for slot in self.conns.slots() {
            self.close_conn(slot, None);
        }
        self.listeners.clear();
        self.relays.clear();
        stats.allocations.store(0, Ordering::Relaxed);
    }

    /// Ends TLS handshakes that took too long, and connections and DTLS sessions that
    /// stalled or went quiet without an allocation.
    fn sweep(&mut self, now: Instant) {
        for (slot, why) in self.conns.late(now, &self.engine) {
            self.close_conn(slot, Some(why));
        }
        self.listeners.sweep_dtls(now, &mut self.engine);
        self.relays.close_released(&mut self.engine);
    }

    /// Opens listeners the snapshot adds and closes those it removes (or changes in a way
    /// that needs a restart), with their connections and allocations; unchanged listeners
    /// and their allocations are left alone. `false` if a listener could not open yet.
    fn reconcile_listeners(&mut self, snap: &Snapshot, setup: &ShardSetup) -> bool {
        setup.groups.reconciling(self.index, snap);
        for id in self.listeners.stale(snap) {
            for slot in self.conns.of_listener(id) {
                self.close_conn(slot, None);
            }
            self.engine.close_listener(id);
            self.relays.close_released(&mut self.engine);
            self.listeners.close(id, &setup.groups, self.index);
        }
        self.listeners.open_added(
            snap,
            &setup.groups,
            self.index,
            &self.driver,
            &mut self.counters.listeners,
        )
    }

    /// Receives and handles what waits on the socket behind `token`, up to [`ROUNDS`] batches.
    pub(super) fn readable(&mut self, token: Token) -> Readiness {
        match token {
            Token::Relay(relay) => self.relay_readable(relay),
            Token::Listener { id, socket } => {
                let stream = self.listeners.get(id).map(|l| l.transport.is_stream());
                match stream {
                    None => Readiness::Drained,
                    Some(true) => self.accept_ready(id, usize::from(socket)),
                    Some(false) => self.listener_readable(id, usize::from(socket)),
                }
            }
            Token::Conn { slot, generation } => self.conn_ready(slot, generation),
            Token::Sibling => self.sibling_readable(),
        }
    }

    /// Sends every queued datagram and writes what connections have queued.
    pub(super) fn flush(&mut self) {
        self.datagrams.flush_to_peers(&mut self.counters);
        self.datagrams.flush_to_clients(&mut self.counters);
        if let Some(siblings) = self.siblings.as_mut() {
            siblings.flush();
        }
        while let Some(slot) = self.conns.pop_dirty() {
            self.flush_conn(slot);
        }
    }

    fn listener_readable(&mut self, id: ListenerId, n: usize) -> Readiness {
        let Some(socket) = self.listeners.get(id).and_then(|l| l.datagram_socket(n)) else {
            return Readiness::Drained;
        };
        self.drain(socket.fd, Batch::Listener, |shard, now, datagram| {
            shard.client_datagram(now, socket, datagram)
        })
    }

    fn relay_readable(&mut self, relay: RelayId) -> Readiness {
        let Some(fd) = self.relays.fd(relay) else {
            return Readiness::Drained;
        };
        self.drain(fd, Batch::Relay, |shard, now, datagram| {
            shard.peer_datagram(now, relay, datagram)
        })
    }

    fn sibling_readable(&mut self) -> Readiness {
        let Some(fd) = self.siblings.as_ref().map(Siblings::fd) else {
            return Readiness::Drained;
        };
        self.drain(fd, Batch::Relay, Self::sibling_datagram)
    }

    /// Receives up to [`ROUNDS`] batches from `fd` into batch `which`, handing each datagram to
    /// `handle`.
    fn drain(
        &mut self,
        fd: RawFd,
        which: Batch,
        handle: impl FnMut(&mut Self, Instant, Datagram<'_>),
    ) -> Readiness {
        let Some(mut batch) = self.datagrams.lend(which) else {
            return Readiness::Drained;
        };
        let readiness = self.receive(fd, &mut batch, handle);
        self.datagrams.give_back(which, batch);
        readiness
    }

    /// [`Shard::drain`]'s rounds, each followed by the sends and closes it queued.
    fn receive(
        &mut self,
        fd: RawFd,
        batch: &mut RecvBatch,
        mut handle: impl FnMut(&mut Self, Instant, Datagram<'_>),
    ) -> Readiness {
        let mut failed = false;
        for _ in 0..ROUNDS {
            let count = match batch.recv(fd) {
                Ok(count) => count,
                // A pending socket error is reported once and cleared: the next round reads
                // what is queued behind it (an edge-triggered backend would not report the
                // socket again for datagrams that are already waiting).
                Err(e) => {
                    tracing::debug!(target: "stunner", "receive failed: {e}");
                    if failed {
                        return Readiness::Drained;
                    }
                    failed = true;
                    continue;
                }
            };
            let now = Instant::now();
            for i in 0..count {
                handle(self, now, batch.get(i));
            }
            self.datagrams.flush_to_peers(&mut self.counters);
            self.relays.close_released(&mut self.engine);
            self.sync_offload(now);
            if count < BATCH {
                return Readiness::Drained;
            }
        }
        Readiness::More
    }

    fn client_datagram(&mut self, now: Instant, socket: DatagramSocket, datagram: Datagram<'_>) {
        self.counters.listener_rx_packets += 1;
        self.counters.listeners.traffic[socket.metric].rx(datagram.len);
        let Some(from) = datagram.from.map(canonical) else {
            return;
        };
        if datagram.truncated || datagram.len >= MAX_DATAGRAM {
            self.counters.unparsed += 1;
            return;
        }
        let data = &datagram.buf[PEER_HEADROOM..PEER_HEADROOM + datagram.len];
        if socket.dtls {
            self.dtls_datagram(now, socket, from, data);
            return;
        }
        self.place_unplaced(now, socket.id, from);
        if let Some(n) = self.handle_turn(now, socket.id, from, data, ArrivalKind::Straight) {
            // The kernel relays a channel from the moment its ChannelBind is answered: the
            // entry is installed before the answer leaves.
            self.sync_offload(now);
            socket.send_to(from, &self.out[..n], &mut self.counters);
        }
    }

    /// A datagram from `from` on DTLS listener socket `socket`: handshake records go to (or
    /// start) its session; decrypted TURN messages go to the engine and their replies back
    /// encrypted.
    fn dtls_datagram(
        &mut self,
        now: Instant,
        socket: DatagramSocket,
        from: SocketAddr,
        data: &[u8],
    ) {
        let Some(dtls) = self.listeners.dtls_mut(socket.id) else {
            return;
        };
        let Some((mut session, datagram)) =
            dtls.take_session(now, from, data, &socket, &mut self.counters)
        else {
            return;
        };
        let Some(mut scratch) = self.scratch.take() else {
            return;
        };
        let received = session.receive(now, datagram, &mut scratch, |session, message| {
            if let Some(n) = self.handle_turn(now, socket.id, from, message, ArrivalKind::Straight)
            {
                if !session.send(&self.out[..n]) {
                    self.counters.send_failed += 1;
                }
            }
        });
        self.scratch = Some(scratch);
        session.drain(|datagram| socket.send_to(from, datagram, &mut self.counters));
        match received {
            Ok(()) => {
                if let Some(dtls) = self.listeners.dtls_mut(socket.id) {
                    dtls.restore(from, session);
                }
            }
            Err(why) => {
                tracing::debug!(target: "stunner", "DTLS session of {from} ended: {why:?}");
                self.engine.close_client(socket.id, from);
                self.relays.close_released(&mut self.engine);
            }
        }
    }

    /// The dispatch point for one TURN message `data` of `client` on listener `id`, whatever
    /// carried it, as it arrived (`kind`): the engine decides, and what it decides is carried
    /// out here, the one place a [`ClientAction`] becomes sends (relayed to the peer, relay
    /// sockets bound, a miss forwarded). The length of the reply left in `self.out`, for the
    /// caller to send the way the message came.
    fn handle_turn(
        &mut self,
        now: Instant,
        id: ListenerId,
        client: SocketAddr,
        data: &[u8],
        kind: ArrivalKind,
    ) -> Option<usize> {
        let snap: &Snapshot = self.snapshots.serving();
        let listener = self.listeners.get(id)?;
        let arrival = Arrival {
            now,
            snap,
            listener: ListenerRef {
                id,
                spec: &listener.spec,
            },
            client,
            kind,
        };
        match self.engine.handle_client(arrival, data, &mut self.out) {
            ClientAction::Drop(_) => None,
            ClientAction::Reply(n) => {
                // Recorded before the answer leaves: a restart after it keeps what it says.
                if let Some(state) = self.state.as_mut() {
                    state.record(&mut self.engine, now);
                }
                Some(n)
            }
            ClientAction::Relay {
                relay,
                peer,
                payload,
                cluster,
            } => {
                if let Some(fd) = self.relays.fd(relay) {
                    let counters = &mut self.counters;
                    self.datagrams
                        .queue_to_peer(fd, peer, &data[payload], snap, cluster, counters);
                }
                None
            }
            ClientAction::Miss => self.miss(now, id, client, data),
            ClientAction::AllocateRelay(request) => {
                let log = &mut self.resource_log;
                let bound = self.relays.bind(&request, &self.driver, log, now);
                let reply = self
                    .engine
                    .complete_allocate(now, request.relay, bound, &mut self.out);
                if reply.is_some() {
                    relays::log_allocation(&request, &bound, client, listener, self.index);
                }
                if let Some(state) = self.state.as_mut() {
                    state.record(&mut self.engine, now);
                }
                reply
            }
        }
    }

    /// A client datagram that needs an allocation this shard does not hold, with forwarding
    /// on: a UDP client's goes to the sibling that holds it (a moved flow) as the policy says;
    /// a stream or DTLS client's (a new connection is a new 5-tuple, which no sibling holds)
    /// and one nobody else holds get today's answer. The length of a reply left in `self.out`.
    fn miss(
        &mut self,
        now: Instant,
        id: ListenerId,
        client: SocketAddr,
        data: &[u8],
    ) -> Option<usize> {
        if let (Some(siblings), Some(listener)) = (self.siblings.as_mut(), self.listeners.get(id)) {
            if let ListenerTransport::Udp = listener.transport {
                let snap = self.snapshots.serving();
                let name = &listener.spec.name;
                let action = siblings.forward_miss(now, snap, id, name, client, data);
                if action != MissAction::AnswerLocally {
                    return None;
                }
            }
        }
        self.handle_turn(now, id, client, data, ArrivalKind::AnsweredLocally)
    }

    /// A datagram from a peer on `relay`'s socket, handed to the engine; what it says carried
    /// out here, the one place a [`PeerAction`] becomes sends: relayed to the client (as
    /// ChannelData or a Data indication) on whatever transport the client uses, or back
    /// through the sibling the client's flow reaches this pod through.
    fn peer_datagram(&mut self, now: Instant, relay: RelayId, datagram: Datagram<'_>) {
        let Some(peer) = datagram.from else {
            return;
        };
        if datagram.truncated {
            self.counters.unparsed += 1;
            return;
        }
        let snap: &Snapshot = self.snapshots.serving();
        let buf = &mut datagram.buf[..PEER_HEADROOM + datagram.len];
        let arrival = PeerArrival {
            now,
            snap,
            relay,
            peer,
        };
        let PeerAction::ToClient {
            listener,
            client,
            bytes,
            cluster,
            payload_len,
            forwarded,
        } = self.engine.handle_peer(arrival, buf, &mut self.out)
        else {
            return;
        };
        let counters = &mut self.counters;
        if let Some(slot) = counters.cluster(snap, cluster) {
            counters.clusters.traffic[slot].rx(payload_len);
        }
        let data = match bytes {
            Bytes::Input(range) => &buf[range],
            Bytes::Output(n) => &self.out[..n],
        };
        if let Some(via) = forwarded.then(|| self.engine.via(relay)).flatten() {
            // The client reaches us through a sibling now: back through it.
            counters.relayed_to_client += 1;
            if let (Some(siblings), Some(running)) =
                (self.siblings.as_mut(), self.listeners.get(listener))
            {
                siblings.return_through(via, &running.spec.name, client, data);
            }
            return;
        }
        let (datagrams, conns) = (&mut self.datagrams, &mut self.conns);
        if self
            .listeners
            .send_to_client(listener, client, data, datagrams, conns, counters)
        {
            counters.relayed_to_client += 1;
        }
    }

    /// A datagram on the sibling socket: opened and decided on by the sibling part; a
    /// forwarded client datagram is served here as arrived through its sibling and answered
    /// back through it, a returned one sent on to its client.
    fn sibling_datagram(&mut self, now: Instant, datagram: Datagram<'_>) {
        let Some(siblings) = self.siblings.as_mut() else {
            return;
        };
        let Some(from) = datagram.from.map(canonical) else {
            return;
        };
        if datagram.truncated {
            siblings.truncated();
            return;
        }
        let bytes = &datagram.buf[PEER_HEADROOM..PEER_HEADROOM + datagram.len];
        let snap = self.snapshots.serving();
        match siblings.receive(now, snap, from, bytes, &self.listeners, &self.engine) {
            None => {}
            Some(Inbound::Serve {
                listener,
                client,
                via,
                claim,
                payload,
            }) => {
                let kind = ArrivalKind::Forwarded { via };
                let reply = self.handle_turn(now, listener, client, payload, kind);
                let (Some(siblings), Some(running)) =
                    (self.siblings.as_mut(), self.listeners.get(listener))
                else {
                    return;
                };
                let reply = reply.map(|n| &self.out[..n]);
                siblings.answer(via, &running.spec.name, client, claim, reply);
            }
            Some(Inbound::Deliver {
                listener,
                client,
                payload,
            }) => {
                let (datagrams, conns) = (&mut self.datagrams, &mut self.conns);
                let counters = &mut self.counters;
                if self
                    .listeners
                    .send_to_client(listener, client, payload, datagrams, conns, counters)
                {
                    siblings.delivered();
                }
            }
        }
    }
}
