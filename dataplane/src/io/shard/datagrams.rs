//! The datagram side of a shard: the receive batches and send queues that move UDP with
//! batched syscalls, the listener socket a datagram came in on, and the session table of a
//! TURN-DTLS listener, which turns a client's records into TURN messages and back
//! ([`crate::io::dtls`] does the DTLS itself).

use super::counters::{Counters, NO_SLOT};
use crate::io::dtls::{Admission, Gate, Session};
use crate::io::socket::for_socket;
use crate::proto::{Engine, ListenerId, PEER_HEADROOM};
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::time::Instant;
use uturn_shared::snapshot::{ClusterId, Snapshot};
use uturn_udp::{try_send_to, RecvBatch, SendQueue, MAX_UDP_PAYLOAD};

/// DTLS sessions one listener holds at most on a shard (a new client beyond it is ignored
/// until some end).
const MAX_DTLS_SESSIONS: usize = 16 << 10;

/// Which receive batch a socket is drained into.
#[derive(Clone, Copy)]
pub(super) enum Batch {
    /// Client datagrams, on listener sockets: room for [`super::MAX_DATAGRAM`] and a little.
    Listener,
    /// Peer datagrams, on relay sockets (and sibling messages): room for the largest.
    Relay,
}

/// The buffers a shard moves datagrams with, allocated once.
pub(super) struct Datagrams {
    /// Lent out while a batch is handled (so the shard can be borrowed alongside it): one for
    /// listener sockets, one with room for the largest datagrams for relay sockets.
    listener_batch: Option<Box<RecvBatch>>,
    relay_batch: Option<Box<RecvBatch>>,
    /// Relayed client datagrams, tagged with their cluster's counter slot (or
    /// [`super::counters::NO_SLOT`]): a run of datagrams for one relay socket (a video frame,
    /// say) leaves in one `sendmmsg`.
    pub to_peers: SendQueue,
    /// Datagrams for clients, tagged with their listener's counter slot.
    pub to_clients: SendQueue,
}

impl Datagrams {
    /// Empty queues and batches with room for a header in front of each datagram.
    pub(super) fn new() -> Datagrams {
        Datagrams {
            listener_batch: Some(Box::new(RecvBatch::new(PEER_HEADROOM))),
            relay_batch: Some(Box::new(RecvBatch::with_room(
                PEER_HEADROOM,
                MAX_UDP_PAYLOAD,
            ))),
            to_peers: SendQueue::new(),
            to_clients: SendQueue::new(),
        }
    }

    /// Lends batch `which` while its datagrams are handled (give it back with
    /// [`Datagrams::give_back`]); `None` while it is lent.
    pub(super) fn lend(&mut self, which: Batch) -> Option<Box<RecvBatch>> {
        match which {
            Batch::Listener => self.listener_batch.take(),
            Batch::Relay => self.relay_batch.take(),
        }
    }

    /// Takes back batch `which`.
    pub(super) fn give_back(&mut self, which: Batch, batch: Box<RecvBatch>) {
        match which {
            Batch::Listener => self.listener_batch = Some(batch),
            Batch::Relay => self.relay_batch = Some(batch),
        }
    }

    /// Sends the datagrams queued for peers.
    pub(super) fn flush_to_peers(&mut self, counters: &mut Counters) {
        if !self.to_peers.is_empty() {
            self.to_peers
                .flush(&mut |cluster, outcome| counters.sent_to_peer(cluster, outcome));
        }
    }

    /// Queues `payload` for `peer` on relay socket `fd`, counted under cluster `cluster` of
    /// `snap`.
    #[inline]
    pub(super) fn queue_to_peer(
        &mut self,
        fd: RawFd,
        peer: SocketAddr,
        payload: &[u8],
        snap: &Snapshot,
        cluster: ClusterId,
        counters: &mut Counters,
    ) {
        counters.relayed_to_peer += 1;
        let cluster = counters.cluster(snap, cluster).unwrap_or(NO_SLOT);
        self.to_peers
            .push(fd, payload, peer, cluster, &mut |cluster, outcome| {
                counters.sent_to_peer(cluster, outcome)
            });
    }

    /// Queues `datagram` for `client`, from UDP listener socket `socket`, counted.
    pub(super) fn queue_to_client(
        &mut self,
        socket: &DatagramSocket,
        client: SocketAddr,
        datagram: &[u8],
        counters: &mut Counters,
    ) {
        self.to_clients.push(
            socket.fd,
            datagram,
            for_socket(socket.local, client),
            socket.metric,
            &mut |metric, outcome| counters.sent_to_client(metric, outcome),
        );
    }

    /// Sends the datagrams queued for clients.
    pub(super) fn flush_to_clients(&mut self, counters: &mut Counters) {
        if !self.to_clients.is_empty() {
            self.to_clients
                .flush(&mut |metric, outcome| counters.sent_to_client(metric, outcome));
        }
    }
}

/// A UDP listener socket being drained or sent from, looked up once per readiness report
/// rather than per datagram.
#[derive(Clone, Copy)]
pub(super) struct DatagramSocket {
    pub id: ListenerId,
    pub fd: RawFd,
    /// Listener counter slot.
    pub metric: usize,
    pub local: SocketAddr,
    /// TURN-DTLS: datagrams are records of per-client sessions.
    pub dtls: bool,
}

impl DatagramSocket {
    /// Sends `datagram` to `client` at once (no queue), counted.
    pub(super) fn send_to(&self, client: SocketAddr, datagram: &[u8], counters: &mut Counters) {
        let outcome = try_send_to(self.fd, datagram, for_socket(self.local, client));
        if let Some(n) = counters.sent(outcome) {
            counters.listeners.traffic[self.metric].tx(n);
        }
    }
}

/// A TURN-DTLS listener's sessions, one per client address, and the gate that admits new
/// ones.
pub(super) struct DtlsListener {
    gate: Gate,
    sessions: HashMap<SocketAddr, Session, RandomState>,
}

impl DtlsListener {
    /// A listener with no sessions yet.
    pub(super) fn new(gate: Gate) -> DtlsListener {
        DtlsListener {
            gate,
            sessions: HashMap::with_hasher(RandomState::default()),
        }
    }

    /// Sessions held.
    pub(super) fn len(&self) -> usize {
        self.sessions.len()
    }

    /// The session a datagram `data` from `from` (on `socket`) is for, taken out of the table
    /// while it is used so that the shard can be borrowed beside it (give it back with
    /// [`DtlsListener::restore`]), with what to hand it: `data`, or nothing for a session the
    /// datagram just started. `None` if the datagram starts no session.
    pub(super) fn take_session<'a>(
        &mut self,
        now: Instant,
        from: SocketAddr,
        data: &'a [u8],
        socket: &DatagramSocket,
        counters: &mut Counters,
    ) -> Option<(Session, &'a [u8])> {
        if let Some(session) = self.sessions.remove(&from) {
            return Some((session, data));
        }
        // Only a handshake record (content type 22) may start a session.
        if data.first() != Some(&22) || self.sessions.len() >= MAX_DTLS_SESSIONS {
            counters.unparsed += 1;
            return None;
        }
        // RFC 6347 §4.2.1: a session only for a ClientHello that echoes our cookie; the
        // HelloVerifyRequest is smaller than the ClientHello, so no amplification either.
        let admission = self.gate.admit(now, from, data, |datagram| {
            socket.send_to(from, datagram, counters)
        });
        match admission {
            Admission::Session(session) => {
                counters.listeners.opened[socket.metric] += 1;
                // OpenSSL holds the ClientHello: go on with no new datagram.
                Some((session, &[]))
            }
            Admission::Nothing => None,
        }
    }

    /// Puts back the session of `client` that [`DtlsListener::take_session`] lent.
    pub(super) fn restore(&mut self, client: SocketAddr, session: Session) {
        self.sessions.insert(client, session);
    }

    /// Encrypts `data` for `client` and sends it from `socket`.
    pub(super) fn send_to_client(
        &mut self,
        client: SocketAddr,
        data: &[u8],
        socket: &DatagramSocket,
        counters: &mut Counters,
    ) {
        let Some(session) = self.sessions.get_mut(&client) else {
            counters.send_failed += 1;
            return;
        };
        if !session.send(data) {
            counters.send_failed += 1;
        }
        session.drain(|datagram| socket.send_to(client, datagram, counters));
    }

    /// Ends the sessions (of listener `id`) whose handshake stalled or that went quiet
    /// without an allocation, and their clients' allocations in `engine`.
    pub(super) fn sweep(&mut self, now: Instant, id: ListenerId, engine: &mut Engine) {
        self.sessions.retain(|client, session| {
            let stalled = session.handshake_deadline.is_some_and(|d| d <= now);
            let idle = now.saturating_duration_since(session.last_rx)
                >= super::IDLE_WITHOUT_ALLOCATION
                && !engine.has_allocation(id, *client);
            if stalled || idle {
                engine.close_client(id, *client);
            }
            !(stalled || idle)
        });
    }
}
