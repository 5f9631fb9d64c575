//! What a config must pass, beyond its own validation, before this process runs it: every
//! TURN-TLS and TURN-DTLS listener's certificate and key load and match (built into the same
//! contexts the listener serves with). A config that fails is refused whole, so the running listeners, and the
//! allocations on them, stay as they are; a listener restarts only for a config that passed.

use super::{dtls, tls};
use uturn_shared::config::{ConfigError, ListenerProtocol, StunnerConfig};

/// Checks `new` before it replaces `running` (at start, `running` is the zero config).
pub fn check_config(_running: &StunnerConfig, new: &StunnerConfig) -> Result<(), String> {
    check_tls_material(new)
}

/// Builds the TLS or DTLS context of every TURN-TLS and TURN-DTLS listener of `config`, as
/// the listener would; the first that fails, named with its field and the fix.
pub fn check_tls_material(config: &StunnerConfig) -> Result<(), String> {
    for (index, listener) in config.listeners.iter().enumerate() {
        let built = match listener.protocol {
            ListenerProtocol::TurnTls => {
                tls::server_config_from_base64(&listener.cert, &listener.key).map(drop)
            }
            ListenerProtocol::TurnDtls => {
                dtls::gate_from_base64(&listener.cert, &listener.key).map(drop)
            }
            _ => Ok(()),
        };
        if let Err(e) = built {
            let field = e.field();
            let value = if field == "cert" {
                summary(&listener.cert)
            } else {
                // Never key material.
                format!("<{} bytes>", listener.key.len())
            };
            return Err(ConfigError::new(
                format!("listeners[{index}].{field}"),
                value,
                format!(
                    "listener {:?} ({}): {e}",
                    listener.name,
                    listener.protocol.as_str()
                ),
            )
            .to_string());
        }
    }
    Ok(())
}

/// The start of a base64 value, to recognise it by.
fn summary(value: &str) -> String {
    let head: String = value.chars().take(40).collect();
    if head.len() < value.len() {
        format!("{head}…")
    } else {
        head
    }
}
