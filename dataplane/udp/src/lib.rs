//! Batched UDP syscalls: the one place uturn calls `recvmmsg`, `sendmmsg` and UDP GSO. The
//! dataplane's shards and the `perf/` tools (turnperf, udprelay) move their datagrams through
//! it. Everything is allocated once; receiving and sending allocate nothing.
//!
//! - [`RecvBatch`] (`recv.rs`) receives with `recvmmsg` into preallocated buffers;
//! - [`SendQueue`] (`send.rs`) is flushed with one `sendmmsg` per run of datagrams on the same
//!   socket; [`try_send_to`] sends one datagram at once;
//! - `gso.rs` decides which consecutive queued datagrams go as one UDP GSO message, writes the
//!   `UDP_SEGMENT` control message, and gives GSO up for good the first time the kernel refuses
//!   it (a sticky fallback, as quinn-udp's);
//! - `name.rs` holds the kernel's form of addresses and the `mmsghdr` arrays both directions
//!   share.
//!
//! A crate of its own beside the dataplane, as quinn-udp is beside quinn: the load generator
//! that measures a TURN server (coturn and pion as well as ours) gets the same batching
//! without building the server, and the `unsafe` of batched IO sits in this one crate, each
//! block with its SAFETY argument.

mod gso;
mod name;
mod recv;
mod send;

pub use recv::{Datagram, RecvBatch};
pub use send::{try_send_to, SendQueue};

/// Datagrams per `recvmmsg`/`sendmmsg` call.
pub const BATCH: usize = 32;
/// Room per datagram buffer by default: more than the dataplane's oversize limit for client
/// datagrams, so a datagram too big is seen as such rather than truncated silently. A queued
/// datagram larger than this is sent on its own ([`SendQueue::push`]).
const SLOT: usize = 2048;
/// The largest UDP payload (65 535 bytes less the IPv4 and UDP headers).
pub const MAX_UDP_PAYLOAD: usize = 65_507;
