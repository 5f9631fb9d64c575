//! What one text message from the config discovery service means, without IO: the WebSocket
//! watch and the one-shot GET both carry a whole config as JSON (stunnerd.md §8), of either API
//! version, or a list of them (`{"version": …, "items": [...]}`) whose items are read each as
//! the version it is (stunnerd-v2.md §8).
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
    parse_message_for(text, None)
}

/// Classifies the text of one CDS message for the gateway `id` (`<namespace>/<name>`): a list
/// gives the item whose `admin.name` is `id`, or its only item; one invalid item invalidates
/// the list.
pub fn parse_message_for(text: &str, id: Option<&str>) -> CdsMessage {
    if text.trim().is_empty() {
        return CdsMessage::Empty;
    }
    if let Ok(serde_json::Value::Object(doc)) = serde_json::from_str::<serde_json::Value>(text) {
        if let Some(serde_json::Value::Array(items)) = doc.get("items") {
            return list(items, id);
        }
    }
    classify(text)
}

fn list(items: &[serde_json::Value], id: Option<&str>) -> CdsMessage {
    let mut configs = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match parse_config(&item.to_string()) {
            Ok(config) => configs.push(config),
            Err(e) => return CdsMessage::Invalid(format!("items[{i}]: {e}")),
        }
    }
    let mine: Vec<StunnerConfig> = match id {
        Some(id) if configs.len() > 1 => {
            configs.into_iter().filter(|c| c.admin.name == id).collect()
        }
        _ => configs,
    };
    match <[StunnerConfig; 1]>::try_from(mine) {
        Ok([config]) if config.is_zero() => CdsMessage::Delete,
        Ok([config]) => CdsMessage::Config(Box::new(config)),
        Err(mine) => CdsMessage::Invalid(format!(
            "a list of {} configs for this gateway{}: expected exactly one",
            mine.len(),
            id.map(|id| format!(" ({id})")).unwrap_or_default()
        )),
    }
}

fn classify(text: &str) -> CdsMessage {
    match parse_config(text) {
        Ok(config) if config.is_zero() => CdsMessage::Delete,
        Ok(config) => CdsMessage::Config(Box::new(config)),
        Err(e) => CdsMessage::Invalid(e.to_string()),
    }
}
