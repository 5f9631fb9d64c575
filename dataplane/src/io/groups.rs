//! Datagram listener sockets are opened for all shards at once.
//!
//! The shards of a TURN-UDP or TURN-DTLS listener share its port through SO_REUSEPORT: the
//! kernel hashes each client's address and port over the sockets bound to that port. The
//! hash spreads clients over however many sockets the group holds *at that moment*, so a
//! socket joining the group moves some clients to another socket. If a shard opened its
//! socket a tick after another shard did, a client that allocated in between would have its
//! next requests and data arrive at a shard that does not hold its allocation: 437 to every
//! Refresh and CreatePermission, and its media dropped.
//!
//! So the first shard to reach a new listener run opens the sockets of every shard, and
//! [`ListenerGroups`] holds the others' until their shards pick them up. Packets that arrive
//! meanwhile wait in those sockets' receive queues. A listener that restarts on the same port
//! (a new realm, certificate or relay address) opens its new sockets only once every shard has
//! closed the old ones, for the same reason: an old socket leaving the group would move the
//! clients of the new one. This is control-path code: a lock, taken when a shard reconciles a
//! new snapshot, never per packet.

use socket2::Socket;
use std::collections::HashMap;
use std::io;
use std::sync::Mutex;
use uturn_shared::snapshot::{ListenerSpec, Snapshot};

/// One listener run, `(name, run)`.
type RunKey = (String, u64);

struct Group {
    port: u16,
    /// Which shards hold sockets of this run (taken and not yet closed).
    held: Vec<bool>,
    state: State,
}

enum State {
    /// Opened; each shard's sockets until it takes them.
    Open(Vec<Vec<io::Result<Socket>>>),
    /// Gone from the snapshot of this generation: never opened again. Forgotten once every
    /// shard has reconciled a snapshot at least that new (and so closed its sockets).
    Retired(u64),
}

/// What a shard gets for a datagram listener run.
pub(crate) enum Take {
    /// Its sockets (none if it has no share of `--udp-thread-num`).
    Sockets(Vec<io::Result<Socket>>),
    /// An older run on the same port still has sockets on some shard: ask again next tick.
    Wait,
    /// The run is over (a newer snapshot removed or changed the listener): the shard asked
    /// with an old snapshot and will reconcile a newer one.
    Over,
}

/// The datagram listener sockets of every shard, by listener run.
pub(crate) struct ListenerGroups {
    shards: usize,
    /// `--udp-thread-num`: sockets per listener, over all shards (0 means one).
    udp_thread_num: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    groups: HashMap<RunKey, Group>,
    /// The generation each shard last reconciled.
    reconciled: Vec<u64>,
}

impl ListenerGroups {
    /// Groups for `shards` shards, with `udp_thread_num` sockets per listener.
    pub(super) fn new(shards: usize, udp_thread_num: usize) -> ListenerGroups {
        ListenerGroups {
            shards,
            udp_thread_num,
            inner: Mutex::new(Inner {
                groups: HashMap::new(),
                reconciled: vec![0; shards],
            }),
        }
    }

    /// How many of a listener's sockets shard `index` holds: the `--udp-thread-num` sockets
    /// are dealt round-robin, so the shards' shares differ by one at most (and a shard beyond
    /// the socket count holds none).
    pub(super) fn share(&self, index: usize) -> usize {
        let sockets = self.udp_thread_num.max(1);
        (0..sockets)
            .filter(|j| j % self.shards.max(1) == index)
            .count()
    }

    /// Shard `index`'s sockets for the datagram listener `spec`. The first shard to ask for a
    /// run opens the sockets of every shard, [`ListenerGroups::share`] of them each, with
    /// `open`.
    pub(super) fn take(
        &self,
        index: usize,
        spec: &ListenerSpec,
        open: impl Fn() -> io::Result<Socket>,
    ) -> Take {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let key = (spec.name.clone(), spec.run);
        if !inner.groups.contains_key(&key) {
            let draining = inner.groups.iter().any(|(other, group)| {
                *other != key
                    && group.port == spec.port
                    && matches!(group.state, State::Retired(_))
                    && group.held.iter().any(|&h| h)
            });
            if draining {
                return Take::Wait;
            }
            let sockets = (0..self.shards)
                .map(|shard| (0..self.share(shard)).map(|_| open()).collect())
                .collect();
            inner.groups.insert(
                key.clone(),
                Group {
                    port: spec.port,
                    held: vec![false; self.shards],
                    state: State::Open(sockets),
                },
            );
        }
        let Some(group) = inner.groups.get_mut(&key) else {
            return Take::Over;
        };
        let State::Open(sockets) = &mut group.state else {
            return Take::Over;
        };
        let Some(mine) = sockets.get_mut(index).map(std::mem::take) else {
            return Take::Over;
        };
        if let Some(held) = group.held.get_mut(index) {
            *held = mine.iter().any(|s| s.is_ok());
        }
        Take::Sockets(mine)
    }

    /// Shard `index` closed its sockets of the datagram listener `spec`.
    pub(super) fn released(&self, index: usize, spec: &ListenerSpec) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = inner
            .groups
            .get_mut(&(spec.name.clone(), spec.run))
            .and_then(|g| g.held.get_mut(index))
        {
            *held = false;
        }
    }

    /// Shard `index` is reconciling `snap`: runs absent from it are retired (their sockets
    /// not yet taken are closed), and retired runs every shard has moved past are forgotten.
    pub(super) fn reconciling(&self, index: usize, snap: &Snapshot) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(seen) = inner.reconciled.get_mut(index) {
            *seen = (*seen).max(snap.generation);
        }
        for ((name, run), group) in inner.groups.iter_mut() {
            // A run started after this snapshot is not yet in it, not over.
            let current = *run > snap.generation
                || snap
                    .listeners
                    .iter()
                    .any(|l| l.run == *run && l.name == *name);
            if !current && matches!(group.state, State::Open(_)) {
                group.state = State::Retired(snap.generation);
            }
        }
        // The oldest snapshot any shard still runs (a shard that has reconciled none holds 0).
        let oldest = inner.reconciled.iter().copied().min().unwrap_or(0);
        inner.groups.retain(|_, group| match group.state {
            State::Retired(at) => at > oldest || group.held.iter().any(|&h| h),
            State::Open(_) => true,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::socket::listener_socket;
    use std::net::UdpSocket;
    use uturn_shared::config::parse_config;

    fn snapshot(generation: u64, port: Option<u16>) -> Snapshot {
        let listeners = match port {
            Some(port) => format!(
                "[{{name: udp, protocol: TURN-UDP, address: 127.0.0.1, port: {port}, routes: [c]}}]"
            ),
            None => "[]".into(),
        };
        let yaml = format!(
            "version: v1\nadmin: {{name: t}}\nauth: {{type: static, credentials: {{username: u, password: p}}}}\n\
             listeners: {listeners}\nclusters: [{{name: c, type: STATIC, endpoints: [127.0.0.1]}}]\n"
        );
        Snapshot::from_config(&parse_config(&yaml).unwrap(), generation, &|_| Vec::new())
    }

    /// A port no socket is bound to (the kernel's pick, let go).
    fn free_udp_port() -> u16 {
        let socket = listener_socket(None, 0).unwrap();
        socket.local_addr().unwrap().as_socket().unwrap().port()
    }

    /// Whether a socket is bound to `port`, as a bind without SO_REUSEPORT sees it.
    fn bound(port: u16) -> bool {
        UdpSocket::bind(("0.0.0.0", port)).is_err()
    }

    /// The sockets of a `Take::Sockets`; panics on anything else.
    fn sockets(take: Take) -> Vec<io::Result<Socket>> {
        match take {
            Take::Sockets(sockets) => sockets,
            Take::Wait => panic!("told to wait"),
            Take::Over => panic!("told the run is over"),
        }
    }

    #[test]
    fn udp_thread_num_sockets_are_dealt_over_the_shards() {
        let shares = |shards, udp_thread_num| {
            let groups = ListenerGroups::new(shards, udp_thread_num);
            (0..shards).map(|i| groups.share(i)).collect::<Vec<_>>()
        };
        assert_eq!(shares(3, 5), [2, 2, 1]);
        // --udp-thread-num 16 on a 2-CPU pod: two shards with eight sockets each.
        assert_eq!(shares(2, 16), [8, 8]);
        // 0 means one socket, on the first shard.
        assert_eq!(shares(2, 0), [1, 0]);
    }

    #[test]
    fn the_first_shard_opens_the_sockets_of_every_shard() {
        let port = free_udp_port();
        let snap = snapshot(1, Some(port));
        let spec = &snap.listeners[0];
        // Shards 0 and 1 get two sockets each, shard 2 one (--udp-thread-num 5 over 3).
        let groups = ListenerGroups::new(3, 5);
        let opened = std::cell::Cell::new(0);
        let open = || {
            opened.set(opened.get() + 1);
            listener_socket(None, port)
        };
        let first = sockets(groups.take(1, spec, open));
        assert_eq!(opened.get(), 5, "the whole group opens at once");
        assert_eq!(first.len(), 2);
        assert!(first.iter().all(|s| s.is_ok()));
        let last = sockets(groups.take(2, spec, open));
        assert_eq!(last.len(), 1);
        assert_eq!(opened.get(), 5, "no shard opens a second group");
        let zero = sockets(groups.take(0, spec, open));
        assert_eq!(zero.len(), 2);
        drop((first, last, zero));
        assert!(!bound(port));
    }

    #[test]
    fn a_removed_run_is_never_reopened_and_untaken_sockets_close() {
        let port = free_udp_port();
        let with = snapshot(1, Some(port));
        let spec = with.listeners[0].clone();
        let groups = ListenerGroups::new(2, 2);
        let mine = sockets(groups.take(0, &spec, || listener_socket(None, port)));
        assert_eq!(mine.len(), 1);
        // Shard 0 reconciles generation 2, where the listener is gone, and closes its socket.
        groups.reconciling(0, &snapshot(2, None));
        drop(mine);
        groups.released(0, &spec);
        assert!(!bound(port), "shard 1's socket, never taken, is closed");
        // Shard 1, still on generation 1, must not open the run again.
        assert!(matches!(
            groups.take(1, &spec, || listener_socket(None, port)),
            Take::Over
        ));
        assert!(!bound(port));
        // Added back in generation 3: a new run, a new group.
        let mut back = snapshot(3, Some(port));
        back.carry_listener_runs(&snapshot(2, None).listeners);
        assert_eq!(back.listeners[0].run, 3);
        groups.reconciling(1, &back);
        let again = sockets(groups.take(1, &back.listeners[0], || listener_socket(None, port)));
        assert_eq!(again.len(), 1);
    }

    #[test]
    fn a_restarted_listener_opens_once_every_shard_closed_the_old_run() {
        let port = free_udp_port();
        let old = snapshot(1, Some(port));
        let groups = ListenerGroups::new(2, 2);
        let open = || listener_socket(None, port);
        let mut held: Vec<_> = (0..2)
            .map(|shard| sockets(groups.take(shard, &old.listeners[0], open)))
            .collect();
        // Generation 2 restarts the listener on the same port (say, a new realm).
        let mut new = snapshot(2, Some(port));
        new.listeners[0].realm = "other".into();
        new.carry_listener_runs(&old.listeners);
        assert_eq!(new.listeners[0].run, 2);
        // Shard 0 closes its old socket; shard 1 still serves the old run.
        groups.reconciling(0, &new);
        held[0].clear();
        groups.released(0, &old.listeners[0]);
        assert!(matches!(
            groups.take(0, &new.listeners[0], open),
            Take::Wait
        ));
        // Shard 1 closes its old socket and opens the new run for both.
        groups.reconciling(1, &new);
        held[1].clear();
        groups.released(1, &old.listeners[0]);
        assert!(!bound(port), "no socket of either run is open");
        let one = sockets(groups.take(1, &new.listeners[0], open));
        let zero = sockets(groups.take(0, &new.listeners[0], open));
        assert_eq!((zero.len(), one.len()), (1, 1));
        assert!(zero.iter().chain(&one).all(|s| s.is_ok()));
    }

    #[test]
    fn a_listener_sharing_a_port_with_a_running_one_does_not_wait() {
        // Two listeners in one config on the same port (UDP and DTLS, say) both open.
        let port = free_udp_port();
        let first = snapshot(1, Some(port));
        let mut second = first.listeners[0].clone();
        second.name = "other".into();
        let groups = ListenerGroups::new(1, 1);
        groups.reconciling(0, &first);
        let a = sockets(groups.take(0, &first.listeners[0], || listener_socket(None, port)));
        let b = sockets(groups.take(0, &second, || listener_socket(None, port)));
        assert_eq!((a.len(), b.len()), (1, 1));
    }

    #[test]
    fn an_old_snapshot_does_not_retire_a_newer_run() {
        let port = free_udp_port();
        let newer = snapshot(5, Some(port));
        let groups = ListenerGroups::new(2, 2);
        let mine = sockets(groups.take(0, &newer.listeners[0], || listener_socket(None, port)));
        // Shard 1 reconciles generation 4, which predates the listener.
        groups.reconciling(1, &snapshot(4, None));
        let theirs = sockets(groups.take(1, &newer.listeners[0], || listener_socket(None, port)));
        assert_eq!((mine.len(), theirs.len()), (1, 1));
    }

    #[test]
    fn an_unchanged_listener_keeps_its_run() {
        let port = free_udp_port();
        let mut next = snapshot(7, Some(port));
        next.carry_listener_runs(&snapshot(6, Some(port)).listeners);
        assert_eq!(next.listeners[0].run, 6);
        let mut moved = snapshot(8, Some(port + 1));
        moved.carry_listener_runs(&next.listeners);
        assert_eq!(moved.listeners[0].run, 8);
    }
}
