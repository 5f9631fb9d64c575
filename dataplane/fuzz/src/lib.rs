//! Harness code for uturn's fuzz targets. Each target in `fuzz_targets/` is a one-line
//! `fuzz_target!` calling one `run` function here, so the seed generator
//! (`examples/gen_corpus.rs`) can replay every seed through exactly the same checks without
//! libFuzzer.
//!
//! Every `run` panics (which libFuzzer reports as a crash) when an invariant a user relies on
//! does not hold, not only when the code under test panics.

pub mod admin_http;
pub mod cds_message;
pub mod config;
pub mod engine;
pub mod framer;
pub mod input;
pub mod peer_policy;
pub mod seeds;
pub mod sibling;
