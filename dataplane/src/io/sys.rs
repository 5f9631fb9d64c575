//! The raw system calls of the IO shell, each behind a safe function with its SAFETY argument,
//! so that the shard, its drivers, the launcher and the probe hold no `unsafe`. Datagram sends
//! and receives are not here: they are the batching crate's (`uturn_udp`: `recvmmsg`,
//! `sendmmsg`, `sendto` and the `msghdr`s they need). Errors come back as `io::Error`s; what
//! `EAGAIN` means is the caller's business.

use socket2::Socket;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The result of a call that returns `-1` and sets `errno` on failure.
fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// The result of a call that returns a length, or `-1` and sets `errno`.
fn check_len(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Accepts a connection on listening socket `listener`: a new non-blocking, close-on-exec
/// socket.
pub(super) fn accept(listener: RawFd) -> io::Result<Socket> {
    // SAFETY: plain syscall on a listening socket; no address is asked for.
    let fd = check(unsafe {
        libc::accept4(
            listener,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    })?;
    // SAFETY: accept4 returned a new fd that nothing else owns.
    Ok(unsafe { Socket::from_raw_fd(fd) })
}

/// Accepts one connection waiting on `listener` and closes it at once. `false` if none could
/// be accepted.
pub(super) fn accept_and_close(listener: RawFd) -> bool {
    // SAFETY: plain syscall on a listening socket; no address is asked for.
    let fd = unsafe {
        libc::accept4(
            listener,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return false;
    }
    // SAFETY: a new fd that nothing else owns; dropping it closes it.
    drop(unsafe { OwnedFd::from_raw_fd(fd) });
    true
}

/// Shuts both directions of connection `fd` down, which wakes whatever waits on it; the fd
/// stays open.
pub(super) fn shutdown(fd: RawFd) {
    // SAFETY: plain syscall on an fd; a closed one only gives EBADF, which nothing needs.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// One non-blocking `recv` on stream `fd`.
pub(super) fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length; MSG_DONTWAIT never blocks.
    check_len(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) })
}

/// One non-blocking `send` on stream `fd`; a closed peer is an error, not a SIGPIPE.
pub(super) fn send(fd: RawFd, data: &[u8]) -> io::Result<usize> {
    // SAFETY: `data` is valid for reads of its length.
    check_len(unsafe {
        libc::send(
            fd,
            data.as_ptr().cast(),
            data.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    })
}

/// Sets the `int` socket option `level`/`name` of `fd` to `value`.
pub(super) fn set_int_option(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: a c_int option value of the right size, valid for the call.
    check(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// The CPUs the calling thread may run on (`sched_getaffinity`).
/// The CLOCK_MONOTONIC time, nanoseconds (what `bpf_ktime_get_ns` reads, and what a journal's
/// deadlines are kept on).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub(super) fn cpu_affinity() -> io::Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is empty; the call fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is valid for writes of its size.
    check(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) })?;
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Restricts the calling thread to `cpu` (`sched_setaffinity`).
pub(super) fn set_cpu_affinity(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::other(format!("CPU {cpu} out of range")));
    }
    // SAFETY: an all-zero cpu_set_t is empty; CPU_SET stays within it for cpu < CPU_SETSIZE.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is valid for reads of its size.
    check(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) })
        .map(drop)
}

/// An epoll instance (closed on drop).
pub(super) struct EpollFd(OwnedFd);

impl EpollFd {
    /// A new, close-on-exec epoll instance.
    pub(super) fn new() -> io::Result<EpollFd> {
        // SAFETY: plain syscall; the result is checked.
        let fd = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: a new fd that nothing else owns.
        Ok(EpollFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// `epoll_ctl(op)` for `fd`, reporting `events` with `data`.
    pub(super) fn control(
        &self,
        op: libc::c_int,
        fd: RawFd,
        events: u32,
        data: u64,
    ) -> io::Result<()> {
        let mut event = libc::epoll_event { events, u64: data };
        // SAFETY: both fds are open; `event` is valid for the call.
        check(unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd, &mut event) }).map(drop)
    }

    /// Waits up to `timeout_ms` for events, filling the start of `events`; returns how many.
    pub(super) fn wait(
        &self,
        events: &mut [libc::epoll_event],
        timeout_ms: i32,
    ) -> io::Result<usize> {
        let room = events.len().min(i32::MAX as usize) as i32;
        // SAFETY: `events` has room for `room` entries.
        let n = check(unsafe {
            libc::epoll_wait(self.0.as_raw_fd(), events.as_mut_ptr(), room, timeout_ms)
        })?;
        Ok(n as usize)
    }
}
