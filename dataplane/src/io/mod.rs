//! The IO shell: one shard per usable CPU, each a single-threaded event loop that owns its
//! SO_REUSEPORT listener sockets, the allocations made on them, their relay sockets and a
//! [`crate::proto::Engine`]. Two IO backends drive the same shard logic: a thread per shard
//! waiting on its own io_uring, or on epoll where io_uring is blocked ([`probe`]). The config
//! arrives as an arc-swap [`uturn_shared::snapshot::Snapshot`] that every shard reads through its own
//! `arc_swap::Cache`; nothing is locked or shared per packet.

pub mod admission;
pub mod certificates;
pub mod check;
mod driver;
mod dtls;
mod epoll;
mod groups;
mod launch;
pub mod metrics;
pub mod offload;
mod placement;
pub mod ports;
pub mod probe;
mod shard;
pub mod socket;
pub mod state;
mod stream;
mod sys;
pub mod tls;
mod uring;

pub use launch::{Dataplane, DataplaneConfig};
pub use placement::{allowed_cpus, shard_placement, usable_cpus};
pub use probe::{select as select_backend, BackendChoice, IoBackend};
pub use shard::{SiblingCounts, SiblingSetup};
