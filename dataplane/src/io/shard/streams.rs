//! The shard's TURN-TCP and TURN-TLS connections: accepted on a stream listener, read and
//! written when ready, their frames handed to [`Shard::handle_turn`], and closed with the
//! allocation they carried (RFC 8656 §3.1).

use super::{Closed, Shard};
use crate::io::driver::{Driver, Readiness};
use crate::proto::{ArrivalKind, ListenerId};
use std::time::Instant;

impl<D: Driver> Shard<D> {
    /// Writes what connection `slot` has queued; closes it if that fails.
    pub(super) fn flush_conn(&mut self, slot: u32) {
        if let Err(why) = self.conns.flush(slot, &self.driver) {
            self.close_conn(slot, Some(why));
        }
    }

    /// Accepts what waits on stream listener `id`'s socket `n`.
    pub(super) fn accept_ready(&mut self, id: ListenerId, n: usize) -> Readiness {
        let Some(listener) = self.listeners.get(id) else {
            return Readiness::Drained;
        };
        let (driver, counters, log) = (&self.driver, &mut self.counters, &mut self.resource_log);
        let accepted = self
            .conns
            .accept(listener, n, driver, counters, log, self.index);
        for slot in accepted.replaced {
            self.close_conn(slot, None);
        }
        accepted.readiness
    }

    /// Connection `slot` is readable (or writable): writes what is queued, then reads and
    /// handles every complete frame.
    pub(super) fn conn_ready(&mut self, slot: u32, generation: u16) -> Readiness {
        if !self.conns.is_current(slot, generation) {
            return Readiness::Closed;
        }
        if self.conns.pending(slot) > 0 {
            self.flush_conn(slot);
        }
        let Some(mut scratch) = self.scratch.take() else {
            return Readiness::Drained;
        };
        let outcome = self.conn_read(slot, &mut scratch);
        self.scratch = Some(scratch);
        self.datagrams.flush_to_peers(&mut self.counters);
        self.relays.close_released(&mut self.engine);
        match outcome {
            Ok(()) => Readiness::Drained,
            Err(why) => {
                self.close_conn(slot, Some(why));
                Readiness::Closed
            }
        }
    }

    /// Reads connection `slot` and hands every complete frame to the engine, queueing the
    /// replies on the connection.
    fn conn_read(&mut self, slot: u32, scratch: &mut [u8]) -> Result<(), Closed> {
        let now = Instant::now();
        let Some(mut read) = self.conns.read(slot, scratch, now) else {
            return Err(Closed::Error);
        };
        loop {
            let range = match read.rx.next_frame() {
                Ok(Some(range)) => range,
                Ok(None) => break,
                Err(why) => {
                    self.counters.unparsed += 1;
                    read.outcome = Err(why);
                    break;
                }
            };
            let frame = &read.rx.bytes()[range];
            self.counters.listener_rx_packets += 1;
            self.counters.listeners.traffic[read.metric].rx(frame.len());
            if let Some(n) = self.handle_turn(
                now,
                read.listener,
                read.client,
                frame,
                ArrivalKind::Straight,
            ) {
                if self.conns.queue(slot, &self.out[..n]) {
                    self.counters.listeners.traffic[read.metric].tx(n);
                } else {
                    self.counters.send_failed += 1;
                }
            }
        }
        self.conns.finish_read(slot, read.rx, &self.engine);
        read.outcome
    }

    /// Closes connection `slot` and frees its allocation (`why`: logged when given).
    pub(super) fn close_conn(&mut self, slot: u32, why: Option<Closed>) {
        if let Some((listener, client)) = self.conns.close(slot, why) {
            self.engine.close_client(listener, client);
            self.relays.close_released(&mut self.engine);
        }
    }
}
