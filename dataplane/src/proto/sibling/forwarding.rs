//! Second-chance forwarding's decisions, without IO: [`Forwarding`], one per shard. For a client
//! datagram that finds no allocation here (a miss) it says whether the datagram goes to the
//! client's known owner, becomes a query to every sibling, waits for a claim, is over the query
//! budget, or gets today's answer here ([`MissAction`]); for each message from a sibling,
//! whether it is authentic, new and from a sibling ([`Forwarding::open`]) and asked for, and
//! what the shard does with it ([`MessageAction`]). It holds what those decisions need: the
//! keys, the sender counter and the receiver's replay windows ([`super::replay`]), the query
//! budgets ([`super::queries`]), and three tables of clients, each bounded by [`MAX_CLIENTS`]:
//! their owners, the queries in flight and the clients nobody claimed.
//!
//! Call order (the shard's): [`Forwarding::handle_miss`] for every miss of a UDP client, then
//! send what the [`MissAction`] says; [`Forwarding::open`] then
//! [`Forwarding::handle_message`] for every datagram on the sibling socket, then do what the
//! [`MessageAction`] says; [`Forwarding::seal`] every message sent; [`Forwarding::handle_timeout`]
//! and [`Forwarding::set_keys`] at each tick (a query's wait ends at the first tick after
//! [`QUERY_WAIT`]). Time comes in as arguments: `now` (monotonic) and `unix_ms` (wall clock, for
//! the messages' freshness).
//!
//! What the policy guarantees (deploy/README.md, "Trust model"): a claim is taken only for a
//! client with a query pending, a return or a gone only from the sibling the client is
//! forwarded to; queries are budgeted per source and per shard, a signed request's apart from
//! unsigned datagrams'; forwards to a known owner are not limited (they are the call's media).

use super::queries::{MissClass, QueryBudget};
use super::{
    Kind, SiblingError, SiblingKeys, SiblingMessage, SiblingReceiver, SiblingSender, FLAG_QUERY,
};
use crate::proto::contract::ListenerId;
use crate::proto::store::ClientKey;
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a query waits for its owner's claim.
pub const QUERY_WAIT: Duration = Duration::from_millis(300);
/// How long a client no sibling claimed gets today's answer without asking again.
pub const NOBODY_FOR: Duration = Duration::from_secs(5);
/// How long a known owner is remembered without a datagram for it.
pub const OWNER_IDLE: Duration = Duration::from_secs(120);
/// Clients remembered at most per shard, in each table (an owner, nobody's, a query in flight).
pub const MAX_CLIENTS: usize = 1 << 16;

/// What becomes of a client datagram that needs an allocation this shard does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissAction {
    /// Forward it to the sibling that holds the client (`Kind::Forward`): nothing to answer.
    ToOwner(SocketAddr),
    /// Forward it to every sibling's first shard as a query (`Kind::Forward` with
    /// [`FLAG_QUERY`]): nothing to answer; the owner claims it.
    Query,
    /// Drop it: a query for the client is in flight, and its owner will be known in a moment.
    AwaitClaim,
    /// Drop it unanswered: no query for it within the budget (a 437 could end a moved call,
    /// whose owner is asked when the budget allows).
    OverBudget,
    /// Nobody else holds the client (no sibling claimed it lately, or there are no siblings):
    /// give today's answer.
    AnswerLocally,
}

/// What the shard does with a message a sibling sent ([`Forwarding::handle_message`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageAction {
    /// A datagram of a client this shard holds: handle the payload as arrived
    /// [forwarded](crate::proto::ArrivalKind::Forwarded) by `via`, and send what answers it back
    /// to `via` (`Kind::Return`); for a query, claim the client to `via` first
    /// (`Kind::Claim`).
    Serve {
        /// Where answers go: the forwarder (the query's origin, when handed on inside a pod).
        via: SocketAddr,
        /// It was a query: claim the client.
        claim: bool,
    },
    /// A forward for a client this shard no longer holds (the call ended, or its allocation
    /// expired): tell `to` to stop (`Kind::Gone`).
    SendGone {
        /// The forwarder.
        to: SocketAddr,
    },
    /// A query for a client this shard does not hold, received by its pod's first shard: hand
    /// it on to the pod's other shards, naming `origin` (the forwarder) as where to answer.
    HandOn {
        /// The forwarder.
        origin: SocketAddr,
    },
    /// A datagram for a client this shard forwards to that sibling: send the payload to the
    /// client from its listener.
    Deliver,
    /// Nothing more to do: a claim or a gone taken, or a query this shard cannot answer.
    Done,
    /// Refused and counted ([`SiblingError::Unsolicited`]).
    Refused(SiblingError),
}

/// What [`Forwarding`] counted: the queries and what became of them, and the messages refused
/// by cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForwardingCounts {
    /// Queries sent (one per unknown client, to every sibling).
    pub queries: u64,
    /// Queries a sibling claimed.
    pub hits: u64,
    /// Queries no sibling claimed in time.
    pub misses: u64,
    /// Queries not sent for the query budget (the source's or the shard's, of the miss's class).
    pub rate_limited: u64,
    /// Messages refused, by [`SiblingError::index`].
    pub refused: [u64; SiblingError::ALL.len()],
}

/// Whom a client of one of our listeners is forwarded to.
#[derive(Debug, Clone, Copy)]
struct Owner {
    addr: SocketAddr,
    seen: Instant,
}

/// One shard's second-chance forwarding: keys, sender and replay windows, owners, queries and
/// their budget. See the module doc for the call order.
pub struct Forwarding {
    /// The keys this shard runs (the shell hands in new ones with [`Forwarding::set_keys`]).
    keys: Arc<SiblingKeys>,
    sender: SiblingSender,
    receiver: SiblingReceiver,
    /// Whether this is its pod's first shard, the one queries reach.
    first_shard: bool,
    owners: HashMap<ClientKey, Owner, RandomState>,
    nobody: HashMap<ClientKey, Instant, RandomState>,
    pending: HashMap<ClientKey, Instant, RandomState>,
    queries: QueryBudget,
    counts: ForwardingCounts,
}

impl Forwarding {
    /// A shard's forwarding under `keys`, sending as `sender_id` (draw it at random: a
    /// restarted process must be a new sender); `first_shard`: the pod's first shard.
    pub fn new(
        keys: Arc<SiblingKeys>,
        sender_id: u64,
        first_shard: bool,
        now: Instant,
    ) -> Forwarding {
        Forwarding {
            keys,
            sender: SiblingSender::new(sender_id),
            receiver: SiblingReceiver::new(),
            first_shard,
            owners: HashMap::with_hasher(RandomState::default()),
            nobody: HashMap::with_hasher(RandomState::default()),
            pending: HashMap::with_hasher(RandomState::default()),
            queries: QueryBudget::new(now),
            counts: ForwardingCounts::default(),
        }
    }

    /// The keys this shard runs.
    pub fn keys(&self) -> &Arc<SiblingKeys> {
        &self.keys
    }

    /// Runs `keys` from now on (a rotated key file).
    pub fn set_keys(&mut self, keys: Arc<SiblingKeys>) {
        self.keys = keys;
    }

    /// A datagram of `client` on UDP listener `listener` needs an allocation this shard does
    /// not hold, at `now`; `siblings`: whether the gateway has any; `class`: the miss's
    /// budget class, asked for only when a query would be sent (it checks a signature).
    pub fn handle_miss(
        &mut self,
        now: Instant,
        listener: ListenerId,
        client: SocketAddr,
        siblings: bool,
        class: impl FnOnce() -> MissClass,
    ) -> MissAction {
        let key = ClientKey { listener, client };
        if let Some(owner) = self.owners.get_mut(&key) {
            owner.seen = now;
            return MissAction::ToOwner(owner.addr);
        }
        if self.nobody.get(&key).is_some_and(|until| *until > now) || !siblings {
            return MissAction::AnswerLocally;
        }
        if self.pending.contains_key(&key) {
            return MissAction::AwaitClaim;
        }
        // Checked only here, where a query would be sent: a signed request has a budget of its
        // own, which spoofed misses (ChannelData, anything unsigned) cannot spend.
        if self.pending.len() >= MAX_CLIENTS || !self.queries.allow(now, client.ip(), class()) {
            self.counts.rate_limited += 1;
            return MissAction::OverBudget;
        }
        self.pending.insert(key, now + QUERY_WAIT);
        self.counts.queries += 1;
        MissAction::Query
    }

    /// Checks a datagram `bytes` from `from` received at `now` (`unix_ms` on the wall clock):
    /// from a sibling (`from_sibling`, or from loopback: a query handed on inside the pod),
    /// authentic under either key, fresh, of a sender counter not seen before. Refusals are
    /// counted; only an authentic message touches the replay windows.
    pub fn open<'a>(
        &mut self,
        from: SocketAddr,
        from_sibling: bool,
        bytes: &'a [u8],
        unix_ms: u64,
        now: Instant,
    ) -> Result<SiblingMessage<'a>, SiblingError> {
        let opened = if !from.ip().is_loopback() && !from_sibling {
            Err(SiblingError::NotSibling)
        } else {
            self.receiver.open(&self.keys, bytes, unix_ms, now)
        };
        if let Err(error) = opened {
            self.counts.refused[error.index()] += 1;
        }
        opened
    }

    /// What to do with `message`, opened from `from` at `now`, about a client of this shard's
    /// listener `listener`; `held`: whether this shard holds the client's allocation.
    pub fn handle_message(
        &mut self,
        now: Instant,
        from: SocketAddr,
        listener: ListenerId,
        message: &SiblingMessage<'_>,
        held: bool,
    ) -> MessageAction {
        let key = ClientKey {
            listener,
            client: message.client,
        };
        let action = match message.kind {
            Kind::Forward => self.forwarded(from, message, held),
            Kind::Claim => self.claimed(now, from, key),
            Kind::Gone => self.gone(now, from, key),
            Kind::Return => match self.owners.get_mut(&key) {
                // Only for a client this shard forwards to that very sibling: a return names
                // the address our listener sends it to, which must be that client's.
                Some(owner) if owner.addr == from => {
                    owner.seen = now;
                    MessageAction::Deliver
                }
                _ => MessageAction::Refused(SiblingError::Unsolicited),
            },
        };
        if let MessageAction::Refused(error) = action {
            self.counts.refused[error.index()] += 1;
        }
        action
    }

    /// A forward: served if held; else, not a query, the forwarder must stop; a query on the
    /// pod's first shard is handed on to the others (one of them may hold the client).
    fn forwarded(
        &self,
        from: SocketAddr,
        message: &SiblingMessage<'_>,
        held: bool,
    ) -> MessageAction {
        let via = message.origin.unwrap_or(from);
        let query = message.flags & FLAG_QUERY != 0;
        if held {
            MessageAction::Serve { via, claim: query }
        } else if !query {
            MessageAction::SendGone { to: via }
        } else if message.origin.is_none() && self.first_shard {
            MessageAction::HandOn { origin: from }
        } else {
            MessageAction::Done
        }
    }

    /// A claim: only the answer to a query of ours (a claim nobody asked for would steer a
    /// client's datagrams to whoever sent it); the claimant is the owner from now on.
    fn claimed(&mut self, now: Instant, from: SocketAddr, key: ClientKey) -> MessageAction {
        if self.pending.remove(&key).is_none() {
            return MessageAction::Refused(SiblingError::Unsolicited);
        }
        self.counts.hits += 1;
        self.nobody.remove(&key);
        if self.owners.len() < MAX_CLIENTS || self.owners.contains_key(&key) {
            self.owners.insert(
                key,
                Owner {
                    addr: from,
                    seen: now,
                },
            );
        }
        MessageAction::Done
    }

    /// A gone: only from the owner; the client is nobody's from now on.
    fn gone(&mut self, now: Instant, from: SocketAddr, key: ClientKey) -> MessageAction {
        if self.owners.get(&key).is_none_or(|o| o.addr != from) {
            return MessageAction::Refused(SiblingError::Unsolicited);
        }
        self.owners.remove(&key);
        if self.nobody.len() < MAX_CLIENTS {
            self.nobody.insert(key, now + NOBODY_FOR);
        }
        MessageAction::Done
    }

    /// Writes `message` into `out` under the current key at `unix_ms`, with this shard's next
    /// counter; `None` if it cannot be encoded (a listener name over 255 bytes).
    pub fn seal(
        &mut self,
        message: &SiblingMessage<'_>,
        unix_ms: u64,
        out: &mut Vec<u8>,
    ) -> Option<()> {
        self.sender.seal(&self.keys, message, unix_ms, out)
    }

    /// Forgets owners idle for [`OWNER_IDLE`], nobody's clients after [`NOBODY_FOR`] and
    /// senders gone quiet; a query unclaimed for [`QUERY_WAIT`] makes its client nobody's.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.receiver.handle_timeout(now);
        self.owners
            .retain(|_, owner| now.saturating_duration_since(owner.seen) < OWNER_IDLE);
        self.nobody.retain(|_, until| *until > now);
        let (nobody, counts) = (&mut self.nobody, &mut self.counts);
        self.pending.retain(|client, deadline| {
            if *deadline > now {
                return true;
            }
            counts.misses += 1;
            if nobody.len() < MAX_CLIENTS {
                nobody.insert(*client, now + NOBODY_FOR);
            }
            false
        });
    }

    /// What it counted.
    pub fn counts(&self) -> &ForwardingCounts {
        &self.counts
    }

    /// How many clients this shard forwards to each sibling.
    pub fn forwarding_for(&self) -> Vec<SiblingForwarding> {
        let mut counts: Vec<SiblingForwarding> = Vec::new();
        for owner in self.owners.values() {
            let sibling = owner.addr.ip();
            match counts.iter_mut().find(|counted| counted.sibling == sibling) {
                Some(counted) => counted.clients += 1,
                None => counts.push(SiblingForwarding {
                    sibling,
                    clients: 1,
                }),
            }
        }
        counts
    }
}

/// How many clients are forwarded to one sibling pod (`/status`'s `siblings` section).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SiblingForwarding {
    /// The sibling's IP.
    pub sibling: IpAddr,
    /// The clients forwarded to it.
    pub clients: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::sibling::SiblingKey;
    use std::net::Ipv4Addr;

    const UNIX_MS: u64 = 1_760_000_000_000;
    const LISTENER: ListenerId = ListenerId(1);
    const NAME: &str = "stunner/udp-gateway/udp-listener";

    fn keys() -> Arc<SiblingKeys> {
        Arc::new(SiblingKey::new(&[7; 32]).unwrap().into())
    }

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    fn unsigned() -> MissClass {
        MissClass::Unsigned
    }

    /// A message about `client` of the given kind, sent by a sibling.
    fn message(kind: Kind, flags: u8, client: SocketAddr) -> SiblingMessage<'static> {
        SiblingMessage {
            kind,
            flags,
            client,
            origin: None,
            listener: NAME,
            payload: b"\x40\x00\x00\x00",
        }
    }

    /// A shard with siblings, on a virtual clock starting at `t0`.
    fn shard(t0: Instant) -> Forwarding {
        Forwarding::new(keys(), 1, true, t0)
    }

    #[test]
    fn an_unknown_clients_miss_is_queried_once_and_nobodys_for_5_s_when_unclaimed() {
        let t0 = Instant::now();
        let mut f = shard(t0);
        let client = addr("192.0.2.1:40000");
        assert_eq!(
            f.handle_miss(t0, LISTENER, client, true, unsigned),
            MissAction::Query
        );
        // Until the claim comes (or the wait ends), its datagrams wait.
        let soon = t0 + Duration::from_millis(100);
        assert_eq!(
            f.handle_miss(soon, LISTENER, client, true, || panic!(
                "no query, no class"
            )),
            MissAction::AwaitClaim
        );
        f.handle_timeout(soon);
        assert_eq!(f.counts().misses, 0);
        // Nobody claimed it: today's answer, without asking again, for NOBODY_FOR.
        let unclaimed = t0 + QUERY_WAIT;
        f.handle_timeout(unclaimed);
        assert_eq!((f.counts().queries, f.counts().misses), (1, 1));
        let later = unclaimed + NOBODY_FOR - Duration::from_millis(1);
        assert_eq!(
            f.handle_miss(later, LISTENER, client, true, unsigned),
            MissAction::AnswerLocally
        );
        f.handle_timeout(unclaimed + NOBODY_FOR);
        assert_eq!(
            f.handle_miss(unclaimed + NOBODY_FOR, LISTENER, client, true, unsigned),
            MissAction::Query
        );
        // Another listener's client of the same address is another client.
        assert_eq!(
            f.handle_miss(t0, ListenerId(2), client, true, unsigned),
            MissAction::Query
        );
    }

    #[test]
    fn a_claim_makes_its_sender_the_owner_until_idle_and_misses_go_to_it_unbudgeted() {
        let t0 = Instant::now();
        let mut f = shard(t0);
        let (client, owner) = (addr("192.0.2.1:40000"), addr("10.0.0.2:13479"));
        assert_eq!(
            f.handle_miss(t0, LISTENER, client, true, unsigned),
            MissAction::Query
        );
        let claim = message(Kind::Claim, 0, client);
        assert_eq!(
            f.handle_message(t0, owner, LISTENER, &claim, false),
            MessageAction::Done
        );
        assert_eq!(f.counts().hits, 1);
        assert_eq!(
            f.forwarding_for(),
            vec![SiblingForwarding {
                sibling: owner.ip(),
                clients: 1
            }]
        );
        // The call's media: forwarded to the owner, beyond any query budget.
        for i in 0..10_000 {
            let now = t0 + Duration::from_millis(i);
            assert_eq!(
                f.handle_miss(now, LISTENER, client, false, unsigned),
                MissAction::ToOwner(owner)
            );
        }
        // A second claim (a replayed one passed the window's check elsewhere) is unsolicited.
        assert_eq!(
            f.handle_message(t0, owner, LISTENER, &claim, false),
            MessageAction::Refused(SiblingError::Unsolicited)
        );
        // Each forward keeps the owner; OWNER_IDLE without one forgets it.
        let last = t0 + Duration::from_millis(9_999);
        f.handle_timeout(last + OWNER_IDLE - Duration::from_millis(1));
        assert_eq!(f.forwarding_for().len(), 1);
        f.handle_timeout(last + OWNER_IDLE);
        assert!(f.forwarding_for().is_empty());
        assert_eq!(
            f.handle_miss(last + OWNER_IDLE, LISTENER, client, true, unsigned),
            MissAction::Query
        );
    }

    #[test]
    fn claims_returns_and_gones_are_taken_only_when_asked_for() {
        let t0 = Instant::now();
        let mut f = shard(t0);
        let (client, owner, other) = (
            addr("192.0.2.1:40000"),
            addr("10.0.0.2:13479"),
            addr("10.0.0.3:13479"),
        );
        let refused = MessageAction::Refused(SiblingError::Unsolicited);
        // No query pending: a claim would steer the client's datagrams to whoever sent it.
        let claim = message(Kind::Claim, 0, client);
        assert_eq!(
            f.handle_message(t0, owner, LISTENER, &claim, false),
            refused
        );
        // Not forwarded to anyone: a return would make our listener send to any address.
        let ret = message(Kind::Return, 0, client);
        assert_eq!(f.handle_message(t0, owner, LISTENER, &ret, false), refused);
        let gone = message(Kind::Gone, 0, client);
        assert_eq!(f.handle_message(t0, owner, LISTENER, &gone, false), refused);
        f.handle_miss(t0, LISTENER, client, true, unsigned);
        assert_eq!(
            f.handle_message(t0, owner, LISTENER, &claim, false),
            MessageAction::Done
        );
        // From the owner only.
        assert_eq!(f.handle_message(t0, other, LISTENER, &ret, false), refused);
        assert_eq!(f.handle_message(t0, other, LISTENER, &gone, false), refused);
        assert_eq!(
            f.handle_message(t0, owner, LISTENER, &ret, false),
            MessageAction::Deliver
        );
        assert_eq!(
            f.handle_message(t0, owner, ListenerId(2), &ret, false),
            refused,
            "another listener's client"
        );
        assert_eq!(f.counts().refused[SiblingError::Unsolicited.index()], 6);
        // Gone: the owner lost the allocation; the client is nobody's, then asked about again.
        assert_eq!(
            f.handle_message(t0, owner, LISTENER, &gone, false),
            MessageAction::Done
        );
        assert_eq!(
            f.handle_miss(t0, LISTENER, client, true, unsigned),
            MissAction::AnswerLocally
        );
        assert_eq!(f.handle_message(t0, owner, LISTENER, &ret, false), refused);
        f.handle_timeout(t0 + NOBODY_FOR);
        assert_eq!(
            f.handle_miss(t0 + NOBODY_FOR, LISTENER, client, true, unsigned),
            MissAction::Query
        );
    }

    #[test]
    fn a_forward_is_served_where_held_else_gone_or_a_query_handed_on_by_the_first_shard() {
        let t0 = Instant::now();
        let (client, forwarder) = (addr("192.0.2.1:40000"), addr("10.0.0.2:13479"));
        let forward = message(Kind::Forward, 0, client);
        let query = message(Kind::Forward, FLAG_QUERY, client);
        let handed_on = SiblingMessage {
            origin: Some(forwarder),
            ..query.clone()
        };
        let local = addr("127.0.0.1:13479");
        for first_shard in [true, false] {
            let mut f = Forwarding::new(keys(), 1, first_shard, t0);
            let serve = |claim| MessageAction::Serve {
                via: forwarder,
                claim,
            };
            assert_eq!(
                f.handle_message(t0, forwarder, LISTENER, &forward, true),
                serve(false)
            );
            assert_eq!(
                f.handle_message(t0, forwarder, LISTENER, &query, true),
                serve(true)
            );
            // Handed on inside the pod: answered to the origin, not to the first shard.
            assert_eq!(
                f.handle_message(t0, local, LISTENER, &handed_on, true),
                serve(true)
            );
            // Not held: the forwarder must stop; a query's silence says "not here".
            assert_eq!(
                f.handle_message(t0, forwarder, LISTENER, &forward, false),
                MessageAction::SendGone { to: forwarder }
            );
            let unheld_query = f.handle_message(t0, forwarder, LISTENER, &query, false);
            if first_shard {
                assert_eq!(unheld_query, MessageAction::HandOn { origin: forwarder });
            } else {
                assert_eq!(unheld_query, MessageAction::Done);
            }
            // A query already handed on is never handed on again.
            assert_eq!(
                f.handle_message(t0, local, LISTENER, &handed_on, false),
                MessageAction::Done
            );
        }
    }

    #[test]
    fn no_siblings_means_todays_answer_and_an_over_budget_miss_is_dropped_unanswered() {
        let t0 = Instant::now();
        let mut f = shard(t0);
        let client = addr("192.0.2.1:40000");
        assert_eq!(
            f.handle_miss(t0, LISTENER, client, false, unsigned),
            MissAction::AnswerLocally
        );
        // One source's unsigned burst, from as many ports.
        let source = |port| SocketAddr::new(IpAddr::from(Ipv4Addr::new(192, 0, 2, 9)), port);
        let queried = (1..=200)
            .filter(|port| {
                f.handle_miss(t0, LISTENER, source(*port), true, unsigned) == MissAction::Query
            })
            .count();
        assert_eq!(queried, super::super::queries::QUERY_BURST as usize);
        assert_eq!(
            f.handle_miss(t0, LISTENER, source(201), true, unsigned),
            MissAction::OverBudget
        );
        assert_eq!(f.counts().rate_limited, 101);
        // A signed request from the same source has a budget of its own.
        assert_eq!(
            f.handle_miss(t0, LISTENER, source(202), true, || MissClass::Signed),
            MissAction::Query
        );
        // The over-budget client is asked about when the budget allows: 20 ms, one token.
        let refilled = t0 + Duration::from_millis(20);
        assert_eq!(
            f.handle_miss(refilled, LISTENER, source(201), true, unsigned),
            MissAction::Query
        );
    }

    #[test]
    fn messages_are_taken_from_siblings_or_loopback_once_each() {
        let t0 = Instant::now();
        let mut owner = Forwarding::new(keys(), 2, true, t0);
        let mut f = shard(t0);
        let (client, sibling) = (addr("192.0.2.1:40000"), addr("10.0.0.2:13479"));
        let mut sealed = Vec::new();
        owner
            .seal(&message(Kind::Claim, 0, client), UNIX_MS, &mut sealed)
            .unwrap();
        let stranger = addr("198.51.100.1:13479");
        assert_eq!(
            f.open(stranger, false, &sealed, UNIX_MS, t0),
            Err(SiblingError::NotSibling)
        );
        assert_eq!(
            f.open(sibling, true, &sealed, UNIX_MS, t0).unwrap(),
            message(Kind::Claim, 0, client)
        );
        assert_eq!(
            f.open(sibling, true, &sealed, UNIX_MS, t0),
            Err(SiblingError::Replayed)
        );
        // Handed on inside the pod: from loopback, which is no sibling's address.
        owner
            .seal(&message(Kind::Claim, 0, client), UNIX_MS, &mut sealed)
            .unwrap();
        assert!(f
            .open(addr("127.0.0.1:13480"), false, &sealed, UNIX_MS, t0)
            .is_ok());
        // Under a key this shard does not run (until the rotation reaches it).
        let mut rotated = Forwarding::new(
            Arc::new(SiblingKey::new(&[8; 32]).unwrap().into()),
            3,
            true,
            t0,
        );
        rotated
            .seal(&message(Kind::Claim, 0, client), UNIX_MS, &mut sealed)
            .unwrap();
        assert_eq!(
            f.open(sibling, true, &sealed, UNIX_MS, t0),
            Err(SiblingError::Unauthenticated)
        );
        f.set_keys(rotated.keys().clone());
        assert!(f.open(sibling, true, &sealed, UNIX_MS, t0).is_ok());
        let refused = f.counts().refused;
        assert_eq!(
            [
                SiblingError::NotSibling,
                SiblingError::Replayed,
                SiblingError::Unauthenticated
            ]
            .map(|e| refused[e.index()]),
            [1, 1, 1]
        );
    }
}
