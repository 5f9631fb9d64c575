//! turncat's log: one level (the `turncat` scope of the `-l` spec), lines to stderr.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

use uturn_shared::logspec::{Level, LogSpec};

static LEVEL: AtomicU8 = AtomicU8::new(Level::Warn as u8);

/// Sets the level from a stunnerd-style spec (`all:WARN,turncat:DEBUG`); `verbose` is
/// `all:DEBUG` (STUNner's `-v`).
pub fn configure(spec: &str, verbose: bool) {
    let spec = if verbose { "all:DEBUG" } else { spec };
    set_level(LogSpec::parse(spec).level_for("turncat"));
}

/// Sets the level.
pub fn set_level(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// Whether messages at `level` are printed.
pub fn enabled(level: Level) -> bool {
    let stored = usize::from(LEVEL.load(Ordering::Relaxed));
    let current = Level::ALL[stored.min(Level::ALL.len() - 1)];
    current.enables(level)
}

/// Prints `message` at `level`, if enabled.
pub fn log(level: Level, message: fmt::Arguments<'_>) {
    if enabled(level) {
        eprintln!("turncat {}: {message}", level.label());
    }
}
