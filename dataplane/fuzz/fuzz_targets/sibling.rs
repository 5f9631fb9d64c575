#![no_main]
//! See `uturn_fuzz::sibling` for the input layout and the invariants checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| uturn_fuzz::sibling::run(data));
