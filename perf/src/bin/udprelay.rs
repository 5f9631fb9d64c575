//! udprelay: the "no TURN" reference for perf/compare.sh, a plain UDP relay with batched
//! syscalls (recvmmsg/sendmmsg, 32 per call) and nothing else. It is the practical ceiling of
//! relaying a datagram on this machine: what a TURN server costs is measured against it.
//!
//! Clients send to the listen port; their first datagram `UTPF-CLIENT <index>` registers them.
//! The peer registers with `UTPF-PEER` on the relay port. Then client datagrams go to the peer
//! from the relay port, and peer datagrams go back to the client whose index the payload
//! carries (turnperf's timing header), one thread per direction.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::{Arc, RwLock};
use uturn_udp::{RecvBatch, SendQueue};

/// The largest datagram relayed whole (turnperf's carry at most 1400 bytes of payload).
const SIZE: usize = 2048;

/// Sends each of the `count` datagrams in `batch` that `route` gives a destination to from
/// `out_fd`, all in one flush. `route` sees the payload and its source.
fn forward(
    batch: &mut RecvBatch,
    count: usize,
    out_fd: i32,
    queue: &mut SendQueue,
    mut route: impl FnMut(&[u8], Option<SocketAddr>) -> Option<SocketAddr>,
) {
    let mut ignore = |_, _| {};
    for i in 0..count {
        let datagram = batch.get(i);
        let data = &datagram.buf[..datagram.len.min(datagram.buf.len())];
        if let Some(to) = route(data, datagram.from) {
            queue.push(out_fd, data, to, 0, &mut ignore);
        }
    }
    queue.flush(&mut ignore);
}

/// How this relay has always sent, so that compare.sh's ceiling stays comparable with earlier
/// results: blocking (a full socket buffer holds the relay back rather than drops) and one
/// datagram per message (no UDP GSO).
fn queue() -> SendQueue {
    SendQueue::new().without_gso().waiting()
}

fn main() {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3478".into());
    let listener = UdpSocket::bind(&listen).expect("cannot bind the listen address");
    let relay = UdpSocket::bind((listener.local_addr().unwrap().ip(), 0)).unwrap();
    println!(
        "udprelay: listen {} relay {}",
        listener.local_addr().unwrap(),
        relay.local_addr().unwrap()
    );
    let clients: Arc<RwLock<Vec<Option<SocketAddr>>>> = Arc::new(RwLock::new(Vec::new()));
    let peer: Arc<RwLock<Option<SocketAddr>>> = Arc::new(RwLock::new(None));
    let (lfd, rfd) = (listener.as_raw_fd(), relay.as_raw_fd());
    let up = {
        let (clients, peer) = (clients.clone(), peer.clone());
        std::thread::spawn(move || {
            let (mut batch, mut queue) = (RecvBatch::with_room(0, SIZE), queue());
            loop {
                let count = batch.recv_waiting(lfd).unwrap_or(0);
                let target = *peer.read().unwrap();
                forward(&mut batch, count, rfd, &mut queue, |data, from| {
                    if let Some(index) = data.strip_prefix(b"UTPF-CLIENT ") {
                        let index: usize = std::str::from_utf8(index)
                            .ok()
                            .and_then(|s| s.trim().parse().ok())
                            .unwrap_or(0);
                        if let Some(addr) = from {
                            let mut c = clients.write().unwrap();
                            if c.len() <= index {
                                c.resize(index + 1, None);
                            }
                            c[index] = Some(addr);
                        }
                        return None;
                    }
                    target
                });
            }
        })
    };
    let (mut batch, mut queue) = (RecvBatch::with_room(0, SIZE), queue());
    loop {
        let count = batch.recv_waiting(rfd).unwrap_or(0);
        let c = clients.read().unwrap();
        forward(&mut batch, count, lfd, &mut queue, |data, from| {
            if data.starts_with(b"UTPF-PEER") {
                if let Some(addr) = from {
                    *peer.write().unwrap() = Some(addr);
                }
                return None;
            }
            // turnperf's header: "UTPF", then the allocation index.
            let index = data
                .get(4..8)
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize);
            index.and_then(|i| c.get(i)).copied().flatten()
        });
        drop(c);
        if up.is_finished() {
            break;
        }
    }
}
