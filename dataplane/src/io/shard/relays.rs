//! The relay sockets of a shard's allocations, by [`RelayId`]: opened when the engine asks for
//! them (an Allocate: one socket, or an IPv4 and an IPv6 one for a dual allocation) and closed
//! when it says an allocation (or one of its relays) ended.

use crate::io::driver::{Driver, Interest, Token, Watched};
use crate::io::offload::{Delta, OffloadTable};
use crate::io::socket::relay_socket;
use crate::proto::{Engine, OffloadChannel, RelayId, RelayRequest};
use std::io;
use std::os::fd::RawFd;

/// A relay socket and its port.
struct Relay<W> {
    watched: Watched<W>,
    port: u16,
}

/// The relay sockets, indexed by [`RelayId`] (the engine reuses ids, so the table stays dense),
/// and what the kernel offload relays for them.
pub(super) struct Relays<W> {
    sockets: Vec<Option<Relay<W>>>,
    /// The kernel offload's entries of this shard's allocations, if it runs.
    pub offload: Option<OffloadTable>,
    /// What offload entries relayed until they were removed, for the counters.
    pub offload_deltas: Vec<Delta>,
}

impl<W> Relays<W> {
    /// No relay sockets.
    pub(super) fn new(offload: Option<OffloadTable>) -> Relays<W> {
        Relays {
            sockets: Vec::new(),
            offload,
            offload_deltas: Vec::new(),
        }
    }

    /// Opens and watches the relay sockets `request` asks for (the additional one only if the
    /// first could be); the port of each, or why it could not be had.
    pub(super) fn open<D: Driver<Watch = W>>(
        &mut self,
        request: &RelayRequest,
        driver: &D,
    ) -> (io::Result<u16>, Option<io::Result<u16>>) {
        let first = self.open_one(request.relay, request, driver);
        let additional = match (&first, request.additional) {
            (Ok(_), Some(relay)) => Some(self.open_one(relay, request, driver)),
            _ => None,
        };
        (first, additional)
    }

    /// Opens and watches socket `relay` of `request` (the family `relay` names); its port.
    fn open_one<D: Driver<Watch = W>>(
        &mut self,
        relay: RelayId,
        request: &RelayRequest,
        driver: &D,
    ) -> io::Result<u16> {
        let (socket, port) = relay_socket(relay.family(), request)?;
        let watched = driver.watch(socket, Token::Relay(relay), Interest::Datagrams)?;
        let index = relay.0 as usize;
        if self.sockets.len() <= index {
            self.sockets.resize_with(index + 1, || None);
        }
        self.sockets[index] = Some(Relay { watched, port });
        Ok(port)
    }

    /// The fd of `relay`'s socket, if it is open.
    pub(super) fn fd(&self, relay: RelayId) -> Option<RawFd> {
        self.sockets
            .get(relay.0 as usize)
            .and_then(Option::as_ref)
            .map(|relay| relay.watched.fd)
    }

    /// Makes the kernel offload relay `channels` (each with its listener's port) of allocation
    /// `relay`, and nothing else of it.
    pub(super) fn offload_channels(
        &mut self,
        relay: RelayId,
        channels: &[(OffloadChannel, u16)],
        now: std::time::Instant,
    ) {
        let port = self
            .sockets
            .get(relay.0 as usize)
            .and_then(Option::as_ref)
            .map(|r| r.port);
        if let (Some(table), Some(port)) = (self.offload.as_mut(), port) {
            table.set(relay, port, channels, now, &mut self.offload_deltas);
        }
    }

    /// Closes the sockets of every allocation `engine` has ended since the last call.
    pub(super) fn close_released(&mut self, engine: &mut Engine) {
        while let Some(relay) = engine.poll_close() {
            // The kernel stops relaying for it before its port can be reused.
            if let Some(table) = self.offload.as_mut() {
                table.forget(relay, &mut self.offload_deltas);
            }
            if let Some(slot) = self.sockets.get_mut(relay.0 as usize) {
                *slot = None;
            }
        }
    }

    /// Closes every relay socket.
    pub(super) fn clear(&mut self) {
        if let Some(table) = self.offload.as_mut() {
            for relay in 0..self.sockets.len() {
                table.forget(RelayId(relay as u32), &mut self.offload_deltas);
            }
        }
        self.sockets.clear();
    }
}
