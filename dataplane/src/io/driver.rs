//! The contract between a shard and the IO backend that drives it ([`super::uring`] or
//! [`super::epoll`]). The backend only waits: the shard opens its sockets and hands each to
//! [`Driver::watch`] with a [`Token`]; the backend then calls the shard's `readable(token)`
//! when that socket has something, `flush()` after each wakeup's reads, and `tick()` every
//! [`TICK`]. Everything else (reading, writing, the TURN engine) is the shard's.

use crate::proto::{ListenerId, RelayId};
use socket2::Socket;
use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// How often a shard picks up a new snapshot, expires allocations and publishes counters.
pub(super) const TICK: Duration = Duration::from_millis(100);

/// Which socket a backend reports readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Token {
    /// Socket number `socket` of listener `id`.
    Listener { id: ListenerId, socket: u16 },
    /// An allocation's relay socket.
    Relay(RelayId),
    /// A TCP/TLS connection: its slot in the shard's connection table and the slot's
    /// generation, so that a report for an earlier connection in the slot is ignored.
    Conn { slot: u32, generation: u16 },
    /// The shard's sibling socket (second-chance forwarding between gateway pods).
    Sibling,
}

impl Token {
    const LISTENER: u64 = 1 << 63;
    const CONN: u64 = 1 << 62;
    /// Both high bits, which no listener or connection token has.
    const SIBLING: u64 = Token::LISTENER | Token::CONN;

    /// A number to register with a poller.
    pub(super) fn to_u64(self) -> u64 {
        match self {
            Token::Listener { id, socket } => {
                Token::LISTENER | (u64::from(id.0) << 16) | u64::from(socket)
            }
            Token::Relay(id) => u64::from(id.0),
            Token::Conn { slot, generation } => {
                Token::CONN | (u64::from(generation) << 32) | u64::from(slot)
            }
            Token::Sibling => Token::SIBLING,
        }
    }

    /// The token [`Token::to_u64`] made `raw` from.
    pub(super) fn from_u64(raw: u64) -> Token {
        if raw & Token::SIBLING == Token::SIBLING {
            Token::Sibling
        } else if raw & Token::LISTENER != 0 {
            Token::Listener {
                id: ListenerId((raw >> 16) as u32),
                socket: raw as u16,
            }
        } else if raw & Token::CONN != 0 {
            Token::Conn {
                slot: raw as u32,
                generation: (raw >> 32) as u16,
            }
        } else {
            Token::Relay(RelayId(raw as u32))
        }
    }
}

/// What a watched socket is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Interest {
    /// A UDP socket: report it when datagrams wait.
    Datagrams,
    /// A listening TCP socket: report it readable, and the shard accepts.
    Accept,
    /// A TCP connection: report it when bytes (or end of stream) wait, and when writable
    /// while [`Driver::want_writable`] asks.
    Stream,
}

/// A socket a backend watches: its fd, valid for as long as `watch` lives.
pub(super) struct Watched<W> {
    /// The socket's fd, for the shard's own syscalls.
    pub fd: RawFd,
    /// Keeps the socket reported (see [`Driver::Watch`]).
    pub watch: W,
}

/// What an IO backend provides: readiness reports for the sockets a shard opens.
pub(super) trait Driver {
    /// Keeps a watched socket reported. Dropping it stops the reports and closes the socket.
    type Watch;

    /// Starts reporting `socket` (non-blocking) as `token`.
    fn watch(
        &self,
        socket: Socket,
        token: Token,
        interest: Interest,
    ) -> io::Result<Watched<Self::Watch>>;

    /// Asks for (`on`) or stops asking for reports that stream `token` can take more bytes:
    /// the shard's `readable(token)` then writes what is queued.
    fn want_writable(&self, fd: RawFd, token: Token, on: bool);
}

/// Whether a readable socket was emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Readiness {
    /// The socket had nothing more.
    Drained,
    /// The shard stopped after a few full batches, so as to serve its other sockets; more is
    /// probably waiting.
    More,
    /// The socket is gone (a stream closed): stop watching it.
    Closed,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_survive_the_poller() {
        for token in [
            Token::Listener {
                id: ListenerId(u32::MAX >> 1),
                socket: u16::MAX,
            },
            Token::Listener {
                id: ListenerId(1),
                socket: 0,
            },
            Token::Relay(RelayId(u32::MAX)),
            Token::Relay(RelayId(0)),
            Token::Conn {
                slot: u32::MAX,
                generation: u16::MAX,
            },
            Token::Conn {
                slot: 0,
                generation: 1,
            },
            Token::Sibling,
        ] {
            assert_eq!(Token::from_u64(token.to_u64()), token);
        }
    }
}
