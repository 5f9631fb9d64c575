//! What a config must pass, beyond its own validation, before this process runs it: every
//! TURN-TLS and TURN-DTLS listener's certificate and key load and match (built into the same
//! contexts the listener serves with), and no port a listener is to open is served by another
//! process. A config that fails is refused whole, so the running listeners, and the
//! allocations on them, stay as they are; a listener restarts only for a config that passed.

use super::ports::{foreign_holders, Holder, PortProtocol};
use super::{dtls, tls};
use std::time::{Duration, Instant};
use uturn_shared::config::{ConfigError, ListenerProtocol, StunnerConfig};

/// Whether a listener may open a port that another process also serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedPorts {
    /// Refuse the config (the default).
    Refuse,
    /// Open it anyway and share the port's clients (`--allow-shared-ports`).
    Allow,
}

/// Checks `new` before it replaces `running` (at start, `running` is the zero config).
pub fn check_config(
    running: &StunnerConfig,
    new: &StunnerConfig,
    shared_ports: SharedPorts,
) -> Result<(), String> {
    check_tls_material(new)?;
    if shared_ports == SharedPorts::Refuse {
        check_ports(running, new)?;
    }
    Ok(())
}

/// Builds the TLS or DTLS context of every TURN-TLS and TURN-DTLS listener of `config`, as
/// the listener would; the first that fails, named with its field and the fix.
pub fn check_tls_material(config: &StunnerConfig) -> Result<(), String> {
    for (index, listener) in config.listeners.iter().enumerate() {
        let built = match config.listener_protocol(listener) {
            Some(ListenerProtocol::TurnTls) => {
                tls::server_config_from_base64(&listener.cert, &listener.key).map(drop)
            }
            Some(ListenerProtocol::TurnDtls) => {
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

/// How long a port held only by sockets that no process has open may take to come free. A
/// process that has just exited can leave such sockets for a few milliseconds (the kernel
/// tears an io_uring instance down after the process is gone, and the sockets it holds with
/// it), so a stunnerd restarted at once on the same host waits them out instead of refusing
/// its config.
const ORPHAN_GRACE: Duration = Duration::from_secs(1);

/// [`foreign_holders`], asked again until no holder is left, one of them is a live process,
/// or [`ORPHAN_GRACE`] has passed.
fn settled_foreign_holders(protocol: PortProtocol, port: u16) -> std::io::Result<Vec<Holder>> {
    let deadline = Instant::now() + ORPHAN_GRACE;
    loop {
        let holders = foreign_holders(protocol, port)?;
        let orphans_only = !holders.is_empty() && holders.iter().all(|h| h.process.is_none());
        if !orphans_only || Instant::now() >= deadline {
            return Ok(holders);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Refuses a listener of `new` that would open a port another process serves. Listeners that
/// `running` already serves on the same port are left alone: their sockets are open, and
/// whoever joined them later is not this config's doing.
pub fn check_ports(running: &StunnerConfig, new: &StunnerConfig) -> Result<(), String> {
    let served = |protocol: PortProtocol, port: u16| {
        running.listeners.iter().any(|l| {
            running.listener_protocol(l).and_then(PortProtocol::of) == Some(protocol)
                && l.port == port
        })
    };
    for (index, listener) in new.listeners.iter().enumerate() {
        let Some(protocol) = new.listener_protocol(listener).and_then(PortProtocol::of) else {
            continue;
        };
        if served(protocol, listener.port) {
            continue;
        }
        let holders = match settled_foreign_holders(protocol, listener.port) {
            Ok(holders) => holders,
            Err(e) => {
                tracing::warn!(
                    target: "stunnerd",
                    "listener {:?}: cannot tell whether another process serves port {}/{} \
                     ({e}): opening it unchecked",
                    listener.name,
                    listener.port,
                    protocol.as_str()
                );
                continue;
            }
        };
        if let Some(holder) = holders.first() {
            return Err(ConfigError::new(
                format!("listeners[{index}].port"),
                listener.port.to_string(),
                format!(
                    "listener {:?} ({}): port {}/{} is already served by another process \
                     ({holder}), which would take a share of this listener's clients: stop \
                     that process, give the listener another port, or run stunnerd with \
                     --allow-shared-ports to share the port on purpose",
                    listener.name,
                    listener.protocol.as_str(),
                    listener.port,
                    protocol.as_str()
                ),
            )
            .to_string());
        }
    }
    Ok(())
}
