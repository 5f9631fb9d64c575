//! uturn's control plane: config origins (file, CDS, TURN URI), discovery, health and metrics,
//! signals and drain.
#![deny(missing_docs)]

pub mod origin;
