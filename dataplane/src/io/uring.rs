//! The io_uring backend: one ring per shard thread, used as a readiness notifier. The shard
//! reads a ready socket with its batched syscalls (`recvmmsg`, `accept4`, `read`).
//!
//! Datagram sockets (listeners and relays: the per-packet path) have a multishot `POLL_ADD`,
//! armed once: it completes every time datagrams arrive and stays armed, so serving a packet
//! submits nothing. That is edge-triggered, which is sound because the shard reads a datagram
//! socket until `recvmmsg` returns a short batch (the queue was empty then; whatever arrives
//! later completes the poll again) or says it has more ([`Readiness::More`]).
//!
//! Stream sockets and stream listeners (whose reads may leave bytes behind) have a one-shot poll,
//! armed again in the same `io_uring_enter` that waits for the next completions once the shard
//! has served them; a one-shot poll armed on a socket that still holds data completes at once,
//! which gives the level-triggered contract of the epoll backend. A multishot poll the kernel
//! ends (its completion without `IORING_CQE_F_MORE`) is armed again the same way.
//!
//! A socket's poll holds a reference to it in the kernel: closing the fd alone would leave the
//! socket (and its port) open until the poll completed. Dropping a [`UringWatch`] therefore
//! cancels its polls (`ASYNC_CANCEL`, submitted at once) before the fd is closed. Not
//! `POLL_REMOVE`: that fails with `EALREADY` when the poll's wakeup is already queued (a
//! datagram arrived since the last wait) and leaves a multishot poll armed, holding the closed
//! socket in its port's SO_REUSEPORT group for good, a sink for every client hashed to it.

use super::driver::{Driver, Interest, Readiness, Token, Watched};
use super::shard::{Shard, ShardSetup};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use socket2::Socket;
use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::time::Instant;

/// Submission queue entries per ring (the completion queue has twice as many; the kernel
/// keeps completions that do not fit instead of dropping them).
pub(super) const RING_ENTRIES: u32 = 1024;

/// The `user_data` of requests whose completions mean nothing (poll cancels).
const IGNORED: u64 = u64::MAX;
/// `io_uring_enter`'s flag to reap completions (and run deferred task work).
const IORING_ENTER_GETEVENTS: u32 = 1;
/// Marks a writability poll's `user_data`.
const WRITE: u64 = 1 << 63;
/// Generations take the 31 bits of `user_data` between the fd and [`WRITE`].
const GENERATION_MASK: u32 = 0x7fff_ffff;

/// What a watched socket is polled for.
#[derive(Debug, Clone, Copy)]
struct Entry {
    token: Token,
    /// Tells a completion for this socket from one for an earlier socket with the same fd.
    generation: u32,
    readable_mask: u32,
    /// The read poll is multishot (datagram sockets).
    multishot: bool,
    read_armed: bool,
    write_armed: bool,
    /// Waiting in this wakeup's list for the shard (so it is handed over once).
    queued: bool,
}

/// The ring and the sockets it watches, indexed by fd.
struct Ring {
    ring: IoUring,
    watched: Vec<Option<Entry>>,
    next_generation: u32,
}

impl Ring {
    fn slot(&mut self, fd: RawFd) -> Option<&mut Option<Entry>> {
        self.watched.get_mut(usize::try_from(fd).ok()?)
    }

    fn entry(&mut self, fd: RawFd, generation: u32) -> Option<&mut Entry> {
        self.slot(fd)?
            .as_mut()
            .filter(|e| e.generation == generation)
    }

    /// Queues `entry` (waiting for the next submit; submits first if the queue is full).
    fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: the entries are polls and cancels, which point at no memory of ours.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return;
            }
            if let Err(e) = self.ring.submit() {
                if !transient(&e) {
                    tracing::warn!(target: "stunner", "io_uring submit failed: {e}");
                    return;
                }
            }
        }
    }

    /// Arms the one-shot poll of `fd` for reading or for writing, unless it is armed or the
    /// socket is gone (`generation`: `None` for whichever socket has the fd now).
    fn arm(&mut self, fd: RawFd, generation: Option<u32>, write: bool) {
        let Some(entry) = self
            .slot(fd)
            .and_then(Option::as_mut)
            .filter(|e| generation.is_none_or(|g| e.generation == g))
        else {
            return;
        };
        let armed = if write {
            &mut entry.write_armed
        } else {
            &mut entry.read_armed
        };
        if *armed {
            return;
        }
        *armed = true;
        let mask = if write {
            libc::POLLOUT as u32
        } else {
            entry.readable_mask
        };
        let poll = opcode::PollAdd::new(types::Fd(fd), mask)
            .multi(entry.multishot && !write)
            .build()
            .user_data(user_data(fd, entry.generation, write));
        self.push(&poll);
    }

    /// Stops watching `fd`: cancels its polls, in the kernel before this returns.
    fn forget(&mut self, fd: RawFd, generation: u32) {
        let Some(entry) = self
            .slot(fd)
            .and_then(|slot| slot.take_if(|e| e.generation == generation))
        else {
            return;
        };
        let mut removed = false;
        for (armed, write) in [(entry.read_armed, false), (entry.write_armed, true)] {
            if armed {
                // Marks the poll cancelled even while its wakeup is queued; the task work
                // run below (or the queued one) then completes it.
                let cancel = opcode::AsyncCancel::new(user_data(fd, generation, write))
                    .build()
                    .user_data(IGNORED);
                self.push(&cancel);
                removed = true;
            }
        }
        if removed {
            // Submits the cancels and runs the task work that completes the cancelled polls
            // (deferred until a GETEVENTS enter), which drops their hold on the socket: the
            // fd closed after this closes the socket itself, and a listener reopened on the
            // same port at once finds it free.
            let pending = self.ring.submission().len() as u32;
            // SAFETY: no wait argument; the queued entries were pushed through `push`.
            let entered = unsafe {
                self.ring.submitter().enter::<libc::sigset_t>(
                    pending,
                    0,
                    IORING_ENTER_GETEVENTS,
                    None,
                )
            };
            if let Err(e) = entered {
                tracing::warn!(target: "stunner", "io_uring submit failed: {e}");
            }
        }
    }
}

fn user_data(fd: RawFd, generation: u32, write: bool) -> u64 {
    let data = (u64::from(generation) << 32) | u64::from(fd as u32);
    if write {
        data | WRITE
    } else {
        data
    }
}

/// The fd, generation and direction in a completion's `user_data`.
fn from_user_data(data: u64) -> (RawFd, u32, bool) {
    (
        data as u32 as RawFd,
        ((data >> 32) as u32) & GENERATION_MASK,
        data & WRITE != 0,
    )
}

/// Errors of `io_uring_enter` after which the loop just goes on.
fn transient(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY | libc::ETIME)
    )
}

pub(super) struct Uring {
    ring: Rc<RefCell<Ring>>,
}

/// A watched socket: dropping it removes its polls, then closes it.
pub(super) struct UringWatch {
    ring: Rc<RefCell<Ring>>,
    fd: RawFd,
    generation: u32,
    /// Closed after the polls are cancelled (fields drop after `drop` runs).
    _socket: Socket,
}

impl Drop for UringWatch {
    fn drop(&mut self) {
        if let Ok(mut ring) = self.ring.try_borrow_mut() {
            ring.forget(self.fd, self.generation);
        }
    }
}

impl Driver for Uring {
    type Watch = UringWatch;

    fn watch(
        &self,
        socket: Socket,
        token: Token,
        interest: Interest,
    ) -> io::Result<Watched<UringWatch>> {
        let fd = socket.as_raw_fd();
        let index = usize::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
        let readable_mask = match interest {
            Interest::Datagrams | Interest::Accept => libc::POLLIN,
            Interest::Stream => libc::POLLIN | libc::POLLRDHUP,
        } as u32;
        let mut ring = self.ring.borrow_mut();
        let generation = ring.next_generation;
        ring.next_generation = generation.wrapping_add(1) & GENERATION_MASK;
        if ring.watched.len() <= index {
            ring.watched.resize(index + 1, None);
        }
        ring.watched[index] = Some(Entry {
            token,
            generation,
            readable_mask,
            multishot: matches!(interest, Interest::Datagrams),
            read_armed: false,
            write_armed: false,
            queued: false,
        });
        ring.arm(fd, Some(generation), false);
        Ok(Watched {
            fd,
            watch: UringWatch {
                ring: self.ring.clone(),
                fd,
                generation,
                _socket: socket,
            },
        })
    }

    fn want_writable(&self, fd: RawFd, _token: Token, on: bool) {
        // A poll left armed after the bytes went out costs one spurious report, which the
        // shard's read handles; removing it would cost a syscall every time.
        if on {
            self.ring.borrow_mut().arm(fd, None, true);
        }
    }
}

/// A socket to hand to the shard: its fd and generation (to re-arm its poll) and token.
#[derive(Debug, Clone, Copy)]
struct Ready {
    fd: RawFd,
    generation: u32,
    token: Token,
}

/// A shard's ring. Completions are processed only when the shard asks for them (deferred task
/// work, Linux 6.1) and never interrupt it (cooperative task work, 5.19), so a busy shard is
/// not preempted for every packet that arrives; older kernels get a plain ring.
pub(super) fn new_ring() -> io::Result<IoUring> {
    let mut error = None;
    for tuning in [Tuning::Deferred, Tuning::Cooperative, Tuning::Plain] {
        let mut builder = IoUring::builder();
        match tuning {
            Tuning::Deferred => {
                builder
                    .setup_single_issuer()
                    .setup_defer_taskrun()
                    .setup_coop_taskrun()
                    .setup_taskrun_flag();
            }
            Tuning::Cooperative => {
                builder.setup_coop_taskrun().setup_taskrun_flag();
            }
            Tuning::Plain => {}
        }
        match builder.build(RING_ENTRIES) {
            Ok(ring) => return Ok(ring),
            // An older kernel refuses flags it does not know.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => error = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(error.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EINVAL)))
}

#[derive(Clone, Copy)]
enum Tuning {
    Deferred,
    Cooperative,
    Plain,
}

pub(super) fn run(setup: ShardSetup) -> io::Result<()> {
    let ring = new_ring()?;
    let ring = Rc::new(RefCell::new(Ring {
        ring,
        watched: Vec::new(),
        next_generation: 0,
    }));
    let mut shard = Shard::new(&setup, Uring { ring: ring.clone() });
    let mut completions: Vec<(u64, bool)> = Vec::with_capacity(RING_ENTRIES as usize);
    let mut ready: Vec<Ready> = Vec::with_capacity(RING_ENTRIES as usize);
    // Sockets the shard left with data (it serves the others before coming back).
    let mut more: Vec<Ready> = Vec::new();
    let mut next_tick = Instant::now();
    loop {
        if !shard.tick_if_due(&setup, &mut next_tick) {
            break;
        }
        {
            let mut ring = ring.borrow_mut();
            let result = if more.is_empty() {
                let wait = next_tick.saturating_duration_since(Instant::now());
                let timeout = types::Timespec::from(wait);
                let args = types::SubmitArgs::new().timespec(&timeout);
                ring.ring.submitter().submit_with_args(1, &args)
            } else {
                ring.ring.submit()
            };
            if let Err(error) = result {
                if !transient(&error) {
                    return Err(error);
                }
            }
            completions.clear();
            completions.extend(
                ring.ring
                    .completion()
                    .map(|c: cqueue::Entry| (c.user_data(), cqueue::more(c.flags()))),
            );
            ready.clear();
            for &(data, armed) in &completions {
                if data == IGNORED {
                    continue;
                }
                let (fd, generation, write) = from_user_data(data);
                let Some(entry) = ring.entry(fd, generation) else {
                    continue;
                };
                // A multishot poll stays armed until a completion without F_MORE.
                if write {
                    entry.write_armed = armed;
                } else {
                    entry.read_armed = armed;
                }
                // Any completion of a live socket's poll, errors included, lets the shard
                // look: its read tells what happened, and the poll is armed again.
                if !entry.queued {
                    entry.queued = true;
                    ready.push(Ready {
                        fd,
                        generation,
                        token: entry.token,
                    });
                }
            }
        }
        // Those the shard left with data were queued already.
        ready.append(&mut more);
        for r in ready.drain(..) {
            match ring.borrow_mut().entry(r.fd, r.generation) {
                Some(entry) => entry.queued = false,
                // Closed meanwhile (its fd may already serve another socket).
                None => continue,
            }
            match shard.readable(r.token) {
                Readiness::More => {
                    if let Some(entry) = ring.borrow_mut().entry(r.fd, r.generation) {
                        entry.queued = true;
                        more.push(r);
                    }
                }
                Readiness::Drained => ring.borrow_mut().arm(r.fd, Some(r.generation), false),
                Readiness::Closed => {}
            }
        }
        shard.flush();
    }
    shard.shutdown(&setup.stats[setup.index]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::RelayId;
    use socket2::{Domain, Protocol, Type};
    use std::net::{SocketAddr, UdpSocket};

    fn ring() -> Uring {
        Uring {
            ring: Rc::new(RefCell::new(Ring {
                ring: new_ring().expect("an io_uring"),
                watched: Vec::new(),
                next_generation: 0,
            })),
        }
    }

    /// A socket in a SO_REUSEPORT group on a free loopback port, as a listener's.
    fn reuseport_socket() -> (Socket, SocketAddr) {
        let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).unwrap();
        socket.set_reuse_port(true).unwrap();
        socket
            .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        (socket, addr)
    }

    /// A closed socket leaves its port even when a datagram woke its poll and the shard has
    /// not waited since (its wakeup is queued): `POLL_REMOVE` refused that case with
    /// `EALREADY` and the multishot poll kept the socket, and its port, for good.
    #[test]
    fn a_socket_closed_with_a_wakeup_queued_leaves_its_port() {
        for datagrams in [0, 1, 64] {
            let uring = ring();
            let (socket, addr) = reuseport_socket();
            let watched = uring
                .watch(socket, Token::Relay(RelayId(7)), Interest::Datagrams)
                .unwrap();
            uring.ring.borrow_mut().ring.submit().unwrap();
            let client = UdpSocket::bind("127.0.0.1:0").unwrap();
            for _ in 0..datagrams {
                client.send_to(b"queued", addr).unwrap();
            }
            drop(watched);
            // The cancellation completes in the kernel's time: the port is free within moments
            // (before the fix it stayed held for good).
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
            let mut freed = UdpSocket::bind(addr).is_ok();
            while !freed && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
                freed = UdpSocket::bind(addr).is_ok();
            }
            assert!(
                freed,
                "port {} still held 500 ms after closing with {datagrams} datagrams queued",
                addr.port()
            );
        }
    }
}
