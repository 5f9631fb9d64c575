//! `cds_message`: the config discovery client's message parser
//! (`control/src/origin/cds_message.rs`, compiled here on its own so the instrumented build
//! carries no tokio or kube) on arbitrary text frames.
//!
//! Input: the text of one WebSocket frame (not UTF-8: skipped, as tungstenite refuses such a
//! text frame).
//!
//! Checks: never panics; blank text is `Empty` and nothing else is; a `Config` is not the zero
//! config, validates again to itself and its JSON parses back to an equal `Config`; a `Delete`
//! is a config that is zero (or a list whose one item is); an `Invalid` carries a reason. Both
//! API versions, single documents and lists (`items`), as the two operator variants send them.

#[path = "../../../control/src/origin/cds_message.rs"]
mod cds_message;

use cds_message::{parse_message, CdsMessage};

/// The fuzz target.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let message = parse_message(text);
    assert_eq!(
        matches!(message, CdsMessage::Empty),
        text.trim().is_empty(),
        "{message:?}"
    );
    match message {
        CdsMessage::Empty => {}
        CdsMessage::Delete => {
            let list = serde_json::from_str::<serde_json::Value>(text)
                .is_ok_and(|doc| doc.get("items").is_some_and(|items| items.is_array()));
            if !list {
                let config = uturn_shared::config::parse_config(text).expect("a delete parses");
                assert!(config.is_zero());
            }
        }
        CdsMessage::Config(config) => {
            assert!(!config.is_zero());
            let mut again = (*config).clone();
            again.validate().expect("a parsed config validates again");
            assert_eq!(again, *config, "validation changed a validated config");
            match parse_message(&config.to_json()) {
                CdsMessage::Config(back) => assert_eq!(back, config, "to_json does not round-trip"),
                other => panic!("to_json of a config parses as {other:?}"),
            }
        }
        CdsMessage::Invalid(why) => assert!(!why.is_empty()),
    }
}
