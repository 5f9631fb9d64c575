//! The config's one error type: every refusal names the field, the value and the fix.

use serde::Serialize;
use std::fmt;

/// A config the user must fix: which field, what it held, and what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigError {
    /// Path of the offending field, e.g. `listeners[0].port` (empty for a syntax error).
    pub field: String,
    /// The offending value as written (secrets redacted).
    pub value: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl ConfigError {
    /// Builds an error for `field` holding `value`.
    pub fn new(
        field: impl Into<String>,
        value: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ConfigError {
            field: field.into(),
            value: value.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid config: {}", self.message)
        } else {
            write!(
                f,
                "invalid config: {} = {:?}: {}",
                self.field, self.value, self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}
