//! Which listeners of one config may share a port: the one rule of both versions. Two
//! listeners of one transport (UDP: TURN-UDP and TURN-DTLS; TCP: TURN-TCP and TURN-TLS) on one
//! port whose bind addresses overlap would split the port's clients between them: each opens
//! the port with SO_REUSEPORT, and the kernel hashes clients over every socket on it.

use super::ConfigError;

/// A served listener as the rule sees it.
pub(super) struct PortUse<'a> {
    /// Its name, for the message.
    pub(super) name: &'a str,
    /// Its protocol as the document writes it (`TURN-UDP` in v1, `UDP` in v2), for the message.
    pub(super) protocol: &'static str,
    /// Whether its transport is UDP (rather than TCP).
    pub(super) datagram: bool,
    /// The port it opens.
    pub(super) port: u16,
    /// The address it binds; `None`: every address of both families.
    pub(super) bind: Option<&'a str>,
}

impl PortUse<'_> {
    /// Whether the two would split the clients of one port.
    fn collides(&self, other: &PortUse<'_>) -> bool {
        self.port == other.port
            && self.datagram == other.datagram
            && match (self.bind, other.bind) {
                (Some(mine), Some(theirs)) => mine == theirs,
                _ => true,
            }
    }
}

/// How a version's listeners bind their port, which decides the fix a collision names.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Binding {
    /// v1: on every address (a listener's `address` is the relay address it advertises).
    EveryAddress,
    /// v2: on the listener's `address`, or on every address when it has none.
    Address,
}

/// The first listener that collides with an earlier one, as an error on its `port` naming
/// both and the fix. `listeners` is the config's list in order, `None` for a listener that
/// opens no port.
pub(super) fn check_shared_ports(
    listeners: &[Option<PortUse<'_>>],
    binding: Binding,
) -> Result<(), ConfigError> {
    for (i, listener) in listeners.iter().enumerate() {
        let Some(listener) = listener else {
            continue;
        };
        let earlier = listeners[..i]
            .iter()
            .position(|other| other.as_ref().is_some_and(|o| o.collides(listener)));
        if let Some(first) = earlier {
            if let Some(other) = &listeners[first] {
                return Err(collision(i, listener, first, other, binding));
            }
        }
    }
    Ok(())
}

/// The error for `listeners[i]`, which collides with `listeners[first]`.
fn collision(
    i: usize,
    listener: &PortUse<'_>,
    first: usize,
    other: &PortUse<'_>,
    binding: Binding,
) -> ConfigError {
    let (transport, pairs, other_transport) = if listener.datagram {
        ("UDP", "TURN-UDP and TURN-DTLS", "TCP")
    } else {
        ("TCP", "TURN-TCP and TURN-TLS", "UDP")
    };
    let both = format!(
        "listener {:?} ({}) and listener {:?} ({}, listeners[{first}]) both use {transport} \
         port {}",
        listener.name, listener.protocol, other.name, other.protocol, listener.port,
    );
    let message = match binding {
        Binding::EveryAddress => format!(
            "{both}: listeners bind their port on every address, so the two would split the \
             port's clients between them; give one of them another port ({pairs} are both \
             {transport}; a {transport}-based and a {other_transport}-based listener may share \
             a port)"
        ),
        Binding::Address => format!(
            "{both} on the same addresses: the two would split the port's clients between \
             them; give one of them another port or another bind address"
        ),
    };
    ConfigError::new(
        format!("listeners[{i}].port"),
        listener.port.to_string(),
        message,
    )
}
