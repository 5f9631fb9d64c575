//! Sending: [`SendQueue`], datagrams copied into buffers allocated once and flushed with one
//! `sendmmsg` per run of datagrams on the same socket (consecutive datagrams to one destination
//! as one UDP GSO message, see `gso.rs`), and [`try_send_to`], one datagram at once.

use crate::gso::{Control, Gso};
use crate::name::{RawName, Slots};
use crate::{BATCH, SLOT};
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;

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
    controls: Box<[Control]>,
    /// The queued datagrams `start..end` each message of a flush carries.
    groups: Vec<(usize, usize)>,
    /// Whether runs go as GSO messages (until the kernel refuses it once).
    gso: Gso,
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
            gso: Gso::new(true),
            flags: libc::MSG_DONTWAIT,
        }
    }

    /// This queue, sending one datagram per message: never as UDP GSO.
    pub fn without_gso(mut self) -> SendQueue {
        self.gso = Gso::new(false);
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
                if self.gso.refused(&error, first.1 - first.0) {
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
            let (queued, names) = (&self.queued, &self.names);
            let j = self
                .gso
                .message_end(i, end, |k| queued[k].len, |k| names[k].same(&names[i]));
            let k = self.groups.len();
            let header = &mut self.headers[k].msg_hdr;
            header.msg_name = (&mut self.names[i].storage as *mut libc::sockaddr_storage).cast();
            header.msg_namelen = self.names[i].len;
            header.msg_iov = &mut self.iovecs[i];
            header.msg_iovlen = j - i;
            header.msg_flags = 0;
            Gso::set_segment(header, &mut self.controls[k], j - i, self.queued[i].len);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RecvBatch, MAX_UDP_PAYLOAD};
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

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
        assert!(queue.gso.is_on(), "the kernel refused UDP GSO on loopback");
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
        assert!(queue.gso.is_on(), "the kernel refused UDP GSO on loopback");
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
        assert!(!queue.gso.is_on());
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
}
