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

const BATCH: usize = 32;

/// A socket address as the kernel takes it, with its length.
type Name = (libc::sockaddr_storage, u32);
const SIZE: usize = 2048;

fn to_storage(addr: SocketAddr) -> (libc::sockaddr_storage, u32) {
    // SAFETY: all-zero is a valid sockaddr_storage; the writes below fit in it.
    unsafe {
        let mut storage: libc::sockaddr_storage = std::mem::zeroed();
        match addr {
            SocketAddr::V4(v4) => {
                let sin =
                    &mut *(&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>();
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_port = v4.port().to_be();
                sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
                (storage, std::mem::size_of::<libc::sockaddr_in>() as u32)
            }
            SocketAddr::V6(v6) => {
                let sin6 = &mut *(&mut storage as *mut libc::sockaddr_storage)
                    .cast::<libc::sockaddr_in6>();
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_port = v6.port().to_be();
                sin6.sin6_addr.s6_addr = v6.ip().octets();
                (storage, std::mem::size_of::<libc::sockaddr_in6>() as u32)
            }
        }
    }
}

fn from_storage(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: the family tells which struct the kernel wrote.
    unsafe {
        match i32::from(storage.ss_family) {
            libc::AF_INET => {
                let sin = &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>();
                Some(SocketAddr::from((
                    u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                    u16::from_be(sin.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let sin6 =
                    &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
                Some(SocketAddr::from((
                    sin6.sin6_addr.s6_addr,
                    u16::from_be(sin6.sin6_port),
                )))
            }
            _ => None,
        }
    }
}

/// Receives up to BATCH datagrams: (payload, source) each.
struct Batch {
    bufs: Vec<[u8; SIZE]>,
    names: Vec<libc::sockaddr_storage>,
    lens: Vec<usize>,
    count: usize,
}

impl Batch {
    fn new() -> Batch {
        Batch {
            bufs: vec![[0u8; SIZE]; BATCH],
            // SAFETY: all-zero sockaddr_storage is valid.
            names: vec![unsafe { std::mem::zeroed() }; BATCH],
            lens: vec![0; BATCH],
            count: 0,
        }
    }

    fn recv(&mut self, fd: i32) {
        let mut iovecs: Vec<libc::iovec> = self
            .bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: SIZE,
            })
            .collect();
        // SAFETY: zeroed headers are valid; pointers below stay valid for the call.
        let mut headers: Vec<libc::mmsghdr> =
            (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
        for i in 0..BATCH {
            headers[i].msg_hdr.msg_iov = &mut iovecs[i];
            headers[i].msg_hdr.msg_iovlen = 1;
            headers[i].msg_hdr.msg_name =
                (&mut self.names[i] as *mut libc::sockaddr_storage).cast();
            headers[i].msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
        }
        // SAFETY: as above; blocks until at least one datagram arrives.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                headers.as_mut_ptr(),
                BATCH as u32,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        self.count = usize::try_from(n).unwrap_or(0);
        for (len, header) in self.lens.iter_mut().zip(&headers).take(self.count) {
            *len = header.msg_len as usize;
        }
    }
}

fn send(fd: i32, items: &mut [(usize, libc::sockaddr_storage, u32)], batch: &mut Batch) {
    if items.is_empty() {
        return;
    }
    let mut iovecs: Vec<libc::iovec> = items
        .iter()
        .map(|(i, ..)| libc::iovec {
            iov_base: batch.bufs[*i].as_mut_ptr().cast(),
            iov_len: batch.lens[*i],
        })
        .collect();
    // SAFETY: zeroed headers are valid; pointers below stay valid for the call.
    let mut headers: Vec<libc::mmsghdr> = (0..items.len())
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    for (k, (_, name, len)) in items.iter_mut().enumerate() {
        headers[k].msg_hdr.msg_iov = &mut iovecs[k];
        headers[k].msg_hdr.msg_iovlen = 1;
        headers[k].msg_hdr.msg_name = (name as *mut libc::sockaddr_storage).cast();
        headers[k].msg_hdr.msg_namelen = *len;
    }
    // SAFETY: as above.
    unsafe { libc::sendmmsg(fd, headers.as_mut_ptr(), headers.len() as u32, 0) };
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
    let clients: Arc<RwLock<Vec<Option<Name>>>> = Arc::new(RwLock::new(Vec::new()));
    let peer: Arc<RwLock<Option<Name>>> = Arc::new(RwLock::new(None));
    let (lfd, rfd) = (listener.as_raw_fd(), relay.as_raw_fd());
    let up = {
        let (clients, peer) = (clients.clone(), peer.clone());
        std::thread::spawn(move || {
            let mut batch = Batch::new();
            loop {
                batch.recv(lfd);
                let mut out = Vec::with_capacity(BATCH);
                let target = *peer.read().unwrap();
                for i in 0..batch.count {
                    let data = &batch.bufs[i][..batch.lens[i]];
                    if let Some(index) = data.strip_prefix(b"UTPF-CLIENT ") {
                        let index: usize = std::str::from_utf8(index)
                            .ok()
                            .and_then(|s| s.trim().parse().ok())
                            .unwrap_or(0);
                        if let Some(addr) = from_storage(&batch.names[i]) {
                            let mut c = clients.write().unwrap();
                            if c.len() <= index {
                                c.resize(index + 1, None);
                            }
                            c[index] = Some(to_storage(addr));
                        }
                        continue;
                    }
                    if let Some((name, len)) = target {
                        out.push((i, name, len));
                    }
                }
                send(rfd, &mut out, &mut batch);
            }
        })
    };
    let mut batch = Batch::new();
    loop {
        batch.recv(rfd);
        let mut out = Vec::with_capacity(BATCH);
        {
            let c = clients.read().unwrap();
            for i in 0..batch.count {
                let data = &batch.bufs[i][..batch.lens[i]];
                if data.starts_with(b"UTPF-PEER") {
                    if let Some(addr) = from_storage(&batch.names[i]) {
                        *peer.write().unwrap() = Some(to_storage(addr));
                    }
                    continue;
                }
                // turnperf's header: "UTPF", then the allocation index.
                let index = data
                    .get(4..8)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize);
                if let Some(Some((name, len))) = index.and_then(|i| c.get(i)) {
                    out.push((i, *name, *len));
                }
            }
        }
        send(lfd, &mut out, &mut batch);
        if up.is_finished() {
            break;
        }
    }
}
