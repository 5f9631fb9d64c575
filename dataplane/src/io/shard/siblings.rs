//! Second-chance forwarding between the gateway pods of one gateway ("siblings"): when a
//! client's UDP flow moves to this pod (a load balancer re-balanced it, a conntrack entry
//! timed out) and its datagram finds no allocation here, this pod hands the datagram to the
//! sibling that holds the allocation, which answers through this pod; the client keeps
//! talking to the address it knows, the peer to the relay address it knows.
//!
//! Each shard has its own sibling socket, on the base port plus its index, so that an owner
//! answers from the shard that holds the allocation and the forwarder's later datagrams reach
//! that shard directly. A datagram whose owner is not known yet goes to every sibling's first
//! shard as a query ([`FLAG_QUERY`]); a first shard that does not hold the client hands the
//! query on to its pod's other shards (with the forwarder as its origin); the shard that holds
//! it answers a [`Kind::Claim`] and, like every answer, a [`Kind::Return`] to the forwarder,
//! which remembers the owner. A query nobody claims within [`QUERY_WAIT`] makes the client
//! "nobody's" for [`NOBODY_FOR`]: its datagrams then get today's answer (437, or a drop); so
//! does a [`Kind::Gone`] from an owner whose allocation ended.
//! Queries are limited per client source IP and per shard over all sources; forwards to a
//! known owner are not (they are the call's media). Every message is authenticated ([`crate::proto::sibling`]) and must come
//! from a sibling's address (or, handed on inside the pod, from loopback).

use super::{Driver, Shard};
use crate::io::driver::{Interest, Readiness, Token, Watched};
use crate::io::socket::{canonical, for_socket, listener_socket};
use crate::proto::limits::ChallengeLimiter;
use crate::proto::sibling::{self, Kind, SiblingError, SiblingKey, SiblingMessage, FLAG_QUERY};
use crate::proto::{BoundRelays, ClientAction, ListenerId, ListenerRef, PEER_HEADROOM};
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use uturn_shared::snapshot::Snapshot;
use uturn_udp::SendQueue;

/// How long a query waits for its owner's claim.
pub(crate) const QUERY_WAIT: Duration = Duration::from_millis(300);
/// How long a client no sibling claimed gets today's answer without asking again.
pub(crate) const NOBODY_FOR: Duration = Duration::from_secs(5);
/// How long a known owner is remembered without a datagram for it.
pub(crate) const OWNER_IDLE: Duration = Duration::from_secs(120);
/// Clients remembered at most per shard, in each table (an owner, nobody's, a query in flight).
const MAX_CLIENTS: usize = 1 << 16;
/// Queries one client source IP may make at once, and per second after that: room for the
/// calls of a NAT address shared by many clients (an office, a carrier NAT) that move at once,
/// while one source still takes only a tenth of the shard's budget.
const QUERY_BURST: u32 = 100;
const QUERY_RATE: u32 = 50;
/// Queries a shard makes at once and per second over all sources: misses spoofed from many
/// source addresses (each with a bucket of its own) send no more than this to the siblings,
/// while a load balancer moving a thousand calls at once still finds their owners at once.
const QUERY_BURST_ALL: u32 = 1000;
const QUERY_RATE_ALL: u32 = 500;

/// What the dataplane is told about its siblings at start (their addresses come and go with
/// the snapshot).
#[derive(Debug, Clone)]
pub struct SiblingSetup {
    /// The key the gateway's pods share.
    pub key: SiblingKey,
    /// The first shard's sibling port; shard `i` listens on `port + i`, on every pod.
    pub port: u16,
}

/// The counters of second-chance forwarding, per shard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SiblingCounts {
    /// Client datagrams handed to a sibling (queries included).
    pub forwarded_out: u64,
    /// Client datagrams a sibling handed us, that we held the allocation of.
    pub forwarded_in: u64,
    /// Datagrams for a client sent back through the sibling it reaches us through.
    pub returned_out: u64,
    /// Datagrams a sibling sent back for our listener to send to its client.
    pub returned_in: u64,
    /// Queries sent (one per unknown client, to every sibling).
    pub queries: u64,
    /// Queries a sibling claimed.
    pub hits: u64,
    /// Queries no sibling claimed in time.
    pub misses: u64,
    /// Queries not sent for the client source's query budget.
    pub rate_limited: u64,
    /// Messages refused: not authenticated (wrong key), stale clock, malformed, or from an
    /// address that is no sibling.
    pub unauthenticated: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub stale: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub malformed: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub not_sibling: u64,
}

/// Whom a client of one of our listeners is forwarded to.
#[derive(Debug, Clone, Copy)]
struct Owner {
    addr: SocketAddr,
    seen: Instant,
}

type ClientOf = (ListenerId, SocketAddr);

/// A shard's sibling socket and what it knows of its clients' owners.
pub(super) struct SiblingLink<W> {
    socket: Watched<W>,
    /// Its address: `[::]` (dual-stack) where the host has IPv6, else `0.0.0.0`.
    local: SocketAddr,
    key: SiblingKey,
    base: u16,
    index: usize,
    shards: usize,
    owners: HashMap<ClientOf, Owner, RandomState>,
    nobody: HashMap<ClientOf, Instant, RandomState>,
    pending: HashMap<ClientOf, Instant, RandomState>,
    queries: ChallengeLimiter,
    /// The shard's budget over all sources (one bucket).
    queries_all: ChallengeLimiter,
    message: Vec<u8>,
    /// Messages for siblings, sent together when the shard flushes (a run of forwarded media
    /// for one owner leaves in one `sendmmsg`), tagged with what they count as ([`Sent`]).
    /// Without UDP GSO: between pods it cost more CPU than it saved below saturation
    /// (perf/results/2026-12-07-second-chance.md).
    queue: SendQueue,
    pub(super) counts: SiblingCounts,
}

/// What a message sent to a sibling counts as, once the kernel took it.
#[derive(Clone, Copy)]
enum Sent {
    /// A client datagram forwarded (or a query): `forwarded_out`.
    Forwarded = 0,
    /// Something for a client, returned through its forwarder: `returned_out`.
    Returned = 1,
    /// A claim, a gone, a query handed on inside the pod: not counted.
    Control = 2,
}

/// Counts one message the sibling queue sent (or failed to).
fn count_sent(counts: &mut SiblingCounts, tag: usize, outcome: io::Result<usize>) {
    if outcome.is_err() {
        return;
    }
    if tag == Sent::Forwarded as usize {
        counts.forwarded_out += 1;
    } else if tag == Sent::Returned as usize {
        counts.returned_out += 1;
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl<W> SiblingLink<W> {
    /// Opens shard `index`'s sibling socket (`setup.port + index`, every address).
    pub(super) fn open<D: Driver<Watch = W>>(
        setup: &SiblingSetup,
        index: usize,
        shards: usize,
        driver: &D,
        now: Instant,
    ) -> io::Result<SiblingLink<W>> {
        let port = u16::try_from(usize::from(setup.port) + index)
            .map_err(|_| io::Error::other("sibling port beyond 65535"))?;
        let socket = listener_socket(None, port)?;
        let local = socket
            .local_addr()?
            .as_socket()
            .ok_or_else(|| io::Error::other("the sibling socket has no IP address"))?;
        let socket = driver.watch(socket, Token::Sibling, Interest::Datagrams)?;
        Ok(SiblingLink {
            socket,
            local,
            key: setup.key.clone(),
            base: setup.port,
            index,
            shards,
            owners: HashMap::with_hasher(RandomState::default()),
            nobody: HashMap::with_hasher(RandomState::default()),
            pending: HashMap::with_hasher(RandomState::default()),
            queries: ChallengeLimiter::new(QUERY_RATE, QUERY_BURST, now),
            queries_all: ChallengeLimiter::shared(QUERY_RATE_ALL, QUERY_BURST_ALL, now),
            message: Vec::with_capacity(2048),
            queue: SendQueue::new().without_gso(),
            counts: SiblingCounts::default(),
        })
    }

    /// Queues `message` for sibling `to` (sent at the shard's next flush), counted as `sent`.
    fn send(&mut self, to: SocketAddr, message: &SiblingMessage<'_>, sent: Sent) {
        if sibling::encode(&self.key, message, unix_ms(), &mut self.message).is_none() {
            return;
        }
        let counts = &mut self.counts;
        self.queue.push(
            self.socket.fd,
            &self.message,
            for_socket(self.local, to),
            sent as usize,
            &mut |tag, outcome| count_sent(counts, tag, outcome),
        );
    }

    /// Sends the queued messages.
    pub(super) fn flush(&mut self) {
        if !self.queue.is_empty() {
            let counts = &mut self.counts;
            self.queue
                .flush(&mut |tag, outcome| count_sent(counts, tag, outcome));
        }
    }

    /// Forgets owners idle too long, turns unanswered queries into "nobody's".
    pub(super) fn tick(&mut self, now: Instant) {
        self.owners
            .retain(|_, owner| now.saturating_duration_since(owner.seen) < OWNER_IDLE);
        self.nobody.retain(|_, until| *until > now);
        let mut missed = Vec::new();
        self.pending.retain(|client, deadline| {
            let waiting = *deadline > now;
            if !waiting {
                missed.push(*client);
            }
            waiting
        });
        for client in missed {
            self.counts.misses += 1;
            if self.nobody.len() < MAX_CLIENTS {
                self.nobody.insert(client, now + NOBODY_FOR);
            }
        }
    }

    /// How many clients this shard forwards to each sibling (by IP).
    pub(super) fn forwarding_for(&self) -> Vec<(IpAddr, u64)> {
        let mut counts: Vec<(IpAddr, u64)> = Vec::new();
        for owner in self.owners.values() {
            crate::io::metrics::add_count(&mut counts, owner.addr.ip(), 1);
        }
        counts
    }
}

/// What to do with a client datagram that missed.
pub(super) enum MissVerdict {
    /// Handed to a sibling (or dropped while a query is in flight, or over the query budget):
    /// nothing to answer here.
    Forwarded,
    /// Give today's answer.
    Local,
}

impl<D: Driver> Shard<D> {
    /// A datagram from `from` on UDP listener `id` that needs an allocation this shard does
    /// not hold: to its owner if known, else a query to every sibling, else today's answer.
    pub(super) fn forward_miss(
        &mut self,
        now: Instant,
        id: ListenerId,
        from: SocketAddr,
        data: &[u8],
    ) -> MissVerdict {
        let snap: &Snapshot = self.snapshots.serving();
        let siblings = snap.sibling_ips.clone();
        let (Some(link), Some(listener)) = (self.siblings.as_mut(), self.listeners.get(id)) else {
            return MissVerdict::Local;
        };
        let client = (id, from);
        let message = |flags| SiblingMessage {
            kind: Kind::Forward,
            flags,
            client: from,
            origin: None,
            listener: &listener.spec.name,
            payload: data,
        };
        if let Some(owner) = link.owners.get_mut(&client) {
            owner.seen = now;
            let to = owner.addr;
            link.send(to, &message(0), Sent::Forwarded);
            return MissVerdict::Forwarded;
        }
        if link.nobody.get(&client).is_some_and(|until| *until > now) || siblings.is_empty() {
            return MissVerdict::Local;
        }
        if link.pending.contains_key(&client) {
            // A query is out: the owner will be known in a moment.
            return MissVerdict::Forwarded;
        }
        if link.pending.len() >= MAX_CLIENTS
            || !link.queries.allow(from.ip(), now)
            || !link.queries_all.allow(from.ip(), now)
        {
            // Dropped unanswered, not given today's 437: the client may be a moved call whose
            // owner is asked when the budget allows (its next datagram, or the request's
            // retransmission); a 437 to its Refresh would end the call at the client.
            link.counts.rate_limited += 1;
            return MissVerdict::Forwarded;
        }
        link.pending.insert(client, now + QUERY_WAIT);
        link.counts.queries += 1;
        let base = link.base;
        for ip in siblings.iter() {
            link.send(
                SocketAddr::new(*ip, base),
                &message(FLAG_QUERY),
                Sent::Forwarded,
            );
        }
        MissVerdict::Forwarded
    }

    /// The sibling socket is readable.
    pub(super) fn sibling_readable(&mut self) -> Readiness {
        let Some(fd) = self.siblings.as_ref().map(|l| l.socket.fd) else {
            return Readiness::Drained;
        };
        let Some(mut batch) = self.datagrams.relay_batch.take() else {
            return Readiness::Drained;
        };
        let readiness = self.drain(fd, &mut batch, |shard, now, datagram| {
            let Some(from) = datagram.from.map(canonical) else {
                return;
            };
            if datagram.truncated {
                if let Some(link) = shard.siblings.as_mut() {
                    link.counts.malformed += 1;
                }
                return;
            }
            let bytes = &datagram.buf[PEER_HEADROOM..PEER_HEADROOM + datagram.len];
            shard.sibling_datagram(now, from, bytes);
        });
        self.datagrams.relay_batch = Some(batch);
        readiness
    }

    fn sibling_datagram(&mut self, now: Instant, from: SocketAddr, bytes: &[u8]) {
        let snap = self.snapshots.serving_arc();
        let Some(link) = self.siblings.as_mut() else {
            return;
        };
        // Handed on inside this pod, or from a sibling.
        if !from.ip().is_loopback() && !snap.sibling_ips.contains(&from.ip()) {
            link.counts.not_sibling += 1;
            return;
        }
        let message = match sibling::decode(&link.key, bytes, unix_ms()) {
            Ok(message) => message,
            Err(error) => {
                match error {
                    SiblingError::Unauthenticated => link.counts.unauthenticated += 1,
                    SiblingError::Stale => link.counts.stale += 1,
                    SiblingError::Malformed => link.counts.malformed += 1,
                }
                return;
            }
        };
        let Some(id) = self.listeners.id_of(message.listener) else {
            return;
        };
        let client = (id, message.client);
        match message.kind {
            Kind::Claim => {
                let link = self.siblings.as_mut().expect("checked above");
                if link.pending.remove(&client).is_some() {
                    link.counts.hits += 1;
                }
                link.nobody.remove(&client);
                if link.owners.len() < MAX_CLIENTS || link.owners.contains_key(&client) {
                    link.owners.insert(
                        client,
                        Owner {
                            addr: from,
                            seen: now,
                        },
                    );
                }
            }
            Kind::Gone => {
                let link = self.siblings.as_mut().expect("checked above");
                if link.owners.get(&client).is_some_and(|o| o.addr == from) {
                    link.owners.remove(&client);
                    if link.nobody.len() < MAX_CLIENTS {
                        link.nobody.insert(client, now + NOBODY_FOR);
                    }
                }
            }
            Kind::Return => {
                let Some(socket) = self
                    .listeners
                    .get(id)
                    .and_then(|l| l.datagram_socket(0))
                    .filter(|s| !s.dtls)
                else {
                    return;
                };
                let link = self.siblings.as_mut().expect("checked above");
                link.counts.returned_in += 1;
                if let Some(owner) = link.owners.get_mut(&client) {
                    owner.seen = now;
                }
                self.datagrams.queue_to_client(
                    &socket,
                    message.client,
                    message.payload,
                    &mut self.counters,
                );
            }
            Kind::Forward => {
                let reply_to = message.origin.unwrap_or(from);
                if self.engine.holds(id, message.client) {
                    self.owner_forwarded(now, &snap, id, reply_to, &message);
                    return;
                }
                let link = self.siblings.as_mut().expect("checked above");
                if message.flags & FLAG_QUERY == 0 {
                    // The forwarder thinks we own the client, which we no longer do (the call
                    // ended, or its allocation expired): it must stop, and answer as today.
                    let gone = SiblingMessage {
                        kind: Kind::Gone,
                        flags: 0,
                        payload: &[],
                        origin: None,
                        ..message.clone()
                    };
                    link.send(reply_to, &gone, Sent::Control);
                    return;
                }
                // A query reaches every pod's first shard: that shard asks the pod's others.
                if message.origin.is_none() && link.index == 0 {
                    let handed_on = SiblingMessage {
                        origin: Some(from),
                        ..message.clone()
                    };
                    for shard in 1..link.shards {
                        let Some(port) = u16::try_from(usize::from(link.base) + shard).ok() else {
                            break;
                        };
                        let local = SocketAddr::new(IpAddr::from([127, 0, 0, 1]), port);
                        link.send(local, &handed_on, Sent::Control);
                    }
                }
            }
        }
    }

    /// The owner's side: a datagram a sibling (`reply_to`) forwarded for a client whose
    /// allocation this shard holds, handled as if it came straight, answered through it.
    fn owner_forwarded(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        id: ListenerId,
        reply_to: SocketAddr,
        message: &SiblingMessage<'_>,
    ) {
        let Some(listener) = self.listeners.get(id) else {
            return;
        };
        let action = self.engine.handle_forwarded(
            now,
            snap,
            ListenerRef {
                id,
                spec: &listener.spec,
            },
            message.client,
            message.payload,
            &mut self.out,
            reply_to,
        );
        let reply = self.act(now, snap, message.payload, action);
        // Fields apart: the listener's name, the link and the reply are borrowed together.
        let (Some(link), Some(listener)) = (self.siblings.as_mut(), self.listeners.get(id)) else {
            return;
        };
        let name = &listener.spec.name;
        link.counts.forwarded_in += 1;
        if message.flags & FLAG_QUERY != 0 {
            let claim = SiblingMessage {
                kind: Kind::Claim,
                flags: 0,
                client: message.client,
                origin: None,
                listener: name,
                payload: &[],
            };
            link.send(reply_to, &claim, Sent::Control);
        }
        if let Some(n) = reply {
            let answer = SiblingMessage {
                kind: Kind::Return,
                flags: 0,
                client: message.client,
                origin: None,
                listener: name,
                payload: &self.out[..n],
            };
            link.send(reply_to, &answer, Sent::Returned);
        }
    }

    /// Sends `data` for `client` of listener `id` back through sibling `via`.
    pub(super) fn return_through(
        &mut self,
        via: SocketAddr,
        id: ListenerId,
        client: SocketAddr,
        data: &[u8],
    ) {
        let (Some(link), Some(listener)) = (self.siblings.as_mut(), self.listeners.get(id)) else {
            return;
        };
        let answer = SiblingMessage {
            kind: Kind::Return,
            flags: 0,
            client,
            origin: None,
            listener: &listener.spec.name,
            payload: data,
        };
        link.send(via, &answer, Sent::Returned);
    }

    /// Carries out what the engine asked for a client datagram (relays it, or binds an
    /// allocation's sockets); the length of the reply left in `self.out`, if any.
    pub(super) fn act(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        data: &[u8],
        action: ClientAction,
    ) -> Option<usize> {
        match action {
            ClientAction::Drop(_) | ClientAction::Miss => None,
            ClientAction::Reply(n) => Some(n),
            ClientAction::Relay {
                relay,
                peer,
                payload,
                cluster,
            } => {
                self.relay_to_peer(snap, relay, peer, &data[payload], cluster);
                None
            }
            ClientAction::AllocateRelay(request) => {
                // An Allocate is never forwarded; a request for relays here is answered as
                // a bind failure rather than left pending.
                self.engine.complete_allocate(
                    now,
                    request.relay,
                    BoundRelays {
                        relay: Err(crate::proto::RelayBindError {
                            kind: io::ErrorKind::Unsupported,
                        }),
                        additional: None,
                    },
                    &mut self.out,
                )
            }
        }
    }
}
