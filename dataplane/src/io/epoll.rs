//! The epoll engine, for hosts where io_uring is blocked: one thread per shard waiting in
//! `epoll_wait` (level-triggered) on all of its sockets, with the same shard logic and the same
//! batched syscalls as the io_uring engine. Datagrams queued for clients during one wakeup go
//! out together, one `sendmmsg` per listener socket.

use super::shard::{Driver, Interest, Readiness, Shard, ShardSetup, Token, TICK};
use socket2::Socket;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Events taken per `epoll_wait`.
const EVENTS: usize = 64;

pub(super) struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new fd that nothing else owns.
        Ok(Epoll {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }
}

impl Driver for Epoll {
    /// Closing the socket removes it from the epoll set.
    type Watch = Socket;

    fn watch(
        &self,
        socket: Socket,
        token: Token,
        _interest: Interest,
    ) -> io::Result<(RawFd, Socket)> {
        let fd = socket.as_raw_fd();
        self.control(libc::EPOLL_CTL_ADD, fd, token, libc::EPOLLIN as u32)?;
        Ok((fd, socket))
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
        let mut event = libc::epoll_event {
            events,
            u64: token.to_u64(),
        };
        // SAFETY: both fds are open; `event` is valid for the call.
        let rc = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut event) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

pub(super) fn run(setup: ShardSetup) -> io::Result<()> {
    let driver = Epoll::new()?;
    let epfd = driver.fd.as_raw_fd();
    let mut shard = Shard::new(&setup, driver);
    // SAFETY: all-zero epoll_events are valid.
    let mut events: Vec<libc::epoll_event> = vec![unsafe { std::mem::zeroed() }; EVENTS];
    let mut next_tick = Instant::now();
    loop {
        let now = Instant::now();
        if now >= next_tick {
            if setup.stop.load(Ordering::Relaxed) {
                break;
            }
            shard.tick(&setup);
            next_tick = now + TICK;
        }
        let wait = next_tick.saturating_duration_since(now);
        let timeout = wait.as_millis().min(i32::MAX as u128) as i32 + 1;
        // SAFETY: `events` has room for EVENTS entries.
        let n = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), EVENTS as i32, timeout) };
        if n < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        for event in &events[..n as usize] {
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
