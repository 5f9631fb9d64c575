//! The relay sockets of a shard's allocations, by [`RelayId`]: opened when the engine asks for
//! one (an Allocate) and closed when it says an allocation ended.

use crate::io::driver::{Driver, Interest, Token, Watched};
use crate::io::socket::relay_socket;
use crate::proto::{Engine, RelayId, RelayRequest};
use std::io;
use std::os::fd::RawFd;

/// The relay sockets, indexed by [`RelayId`] (the engine reuses ids, so the table stays dense).
pub(super) struct Relays<W> {
    sockets: Vec<Option<Watched<W>>>,
}

impl<W> Relays<W> {
    /// No relay sockets.
    pub(super) fn new() -> Relays<W> {
        Relays {
            sockets: Vec::new(),
        }
    }

    /// Opens and watches the relay socket `request` asks for; its port.
    pub(super) fn open<D: Driver<Watch = W>>(
        &mut self,
        request: &RelayRequest,
        driver: &D,
    ) -> io::Result<u16> {
        let (socket, port) = relay_socket(request)?;
        let watched = driver.watch(socket, Token::Relay(request.relay), Interest::Datagrams)?;
        let slot = request.relay.0 as usize;
        if self.sockets.len() <= slot {
            self.sockets.resize_with(slot + 1, || None);
        }
        self.sockets[slot] = Some(watched);
        Ok(port)
    }

    /// The fd of `relay`'s socket, if it is open.
    pub(super) fn fd(&self, relay: RelayId) -> Option<RawFd> {
        self.sockets
            .get(relay.0 as usize)
            .and_then(Option::as_ref)
            .map(|watched| watched.fd)
    }

    /// Closes the sockets of every allocation `engine` has ended since the last call.
    pub(super) fn close_released(&mut self, engine: &mut Engine) {
        while let Some(relay) = engine.poll_close() {
            if let Some(slot) = self.sockets.get_mut(relay.0 as usize) {
                *slot = None;
            }
        }
    }

    /// Closes every relay socket.
    pub(super) fn clear(&mut self) {
        self.sockets.clear();
    }
}
