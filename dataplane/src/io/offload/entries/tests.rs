//! The entry table on a virtual clock: no BPF, no root.

use super::*;
use std::net::SocketAddrV4;

const SECOND: u64 = 1_000_000_000;

struct Clock {
    epoch: Instant,
}

impl Clock {
    fn at(&self, secs: u64) -> Instant {
        self.epoch + Duration::from_secs(secs)
    }
}

fn setup() -> (Entries, Clock) {
    let epoch = Instant::now();
    (Entries::new(epoch, 1_000 * SECOND), Clock { epoch })
}

/// Channel `number` to peer 10.1.0.`host`:`peer_port`, ending at `expires_at`, its
/// permission at `permission`.
fn want(
    number: u16,
    host: u8,
    peer_port: u16,
    expires_at: Instant,
    permission: Instant,
    entries: &Entries,
) -> Wanted {
    Wanted {
        spec: EntrySpec {
            client: SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 5000),
            listener: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 3478),
            channel: number,
            relay: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 40000),
            peer: SocketAddrV4::new(Ipv4Addr::new(10, 1, 0, host), peer_port),
            peer_ifindex: 2,
            client_ifindex: 2,
            peer_macs: None,
            client_macs: None,
            alloc: 0,
            perm: 0,
            expires_ns: entries.ns(expires_at),
        },
        listener: ListenerId(0),
        cluster: 0,
        expires_at,
        permission_expires_at: permission,
    }
}

fn slots() -> impl FnMut() -> Option<u32> {
    let mut next = 0;
    move || {
        next += 1;
        Some(next)
    }
}

fn count(ops: &[Op], kind: impl Fn(&Op) -> bool) -> usize {
    ops.iter().filter(|op| kind(op)).count()
}

#[test]
fn a_new_channel_gets_its_deadline_words_before_its_entry() {
    let (mut e, c) = setup();
    let mut ops = Vec::new();
    let w = want(0x4000, 1, 9000, c.at(600), c.at(300), &e);
    e.set_all(RelayId(1), &[w], c.at(600), c.at(0), &mut slots(), &mut ops);
    let spec = EntrySpec {
        alloc: 1,
        perm: 2,
        ..w.spec
    };
    assert_eq!(
        ops,
        [
            Op::Deadline {
                slot: 1,
                ns: e.ns(c.at(600))
            },
            Op::Deadline {
                slot: 2,
                ns: e.ns(c.at(300))
            },
            Op::Install(spec)
        ]
    );
    assert_eq!(e.len(), 1);
}

#[test]
fn a_refresh_or_a_permission_is_one_word_however_many_channels() {
    let (mut e, c) = setup();
    let relay = RelayId(1);
    let mut ops = Vec::new();
    // 2 048 channels to one peer IP: one allocation word, one permission word.
    let wanted: Vec<Wanted> = (0..2048)
        .map(|i| want(0x4000 + i, 1, 9000 + i, c.at(600), c.at(2), &e))
        .collect();
    e.set_all(relay, &wanted, c.at(2), c.at(0), &mut slots(), &mut ops);
    assert_eq!(count(&ops, |o| matches!(o, Op::Install(_))), 2048);
    assert_eq!(count(&ops, |o| matches!(o, Op::Deadline { .. })), 2);
    // The allocation's end near: a Refresh writes its one word at once.
    ops.clear();
    e.set_deadline(relay, c.at(602), c.at(1), &mut ops);
    assert_eq!(
        ops,
        [Op::Deadline {
            slot: 1,
            ns: e.ns(c.at(602))
        }]
    );
    // The permission's end near: a CreatePermission writes its one word at once.
    ops.clear();
    let ip = Ipv4Addr::new(10, 1, 0, 1);
    assert!(!e.set_permission(relay, ip, c.at(301), 2048, c.at(1), &mut ops));
    assert_eq!(
        ops,
        [Op::Deadline {
            slot: 2,
            ns: e.ns(c.at(301))
        }]
    );
    // Far: the next ones wait for the sync.
    ops.clear();
    e.set_deadline(relay, c.at(700), c.at(2), &mut ops);
    assert!(!e.set_permission(relay, ip, c.at(302), 2048, c.at(2), &mut ops));
    assert!(ops.is_empty(), "{ops:?}");
    // Shorter: at once, the kernel never relays past the allocation's end.
    e.set_deadline(relay, c.at(60), c.at(3), &mut ops);
    assert_eq!(
        ops,
        [Op::Deadline {
            slot: 1,
            ns: e.ns(c.at(60))
        }]
    );
    // The sync writes the permission's extension that waited, and nothing per channel.
    ops.clear();
    assert!(e.sync(c.at(4), false, &mut ops).is_empty());
    assert_eq!(
        ops,
        [Op::Deadline {
            slot: 2,
            ns: e.ns(c.at(302))
        }]
    );
}

#[test]
fn a_rebind_far_from_its_end_waits_for_the_sync_and_one_near_is_written_now() {
    let (mut e, c) = setup();
    let relay = RelayId(1);
    let mut ops = Vec::new();
    let first = want(0x4000, 1, 9000, c.at(300), c.at(3000), &e);
    e.set_all(relay, &[first], c.at(6000), c.at(0), &mut slots(), &mut ops);
    ops.clear();
    // Rebound at 100 s: the kernel's end (300 s) is far; nothing written.
    let later = want(0x4000, 1, 9000, c.at(700), c.at(3000), &e);
    e.set_channel(relay, later, c.at(6000), c.at(100), &mut slots(), &mut ops);
    assert!(ops.is_empty(), "{ops:?}");
    // The sync writes the extension once.
    assert!(e.sync(c.at(101), false, &mut ops).is_empty());
    assert_eq!(
        count(
            &ops,
            |o| matches!(o, Op::Update(s) if s.expires_ns == SECOND * 1_700)
        ),
        1,
        "{ops:?}"
    );
    ops.clear();
    assert!(e.sync(c.at(102), false, &mut ops).is_empty() && ops.is_empty());
    // Rebound at 698 s, 2 s before the kernel's end: written now.
    let last = want(0x4000, 1, 9000, c.at(1300), c.at(3000), &e);
    e.set_channel(relay, last, c.at(6000), c.at(698), &mut slots(), &mut ops);
    let end = e.ns(c.at(1300));
    assert_eq!(
        count(&ops, |o| matches!(o, Op::Update(s) if s.expires_ns == end)),
        1,
        "{ops:?}"
    );
}

#[test]
fn new_keys_remove_the_old_pair_before_installing_the_new() {
    let (mut e, c) = setup();
    let relay = RelayId(1);
    let mut ops = Vec::new();
    let mut slots = slots();
    let slots = &mut slots;
    let first = want(0x4000, 1, 9000, c.at(300), c.at(300), &e);
    e.set_all(relay, &[first], c.at(600), c.at(0), slots, &mut ops);
    ops.clear();
    // The route to the peer changed: another relay source address, so another in-key.
    let mut moved = want(0x4000, 1, 9000, c.at(300), c.at(300), &e);
    moved.spec.relay = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 40000);
    e.set_all(relay, &[moved], c.at(600), c.at(1), slots, &mut ops);
    assert_eq!(ops.len(), 2, "{ops:?}");
    assert!(
        matches!(ops[0], Op::Remove(h) if h.spec.relay.ip() == &Ipv4Addr::new(10, 0, 0, 1)),
        "{ops:?}"
    );
    assert!(
        matches!(ops[1], Op::Install(s) if s.relay.ip() == &Ipv4Addr::new(10, 0, 0, 2)),
        "{ops:?}"
    );
    // Other values under the same keys (the MACs learnt): one update, no removal.
    ops.clear();
    let mut macs = moved;
    macs.spec.peer_macs = Some([1; 12]);
    e.set_all(relay, &[macs], c.at(600), c.at(2), slots, &mut ops);
    assert_eq!(ops.len(), 1);
    assert!(matches!(ops[0], Op::Update(s) if s.peer_macs == Some([1; 12])));
    // Bound to another peer (after the first lapsed): the new permission's word comes
    // first, then the old pair and its permission go, then the new pair (the allocation's
    // later end, far, waits for the sync).
    ops.clear();
    let other = want(0x4000, 2, 9000, c.at(900), c.at(900), &e);
    e.set_all(relay, &[other], c.at(900), c.at(3), slots, &mut ops);
    assert_eq!(ops.len(), 5, "{ops:?}");
    assert!(matches!(ops[0], Op::Deadline { slot: 3, .. }), "{ops:?}");
    assert!(
        matches!(ops[1], Op::Remove(h) if h.spec.perm == 2),
        "{ops:?}"
    );
    assert_eq!(ops[2], Op::Deadline { slot: 2, ns: 0 });
    assert_eq!(ops[3], Op::Free { slot: 2 });
    assert!(
        matches!(ops[4], Op::Install(s) if s.perm == 3 && s.alloc == 1),
        "{ops:?}"
    );
}

#[test]
fn channels_not_offered_go_and_the_last_one_frees_the_slots() {
    let (mut e, c) = setup();
    let relay = RelayId(1);
    let mut ops = Vec::new();
    let two = [
        want(0x4000, 1, 9000, c.at(300), c.at(300), &e),
        want(0x4001, 1, 9001, c.at(300), c.at(300), &e),
    ];
    e.set_all(relay, &two, c.at(600), c.at(0), &mut slots(), &mut ops);
    ops.clear();
    e.set_all(relay, &two[..1], c.at(600), c.at(1), &mut slots(), &mut ops);
    assert_eq!(ops.len(), 1);
    assert!(matches!(ops[0], Op::Remove(h) if h.spec.channel == 0x4001));
    ops.clear();
    e.unset_channel(relay, 0x4000, &mut ops);
    assert!(matches!(ops[0], Op::Remove(h) if h.spec.channel == 0x4000));
    assert_eq!(
        ops[1..],
        [
            Op::Deadline { slot: 2, ns: 0 },
            Op::Free { slot: 2 },
            Op::Deadline { slot: 1, ns: 0 },
            Op::Free { slot: 1 }
        ]
    );
    assert_eq!(e.len(), 0);
}

#[test]
fn a_refused_install_is_not_held_and_is_offered_again() {
    let (mut e, c) = setup();
    let mut ops = Vec::new();
    let two = [
        want(0x4000, 1, 9000, c.at(300), c.at(300), &e),
        want(0x4001, 2, 9001, c.at(300), c.at(300), &e),
    ];
    e.set_all(RelayId(1), &two, c.at(600), c.at(0), &mut slots(), &mut ops);
    let installs: Vec<EntrySpec> = ops
        .iter()
        .filter_map(|op| match op {
            Op::Install(spec) => Some(*spec),
            _ => None,
        })
        .collect();
    ops.clear();
    e.refused(&installs[1], &mut ops);
    assert_eq!(e.len(), 1);
    // Its permission (its own peer's) goes; nothing of the kernel's pair to remove.
    assert_eq!(
        ops,
        [
            Op::Deadline {
                slot: installs[1].perm,
                ns: 0
            },
            Op::Free {
                slot: installs[1].perm
            }
        ]
    );
    assert_eq!(e.sync(c.at(1), false, &mut ops), [RelayId(1)]);
    // The last one refused frees the allocation's slot too.
    ops.clear();
    e.refused(&installs[0], &mut ops);
    assert_eq!(e.len(), 0);
    assert_eq!(count(&ops, |o| matches!(o, Op::Free { .. })), 2, "{ops:?}");
}

#[test]
fn without_a_free_deadline_slot_nothing_is_offloaded() {
    let (mut e, c) = setup();
    let mut ops = Vec::new();
    let w = want(0x4000, 1, 9000, c.at(300), c.at(300), &e);
    e.set_all(RelayId(1), &[w], c.at(600), c.at(0), &mut || None, &mut ops);
    assert!(ops.is_empty());
    assert_eq!(e.len(), 0);
    // A slot for the allocation but none for its permission: nothing held either.
    let mut one = Some(7);
    e.set_all(
        RelayId(1),
        &[w],
        c.at(600),
        c.at(0),
        &mut || one.take(),
        &mut ops,
    );
    assert_eq!(e.len(), 0);
    assert_eq!(ops.last(), Some(&Op::Free { slot: 7 }), "{ops:?}");
}

#[test]
fn the_sync_offers_again_what_was_marked_or_ended_and_a_permission_says_what_it_lacks() {
    let (mut e, c) = setup();
    let mut ops = Vec::new();
    let ends_first = want(0x4000, 1, 9000, c.at(10), c.at(300), &e);
    e.set_all(
        RelayId(1),
        &[ends_first],
        c.at(600),
        c.at(0),
        &mut slots(),
        &mut ops,
    );
    let lapses = want(0x4000, 1, 9000, c.at(600), c.at(20), &e);
    e.set_all(
        RelayId(2),
        &[lapses],
        c.at(600),
        c.at(0),
        &mut slots(),
        &mut ops,
    );
    e.mark(RelayId(2));
    ops.clear();
    assert_eq!(e.sync(c.at(1), false, &mut ops), [RelayId(2)]);
    assert_eq!(e.sync(c.at(2), false, &mut ops), []);
    assert_eq!(e.sync(c.at(10), false, &mut ops), [RelayId(1)]);
    // A permission that lapsed: offered again.
    assert!(e.sync(c.at(20), false, &mut ops).contains(&RelayId(2)));
    assert!(ops.is_empty(), "{ops:?}");
    // A permission with more channels bound than held: the shell is told to offer them.
    let held = want(0x4000, 1, 9000, c.at(600), c.at(300), &e);
    e.set_all(
        RelayId(3),
        &[held],
        c.at(600),
        c.at(21),
        &mut slots(),
        &mut ops,
    );
    let ip = Ipv4Addr::new(10, 1, 0, 1);
    assert!(!e.set_permission(RelayId(3), ip, c.at(300), 1, c.at(21), &mut ops));
    assert!(e.set_permission(RelayId(3), ip, c.at(300), 2, c.at(21), &mut ops));
    assert!(e.set_permission(RelayId(4), ip, c.at(300), 1, c.at(21), &mut ops));
    // A forgotten allocation is no longer offered, even if marked.
    e.mark(RelayId(2));
    e.forget(RelayId(2), &mut ops);
    assert!(e
        .sync(c.at(22), false, &mut ops)
        .iter()
        .all(|r| *r != RelayId(2)));
}
