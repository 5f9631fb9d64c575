//! What both planes of uturn agree on: the v1 config schema, auth, the route snapshot, the
//! log-spec parser, TURN stream framing, the allocation counts `/status` shows.
#![deny(missing_docs)]
// Config, auth and policy parsing for both planes: nothing here needs unsafe.
#![forbid(unsafe_code)]

pub mod auth;
pub mod config;
pub mod framing;
pub mod go;
pub mod logspec;
pub mod policy;
pub mod snapshot;
mod spelling;
pub mod status;
