//! Receiving: [`RecvBatch`], up to [`BATCH`] datagrams per `recvmmsg` into buffers allocated
//! once, each landing after a headroom so that a header can be framed in front of it in place.

use crate::name::{RawName, Slots};
use crate::{BATCH, SLOT};
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SendQueue;
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
