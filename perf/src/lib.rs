//! Client tools for uturn: `turnperf` (a TURN load generator and reporter) and the TURN client
//! they share with `cargo bench`.
#![deny(missing_docs)]

pub mod client;
pub mod histogram;
pub mod load;

pub use client::BenchClient;
