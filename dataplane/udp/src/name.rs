//! The kernel's form of a socket address, and the `mmsghdr` arrays that point at a batch's
//! buffers and addresses (the same shape for receiving and sending).

use crate::BATCH;
use std::net::SocketAddr;

/// The kernel's form of a socket address, and its length.
#[derive(Clone, Copy)]
pub(crate) struct RawName {
    pub(crate) storage: libc::sockaddr_storage,
    pub(crate) len: libc::socklen_t,
}

impl RawName {
    pub(crate) fn empty() -> RawName {
        RawName {
            // SAFETY: all-zero is a valid sockaddr_storage.
            storage: unsafe { std::mem::zeroed() },
            len: std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t,
        }
    }

    /// No address: a send on a connected socket goes to the address it is connected to (the
    /// kernel reads a zero-length name as none).
    pub(crate) fn connected() -> RawName {
        RawName {
            len: 0,
            ..RawName::empty()
        }
    }

    pub(crate) fn from_addr(addr: SocketAddr) -> RawName {
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
    pub(crate) fn same(&self, other: &RawName) -> bool {
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

    pub(crate) fn to_addr(self) -> Option<SocketAddr> {
        // SAFETY: the kernel wrote a socket address of `len` bytes into `storage`.
        unsafe { socket2::SockAddr::new(self.storage, self.len) }.as_socket()
    }
}

/// [`BATCH`] buffers of `slot` bytes each (one allocation), addresses and the `mmsghdr`s
/// that point at them.
pub(crate) struct Slots {
    pub(crate) bufs: Box<[u8]>,
    pub(crate) slot: usize,
    pub(crate) names: Box<[RawName]>,
    pub(crate) iovecs: Box<[libc::iovec]>,
    pub(crate) headers: Box<[libc::mmsghdr]>,
}

impl Slots {
    /// Buffers of `slot` bytes; each header's one iovec starts `offset` bytes into its buffer
    /// and is `len` long.
    pub(crate) fn new(slot: usize, offset: usize, len: usize) -> Slots {
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
