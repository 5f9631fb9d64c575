//! Second-chance forwarding between the gateway pods of one gateway ("siblings"), the shard's
//! part: when a client's UDP flow moves to this pod (a load balancer re-balanced it, a
//! conntrack entry timed out) and its datagram finds no allocation here, this pod hands the
//! datagram to the sibling that holds the allocation, which answers through this pod; the
//! client keeps talking to the address it knows, the peer to the relay address it knows.
//!
//! What to do is decided without IO by [`Forwarding`] (`proto/sibling/forwarding.rs`: owners,
//! queries and their budgets, which messages are accepted, replay windows); [`Siblings`] owns
//! what it needs to carry that out: the shard's sibling socket, the keys as last read, the
//! queue of messages to send and the traffic counts. The shard hands it each miss
//! ([`Siblings::forward_miss`]) and each datagram of the sibling socket
//! ([`Siblings::receive`]), and does what comes back that needs its other parts: a forwarded
//! datagram served by the engine ([`Inbound::Serve`], answered with [`Siblings::answer`]), a
//! returned one sent to its client ([`Inbound::Deliver`]).
//!
//! Each shard has its own sibling socket, on the base port plus its index, so that an owner
//! answers from the shard that holds the allocation and the forwarder's later datagrams reach
//! that shard directly. A datagram whose owner is not known yet goes to every sibling's first
//! shard as a query ([`FLAG_QUERY`]); a first shard that does not hold the client hands the
//! query on to its pod's other shards (with the forwarder as its origin); the shard that holds
//! it answers a [`Kind::Claim`] and, like every answer, a [`Kind::Return`] to the forwarder,
//! which remembers the owner.
//!
//! The keys come from `--sibling-key-file` (or `UTURN_SIBLING_KEY`) through a
//! [`SiblingSetup`]; a key file is read again every [`KEY_FILE_POLL`] (a Kubernetes Secret
//! mount changes in place, by a symlink swap) and a shard takes new keys at its next tick.

use super::listeners::Listeners;
use crate::io::driver::{Driver, Interest, Token, Watched};
use crate::io::metrics::SiblingReport;
use crate::io::socket::{for_socket, listener_socket};
use crate::proto::sibling::queries::MissClass;
use crate::proto::sibling::{
    Forwarding, Kind, MessageAction, MissAction, SiblingError, SiblingKeys, SiblingMessage,
    FLAG_QUERY,
};
use crate::proto::{Engine, ListenerId};
use arc_swap::ArcSwap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use uturn_shared::snapshot::Snapshot;
use uturn_udp::SendQueue;

/// How often a key file is read again.
pub(crate) const KEY_FILE_POLL: Duration = Duration::from_secs(1);

/// What the dataplane is told about its siblings at start (their addresses come and go with
/// the snapshot, their keys with the key file).
#[derive(Debug, Clone)]
pub struct SiblingSetup {
    /// The keys the gateway's pods share, as last read; every shard holds a handle.
    keys: Arc<ArcSwap<SiblingKeys>>,
    /// The first shard's sibling port; shard `i` listens on `port + i`, on every pod.
    pub port: u16,
}

impl SiblingSetup {
    /// Forwarding under `keys`, fixed for the process's life (`UTURN_SIBLING_KEY`).
    pub fn new(keys: SiblingKeys, port: u16) -> SiblingSetup {
        SiblingSetup {
            keys: Arc::new(ArcSwap::from_pointee(keys)),
            port,
        }
    }

    /// Forwarding under the keys in file `path` ([`SiblingKeys::parse`]: the current key on
    /// the first line, optionally the next on the second), read now and then again every
    /// second (`KEY_FILE_POLL`) by a thread of its own: a change is taken by every shard at its next
    /// tick, a file that cannot be read or holds no valid keys is logged and the running keys
    /// stay. The thread ends once the dataplane has dropped the setup.
    pub fn from_key_file(path: &Path, port: u16) -> Result<SiblingSetup, String> {
        let shown = path.display().to_string();
        let text = std::fs::read(path).map_err(|e| format!("--sibling-key-file {shown:?}: {e}"))?;
        let keys =
            SiblingKeys::parse(&text).map_err(|e| format!("--sibling-key-file {shown:?}: {e}"))?;
        let setup = SiblingSetup::new(keys, port);
        let watched = Arc::downgrade(&setup.keys);
        let path = path.to_owned();
        std::thread::Builder::new()
            .name("sibling-keys".into())
            .spawn(move || follow_key_file(path, watched, text))
            .map_err(|e| format!("--sibling-key-file {shown:?}: cannot start its reader: {e}"))?;
        Ok(setup)
    }

    /// The keys as last read.
    pub fn keys(&self) -> Arc<SiblingKeys> {
        self.keys.load_full()
    }
}

/// Reads key file `path` every [`KEY_FILE_POLL`] and stores what it holds when it changes
/// (`last`: the contents read last), until nobody holds the keys any more.
fn follow_key_file(path: PathBuf, keys: std::sync::Weak<ArcSwap<SiblingKeys>>, mut last: Vec<u8>) {
    let shown = path.display().to_string();
    let mut unreadable = false;
    loop {
        std::thread::sleep(KEY_FILE_POLL);
        let Some(keys) = keys.upgrade() else {
            return;
        };
        match std::fs::read(&path) {
            Err(e) => {
                if !unreadable {
                    tracing::warn!(target: "stunnerd", "cannot read the sibling keys in {shown:?} (the running keys stay: {}): {e}", keys.load());
                }
                unreadable = true;
            }
            Ok(text) => {
                unreadable = false;
                if text == last {
                    continue;
                }
                match SiblingKeys::parse(&text) {
                    Ok(new) if **keys.load() == new => {}
                    Ok(new) => {
                        tracing::info!(target: "stunnerd", "sibling keys in {shown:?} changed: {new} (were {})", keys.load());
                        keys.store(Arc::new(new));
                    }
                    Err(e) => {
                        tracing::warn!(target: "stunnerd", "ignoring the sibling keys in {shown:?} (the running keys stay: {}): {e}", keys.load())
                    }
                }
                last = text;
            }
        }
    }
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
    /// Queries not sent for the query budget (the source's or the shard's, of the miss's
    /// class).
    pub rate_limited: u64,
    /// Messages refused: not authenticated (under neither key), stale clock, malformed, from
    /// an address that is no sibling, a sender counter seen before or older than its window
    /// (replayed), a new sender with no room for it, or a claim, return or gone this shard did
    /// not ask for (no query pending, no forwarding to that sibling).
    pub unauthenticated: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub stale: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub malformed: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub not_sibling: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub replayed: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub too_many_senders: u64,
    /// See [`SiblingCounts::unauthenticated`].
    pub unsolicited: u64,
}

/// What this shard sent and received for clients, counted here (the policy counts its
/// decisions: [`crate::proto::sibling::ForwardingCounts`]).
#[derive(Debug, Clone, Copy, Default)]
struct Traffic {
    forwarded_out: u64,
    forwarded_in: u64,
    returned_out: u64,
    returned_in: u64,
    /// Datagrams cut by the socket (counted as malformed).
    truncated: u64,
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
fn count_sent(traffic: &mut Traffic, tag: usize, outcome: io::Result<usize>) {
    if outcome.is_err() {
        return;
    }
    if tag == Sent::Forwarded as usize {
        traffic.forwarded_out += 1;
    } else if tag == Sent::Returned as usize {
        traffic.returned_out += 1;
    }
}

/// The wall clock in ms since the Unix epoch: the messages' freshness is checked against it.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What a message from a sibling asks of the shard's other parts.
pub(super) enum Inbound<'a> {
    /// A datagram of `client` of `listener`, forwarded by `via` for an allocation this shard
    /// holds: handle `payload` as arrived forwarded, then [`Siblings::answer`].
    Serve {
        listener: ListenerId,
        client: SocketAddr,
        via: SocketAddr,
        /// It was a query: the answer claims the client.
        claim: bool,
        payload: &'a [u8],
    },
    /// A datagram for `client` of `listener`, returned by its owner: send `payload` to it from
    /// the listener's socket.
    Deliver {
        listener: ListenerId,
        client: SocketAddr,
        payload: &'a [u8],
    },
}

/// A shard's sibling socket, its forwarding policy and what it sends.
pub(super) struct Siblings<W> {
    socket: Watched<W>,
    /// Its address: `[::]` (dual-stack) where the host has IPv6, else `0.0.0.0`.
    local: SocketAddr,
    /// The keys as last read, shared with the key file's reader.
    keyring: Arc<ArcSwap<SiblingKeys>>,
    forwarding: Forwarding,
    /// The first shard's sibling port, and how many shards the pod runs.
    base: u16,
    shards: usize,
    /// Where a message is sealed before it is queued.
    message: Vec<u8>,
    /// Messages for siblings, sent together when the shard flushes (a run of forwarded media
    /// for one owner leaves in one `sendmmsg`), tagged with what they count as ([`Sent`]).
    /// Without UDP GSO: between pods it cost more CPU than it saved below saturation
    /// (perf/results/2026-12-07-second-chance.md).
    queue: SendQueue,
    traffic: Traffic,
}

impl<W> Siblings<W> {
    /// With `setup` (forwarding configured, `shards` in the pod), opens shard `index`'s part
    /// and turns misses over to it in `engine`; a socket that cannot be had is logged, and the
    /// shard forwards nothing.
    pub(super) fn start<D: Driver<Watch = W>>(
        setup: Option<&(SiblingSetup, usize)>,
        index: usize,
        driver: &D,
        engine: &mut Engine,
        now: Instant,
    ) -> Option<Siblings<W>> {
        let (setup, shards) = setup?;
        match Siblings::open(setup, index, *shards, driver, now) {
            Ok(siblings) => {
                engine.set_forward_misses(true);
                Some(siblings)
            }
            Err(e) => {
                tracing::error!(
                    target: "stunnerd",
                    "shard {index}: cannot open the sibling socket on port {} + {index}: {e}; \
                     this shard forwards no client to a sibling",
                    setup.port,
                );
                None
            }
        }
    }

    /// Opens shard `index`'s sibling socket (`setup.port + index`, every address).
    fn open<D: Driver<Watch = W>>(
        setup: &SiblingSetup,
        index: usize,
        shards: usize,
        driver: &D,
        now: Instant,
    ) -> io::Result<Siblings<W>> {
        let port = u16::try_from(usize::from(setup.port) + index)
            .map_err(|_| io::Error::other("sibling port beyond 65535"))?;
        let socket = listener_socket(None, port)?;
        let local = socket
            .local_addr()?
            .as_socket()
            .ok_or_else(|| io::Error::other("the sibling socket has no IP address"))?;
        let socket = driver.watch(socket, Token::Sibling, Interest::Datagrams)?;
        if index == 0 {
            tracing::info!(target: "stunnerd", "second-chance forwarding on sibling ports {}+, sibling keys {}", setup.port, setup.keys());
        }
        Ok(Siblings {
            socket,
            local,
            keyring: setup.keys.clone(),
            // Random per shard and process: a restarted pod's messages are a new sender's,
            // whose counters start again.
            forwarding: Forwarding::new(setup.keys(), rand::random(), index == 0, now),
            base: setup.port,
            shards,
            message: Vec::with_capacity(2048),
            queue: SendQueue::new().without_gso(),
            traffic: Traffic::default(),
        })
    }

    /// The sibling socket's fd, to drain.
    pub(super) fn fd(&self) -> RawFd {
        self.socket.fd
    }

    /// Queues `message` for sibling `to` (sent at the shard's next flush), counted as `sent`.
    fn send(&mut self, to: SocketAddr, message: &SiblingMessage<'_>, sent: Sent) {
        if self
            .forwarding
            .seal(message, unix_ms(), &mut self.message)
            .is_none()
        {
            return;
        }
        let traffic = &mut self.traffic;
        self.queue.push(
            self.socket.fd,
            &self.message,
            for_socket(self.local, to),
            sent as usize,
            &mut |tag, outcome| count_sent(traffic, tag, outcome),
        );
    }

    /// Sends the queued messages.
    pub(super) fn flush(&mut self) {
        if !self.queue.is_empty() {
            let traffic = &mut self.traffic;
            self.queue
                .flush(&mut |tag, outcome| count_sent(traffic, tag, outcome));
        }
    }

    /// Takes the keys as last read, and lets the policy forget what is due.
    pub(super) fn tick(&mut self, now: Instant) {
        let keys = self.keyring.load();
        if !Arc::ptr_eq(&keys, self.forwarding.keys()) {
            self.forwarding.set_keys(Arc::clone(&keys));
        }
        self.forwarding.handle_timeout(now);
    }

    /// A datagram `data` of `client` on UDP listener `listener` (called `name`) that needs an
    /// allocation this shard does not hold: sent to its owner, or as a query to every
    /// sibling, as the policy says. What the policy said.
    pub(super) fn forward_miss(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerId,
        name: &str,
        client: SocketAddr,
        data: &[u8],
    ) -> MissAction {
        let action = self.forwarding.handle_miss(
            now,
            listener,
            client,
            !snap.sibling_ips.is_empty(),
            || MissClass::of(&snap.auth, data, unix_ms() / 1000),
        );
        let forward = |flags| SiblingMessage {
            kind: Kind::Forward,
            flags,
            client,
            origin: None,
            listener: name,
            payload: data,
        };
        match action {
            MissAction::ToOwner(owner) => self.send(owner, &forward(0), Sent::Forwarded),
            MissAction::Query => {
                for ip in snap.sibling_ips.iter() {
                    let first_shard = SocketAddr::new(*ip, self.base);
                    self.send(first_shard, &forward(FLAG_QUERY), Sent::Forwarded);
                }
            }
            MissAction::AwaitClaim | MissAction::OverBudget | MissAction::AnswerLocally => {}
        }
        action
    }

    /// A datagram `bytes` from `from` on the sibling socket, received at `now` under `snap`:
    /// opened and decided on by the policy; what it asks of this part (a gone, a query handed
    /// on) is queued here, what it asks of the shard's other parts is returned. A message about
    /// a listener that is not one of the UDP `listeners` is dropped; `engine` says whether the
    /// client's allocation is held here.
    pub(super) fn receive<'a>(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        from: SocketAddr,
        bytes: &'a [u8],
        listeners: &Listeners<W>,
        engine: &Engine,
    ) -> Option<Inbound<'a>> {
        let from_sibling = snap.sibling_ips.contains(&from.ip());
        let message = self
            .forwarding
            .open(from, from_sibling, bytes, unix_ms(), now)
            .ok()?;
        let listener = listeners.udp_id_of(message.listener)?;
        let client = message.client;
        let held = engine.has_allocation(listener, client);
        match self
            .forwarding
            .handle_message(now, from, listener, &message, held)
        {
            MessageAction::Serve { via, claim } => Some(Inbound::Serve {
                listener,
                client,
                via,
                claim,
                payload: message.payload,
            }),
            MessageAction::Deliver => Some(Inbound::Deliver {
                listener,
                client,
                payload: message.payload,
            }),
            MessageAction::SendGone { to } => {
                let gone = SiblingMessage {
                    kind: Kind::Gone,
                    flags: 0,
                    payload: &[],
                    origin: None,
                    ..message
                };
                self.send(to, &gone, Sent::Control);
                None
            }
            MessageAction::HandOn { origin } => {
                let handed_on = SiblingMessage {
                    origin: Some(origin),
                    ..message
                };
                for shard in 1..self.shards {
                    let Some(port) = u16::try_from(usize::from(self.base) + shard).ok() else {
                        break;
                    };
                    let local = SocketAddr::new(IpAddr::from([127, 0, 0, 1]), port);
                    self.send(local, &handed_on, Sent::Control);
                }
                None
            }
            MessageAction::Done | MessageAction::Refused(_) => None,
        }
    }

    /// A datagram the socket cut (too long to be a message): refused as malformed.
    pub(super) fn truncated(&mut self) {
        self.traffic.truncated += 1;
    }

    /// The owner's answer to an [`Inbound::Serve`] of `client` of listener `name`, through
    /// `via`: the claim a query asked for, then `reply`, what the engine answered, if anything.
    pub(super) fn answer(
        &mut self,
        via: SocketAddr,
        name: &str,
        client: SocketAddr,
        claim: bool,
        reply: Option<&[u8]>,
    ) {
        self.traffic.forwarded_in += 1;
        let message = |kind, payload| SiblingMessage {
            kind,
            flags: 0,
            client,
            origin: None,
            listener: name,
            payload,
        };
        if claim {
            self.send(via, &message(Kind::Claim, &[]), Sent::Control);
        }
        if let Some(reply) = reply {
            self.send(via, &message(Kind::Return, reply), Sent::Returned);
        }
    }

    /// Sends `data` for `client` of listener `name` back through sibling `via`, the forwarder
    /// its flow reaches this pod through.
    pub(super) fn return_through(
        &mut self,
        via: SocketAddr,
        name: &str,
        client: SocketAddr,
        data: &[u8],
    ) {
        let answer = SiblingMessage {
            kind: Kind::Return,
            flags: 0,
            client,
            origin: None,
            listener: name,
            payload: data,
        };
        self.send(via, &answer, Sent::Returned);
    }

    /// An [`Inbound::Deliver`] was sent on to its client.
    pub(super) fn delivered(&mut self) {
        self.traffic.returned_in += 1;
    }

    /// What this shard publishes per tick: its counts, and how many clients it forwards to
    /// each sibling.
    pub(super) fn report(&self) -> SiblingReport {
        SiblingReport {
            counts: self.counts(),
            forwarding: self.forwarding.forwarding_for(),
        }
    }

    /// What this shard counted: the traffic here, the decisions of its policy.
    fn counts(&self) -> SiblingCounts {
        let policy = self.forwarding.counts();
        let refused = |error: SiblingError| policy.refused[error.index()];
        SiblingCounts {
            forwarded_out: self.traffic.forwarded_out,
            forwarded_in: self.traffic.forwarded_in,
            returned_out: self.traffic.returned_out,
            returned_in: self.traffic.returned_in,
            queries: policy.queries,
            hits: policy.hits,
            misses: policy.misses,
            rate_limited: policy.rate_limited,
            unauthenticated: refused(SiblingError::Unauthenticated),
            stale: refused(SiblingError::Stale),
            malformed: refused(SiblingError::Malformed) + self.traffic.truncated,
            not_sibling: refused(SiblingError::NotSibling),
            replayed: refused(SiblingError::Replayed),
            too_many_senders: refused(SiblingError::TooManySenders),
            unsolicited: refused(SiblingError::Unsolicited),
        }
    }
}
