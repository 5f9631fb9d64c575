//! What one text message from the config discovery service means, without IO: the WebSocket
//! watch and the one-shot GET both carry a whole config as JSON (stunnerd.md §8).
//!
//! Depends on `uturn-shared` only (the fuzz targets compile this file on its own).

use uturn_shared::config::{parse_config, StunnerConfig};

/// One CDS message, classified as stunnerd's watcher treats it.
#[derive(Debug, Clone, PartialEq)]
pub enum CdsMessage {
    /// Empty or blank: ignored.
    Empty,
    /// The zero config (the operator deleted the gateway): ignored by a watcher.
    Delete,
    /// A valid config to apply.
    Config(Box<StunnerConfig>),
    /// Not a valid config: ignored, the running config stays; the reason names the field.
    Invalid(String),
}

/// Classifies the text of one CDS message.
pub fn parse_message(text: &str) -> CdsMessage {
    if text.trim().is_empty() {
        return CdsMessage::Empty;
    }
    match parse_config(text) {
        Ok(config) if config.is_zero() => CdsMessage::Delete,
        Ok(config) => CdsMessage::Config(Box::new(config)),
        Err(e) => CdsMessage::Invalid(e.to_string()),
    }
}
