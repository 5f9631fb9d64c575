//! uturn's dataplane: the sans-IO TURN engine ([`proto`]) and the per-core shards that run it
//! over real sockets ([`io`]).
#![deny(missing_docs)]

pub mod io;
pub mod proto;
