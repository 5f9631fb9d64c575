//! The budget of owner queries: what a client datagram that finds no allocation here (a miss)
//! may cost the siblings when its owner is not known yet. A query is one small datagram to
//! every sibling, and misses are the one thing a stranger can make a pod send to its siblings
//! (by spoofing them), so they are budgeted per source and per shard over all sources.
//!
//! Two budgets, so that spoofed misses cannot starve a moved call:
//! - [`MissClass::Signed`]: a STUN request whose MESSAGE-INTEGRITY checks under the long-term
//!   key of a user of the running config (`MD5(user:realm:password)`, or the password an
//!   ephemeral secret derives). Every pod of a gateway runs the same config, so the forwarder
//!   can check it without the owner's nonce (the nonce is the owner's to check, after the
//!   forward). A moved call's Refresh, CreatePermission and ChannelBind are signed.
//! - [`MissClass::Unsigned`]: everything else (ChannelData, indications, requests without
//!   integrity or with integrity that does not check), which anyone can spoof from any address.
//!   They never spend the signed budget.
//!
//! Each class has a token bucket per source and one per shard. A source is an IPv4 address or
//! an IPv6 /64 ([`budget_source`]): a host that owns a /64 would otherwise have 2^64 buckets.

use crate::proto::limits::SourceBuckets;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Instant;
use stun_proto::types::attribute::{
    AttributeStaticType, MessageIntegrity, MessageIntegritySha256, Username,
};
use stun_proto::types::message::{
    IntegrityAlgorithm, LongTermKeyCredentials, Message, MessageClass,
};
use uturn_shared::auth::Authenticator;

/// Queries one source (an IPv4 address, an IPv6 /64) may make at once, and per second after
/// that, in each class: room for the calls of a NAT address shared by many clients (an office,
/// a carrier NAT) that move at once, while one source still takes only a tenth of the shard's
/// budget.
pub const QUERY_BURST: u32 = 100;
/// See [`QUERY_BURST`].
pub const QUERY_RATE: u32 = 50;
/// Queries a shard makes at once and per second over all sources, in each class: misses
/// spoofed from many source addresses (each with a bucket of its own) send no more than this
/// to the siblings, while a load balancer moving a thousand calls at once still finds their
/// owners at once.
pub const QUERY_BURST_ALL: u32 = 1000;
/// See [`QUERY_BURST_ALL`].
pub const QUERY_RATE_ALL: u32 = 500;

/// Which budget a miss spends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissClass {
    /// A request signed by a user of the config.
    Signed,
    /// Anything else.
    Unsigned,
}

impl MissClass {
    /// The class of client datagram `data` under the running config's `auth`, at wall time
    /// `unix_now` (seconds; ephemeral usernames expire). Checks MESSAGE-INTEGRITY only, not
    /// the nonce.
    pub fn of(auth: &Authenticator, data: &[u8], unix_now: u64) -> MissClass {
        // RFC 8656 §12.4: ChannelData starts with 0b01, and is never signed.
        if data.first().is_none_or(|b| b >> 6 != 0b00) {
            return MissClass::Unsigned;
        }
        let Ok(msg) = Message::from_bytes(data) else {
            return MissClass::Unsigned;
        };
        if msg.class() != MessageClass::Request
            || !(msg.has_attribute(MessageIntegrity::TYPE)
                || msg.has_attribute(MessageIntegritySha256::TYPE))
        {
            return MissClass::Unsigned;
        }
        let Ok(username) = msg.attribute::<Username>() else {
            return MissClass::Unsigned;
        };
        let Ok(credentials) = auth.credentials(username.username(), unix_now) else {
            return MissClass::Unsigned;
        };
        // The key `proto::auth` checks a request with, on every pod of the gateway.
        let key = LongTermKeyCredentials::new(
            username.username().to_owned(),
            credentials.password,
            auth.realm().to_owned(),
        )
        .make_key(IntegrityAlgorithm::Sha1);
        match msg.validate_integrity_with_key(&key) {
            Ok(_) => MissClass::Signed,
            Err(_) => MissClass::Unsigned,
        }
    }
}

/// What a source's bucket is keyed by: an IPv4 address (an IPv4-mapped IPv6 address is its
/// IPv4 address), or an IPv6 address's /64.
pub fn budget_source(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(v6.to_bits() & !u128::from(u64::MAX))),
        },
    }
}

/// One class's buckets: per source, and the shard's over all sources.
struct Buckets {
    per_source: SourceBuckets,
    all: SourceBuckets,
}

impl Buckets {
    fn new(now: Instant) -> Buckets {
        Buckets {
            per_source: SourceBuckets::new(QUERY_RATE, QUERY_BURST, now),
            all: SourceBuckets::shared(QUERY_RATE_ALL, QUERY_BURST_ALL, now),
        }
    }

    fn allow(&mut self, source: IpAddr, now: Instant) -> bool {
        self.per_source.allow(source, now) && self.all.allow(source, now)
    }
}

/// A shard's query budget: two classes of buckets ([`MissClass`]), each per source and per
/// shard. Fixed size (two tables of [`crate::proto::limits::SOURCE_BUCKETS`] buckets).
pub struct QueryBudget {
    signed: Buckets,
    unsigned: Buckets,
}

impl QueryBudget {
    /// A full budget at `now`.
    pub fn new(now: Instant) -> QueryBudget {
        QueryBudget {
            signed: Buckets::new(now),
            unsigned: Buckets::new(now),
        }
    }

    /// Whether a query for a miss of `class` from `source` may be sent at `now`; spends a
    /// token of the class's source bucket and shard bucket if so.
    pub fn allow(&mut self, now: Instant, source: IpAddr, class: MissClass) -> bool {
        let source = budget_source(source);
        match class {
            MissClass::Signed => self.signed.allow(source, now),
            MissClass::Unsigned => self.unsigned.allow(source, now),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::net::Ipv4Addr;
    use std::time::Duration;
    use stun_proto::types::attribute::{Nonce, Realm};
    use stun_proto::types::message::{
        MessageIntegrityCredentials, MessageType, MessageWrite, MessageWriteExt, MessageWriteVec,
        TransactionId, BINDING,
    };
    use turn_types::message::{REFRESH, SEND};
    use uturn_shared::config::{AuthConfig, AuthType};

    const REALM: &str = "stunner.l7mp.io";

    fn auth(auth_type: AuthType, credentials: &[(&str, &str)]) -> Authenticator {
        Authenticator::from_config(&AuthConfig {
            auth_type,
            realm: REALM.into(),
            credentials: credentials
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            lifetime: String::new(),
        })
    }

    fn static_auth() -> Authenticator {
        auth(
            AuthType::Static,
            &[("username", "user1"), ("password", "pass1")],
        )
    }

    /// A `class` `method` message signed as `user` with `pass` (`None`: not signed), with a
    /// nonce no pod issued.
    fn message(class: MessageClass, method: u16, signed: Option<(&str, &str)>) -> Vec<u8> {
        let method = stun_proto::types::message::Method::new(method);
        let mut msg = Message::builder(
            MessageType::from_class_method(class, method),
            TransactionId::generate(),
            MessageWriteVec::new(),
        );
        if let Some((user, pass)) = signed {
            msg.add_attribute(&Username::new(user).unwrap()).unwrap();
            msg.add_attribute(&Realm::new(REALM).unwrap()).unwrap();
            msg.add_attribute(&Nonce::new("an-old-nonce-from-another-pod").unwrap())
                .unwrap();
            let creds: MessageIntegrityCredentials =
                LongTermKeyCredentials::new(user.into(), pass.into(), REALM.into()).into();
            msg.add_message_integrity(&creds, IntegrityAlgorithm::Sha1)
                .unwrap();
        }
        msg.finish()
    }

    fn refresh(signed: Option<(&str, &str)>) -> Vec<u8> {
        message(MessageClass::Request, REFRESH.value(), signed)
    }

    #[test]
    fn only_a_request_signed_by_a_user_of_the_config_is_signed() {
        let auth = static_auth();
        let now = 1_760_000_000;
        assert_eq!(
            MissClass::of(&auth, &refresh(Some(("user1", "pass1"))), now),
            MissClass::Signed
        );
        let unsigned = [
            refresh(None),
            refresh(Some(("user1", "wrong"))),
            refresh(Some(("someone", "pass1"))),
            message(
                MessageClass::Indication,
                SEND.value(),
                Some(("user1", "pass1")),
            ),
            message(
                MessageClass::Success,
                REFRESH.value(),
                Some(("user1", "pass1")),
            ),
            vec![0x40, 0x00, 0x00, 0x04, 1, 2, 3, 4],
            vec![],
            vec![0x00, 0x03, 0xff],
        ];
        for data in unsigned {
            assert_eq!(
                MissClass::of(&auth, &data, now),
                MissClass::Unsigned,
                "{data:02x?}"
            );
        }
        // A signed request altered after signing.
        let mut altered = refresh(Some(("user1", "pass1")));
        altered[10] ^= 1;
        assert_eq!(MissClass::of(&auth, &altered, now), MissClass::Unsigned);
        // Binding is signed if it is: a Binding never misses, but the class does not care.
        let binding = message(
            MessageClass::Request,
            BINDING.value(),
            Some(("user1", "pass1")),
        );
        assert_eq!(MissClass::of(&auth, &binding, now), MissClass::Signed);
        // TURN off: nothing is signed.
        let none = auth_none();
        assert_eq!(
            MissClass::of(&none, &refresh(Some(("user1", "pass1"))), now),
            MissClass::Unsigned
        );
    }

    fn auth_none() -> Authenticator {
        auth(AuthType::None, &[])
    }

    #[test]
    fn ephemeral_credentials_are_signed_until_they_expire() {
        let auth = auth(AuthType::Ephemeral, &[("secret", "s3cret")]);
        let now = 1_760_000_000;
        let user = format!("{}:alice", now + 60);
        let pass = uturn_shared::auth::ephemeral_password("s3cret", &user);
        let request = refresh(Some((&user, &pass)));
        assert_eq!(MissClass::of(&auth, &request, now), MissClass::Signed);
        assert_eq!(
            MissClass::of(&auth, &request, now + 61),
            MissClass::Unsigned
        );
        let wrong = refresh(Some((&user, "not-the-derived-password")));
        assert_eq!(MissClass::of(&auth, &wrong, now), MissClass::Unsigned);
    }

    #[test]
    fn ipv6_sources_are_budgeted_per_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff:ffff:ffff:ffff".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(budget_source(a), budget_source(b));
        assert_eq!(
            budget_source(a),
            "2001:db8:1:2::".parse::<IpAddr>().unwrap()
        );
        assert_ne!(budget_source(a), budget_source(other));
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(
            budget_source(mapped),
            IpAddr::from(Ipv4Addr::new(192, 0, 2, 7))
        );
        assert_ne!(
            budget_source("::ffff:192.0.2.8".parse().unwrap()),
            budget_source(mapped)
        );

        // Misses from 1000 addresses of one /64 get one source's burst.
        let t0 = Instant::now();
        let mut budget = QueryBudget::new(t0);
        let allowed = (0..1000u128)
            .map(|i| {
                IpAddr::V6(Ipv6Addr::from(
                    0x2001_0db8_0001_0002_0000_0000_0000_0000 + i,
                ))
            })
            .filter(|ip| budget.allow(t0, *ip, MissClass::Unsigned))
            .count();
        assert_eq!(allowed, QUERY_BURST as usize);
    }

    #[test]
    fn unsigned_misses_from_many_sources_cannot_spend_the_signed_budget() {
        let t0 = Instant::now();
        let mut budget = QueryBudget::new(t0);
        // A flood from 50 addresses: each source's burst, the shard's burst over all.
        let mut allowed = 0;
        for source in 0..50u32 {
            let ip = IpAddr::from(Ipv4Addr::from(0xc633_6400 + source));
            for _ in 0..200 {
                allowed += usize::from(budget.allow(t0, ip, MissClass::Unsigned));
            }
        }
        assert_eq!(allowed, QUERY_BURST_ALL as usize);
        let victim = IpAddr::from(Ipv4Addr::new(203, 0, 113, 9));
        assert!(!budget.allow(t0, victim, MissClass::Unsigned));
        // The moved call's signed request is asked about at once, even from a flooded source.
        assert!(budget.allow(t0, victim, MissClass::Signed));
        assert!(budget.allow(
            t0,
            IpAddr::from(Ipv4Addr::from(0xc633_6400)),
            MissClass::Signed
        ));
        // The unsigned budget refills at its rate.
        let later = t0 + Duration::from_millis(100);
        let refilled = (0..100)
            .filter(|i| {
                budget.allow(
                    later,
                    IpAddr::from(Ipv4Addr::from(0x0a00_0000 + i)),
                    MissClass::Unsigned,
                )
            })
            .count();
        assert_eq!(refilled, (QUERY_RATE_ALL / 10) as usize);
    }

    #[test]
    fn signed_misses_have_budgets_of_their_own_too() {
        let t0 = Instant::now();
        let mut budget = QueryBudget::new(t0);
        let ip = IpAddr::from(Ipv4Addr::new(203, 0, 113, 9));
        let allowed = (0..1000)
            .filter(|_| budget.allow(t0, ip, MissClass::Signed))
            .count();
        assert_eq!(allowed, QUERY_BURST as usize);
        assert!(budget.allow(t0, ip, MissClass::Unsigned));
    }
}
