//! The sans-IO TURN engine (RFC 8656 over RFC 8489 message parsing from `stun-proto`).
//!
//! One [`Engine`] per shard. It never opens a socket or reads a clock: every call takes `now`
//! and the current [`Snapshot`](uturn_shared::snapshot::Snapshot), and returns what the IO
//! shell must do; [`Engine`]'s own documentation gives the order of the calls.
//!
//! Where things live:
//! - `contract`: what the engine takes and gives (its config and counters, handles, how a
//!   datagram arrived, actions, the relay socket request and its answer, drop reasons);
//! - `engine`: the [`Engine`], which dispatches each message and owns the parts below;
//! - `store`: allocations, their permissions and channels, and the client 5-tuple index;
//! - `auth` and `nonce`: long-term credentials over stateless nonces; `limits`: what a client
//!   may cost before and after it authenticates;
//! - `allocate`, `permission`: the request handlers (Allocate and Refresh; CreatePermission
//!   and ChannelBind); `relay`: the data path (ChannelData, Send, peer datagrams);
//! - `offload`: what a kernel offload is told (the changes it polls, the channels and
//!   permissions it may relay for);
//! - [`persist`]: allocations that outlive the process: an allocation as a record, the
//!   journal's bytes, and what a journal leaves live (the engine exports and adopts records);
//! - `sibling`: second-chance forwarding between a gateway's pods: the messages, their keys
//!   and replay windows, and the forwarding policy ([`sibling::Forwarding`]);
//! - `error`: why a request is refused, and the STUN code for each cause; `wire`: writing
//!   responses and indications into caller buffers.
// Wire input reaches every line of this module: memory safety is the compiler's to prove.
#![forbid(unsafe_code)]

mod allocate;
mod auth;
mod contract;
mod engine;
mod error;
pub mod limits;
mod nonce;
mod offload;
mod permission;
pub mod persist;
pub mod ratelimit;
mod relay;
pub mod sibling;
mod store;
mod wire;

pub use contract::{
    Arrival, ArrivalKind, BoundRelays, Bytes, ClientAction, DropReason, EngineConfig, EngineStats,
    Family, ListenerId, ListenerRef, PeerAction, PeerArrival, RelayBindError, RelayId,
    RelayRequest, PEER_HEADROOM,
};
pub use engine::Engine;
pub use limits::{AllocationLedger, Limits};
pub use nonce::{NonceCheck, NonceIssuer, NONCE_LIFETIME_SECS};
pub use offload::{OffloadChange, OffloadChannel, OffloadPermission};

use std::time::Duration;

/// Allocation lifetime when none (or 3600 s or more) is requested, as pion/stunnerd.
pub const DEFAULT_ALLOCATION_LIFETIME: Duration = Duration::from_secs(600);
/// Requested lifetimes at or above this fall back to the default (pion's rule).
pub const MAX_REQUESTED_LIFETIME_SECS: u32 = 3600;
/// Permission lifetime (RFC 8656 §9).
pub const PERMISSION_LIFETIME: Duration = Duration::from_secs(300);
/// Channel binding lifetime (RFC 8656 §12).
pub const CHANNEL_LIFETIME: Duration = Duration::from_secs(600);
/// How often [`Engine::handle_timeout`] sweeps for expired state.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// RFC 9000 §8.1's anti-amplification rule, applied to every reply to a request that did not
/// authenticate, on every transport: at most this many times the request's size in bytes.
pub const AMPLIFICATION_FACTOR: usize = 3;

/// Channel numbers accepted (RFC 5766 range, as pion; RFC 8656 clients use a subset).
pub const CHANNEL_NUMBERS: std::ops::RangeInclusive<u16> = 0x4000..=0x7FFF;
