//! One turncat flow's TURN client, sans-IO: allocate with long-term auth, permit and bind a
//! channel to the peer, keep all three alive, and tell relayed data from control traffic.
//!
//! Call order: [`Session::new`], then loop: send every [`Session::poll_transmit`] to the
//! server, drain [`Session::poll_event`], feed each frame from the server to
//! [`Session::handle_frame`], and call [`Session::handle_timeout`] once the instant of
//! [`Session::poll_timeout`] has passed. The session owns no socket and reads no clock.

use std::collections::VecDeque;
use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use stun_proto::types::attribute::{Attribute, AttributeStaticType, ErrorCode, Nonce, Realm};
use stun_proto::types::message::{
    Message, MessageClass, MessageWriteExt, MessageWriteVec, Method, TransactionId,
};
use stun_proto::types::AddressFamily;
use turn_types::attribute::{
    ChannelNumber, Data, Lifetime, RequestedAddressFamily, XorPeerAddress, XorRelayedAddress,
};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, DATA, REFRESH};

use crate::client::{build_request, udp_transport, Credentials};

/// The one channel a flow binds to its peer (RFC 8656 §12: the first valid number).
pub const CHANNEL: u16 = 0x4000;

/// Permissions last 300 s (RFC 8656 §9); refreshed as often as pion's client (STUNner's
/// turncat) does.
pub const PERMISSION_REFRESH: Duration = Duration::from_secs(120);
/// Channel bindings last 600 s (RFC 8656 §12); refreshed as often as pion's client does.
pub const CHANNEL_REFRESH: Duration = Duration::from_secs(300);
/// The allocation lifetime when a response carries no LIFETIME (RFC 8656 §3.2 default).
const DEFAULT_LIFETIME: Duration = Duration::from_secs(600);
/// RFC 8489 §6.2.1: the initial retransmission timeout over UDP.
const RTO: Duration = Duration::from_millis(500);
/// RFC 8489 §6.2.1: Rc, the most times one request is sent over UDP.
const MAX_SENDS: u32 = 7;
/// RFC 8489 §6.2.1 and §6.2.2: how long a transaction waits in all (39.5 s over UDP with the
/// default RTO, Ti over TCP).
pub const TRANSACTION_TIMEOUT: Duration = Duration::from_millis(39_500);
/// How many 401/438 challenges one request may answer before the session gives up.
const MAX_CHALLENGES: u8 = 3;

/// A request the session makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Allocate a relay address (RFC 8656 §7.1).
    Allocate,
    /// Install or refresh the permission for the peer's IP (RFC 8656 §9.1).
    CreatePermission,
    /// Bind [`CHANNEL`] to the peer (RFC 8656 §12.1).
    ChannelBind,
    /// Keep the allocation alive (RFC 8656 §8.1).
    Refresh,
}

impl Step {
    fn method(self) -> Method {
        match self {
            Step::Allocate => ALLOCATE,
            Step::CreatePermission => CREATE_PERMISSION,
            Step::ChannelBind => CHANNEL_BIND,
            Step::Refresh => REFRESH,
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Allocate => "Allocate",
            Step::CreatePermission => "CreatePermission",
            Step::ChannelBind => "ChannelBind",
            Step::Refresh => "Refresh",
        })
    }
}

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionError {
    /// The server answered a request with an error response.
    Rejected {
        /// The request.
        step: Step,
        /// The STUN error code (0 when the response carried none).
        code: u16,
        /// The server's reason phrase.
        reason: String,
    },
    /// The server refused the credentials.
    Unauthorized {
        /// The request.
        step: Step,
        /// The STUN error code (401 or 438).
        code: u16,
        /// The server's reason phrase.
        reason: String,
    },
    /// No response within [`TRANSACTION_TIMEOUT`].
    Timeout {
        /// The request.
        step: Step,
    },
    /// A success response lacked an attribute it must carry.
    BadResponse {
        /// The request.
        step: Step,
        /// The missing attribute.
        missing: &'static str,
    },
    /// The request could not be encoded (a username or realm STUN cannot carry).
    Encode {
        /// The request.
        step: Step,
        /// What the encoder said.
        why: String,
    },
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionError::Rejected { step, code, reason } => {
                write!(f, "{step} refused by the server: {code} {reason}")
            }
            SessionError::Unauthorized { step, code, reason } => write!(
                f,
                "{step} refused by the server: {code} {reason}: check the username and \
                 password in the TURN URI (or the --secret)"
            ),
            SessionError::Timeout { step } => write!(
                f,
                "{step}: no response from the server within {} s: check the server address, \
                 port and transport",
                TRANSACTION_TIMEOUT.as_secs_f32()
            ),
            SessionError::BadResponse { step, missing } => {
                write!(f, "{step}: the server's success response lacks {missing}")
            }
            SessionError::Encode { step, why } => {
                write!(f, "cannot encode the {step} request: {why}")
            }
        }
    }
}

impl std::error::Error for SessionError {}

/// What the session tells its shell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The allocation, permission and channel are in place: data may flow.
    Ready {
        /// The relay address the server allocated.
        relay_addr: SocketAddr,
    },
    /// The session is over; nothing more will be transmitted.
    Failed(SessionError),
}

/// What one frame from the server was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming<'a> {
    /// Data from the peer (a ChannelData payload or a Data indication's DATA), a range of
    /// the frame.
    Data(&'a [u8]),
    /// A response to the session's request.
    Control,
    /// Anything else: stray responses, other channels, malformed input.
    Ignored,
}

/// What a session needs to know.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Long-term credential username.
    pub username: String,
    /// Long-term credential password.
    pub password: String,
    /// The peer to permit and bind.
    pub peer: SocketAddr,
    /// A reliable transport (TCP, TLS): requests are sent once (RFC 8489 §6.2.2).
    pub reliable: bool,
}

#[derive(Debug)]
struct Transaction {
    step: Step,
    id: [u8; 12],
    request: Vec<u8>,
    sends: u32,
    next_at: Instant,
    give_up_at: Instant,
    /// The nonce the request was signed with; `None` when it was not signed.
    signed_nonce: Option<String>,
    challenges: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    SettingUp,
    Ready,
    Failed,
}

/// The TURN client state of one flow.
#[derive(Debug)]
pub struct Session {
    config: SessionConfig,
    /// Realm and nonce from the last challenge; `None` until the server has challenged.
    challenge: Option<(String, String)>,
    stage: Stage,
    pending: Option<Transaction>,
    transmit: Option<Vec<u8>>,
    events: VecDeque<Event>,
    relay_addr: Option<SocketAddr>,
    refresh_at: Option<Instant>,
    permission_at: Option<Instant>,
    bind_at: Option<Instant>,
}

impl Session {
    /// A session whose first Allocate is ready to transmit.
    pub fn new(config: SessionConfig, now: Instant) -> Session {
        let mut session = Session {
            config,
            challenge: None,
            stage: Stage::SettingUp,
            pending: None,
            transmit: None,
            events: VecDeque::new(),
            relay_addr: None,
            refresh_at: None,
            permission_at: None,
            bind_at: None,
        };
        session.start(Step::Allocate, now, 0);
        session
    }

    /// The relay address, once allocated.
    pub fn relay_addr(&self) -> Option<SocketAddr> {
        self.relay_addr
    }

    /// The next message to send to the server.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        self.transmit.take()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Session::handle_timeout`] should next be called; `None` once failed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.stage == Stage::Failed {
            return None;
        }
        match &self.pending {
            Some(t) => Some(t.next_at.min(t.give_up_at)),
            None => self.next_due().map(|(_, at)| at),
        }
    }

    /// Retransmits, times out, or starts the refresh that is due.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.stage == Stage::Failed {
            return;
        }
        if let Some(t) = &mut self.pending {
            if now >= t.give_up_at {
                let step = t.step;
                self.fail(SessionError::Timeout { step });
                return;
            }
            if now >= t.next_at {
                if !self.config.reliable && t.sends < MAX_SENDS {
                    // RFC 8489 §6.2.1: resend with the same transaction id, doubling the
                    // interval each time.
                    self.transmit = Some(t.request.clone());
                    t.sends += 1;
                    t.next_at = (now + RTO * (1 << (t.sends - 1))).min(t.give_up_at);
                } else {
                    t.next_at = t.give_up_at;
                }
            }
            return;
        }
        self.start_due(now);
    }

    /// Classifies one frame from the server (one datagram, or one frame split from a stream)
    /// and acts on responses to the pending request.
    pub fn handle_frame<'a>(&mut self, now: Instant, frame: &'a [u8]) -> Incoming<'a> {
        if frame.len() < 4 {
            return Incoming::Ignored;
        }
        match frame[0] >> 6 {
            // RFC 8656 §12.4: channel number, length, then the payload (any padding after it
            // is not part of the data).
            0b01 => {
                let channel = u16::from_be_bytes([frame[0], frame[1]]);
                let len = usize::from(u16::from_be_bytes([frame[2], frame[3]]));
                match frame.get(4..4 + len) {
                    Some(payload) if channel == CHANNEL => Incoming::Data(payload),
                    _ => Incoming::Ignored,
                }
            }
            0b00 => {
                let Ok(msg) = Message::from_bytes(frame) else {
                    return Incoming::Ignored;
                };
                match msg.class() {
                    MessageClass::Indication if msg.method() == DATA => {
                        self.data_indication(&msg, frame)
                    }
                    MessageClass::Success | MessageClass::Error => {
                        let ours = self
                            .pending
                            .as_ref()
                            .is_some_and(|t| frame.get(8..20) == Some(&t.id[..]));
                        if !ours {
                            return Incoming::Ignored;
                        }
                        self.handle_response(now, &msg);
                        Incoming::Control
                    }
                    _ => Incoming::Ignored,
                }
            }
            _ => Incoming::Ignored,
        }
    }

    /// RFC 8656 §10.4: a Data indication carries XOR-PEER-ADDRESS and DATA; only data from
    /// our peer is passed on.
    fn data_indication<'a>(&self, msg: &Message<'_>, frame: &'a [u8]) -> Incoming<'a> {
        let from_peer = msg
            .attribute::<XorPeerAddress>()
            .is_ok_and(|peer| peer.addr(msg.transaction_id()) == self.config.peer);
        if !from_peer {
            return Incoming::Ignored;
        }
        let Some((offset, raw)) = msg.raw_attribute_and_offset(Data::TYPE) else {
            return Incoming::Ignored;
        };
        let start = offset + 4;
        match frame.get(start..start + usize::from(raw.length())) {
            Some(payload) => Incoming::Data(payload),
            None => Incoming::Ignored,
        }
    }

    fn handle_response(&mut self, now: Instant, msg: &Message<'_>) {
        let Some(t) = self.pending.take() else {
            return;
        };
        if msg.class() == MessageClass::Error {
            self.handle_error(now, msg, t);
            return;
        }
        let txid = msg.transaction_id();
        match t.step {
            Step::Allocate => {
                let Ok(relay) = msg.attribute::<XorRelayedAddress>() else {
                    self.fail(SessionError::BadResponse {
                        step: t.step,
                        missing: "XOR-RELAYED-ADDRESS",
                    });
                    return;
                };
                self.relay_addr = Some(relay.addr(txid));
                self.refresh_at = Some(now + refresh_interval(msg));
                self.start(Step::CreatePermission, now, 0);
            }
            Step::CreatePermission => {
                self.permission_at = Some(now + PERMISSION_REFRESH);
                if self.stage == Stage::SettingUp {
                    self.start(Step::ChannelBind, now, 0);
                }
            }
            Step::ChannelBind => {
                self.bind_at = Some(now + CHANNEL_REFRESH);
                // RFC 8656 §12.2: a ChannelBind also installs or refreshes the permission.
                self.permission_at = Some(now + PERMISSION_REFRESH);
                if self.stage == Stage::SettingUp {
                    self.stage = Stage::Ready;
                    if let Some(relay_addr) = self.relay_addr {
                        self.events.push_back(Event::Ready { relay_addr });
                    }
                }
            }
            Step::Refresh => {
                self.refresh_at = Some(now + refresh_interval(msg));
            }
        }
        self.start_due(now);
    }

    fn handle_error(&mut self, now: Instant, msg: &Message<'_>, t: Transaction) {
        let (code, reason) = match msg.attribute::<ErrorCode>() {
            Ok(error) => (error.code(), error.reason().to_owned()),
            Err(_) => (0, "(no ERROR-CODE)".to_owned()),
        };
        if code != ErrorCode::UNAUTHORIZED && code != ErrorCode::STALE_NONCE {
            self.fail(SessionError::Rejected {
                step: t.step,
                code,
                reason,
            });
            return;
        }
        let unauthorized = SessionError::Unauthorized {
            step: t.step,
            code,
            reason,
        };
        let nonce = msg.attribute::<Nonce>().map(|n| n.nonce().to_owned());
        let realm = msg.attribute::<Realm>().map(|r| r.realm().to_owned());
        let Ok(nonce) = nonce else {
            self.fail(unauthorized);
            return;
        };
        // RFC 8489 §9.2.5: a 401 to a request signed with the current nonce means the
        // credentials are wrong; a 438 (or a 401 with a new nonce) asks for a retry with the
        // new nonce.
        let same_nonce = t.signed_nonce.as_deref() == Some(nonce.as_str());
        if (code == ErrorCode::UNAUTHORIZED && same_nonce) || t.challenges >= MAX_CHALLENGES {
            self.fail(unauthorized);
            return;
        }
        let realm = match (realm, &self.challenge) {
            (Ok(realm), _) => realm,
            (Err(_), Some((realm, _))) => realm.clone(),
            (Err(_), None) => {
                self.fail(unauthorized);
                return;
            }
        };
        self.challenge = Some((realm, nonce));
        self.start(t.step, now, t.challenges + 1);
    }

    /// The refresh that is due next once ready: allocation, permission or channel.
    fn next_due(&self) -> Option<(Step, Instant)> {
        if self.stage != Stage::Ready {
            return None;
        }
        [
            (Step::Refresh, self.refresh_at),
            (Step::CreatePermission, self.permission_at),
            (Step::ChannelBind, self.bind_at),
        ]
        .into_iter()
        .filter_map(|(step, at)| at.map(|at| (step, at)))
        .min_by_key(|&(_, at)| at)
    }

    fn start_due(&mut self, now: Instant) {
        if self.pending.is_some() {
            return;
        }
        if let Some((step, at)) = self.next_due() {
            if at <= now {
                self.start(step, now, 0);
            }
        }
    }

    fn start(&mut self, step: Step, now: Instant, challenges: u8) {
        let peer = self.config.peer;
        let attrs = move |m: &mut MessageWriteVec, txid: TransactionId| {
            // Adding a fresh attribute to a message under construction fails only on our own
            // bug (a duplicate, or writing after MESSAGE-INTEGRITY).
            let added = match step {
                Step::Allocate => {
                    udp_transport(m, txid);
                    if peer.is_ipv6() {
                        // RFC 8656 §7.1: ask for an IPv6 relay to reach an IPv6 peer.
                        m.add_attribute(&RequestedAddressFamily::new(AddressFamily::IPV6))
                    } else {
                        Ok(())
                    }
                }
                Step::CreatePermission => m.add_attribute(&XorPeerAddress::new(peer, txid)),
                Step::ChannelBind => m
                    .add_attribute(&ChannelNumber::new(CHANNEL))
                    .and_then(|()| m.add_attribute(&XorPeerAddress::new(peer, txid))),
                Step::Refresh => Ok(()),
            };
            added.expect("a fresh attribute fits a message under construction");
        };
        let credentials = self.challenge.as_ref().map(|(realm, nonce)| Credentials {
            user: &self.config.username,
            pass: &self.config.password,
            realm,
            nonce,
        });
        let request = match build_request(step.method(), &attrs, credentials.as_ref()) {
            Ok(request) => request,
            Err(why) => {
                self.fail(SessionError::Encode { step, why });
                return;
            }
        };
        let mut id = [0u8; 12];
        id.copy_from_slice(&request[8..20]);
        let give_up_at = now + TRANSACTION_TIMEOUT;
        self.transmit = Some(request.clone());
        self.pending = Some(Transaction {
            step,
            id,
            request,
            sends: 1,
            next_at: if self.config.reliable {
                give_up_at
            } else {
                now + RTO
            },
            give_up_at,
            signed_nonce: self.challenge.as_ref().map(|(_, nonce)| nonce.clone()),
            challenges,
        });
    }

    fn fail(&mut self, error: SessionError) {
        self.stage = Stage::Failed;
        self.pending = None;
        self.transmit = None;
        self.events.push_back(Event::Failed(error));
    }
}

/// Half the lifetime a response grants (RFC 8656 §7.3, §8.3), at least a second.
fn refresh_interval(msg: &Message<'_>) -> Duration {
    let lifetime = msg.attribute::<Lifetime>().map_or(DEFAULT_LIFETIME, |l| {
        Duration::from_secs(l.seconds().into())
    });
    (lifetime / 2).max(Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stun_proto::types::message::{
        IntegrityAlgorithm, LongTermKeyCredentials, MessageIntegrityCredentials, MessageWrite,
    };

    const PEER: &str = "127.0.0.1:9000";
    const RELAY: &str = "127.0.0.1:50000";

    fn config(reliable: bool) -> SessionConfig {
        SessionConfig {
            username: "user1".into(),
            password: "pass1".into(),
            peer: PEER.parse().unwrap(),
            reliable,
        }
    }

    /// A scripted server: answers requests the way a TURN server with long-term auth does.
    struct Server {
        nonce: String,
    }

    impl Server {
        fn error(&self, request: &[u8], code: u16, with_challenge: bool) -> Vec<u8> {
            let req = Message::from_bytes(request).unwrap();
            let mut out = Message::builder_error(&req, MessageWriteVec::new());
            out.add_attribute(&ErrorCode::builder(code).build().unwrap())
                .unwrap();
            if with_challenge {
                out.add_attribute(&Realm::new("perf").unwrap()).unwrap();
                out.add_attribute(&Nonce::new(&self.nonce).unwrap())
                    .unwrap();
            }
            out.finish()
        }

        fn success(&self, request: &[u8], lifetime: Option<u32>) -> Vec<u8> {
            let req = Message::from_bytes(request).unwrap();
            let txid = req.transaction_id();
            let mut out = Message::builder_success(&req, MessageWriteVec::new());
            if req.method() == ALLOCATE {
                out.add_attribute(&XorRelayedAddress::new(RELAY.parse().unwrap(), txid))
                    .unwrap();
            }
            if let Some(seconds) = lifetime {
                out.add_attribute(&Lifetime::new(seconds)).unwrap();
            }
            let creds: MessageIntegrityCredentials =
                LongTermKeyCredentials::new("user1".into(), "pass1".into(), "perf".into()).into();
            out.add_message_integrity(&creds, IntegrityAlgorithm::Sha1)
                .unwrap();
            out.finish()
        }
    }

    fn method_of(request: &[u8]) -> Method {
        Message::from_bytes(request).unwrap().method()
    }

    fn nonce_of(request: &[u8]) -> Option<String> {
        let msg = Message::from_bytes(request).unwrap();
        msg.attribute::<Nonce>().ok().map(|n| n.nonce().to_owned())
    }

    /// Drives a session through challenge, Allocate, CreatePermission and ChannelBind.
    fn ready_session(now: Instant) -> (Session, Server) {
        let server = Server { nonce: "n1".into() };
        let mut session = Session::new(config(false), now);
        let first = session.poll_transmit().unwrap();
        assert_eq!(method_of(&first), ALLOCATE);
        assert_eq!(nonce_of(&first), None);
        let challenge = server.error(&first, 401, true);
        assert_eq!(session.handle_frame(now, &challenge), Incoming::Control);
        for method in [ALLOCATE, CREATE_PERMISSION, CHANNEL_BIND] {
            let request = session.poll_transmit().unwrap();
            assert_eq!(method_of(&request), method);
            assert_eq!(nonce_of(&request).as_deref(), Some("n1"));
            let lifetime = (method == ALLOCATE).then_some(600);
            let reply = server.success(&request, lifetime);
            assert_eq!(session.handle_frame(now, &reply), Incoming::Control);
        }
        assert_eq!(
            session.poll_event(),
            Some(Event::Ready {
                relay_addr: RELAY.parse().unwrap()
            })
        );
        (session, server)
    }

    #[test]
    fn allocates_permits_and_binds_after_the_challenge() {
        let now = Instant::now();
        let (session, _) = ready_session(now);
        assert_eq!(session.relay_addr(), Some(RELAY.parse().unwrap()));
        // The first keepalive is the permission refresh at 120 s.
        assert_eq!(session.poll_timeout(), Some(now + PERMISSION_REFRESH));
    }

    #[test]
    fn refreshes_permission_channel_and_allocation_on_schedule() {
        let start = Instant::now();
        let (mut session, server) = ready_session(start);
        let mut seen = Vec::new();
        for _ in 0..50 {
            let now = session.poll_timeout().expect("the session failed");
            if now > start + Duration::from_secs(700) {
                break;
            }
            session.handle_timeout(now);
            while let Some(request) = session.poll_transmit() {
                seen.push((method_of(&request), (now - start).as_secs()));
                let reply = server.success(&request, Some(600));
                assert_eq!(session.handle_frame(now, &reply), Incoming::Control);
            }
        }
        assert!(
            seen.contains(&(REFRESH, 300)),
            "allocation refreshed at lifetime/2: {seen:?}"
        );
        assert!(seen.contains(&(CHANNEL_BIND, 300)), "{seen:?}");
        assert!(seen.contains(&(CREATE_PERMISSION, 120)), "{seen:?}");
        assert!(seen.contains(&(CHANNEL_BIND, 600)), "{seen:?}");
        assert!(session.poll_event().is_none());
    }

    #[test]
    fn stale_nonce_is_retried_with_the_new_nonce() {
        let now = Instant::now();
        let (mut session, mut server) = ready_session(now);
        let later = now + PERMISSION_REFRESH;
        session.handle_timeout(later);
        let request = session.poll_transmit().unwrap();
        server.nonce = "n2".into();
        let stale = server.error(&request, 438, true);
        assert_eq!(session.handle_frame(later, &stale), Incoming::Control);
        let retry = session.poll_transmit().unwrap();
        assert_eq!(method_of(&retry), CREATE_PERMISSION);
        assert_eq!(nonce_of(&retry).as_deref(), Some("n2"));
        assert_ne!(retry[8..20], request[8..20], "a retry is a new transaction");
    }

    #[test]
    fn wrong_credentials_fail_after_one_signed_attempt() {
        let now = Instant::now();
        let server = Server { nonce: "n1".into() };
        let mut session = Session::new(config(true), now);
        let first = session.poll_transmit().unwrap();
        session.handle_frame(now, &server.error(&first, 401, true));
        let signed = session.poll_transmit().unwrap();
        session.handle_frame(now, &server.error(&signed, 401, true));
        match session.poll_event() {
            Some(Event::Failed(SessionError::Unauthorized { code: 401, .. })) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(session.poll_timeout(), None);
        assert_eq!(session.poll_transmit(), None);
    }

    #[test]
    fn other_errors_end_the_session_with_the_code() {
        let now = Instant::now();
        let server = Server { nonce: "n1".into() };
        let mut session = Session::new(config(false), now);
        let first = session.poll_transmit().unwrap();
        session.handle_frame(now, &server.error(&first, 486, false));
        let Some(Event::Failed(error)) = session.poll_event() else {
            panic!("no failure")
        };
        assert_eq!(
            error,
            SessionError::Rejected {
                step: Step::Allocate,
                code: 486,
                reason: "Allocation Quota Reached".into()
            }
        );
        assert!(error.to_string().contains("486"), "{error}");
    }

    #[test]
    fn udp_retransmits_with_backoff_then_times_out() {
        let start = Instant::now();
        let mut session = Session::new(config(false), start);
        let first = session.poll_transmit().unwrap();
        let mut sends = vec![0];
        while let Some(at) = session.poll_timeout() {
            session.handle_timeout(at);
            if let Some(again) = session.poll_transmit() {
                assert_eq!(again, first, "a retransmission is the same request");
                sends.push((at - start).as_millis());
            }
        }
        // RFC 8489 §6.2.1: 0, 500, 1500, 3500, 7500, 15500, 31500 ms.
        assert_eq!(sends, [0, 500, 1500, 3500, 7500, 15500, 31500]);
        assert_eq!(
            session.poll_event(),
            Some(Event::Failed(SessionError::Timeout {
                step: Step::Allocate
            }))
        );
    }

    #[test]
    fn reliable_transports_send_once_and_wait_ti() {
        let start = Instant::now();
        let mut session = Session::new(config(true), start);
        session.poll_transmit().unwrap();
        assert_eq!(session.poll_timeout(), Some(start + TRANSACTION_TIMEOUT));
        session.handle_timeout(start + Duration::from_secs(5));
        assert_eq!(session.poll_transmit(), None);
        session.handle_timeout(start + TRANSACTION_TIMEOUT);
        assert!(matches!(session.poll_event(), Some(Event::Failed(_))));
    }

    #[test]
    fn channel_data_and_data_indications_yield_the_payload() {
        let now = Instant::now();
        let (mut session, _) = ready_session(now);
        let mut frame = channel_data(CHANNEL, b"hello");
        frame.extend_from_slice(&[0, 0, 0]); // stream padding
        assert_eq!(session.handle_frame(now, &frame), Incoming::Data(b"hello"));
        let other_channel = channel_data(0x4001, b"x");
        assert_eq!(session.handle_frame(now, &other_channel), Incoming::Ignored);

        let indication = |from: SocketAddr| {
            let txid = TransactionId::generate();
            let mut msg = Message::builder(
                stun_proto::types::message::MessageType::from_class_method(
                    MessageClass::Indication,
                    DATA,
                ),
                txid,
                MessageWriteVec::new(),
            );
            msg.add_attribute(&XorPeerAddress::new(from, txid)).unwrap();
            msg.add_attribute(&Data::new(b"world")).unwrap();
            msg.finish()
        };
        let from_peer = indication(PEER.parse().unwrap());
        assert_eq!(
            session.handle_frame(now, &from_peer),
            Incoming::Data(b"world")
        );
        let from_elsewhere = indication("127.0.0.1:9001".parse().unwrap());
        assert_eq!(
            session.handle_frame(now, &from_elsewhere),
            Incoming::Ignored
        );
    }

    #[test]
    fn malformed_frames_are_ignored() {
        let now = Instant::now();
        let (mut session, server) = ready_session(now);
        let mut cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![0x40],
            vec![0x40, 0x00, 0x00, 0x08, 1, 2], // ChannelData shorter than it says
            vec![0x00, 0x01, 0x00, 0x04, 0x21, 0x12, 0xa4, 0x42],
            vec![0xff; 64],
        ];
        // A success response to nothing we asked.
        let mut stray = vec![0u8; 20];
        stray[1] = 0x01;
        stray[4..8].copy_from_slice(&[0x21, 0x12, 0xa4, 0x42]);
        cases.push(server.success(&build_request(REFRESH, &|_, _| {}, None).unwrap(), None));
        cases.push(stray);
        // Every truncation of a real response.
        let response = server.error(
            &build_request(ALLOCATE, &|_, _| {}, None).unwrap(),
            401,
            true,
        );
        for cut in 0..response.len() {
            cases.push(response[..cut].to_vec());
        }
        let mut noise = 0x1234_5678u32;
        for _ in 0..2000 {
            let len = (noise % 96) as usize;
            let mut bytes = Vec::with_capacity(len);
            for _ in 0..len {
                noise ^= noise << 13;
                noise ^= noise >> 17;
                noise ^= noise << 5;
                bytes.push(noise as u8);
            }
            cases.push(bytes);
        }
        for case in &cases {
            let got = session.handle_frame(now, case);
            assert!(!matches!(got, Incoming::Control), "{case:02x?}");
        }
        assert!(session.poll_event().is_none());
        assert!(session.poll_timeout().is_some());
    }

    fn channel_data(channel: u16, payload: &[u8]) -> Vec<u8> {
        let mut frame = crate::client::channel_data_header(channel, payload.len()).to_vec();
        frame.extend_from_slice(payload);
        frame
    }
}
