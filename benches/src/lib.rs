//! `cargo bench -p uturn-benches`: see `benches/`. The TURN client lives in `uturn-perf`.
