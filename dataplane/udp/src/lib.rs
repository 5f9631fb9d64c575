//! Batched UDP syscalls: the one place uturn calls `recvmmsg`, `sendmmsg` and UDP GSO. The
//! dataplane's shards and the `perf/` tools (turnperf, udprelay) move their datagrams through
//! it. [`RecvBatch`] receives with `recvmmsg` into preallocated buffers; [`SendQueue`] is
//! flushed with one `sendmmsg` per run of datagrams on the same socket, consecutive datagrams
//! to one destination going as one UDP GSO message until the kernel refuses GSO, and one by
//! one for good after that. Everything is allocated once; receiving and sending allocate
//! nothing.
//!
//! A crate of its own beside the dataplane, as quinn-udp is beside quinn: the load generator
//! that measures a TURN server (coturn and pion as well as ours) gets the same batching
//! without building the server, and the `unsafe` of batched IO sits in this one module, each
//! block with its SAFETY argument.

use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;

/// Datagrams per `recvmmsg`/`sendmmsg` call.
pub const BATCH: usize = 32;
/// Room per datagram buffer by default: more than the dataplane's oversize limit for client
/// datagrams, so a datagram too big is seen as such rather than truncated silently. A queued
/// datagram larger than this is sent on its own ([`SendQueue::push`]).
const SLOT: usize = 2048;
/// The largest UDP payload (65 535 bytes less the IPv4 and UDP headers).
pub const MAX_UDP_PAYLOAD: usize = 65_507;

/// The kernel's form of a socket address, and its length.
#[derive(Clone, Copy)]
struct RawName {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl RawName {
    fn empty() -> RawName {
        RawName {
            // SAFETY: all-zero is a valid sockaddr_storage.
            storage: unsafe { std::mem::zeroed() },
            len: std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t,
        }
    }

    /// No address: a send on a connected socket goes to the address it is connected to (the
    /// kernel reads a zero-length name as none).
    fn connected() -> RawName {
        RawName {
            len: 0,
            ..RawName::empty()
        }
    }

    fn from_addr(addr: SocketAddr) -> RawName {
        let name = socket2::SockAddr::from(addr);
        let mut raw = RawName::empty();
        // SAFETY: `name` holds `name.len()` valid bytes, at most a sockaddr_storage.
        unsafe {
            std::ptr::copy_nonoverlapping(
                name.as_ptr().cast::<u8>(),
                (&mut raw.storage as *mut libc::sockaddr_storage).cast::<u8>(),
                name.len() as usize,
            );
        }
        raw.len = name.len();
        raw
    }

    /// Whether both name the same address.
    fn same(&self, other: &RawName) -> bool {
        let len = self.len as usize;
        len == other.len as usize && {
            // SAFETY: both storages hold at least `len` initialised bytes.
            let a = unsafe {
                std::slice::from_raw_parts(
                    (&self.storage as *const libc::sockaddr_storage).cast::<u8>(),
                    len,
                )
            };
            let b = unsafe {
                std::slice::from_raw_parts(
                    (&other.storage as *const libc::sockaddr_storage).cast::<u8>(),
                    len,
                )
            };
            a == b
        }
    }

    fn to_addr(self) -> Option<SocketAddr> {
        // SAFETY: the kernel wrote a socket address of `len` bytes into `storage`.
        unsafe { socket2::SockAddr::new(self.storage, self.len) }.as_socket()
    }
}

/// [`BATCH`] buffers of `slot` bytes each (one allocation), addresses and the `mmsghdr`s
/// that point at them.
struct Slots {
    bufs: Box<[u8]>,
    slot: usize,
    names: Box<[RawName]>,
    iovecs: Box<[libc::iovec]>,
    headers: Box<[libc::mmsghdr]>,
}

impl Slots {
    /// Buffers of `slot` bytes; each header's one iovec starts `offset` bytes into its buffer
    /// and is `len` long.
    fn new(slot: usize, offset: usize, len: usize) -> Slots {
        // Zeroed pages are only touched (and only count in RSS) once a datagram lands there.
        let mut bufs = vec![0u8; slot * BATCH].into_boxed_slice();
        let mut names = vec![RawName::empty(); BATCH].into_boxed_slice();
        let mut iovecs: Box<[libc::iovec]> = bufs
            .chunks_exact_mut(slot)
            .map(|b| libc::iovec {
                iov_base: b[offset..].as_mut_ptr().cast(),
                iov_len: len,
            })
            .collect();
        let headers = iovecs
            .iter_mut()
            .zip(names.iter_mut())
            .map(|(iov, name)| {
                // SAFETY: all-zero is a valid mmsghdr; the pointers set below point into boxed
                // slices that never move for the life of the batch.
                let mut header: libc::mmsghdr = unsafe { std::mem::zeroed() };
                header.msg_hdr.msg_iov = iov;
                header.msg_hdr.msg_iovlen = 1;
                header.msg_hdr.msg_name = (&mut name.storage as *mut libc::sockaddr_storage).cast();
                header
            })
            .collect();
        Slots {
            bufs,
            slot,
            names,
            iovecs,
            headers,
        }
    }
}

/// Up to [`BATCH`] received datagrams. Each lands `headroom` bytes into its buffer, so a
/// ChannelData header can be framed in front of it in place.
pub struct RecvBatch {
    bufs: Box<[u8]>,
    slot: usize,
    names: Box<[RawName]>,
    /// Pointed at by `headers`; kept alive, never read directly.
    _iovecs: Box<[libc::iovec]>,
    headers: Box<[libc::mmsghdr]>,
    count: usize,
}

/// One received datagram: its buffer (headroom included), length and source.
pub struct Datagram<'a> {
    /// The whole buffer; the datagram is `buf[headroom..headroom + len]`.
    pub buf: &'a mut [u8],
    /// Bytes received (the kernel's length: may exceed the buffer when truncated).
    pub len: usize,
    /// Set when the datagram did not fit.
    pub truncated: bool,
    /// Where it came from (`None` for an address family we do not handle).
    pub from: Option<SocketAddr>,
}

impl RecvBatch {
    /// Buffers for [`BATCH`] datagrams, each received after `headroom` bytes.
    pub fn new(headroom: usize) -> RecvBatch {
        RecvBatch::with_room(headroom, SLOT - headroom)
    }

    /// As [`RecvBatch::new`], with room for datagrams of up to `max_datagram` bytes (a larger
    /// one is flagged [`Datagram::truncated`]).
    pub fn with_room(headroom: usize, max_datagram: usize) -> RecvBatch {
        // One byte more than the largest datagram, so that one that fills it was larger.
        let slot = headroom + max_datagram + 1;
        let Slots {
            bufs,
            slot,
            names,
            iovecs,
            headers,
        } = Slots::new(slot, headroom, slot - headroom);
        RecvBatch {
            bufs,
            slot,
            names,
            _iovecs: iovecs,
            headers,
            count: 0,
        }
    }

    /// One non-blocking `recvmmsg` on `fd`: how many datagrams arrived (0 when none were
    /// waiting).
    pub fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        self.receive(fd, libc::MSG_DONTWAIT)
    }

    /// One `recvmmsg` on blocking socket `fd` that waits for the first datagram (or the
    /// socket's receive timeout) and then takes what else is waiting: how many arrived.
    pub fn recv_waiting(&mut self, fd: RawFd) -> io::Result<usize> {
        self.receive(fd, libc::MSG_WAITFORONE)
    }

    fn receive(&mut self, fd: RawFd, flags: libc::c_int) -> io::Result<usize> {
        self.count = 0;
        for header in self.headers.iter_mut() {
            header.msg_hdr.msg_namelen =
                std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            header.msg_hdr.msg_flags = 0;
            header.msg_len = 0;
        }
        // SAFETY: every header points at live buffers of the lengths it states.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                self.headers.as_mut_ptr(),
                BATCH as libc::c_uint,
                flags,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            let error = io::Error::last_os_error();
            return match error.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(error),
            };
        }
        self.count = n as usize;
        Ok(self.count)
    }

    /// Datagram `i` of the last [`RecvBatch::recv`].
    pub fn get(&mut self, i: usize) -> Datagram<'_> {
        debug_assert!(i < self.count);
        let header = &self.headers[i];
        let mut name = self.names[i];
        name.len = header.msg_hdr.msg_namelen;
        Datagram {
            len: header.msg_len as usize,
            truncated: header.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
            from: name.to_addr(),
            buf: &mut self.bufs[i * self.slot..(i + 1) * self.slot],
        }
    }
}

struct Queued {
    fd: RawFd,
    len: usize,
    /// Caller's tag, handed back with the outcome (a counter slot).
    tag: usize,
}

/// Datagrams waiting for one `sendmmsg` per run of the same socket.
pub struct SendQueue {
    bufs: Box<[u8]>,
    names: Box<[RawName]>,
    iovecs: Box<[libc::iovec]>,
    headers: Box<[libc::mmsghdr]>,
    queued: Vec<Queued>,
    /// One control buffer (a `UDP_SEGMENT` cmsg) per message.
    controls: Box<[[u64; 4]]>,
    /// The queued datagrams `start..end` each message of a flush carries.
    groups: Vec<(usize, usize)>,
    /// Whether GSO is used (until the kernel refuses it once).
    gso: bool,
    /// `sendmmsg`'s flags: `MSG_DONTWAIT` unless the queue [waits](SendQueue::waiting).
    flags: libc::c_int,
}

impl Default for SendQueue {
    fn default() -> Self {
        SendQueue::new()
    }
}

impl SendQueue {
    /// An empty queue with room for [`BATCH`] datagrams.
    pub fn new() -> SendQueue {
        let Slots {
            bufs,
            names,
            iovecs,
            headers,
            ..
        } = Slots::new(SLOT, 0, 0);
        SendQueue {
            bufs,
            names,
            iovecs,
            headers,
            queued: Vec::with_capacity(BATCH),
            controls: vec![[0u64; 4]; BATCH].into_boxed_slice(),
            groups: Vec::with_capacity(BATCH),
            gso: true,
            flags: libc::MSG_DONTWAIT,
        }
    }

    /// This queue, sending one datagram per message: never as UDP GSO.
    pub fn without_gso(mut self) -> SendQueue {
        self.gso = false;
        self
    }

    /// This queue, with sends that wait for room in a blocking socket's buffer (a load
    /// generator's backpressure) rather than fail with `WouldBlock`.
    pub fn waiting(mut self) -> SendQueue {
        self.flags = 0;
        self
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Queues a copy of `data` for `to` on `fd`. When the queue is full it is flushed first,
    /// reporting each outcome to `done` as in [`SendQueue::flush`]. A datagram larger than a
    /// slot (a jumbo datagram, or ChannelData a TCP client sent) goes out at once, after what
    /// is queued so that order holds: nothing is ever cut.
    pub fn push(
        &mut self,
        fd: RawFd,
        data: &[u8],
        to: SocketAddr,
        tag: usize,
        done: &mut impl FnMut(usize, io::Result<usize>),
    ) {
        self.push_to(fd, data, RawName::from_addr(to), tag, done);
    }

    /// As [`SendQueue::push`], for connected socket `fd`: the datagram goes to the address the
    /// socket is connected to.
    pub fn push_connected(
        &mut self,
        fd: RawFd,
        data: &[u8],
        tag: usize,
        done: &mut impl FnMut(usize, io::Result<usize>),
    ) {
        self.push_to(fd, data, RawName::connected(), tag, done);
    }

    fn push_to(
        &mut self,
        fd: RawFd,
        data: &[u8],
        to: RawName,
        tag: usize,
        done: &mut impl FnMut(usize, io::Result<usize>),
    ) {
        if self.queued.len() == BATCH || data.len() > SLOT {
            self.flush(done);
        }
        if data.len() > SLOT {
            let outcome = send_one(fd, data, &to, self.flags)
                .and_then(|sent| sent.ok_or_else(|| io::ErrorKind::WouldBlock.into()));
            done(tag, outcome);
            return;
        }
        let i = self.queued.len();
        let len = data.len();
        self.bufs[i * SLOT..i * SLOT + len].copy_from_slice(data);
        self.names[i] = to;
        self.iovecs[i].iov_len = len;
        self.queued.push(Queued { fd, len, tag });
    }

    /// Sends everything queued, one `sendmmsg` per run of datagrams on the same socket, and
    /// calls `done(tag, outcome)` once per datagram. Within a run, consecutive datagrams to
    /// the same destination of one size (the last may be shorter; a video frame, say) go as
    /// one UDP GSO message (`UDP_SEGMENT`): the kernel walks its send path once for all of
    /// them and the receiver still gets separate datagrams. A datagram the kernel refuses (a
    /// full socket buffer included) is not retried: UDP media is better late-dropped than
    /// queued behind a stalled socket.
    pub fn flush(&mut self, done: &mut impl FnMut(usize, io::Result<usize>)) {
        let total = self.queued.len();
        let mut start = 0;
        while start < total {
            let fd = self.queued[start].fd;
            let end = start
                + self.queued[start..]
                    .iter()
                    .take_while(|q| q.fd == fd)
                    .count();
            let groups = self.group(start, end);
            // SAFETY: headers 0..groups point at live buffers, names and controls set by
            // `group`.
            let sent = unsafe {
                libc::sendmmsg(
                    fd,
                    self.headers.as_mut_ptr(),
                    groups as libc::c_uint,
                    self.flags,
                )
            };
            let first = self.groups[0];
            if sent < 0 {
                let error = io::Error::last_os_error();
                let unsupported = matches!(
                    error.raw_os_error(),
                    Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
                );
                if first.1 - first.0 > 1 && self.gso && unsupported {
                    // This path cannot segment (no checksum offload, or too old a kernel):
                    // from now on, one datagram per message.
                    self.gso = false;
                    tracing::debug!(target: "stunner", "UDP GSO unavailable ({error}); sending datagrams one by one");
                    continue;
                }
                // The first message of the run failed: report it and go on with the next.
                for q in &self.queued[first.0..first.1] {
                    done(q.tag, Err(io::Error::from(error.kind())));
                }
                start = first.1;
                continue;
            }
            let sent = (sent as usize).min(groups);
            let through = if sent == 0 {
                for q in &self.queued[first.0..first.1] {
                    done(q.tag, Err(io::ErrorKind::WouldBlock.into()));
                }
                first.1
            } else {
                let through = self.groups[sent - 1].1;
                for q in &self.queued[start..through] {
                    done(q.tag, Ok(q.len));
                }
                through
            };
            start = through;
        }
        self.queued.clear();
    }

    /// Fills `headers[0..n]` with the messages for queued datagrams `start..end` (all on one
    /// socket) and `groups[0..n]` with the datagrams each carries; returns `n`.
    fn group(&mut self, start: usize, end: usize) -> usize {
        self.groups.clear();
        let mut i = start;
        while i < end {
            let size = self.queued[i].len;
            let mut j = i + 1;
            let mut bytes = size;
            while self.gso
                && j < end
                && j - i < GSO_SEGMENTS
                && self.queued[j - 1].len == size
                && self.queued[j].len <= size
                && self.queued[j].len > 0
                && bytes + self.queued[j].len <= GSO_BYTES
                && self.names[j].same(&self.names[i])
            {
                bytes += self.queued[j].len;
                j += 1;
            }
            let k = self.groups.len();
            let header = &mut self.headers[k].msg_hdr;
            header.msg_name = (&mut self.names[i].storage as *mut libc::sockaddr_storage).cast();
            header.msg_namelen = self.names[i].len;
            header.msg_iov = &mut self.iovecs[i];
            header.msg_iovlen = j - i;
            header.msg_flags = 0;
            if j - i > 1 {
                let control = &mut self.controls[k];
                // SAFETY: `control` is big and aligned enough for one cmsghdr carrying a u16.
                unsafe {
                    let cmsg = control.as_mut_ptr().cast::<libc::cmsghdr>();
                    (*cmsg).cmsg_level = SOL_UDP;
                    (*cmsg).cmsg_type = UDP_SEGMENT;
                    (*cmsg).cmsg_len = libc::CMSG_LEN(2) as _;
                    std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<u16>(), size as u16);
                    header.msg_control = control.as_mut_ptr().cast();
                    header.msg_controllen = libc::CMSG_SPACE(2) as _;
                }
            } else {
                header.msg_control = std::ptr::null_mut();
                header.msg_controllen = 0;
            }
            self.groups.push((i, j));
            i = j;
        }
        self.groups.len()
    }
}

/// One non-blocking `sendto` straight on the socket, outside any queue (in the dataplane, this
/// also skips the io_uring submission and completion round trip): the datagram is copied into
/// the kernel at once, so there is nothing to wait for. `Ok(None)` when the socket buffer is
/// full.
pub fn try_send_to(fd: RawFd, data: &[u8], to: SocketAddr) -> io::Result<Option<usize>> {
    send_one(fd, data, &RawName::from_addr(to), libc::MSG_DONTWAIT)
}

/// One `sendto` of `data` to `to` (none: the connected address) with `flags`; `Ok(None)` when
/// the socket buffer is full.
fn send_one(fd: RawFd, data: &[u8], to: &RawName, flags: libc::c_int) -> io::Result<Option<usize>> {
    // sendto(2) reads a name of length 0 as a bad address unless the pointer is null.
    let name = if to.len == 0 {
        std::ptr::null()
    } else {
        (&to.storage as *const libc::sockaddr_storage).cast()
    };
    // SAFETY: `data` is valid for reads of its length, and `name` is null or holds `to.len`
    // bytes of address.
    let sent = unsafe { libc::sendto(fd, data.as_ptr().cast(), data.len(), flags, name, to.len) };
    if sent < 0 {
        let error = io::Error::last_os_error();
        return match error.kind() {
            io::ErrorKind::WouldBlock => Ok(None),
            _ => Err(error),
        };
    }
    Ok(Some(sent as usize))
}

/// `SOL_UDP` and its `UDP_SEGMENT` option (linux/udp.h), for UDP GSO.
const SOL_UDP: libc::c_int = 17;
const UDP_SEGMENT: libc::c_int = 103;
/// Most segments and bytes in one GSO message (the kernel's UDP_MAX_SEGMENTS and a margin
/// under 64 KiB).
const GSO_SEGMENTS: usize = 64;
const GSO_BYTES: usize = 60_000;

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    #[test]
    fn receives_a_burst_in_one_call_and_sends_it_back_in_one() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        for i in 0..40u8 {
            client
                .send_to(&[i; 10], server.local_addr().unwrap())
                .unwrap();
        }
        let mut batch = RecvBatch::new(4);
        assert_eq!(batch.recv(server.as_raw_fd()).unwrap(), BATCH);
        let mut queue = SendQueue::new();
        let mut outcomes = Vec::new();
        for i in 0..BATCH {
            let d = batch.get(i);
            assert_eq!(d.len, 10);
            assert!(!d.truncated);
            assert_eq!(d.from, Some(client.local_addr().unwrap()));
            assert_eq!(&d.buf[4..14], &[i as u8; 10]);
            let data = d.buf[4..14].to_vec();
            queue.push(
                server.as_raw_fd(),
                &data,
                client.local_addr().unwrap(),
                i,
                &mut |tag, r| outcomes.push((tag, r.unwrap())),
            );
        }
        assert_eq!(batch.recv(server.as_raw_fd()).unwrap(), 8);
        assert_eq!(batch.recv(server.as_raw_fd()).unwrap(), 0);
        queue.flush(&mut |tag, r| outcomes.push((tag, r.unwrap())));
        assert_eq!(outcomes, (0..BATCH).map(|i| (i, 10)).collect::<Vec<_>>());
        let mut buf = [0u8; 64];
        for i in 0..BATCH as u8 {
            let (n, _) = client.recv_from(&mut buf).unwrap();
            assert_eq!(&buf[..n], &[i; 10]);
        }
    }

    #[test]
    fn a_run_to_one_destination_arrives_as_the_datagrams_it_was() {
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
                .unwrap();
        }
        // 5 × 300 B and a 120 B tail to a (one GSO message), 2 to b, 3 more to a of another size.
        let mut plan: Vec<(&UdpSocket, Vec<u8>)> = Vec::new();
        for i in 0..5u8 {
            plan.push((&a, vec![i; 300]));
        }
        plan.push((&a, vec![5; 120]));
        plan.push((&b, vec![6; 300]));
        plan.push((&b, vec![7; 300]));
        for i in 8..11u8 {
            plan.push((&a, vec![i; 200]));
        }
        let mut queue = SendQueue::new();
        let mut outcomes = Vec::new();
        for (i, (to, data)) in plan.iter().enumerate() {
            queue.push(
                sender.as_raw_fd(),
                data,
                to.local_addr().unwrap(),
                i,
                &mut |tag, r| outcomes.push((tag, r.unwrap())),
            );
        }
        queue.flush(&mut |tag, r| outcomes.push((tag, r.unwrap())));
        assert!(queue.gso, "the kernel refused UDP GSO on loopback");
        let want: Vec<(usize, usize)> = plan
            .iter()
            .enumerate()
            .map(|(i, p)| (i, p.1.len()))
            .collect();
        assert_eq!(outcomes, want);
        let mut buf = [0u8; 2048];
        for (to, data) in &plan {
            let n = to.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], &data[..], "datagrams arrive whole, in order");
        }
    }

    #[test]
    fn flags_a_datagram_larger_than_its_buffer() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .send_to(&[7u8; 3000], server.local_addr().unwrap())
            .unwrap();
        let mut batch = RecvBatch::new(0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(batch.recv(server.as_raw_fd()).unwrap(), 1);
        assert!(batch.get(0).truncated);
    }

    #[test]
    fn datagrams_larger_than_a_slot_go_whole_and_in_order() {
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = receiver.local_addr().unwrap();
        let plan: Vec<Vec<u8>> = [100usize, 3000, 100, 9000, 65_000, 1200]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 7 + j) as u8).collect())
            .collect();
        let mut queue = SendQueue::new();
        let mut outcomes = Vec::new();
        for (i, data) in plan.iter().enumerate() {
            queue.push(sender.as_raw_fd(), data, to, i, &mut |tag, r| {
                outcomes.push((tag, r.unwrap()))
            });
        }
        queue.flush(&mut |tag, r| outcomes.push((tag, r.unwrap())));
        let want: Vec<(usize, usize)> = plan.iter().map(Vec::len).enumerate().collect();
        assert_eq!(outcomes, want);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut batch = RecvBatch::with_room(4, MAX_UDP_PAYLOAD);
        let mut got = Vec::new();
        while got.len() < plan.len() {
            let n = batch.recv(receiver.as_raw_fd()).unwrap();
            assert!(n > 0, "datagrams missing: got {}", got.len());
            for i in 0..n {
                let d = batch.get(i);
                assert!(!d.truncated);
                got.push(d.buf[4..4 + d.len].to_vec());
            }
        }
        assert_eq!(got, plan, "every datagram whole, in the order queued");
    }

    #[test]
    fn a_connected_socket_sends_runs_and_jumbos_to_its_peer() {
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        receiver
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        sender.connect(receiver.local_addr().unwrap()).unwrap();
        // A GSO run of 4 × 500 B, a datagram larger than a slot, then one alone.
        let mut plan: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i; 500]).collect();
        plan.push(vec![4; 5000]);
        plan.push(vec![5; 80]);
        let mut queue = SendQueue::new();
        let mut outcomes = Vec::new();
        for (i, data) in plan.iter().enumerate() {
            queue.push_connected(sender.as_raw_fd(), data, i, &mut |tag, r| {
                outcomes.push((tag, r.unwrap()))
            });
        }
        queue.flush(&mut |tag, r| outcomes.push((tag, r.unwrap())));
        assert!(queue.gso, "the kernel refused UDP GSO on loopback");
        let want: Vec<(usize, usize)> = plan.iter().map(Vec::len).enumerate().collect();
        assert_eq!(outcomes, want);
        let mut buf = [0u8; 8192];
        for data in &plan {
            let (n, from) = receiver.recv_from(&mut buf).unwrap();
            assert_eq!(from, sender.local_addr().unwrap());
            assert_eq!(&buf[..n], &data[..], "datagrams arrive whole, in order");
        }
    }

    #[test]
    fn a_waiting_queue_without_gso_delivers_to_each_destination() {
        // turnperf's peer: a blocking socket, datagrams for destinations in turn.
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let receivers: Vec<UdpSocket> = (0..3)
            .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
            .collect();
        let mut queue = SendQueue::new().without_gso().waiting();
        let mut sent = 0;
        for i in 0..BATCH + 4 {
            let to = receivers[i % 3].local_addr().unwrap();
            queue.push(sender.as_raw_fd(), &[i as u8; 64], to, i, &mut |_, r| {
                sent += r.unwrap() / 64
            });
        }
        queue.flush(&mut |_, r| sent += r.unwrap() / 64);
        assert_eq!(sent, BATCH + 4);
        assert!(!queue.gso);
        let mut buf = [0u8; 128];
        for (k, receiver) in receivers.iter().enumerate() {
            receiver
                .set_read_timeout(Some(std::time::Duration::from_secs(2)))
                .unwrap();
            for i in (k..BATCH + 4).step_by(3) {
                let n = receiver.recv(&mut buf).unwrap();
                assert_eq!(&buf[..n], &[i as u8; 64]);
            }
        }
    }

    #[test]
    fn a_waiting_receive_blocks_for_the_first_datagram_only() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        server
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let to = server.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let client = UdpSocket::bind("127.0.0.1:0").unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
            for i in 0..3u8 {
                client.send_to(&[i; 20], to).unwrap();
            }
            client.local_addr().unwrap()
        });
        let mut batch = RecvBatch::with_room(0, 2047);
        let mut got = Vec::new();
        while got.len() < 3 {
            let n = batch.recv_waiting(server.as_raw_fd()).unwrap();
            assert!(n > 0, "timed out after {} datagrams", got.len());
            for i in 0..n {
                let d = batch.get(i);
                got.push((d.buf[..d.len].to_vec(), d.from));
            }
        }
        let from = Some(client.join().unwrap());
        let want: Vec<(Vec<u8>, Option<SocketAddr>)> =
            (0..3u8).map(|i| (vec![i; 20], from)).collect();
        assert_eq!(got, want);
    }
}
