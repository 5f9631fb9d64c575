//! The IO shell of one client flow: a thread connects the transport and drives the flow's
//! [`Session`], passing peer data to the client; the client side's thread (the UDP listener or
//! the stdin reader) calls [`Flow::forward`] with each datagram. Datagrams that arrive while
//! the allocation is being set up are queued (up to [`SETUP_QUEUE`]) and sent once it is ready.

use std::convert::Infallible;
use std::io::{self, Write};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use uturn_shared::framing::padded;
use uturn_shared::logspec::Level;

use super::log::log;
use super::session::{Event, Incoming, Session, SessionConfig, CHANNEL};
use super::transport::{Connector, Sender};
use crate::client::channel_data_header;

/// Datagrams a flow holds while its allocation is set up; later ones are dropped.
pub const SETUP_QUEUE: usize = 64;
/// The largest client datagram.
const MAX_PAYLOAD: usize = 65_535;
/// A buffer for [`Flow::forward`]: ChannelData header, payload, stream padding.
pub const FRAME_ROOM: usize = 4 + MAX_PAYLOAD + 3;

/// How each flow reaches the server and the peer.
pub struct FlowConfig {
    /// The transport to the server.
    pub connector: Connector,
    /// Credentials and peer.
    pub session: SessionConfig,
}

/// Where a flow's peer data goes.
pub enum ClientSide {
    /// Back to the client's address, from the listening socket.
    Udp {
        /// The listening socket.
        socket: Arc<UdpSocket>,
        /// The client's address.
        client: SocketAddr,
    },
    /// To stdout, each payload as it is.
    Stdout,
}

impl ClientSide {
    fn deliver(&self, payload: &[u8]) -> io::Result<()> {
        match self {
            ClientSide::Udp { socket, client } => {
                // A client that went away is not the flow's failure.
                if let Err(e) = socket.send_to(payload, client) {
                    log(Level::Debug, format_args!("send to {client}: {e}"));
                }
                Ok(())
            }
            ClientSide::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(payload)?;
                out.flush()
            }
        }
    }

    fn name(&self) -> String {
        match self {
            ClientSide::Udp { client, .. } => client.to_string(),
            ClientSide::Stdout => "-".to_owned(),
        }
    }
}

/// What [`Flow::forward`] did with a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    /// Sent to the server.
    Sent,
    /// Held until the allocation is ready.
    Queued,
    /// Dropped: the setup queue is full, or the send failed.
    Dropped,
    /// The flow has ended; start a new one.
    Closed,
}

enum Phase {
    SettingUp(Vec<Vec<u8>>),
    Ready,
    Closed(String),
}

/// One client flow.
pub struct Flow {
    ready: AtomicBool,
    phase: Mutex<Phase>,
    phase_changed: Condvar,
    sender: OnceLock<Arc<Sender>>,
    stream: bool,
    born: Instant,
    last_delivery_ns: AtomicU64,
    warned_full: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The part of a [`FRAME_ROOM`] buffer a datagram is received into.
pub fn payload_space(buf: &mut [u8]) -> &mut [u8] {
    &mut buf[4..4 + MAX_PAYLOAD]
}

impl Flow {
    /// Starts a flow's thread. With `exit_on_failure` (stdin/stdout) a flow that fails after
    /// it was ready ends the process.
    pub fn spawn(config: Arc<FlowConfig>, client: ClientSide, exit_on_failure: bool) -> Arc<Flow> {
        let flow = Arc::new(Flow {
            ready: AtomicBool::new(false),
            phase: Mutex::new(Phase::SettingUp(Vec::new())),
            phase_changed: Condvar::new(),
            sender: OnceLock::new(),
            stream: config.connector.protocol.is_stream(),
            born: Instant::now(),
            last_delivery_ns: AtomicU64::new(0),
            warned_full: AtomicBool::new(false),
        });
        let driven = flow.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("turncat {}", client.name()))
            .spawn(move || {
                let Err(error) = driven.drive(&config, &client);
                let was_ready = driven.close(error.clone());
                if was_ready || !exit_on_failure {
                    log(
                        Level::Error,
                        format_args!("flow {}: {error}", client.name()),
                    );
                }
                if was_ready && exit_on_failure {
                    std::process::exit(1);
                }
            });
        if let Err(e) = spawned {
            flow.close(format!("cannot start a thread: {e}"));
        }
        flow
    }

    /// Sends the datagram at `buf[4..4 + len]` (see [`payload_space`]) as ChannelData, or
    /// queues it while the allocation is set up. `buf` must be [`FRAME_ROOM`] long.
    pub fn forward(&self, buf: &mut [u8], len: usize) -> Forwarded {
        // RFC 8656 §12.5: over TCP and TLS, ChannelData is padded to a multiple of 4 bytes.
        let frame_len = if self.stream {
            4 + padded(len)
        } else {
            4 + len
        };
        buf[..4].copy_from_slice(&channel_data_header(CHANNEL, len));
        buf[4 + len..frame_len].fill(0);
        let frame = &buf[..frame_len];
        if self.ready.load(Ordering::Acquire) {
            return self.send(frame);
        }
        let mut phase = lock(&self.phase);
        match &mut *phase {
            Phase::Ready => {
                drop(phase);
                self.send(frame)
            }
            Phase::SettingUp(queue) if queue.len() < SETUP_QUEUE => {
                queue.push(frame.to_vec());
                Forwarded::Queued
            }
            Phase::SettingUp(_) => {
                if !self.warned_full.swap(true, Ordering::Relaxed) {
                    log(
                        Level::Warn,
                        format_args!(
                            "dropping datagrams until the allocation is ready ({SETUP_QUEUE} \
                             queued)"
                        ),
                    );
                }
                Forwarded::Dropped
            }
            Phase::Closed(_) => Forwarded::Closed,
        }
    }

    /// Waits until the allocation is ready; the error if the flow failed first.
    pub fn wait_ready(&self) -> Result<(), String> {
        let mut phase = lock(&self.phase);
        loop {
            match &*phase {
                Phase::Ready => return Ok(()),
                Phase::Closed(error) => return Err(error.clone()),
                Phase::SettingUp(_) => {
                    phase = self
                        .phase_changed
                        .wait(phase)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
            }
        }
    }

    /// When peer data was last passed to the client (the flow's start if never).
    pub fn last_delivery(&self) -> Instant {
        self.born + Duration::from_nanos(self.last_delivery_ns.load(Ordering::Relaxed))
    }

    fn send(&self, frame: &[u8]) -> Forwarded {
        let Some(sender) = self.sender.get() else {
            return Forwarded::Dropped;
        };
        match sender.send(frame) {
            Ok(()) => Forwarded::Sent,
            Err(e) => {
                log(Level::Debug, format_args!("send to the server: {e}"));
                Forwarded::Dropped
            }
        }
    }

    /// Sends what was queued during setup, then lets [`Flow::forward`] send directly.
    fn mark_ready(&self, sender: &Sender) {
        let mut phase = lock(&self.phase);
        if let Phase::SettingUp(queue) = &mut *phase {
            for frame in queue.drain(..) {
                if let Err(e) = sender.send(&frame) {
                    log(Level::Debug, format_args!("send to the server: {e}"));
                }
            }
        }
        *phase = Phase::Ready;
        self.ready.store(true, Ordering::Release);
        self.phase_changed.notify_all();
    }

    /// Ends the flow; whether it had been ready.
    fn close(&self, error: String) -> bool {
        let mut phase = lock(&self.phase);
        let was_ready = matches!(*phase, Phase::Ready);
        *phase = Phase::Closed(error);
        self.ready.store(false, Ordering::Release);
        self.phase_changed.notify_all();
        was_ready
    }

    /// The flow's thread: connect, then run the session until the transport or the session
    /// fails (it has no other end: the process ends with it).
    fn drive(&self, config: &FlowConfig, client: &ClientSide) -> Result<Infallible, String> {
        let connector = &config.connector;
        let (sender, mut receiver) = connector.connect().map_err(|e| e.to_string())?;
        let _ = self.sender.set(sender.clone());
        log(
            Level::Debug,
            format_args!(
                "flow {}: connected to {} over {}",
                client.name(),
                connector.server,
                connector.protocol
            ),
        );
        let to_server = |e: io::Error| format!("send to the server {}: {e}", connector.server);
        let mut session = Session::new(config.session.clone(), Instant::now());
        loop {
            while let Some(message) = session.poll_transmit() {
                sender.send(&message).map_err(to_server)?;
            }
            while let Some(event) = session.poll_event() {
                match event {
                    Event::Ready { relay_addr } => {
                        eprintln!(
                            "turncat: {} -> relay {relay_addr} -> {}",
                            client.name(),
                            config.session.peer
                        );
                        self.mark_ready(&sender);
                    }
                    Event::Failed(error) => return Err(error.to_string()),
                }
            }
            let received = receiver.recv().map_err(|e| e.to_string())?;
            let now = Instant::now();
            if received {
                while let Some(frame) = receiver.next_frame().map_err(|e| e.to_string())? {
                    if let Incoming::Data(payload) = session.handle_frame(now, frame) {
                        client
                            .deliver(payload)
                            .map_err(|e| format!("write to the client: {e}"))?;
                        let since_birth = now.saturating_duration_since(self.born);
                        self.last_delivery_ns.store(
                            u64::try_from(since_birth.as_nanos()).unwrap_or(u64::MAX),
                            Ordering::Relaxed,
                        );
                    }
                }
            }
            if session.poll_timeout().is_some_and(|at| now >= at) {
                session.handle_timeout(now);
            }
        }
    }
}
