//! The epoll backend, for hosts where io_uring is blocked: one thread per shard waiting in
//! `epoll_wait` (level-triggered) on all of its sockets, with the same shard logic and the same
//! batched syscalls as the io_uring backend. Datagrams queued for clients during one wakeup go
//! out together, one `sendmmsg` per listener socket.

use super::driver::{Driver, Interest, Readiness, Token, Watched};
use super::shard::{Shard, ShardSetup};
use super::sys::EpollFd;
use socket2::Socket;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

/// Events taken per `epoll_wait`.
const EVENTS: usize = 64;

pub(super) struct Epoll {
    epoll: EpollFd,
}

impl Driver for Epoll {
    /// Closing the socket removes it from the epoll set.
    type Watch = Socket;

    fn watch(
        &self,
        socket: Socket,
        token: Token,
        _interest: Interest,
    ) -> io::Result<Watched<Socket>> {
        let fd = socket.as_raw_fd();
        self.control(libc::EPOLL_CTL_ADD, fd, token, libc::EPOLLIN as u32)?;
        Ok(Watched { fd, watch: socket })
    }

    fn want_writable(&self, fd: RawFd, token: Token, on: bool) {
        let events = if on {
            (libc::EPOLLIN | libc::EPOLLOUT) as u32
        } else {
            libc::EPOLLIN as u32
        };
        if let Err(e) = self.control(libc::EPOLL_CTL_MOD, fd, token, events) {
            tracing::debug!(target: "stunner", "epoll_ctl failed: {e}");
        }
    }
}

impl Epoll {
    fn control(&self, op: libc::c_int, fd: RawFd, token: Token, events: u32) -> io::Result<()> {
        self.epoll.control(op, fd, events, token.to_u64())
    }
}

pub(super) fn run(setup: ShardSetup) -> io::Result<()> {
    let mut shard = Shard::new(
        &setup,
        Epoll {
            epoll: EpollFd::new()?,
        },
    );
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; EVENTS];
    let mut next_tick = Instant::now();
    loop {
        if !shard.tick_if_due(&setup, &mut next_tick) {
            break;
        }
        let wait = next_tick.saturating_duration_since(Instant::now());
        let timeout = wait.as_millis().min(i32::MAX as u128) as i32 + 1;
        let n = match shard.driver().epoll.wait(&mut events, timeout) {
            Ok(n) => n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        };
        for event in &events[..n] {
            let token = Token::from_u64(event.u64);
            // Level-triggered: a socket left with data (Readiness::More) is reported again;
            // a closed stream left the set when the shard dropped its socket.
            let _: Readiness = shard.readable(token);
        }
        shard.flush();
    }
    shard.shutdown(&setup.stats[setup.index]);
    Ok(())
}
