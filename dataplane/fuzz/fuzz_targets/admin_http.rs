#![no_main]
//! See `uturn_fuzz::admin_http` for the input layout and the invariants checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| uturn_fuzz::admin_http::run(data));
