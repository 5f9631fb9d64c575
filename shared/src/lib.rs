//! What both planes of uturn agree on: the v1 config schema, auth, the route snapshot, the
//! log-spec parser, TURN stream framing.
#![deny(missing_docs)]

pub mod auth;
pub mod config;
pub mod framing;
pub mod logspec;
pub mod policy;
pub mod snapshot;
