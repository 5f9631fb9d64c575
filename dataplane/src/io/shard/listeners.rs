//! The listeners a shard runs: for each, its spec, its sockets and what its transport needs
//! (a TLS config, a DTLS session table), and their reconcile to a new snapshot: listeners the
//! snapshot drops or changes close, new ones open, unchanged ones are left alone.

use super::conns::ConnTable;
use super::counters::Counters;
use super::datagrams::{DatagramSocket, Datagrams, DtlsListener};
use crate::io::driver::{Driver, Interest, Token, Watched};
use crate::io::dtls;
use crate::io::groups::{ListenerGroups, Take};
use crate::io::metrics::CountersByName;
use crate::io::socket::{listener_socket, stream_listener_socket};
use crate::io::tls::{self, MaterialError};
use crate::proto::{Engine, ListenerId};
use rustls::ServerConfig;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Instant;
use uturn_shared::config::ListenerProtocol;
use uturn_shared::snapshot::{ListenerSpec, Snapshot};

/// What a listener speaks, with what its transport needs.
pub(super) enum ListenerTransport {
    /// TURN-UDP.
    Udp,
    /// TURN-DTLS, with its sessions.
    Dtls(DtlsListener),
    /// TURN-TCP.
    Tcp,
    /// TURN-TLS, with the config its sessions start from.
    Tls(Arc<ServerConfig>),
}

impl ListenerTransport {
    /// What `spec` needs to run: for TLS and DTLS, the context built from its certificate and
    /// key, as [`crate::io::check`] builds it before the config is applied.
    fn for_spec(spec: &ListenerSpec) -> Result<ListenerTransport, MaterialError> {
        let (cert, key) = (&spec.tls.cert, &spec.tls.key);
        Ok(match spec.protocol {
            ListenerProtocol::TurnTcp => ListenerTransport::Tcp,
            ListenerProtocol::TurnTls => {
                ListenerTransport::Tls(tls::server_config_from_base64(cert, key)?)
            }
            ListenerProtocol::TurnDtls => {
                ListenerTransport::Dtls(DtlsListener::new(dtls::gate_from_base64(cert, key)?))
            }
            _ => ListenerTransport::Udp,
        })
    }

    /// Whether clients connect (TCP, TLS) rather than send datagrams (UDP, DTLS).
    pub(super) fn is_stream(&self) -> bool {
        matches!(self, ListenerTransport::Tcp | ListenerTransport::Tls(_))
    }

    /// The client transport, for logs.
    pub(super) fn name(&self) -> &'static str {
        match self {
            ListenerTransport::Udp => "UDP",
            ListenerTransport::Dtls(_) => "DTLS",
            ListenerTransport::Tcp => "TCP",
            ListenerTransport::Tls(_) => "TLS",
        }
    }
}

/// One listener as a shard runs it.
pub(super) struct RunningListener<W> {
    pub id: ListenerId,
    /// Slot of this listener's name in the shard's listener counters.
    pub metric: usize,
    pub spec: ListenerSpec,
    /// The address every socket of this listener is bound to (all share it via SO_REUSEPORT).
    local_addr: SocketAddr,
    sockets: Vec<Watched<W>>,
    pub transport: ListenerTransport,
}

impl<W> RunningListener<W> {
    /// The fd of socket number `n`.
    pub(super) fn socket_fd(&self, n: usize) -> Option<RawFd> {
        self.sockets.get(n).map(|socket| socket.fd)
    }

    /// Datagram socket number `n`, to drain or to send from.
    pub(super) fn datagram_socket(&self, n: usize) -> Option<DatagramSocket> {
        self.sockets.get(n).map(|socket| DatagramSocket {
            id: self.id,
            fd: socket.fd,
            metric: self.metric,
            local: self.local_addr,
            dtls: matches!(self.transport, ListenerTransport::Dtls(_)),
        })
    }
}

/// The listeners a shard runs.
pub(super) struct Listeners<W> {
    running: Vec<RunningListener<W>>,
    /// The id given to the last listener opened (ids are never reused).
    last_id: u32,
}

impl<W> Listeners<W> {
    /// No listeners.
    pub(super) fn new() -> Listeners<W> {
        Listeners {
            running: Vec::new(),
            last_id: 0,
        }
    }

    /// Running listener `id`.
    pub(super) fn get(&self, id: ListenerId) -> Option<&RunningListener<W>> {
        self.running.iter().find(|l| l.id == id)
    }

    /// The running TURN-UDP listener called `name`, with a socket (second-chance forwarding
    /// serves UDP clients only: a forwarder never forwards another transport's).
    pub(super) fn udp_id_of(&self, name: &str) -> Option<ListenerId> {
        self.running
            .iter()
            .find(|l| {
                l.spec.name == name
                    && matches!(l.transport, ListenerTransport::Udp)
                    && l.datagram_socket(0).is_some()
            })
            .map(|l| l.id)
    }

    /// Running listener `id`, to change.
    pub(super) fn get_mut(&mut self, id: ListenerId) -> Option<&mut RunningListener<W>> {
        self.running.iter_mut().find(|l| l.id == id)
    }

    /// The session table of DTLS listener `id`.
    pub(super) fn dtls_mut(&mut self, id: ListenerId) -> Option<&mut DtlsListener> {
        match self.get_mut(id).map(|l| &mut l.transport) {
            Some(ListenerTransport::Dtls(dtls)) => Some(dtls),
            _ => None,
        }
    }

    /// Sends `data` to `client` of listener `id` on the listener's transport, from its first
    /// socket (any of its group would do): queued in `datagrams` for a UDP client, encrypted
    /// into a DTLS client's session, queued on a TCP/TLS client's connection in `conns`;
    /// counted. False if the listener has no socket to send from.
    pub(super) fn send_to_client(
        &mut self,
        id: ListenerId,
        client: SocketAddr,
        data: &[u8],
        datagrams: &mut Datagrams,
        conns: &mut ConnTable<W>,
        counters: &mut Counters,
    ) -> bool {
        let Some(running) = self.get_mut(id) else {
            return false;
        };
        let Some(socket) = running.datagram_socket(0) else {
            return false;
        };
        match &mut running.transport {
            ListenerTransport::Udp => datagrams.queue_to_client(&socket, client, data, counters),
            ListenerTransport::Dtls(dtls) => dtls.send_to_client(client, data, &socket, counters),
            ListenerTransport::Tcp | ListenerTransport::Tls(_) => {
                if conns.queue_to_client(id, client, data) {
                    counters.listeners.traffic[socket.metric].tx(data.len());
                } else {
                    counters.send_failed += 1;
                }
            }
        }
        true
    }

    /// Ends the DTLS sessions that stalled or went quiet without an allocation.
    pub(super) fn sweep_dtls(&mut self, now: Instant, engine: &mut Engine) {
        for listener in &mut self.running {
            if let ListenerTransport::Dtls(dtls) = &mut listener.transport {
                dtls.sweep(now, listener.id, engine);
            }
        }
    }

    /// Adds, at each listener's counter slot, what it holds open that stunnerd counts as a
    /// connection: a UDP socket, a DTLS session (TCP/TLS connections are the connection
    /// table's to count).
    pub(super) fn count_open(&self, open: &mut [u64]) {
        for listener in &self.running {
            open[listener.metric] += match &listener.transport {
                ListenerTransport::Udp => listener.sockets.len() as u64,
                ListenerTransport::Dtls(dtls) => dtls.len() as u64,
                ListenerTransport::Tcp | ListenerTransport::Tls(_) => 0,
            };
        }
    }

    /// The running listeners `snap` no longer runs as they are (removed, or changed in a way
    /// that needs a restart).
    pub(super) fn stale(&self, snap: &Snapshot) -> Vec<ListenerId> {
        self.running
            .iter()
            .filter(|running| !served(snap).any(|spec| *spec == running.spec))
            .map(|running| running.id)
            .collect()
    }

    /// Closes listener `id`'s sockets; shard `shard`'s share of a datagram listener's group
    /// is released.
    pub(super) fn close(&mut self, id: ListenerId, groups: &ListenerGroups, shard: usize) {
        let Some(at) = self.running.iter().position(|l| l.id == id) else {
            return;
        };
        let closed = self.running.remove(at);
        if !closed.transport.is_stream() {
            groups.released(shard, &closed.spec);
        }
        tracing::info!(
            target: "stunner",
            "listener {:?} closed on shard {}",
            closed.spec.name,
            shard
        );
    }

    /// Closes every listener.
    pub(super) fn clear(&mut self) {
        self.running.clear();
    }

    /// Opens the listeners of `snap` that do not run yet, on shard `shard`. `false` if one
    /// could not open yet (an older run's sockets on its port are still open on another
    /// shard).
    pub(super) fn open_added<D: Driver<Watch = W>>(
        &mut self,
        snap: &Snapshot,
        groups: &ListenerGroups,
        shard: usize,
        driver: &D,
        counters: &mut CountersByName,
    ) -> bool {
        let mut complete = true;
        let datagram_sockets = groups.share(shard);
        for spec in served(snap) {
            if self.running.iter().any(|l| l.spec == *spec) {
                continue;
            }
            let transport = match ListenerTransport::for_spec(spec) {
                Ok(transport) => transport,
                Err(why) => {
                    tracing::error!(
                        target: "stunner",
                        "cannot open listener {:?} ({}): {why}",
                        spec.name,
                        spec.protocol.as_str()
                    );
                    continue;
                }
            };
            let stream = transport.is_stream();
            // Every shard accepts on its own stream socket; datagram sockets follow
            // --udp-thread-num.
            let (count, interest) = if stream {
                (1, Interest::Accept)
            } else {
                (datagram_sockets, Interest::Datagrams)
            };
            if count == 0 {
                continue;
            }
            let opened = if stream {
                vec![stream_listener_socket(spec.bind, spec.port)]
            } else {
                // Every shard's sockets at once, so the SO_REUSEPORT group is whole before a
                // client is hashed over it (see `groups`).
                match groups.take(shard, spec, || listener_socket(spec.bind, spec.port)) {
                    Take::Sockets(opened) => opened,
                    Take::Wait => {
                        complete = false;
                        continue;
                    }
                    Take::Over => continue,
                }
            };
            if opened.is_empty() {
                continue;
            }
            self.last_id += 1;
            let id = ListenerId(self.last_id);
            let mut sockets = Vec::new();
            let mut local_addr = None;
            for (n, socket) in opened.into_iter().enumerate() {
                let opened = socket.and_then(|socket| {
                    let local = socket.local_addr()?.as_socket();
                    let token = Token::Listener {
                        id,
                        socket: n as u16,
                    };
                    Ok((local, driver.watch(socket, token, interest)?))
                });
                match opened {
                    Ok((local, watched)) => {
                        local_addr = local_addr.or(local);
                        sockets.push(watched);
                    }
                    Err(e) => tracing::error!(
                        target: "stunner",
                        "cannot open listener {:?} on {} port {}: {e}",
                        spec.name,
                        if stream { "TCP" } else { "UDP" },
                        spec.port
                    ),
                }
            }
            let Some(local_addr) = local_addr else {
                // Not one socket could be watched: this shard holds none of the group.
                if !stream {
                    groups.released(shard, spec);
                }
                continue;
            };
            let metric = counters.slot(&spec.name);
            tracing::info!(
                target: "stunner",
                "listener {:?} ({}, port {}, relay address {}) serving on shard {} with {} socket(s)",
                spec.name,
                spec.protocol.as_str(),
                spec.port,
                spec.relay,
                shard,
                sockets.len()
            );
            if !stream {
                counters.opened[metric] += sockets.len() as u64;
            }
            self.running.push(RunningListener {
                id,
                metric,
                spec: spec.clone(),
                local_addr,
                sockets,
                transport,
            });
        }
        complete
    }
}

/// The listeners of `snap` a shard serves: the `TURN-*` ones.
fn served(snap: &Snapshot) -> impl Iterator<Item = &ListenerSpec> {
    snap.listeners.iter().filter(|l| l.protocol.is_turn())
}
