//! Client tools for uturn: `turnperf` (a TURN load generator and reporter), `turncat` (a UDP
//! port-forward through a TURN server) and the TURN client they share with `cargo bench`.
#![deny(missing_docs)]

pub mod client;
pub mod histogram;
pub mod load;
pub mod ports;
pub mod turncat;

pub use client::BenchClient;
