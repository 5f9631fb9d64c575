//! What the dataplane reports and the control plane shows in `/status`: the live allocations
//! by listener, from which a v2 config's servers count their `sessions`.

/// How many live allocations were made on one listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerAllocations {
    /// The listener's name.
    pub listener: String,
    /// Its live allocations.
    pub allocations: u64,
}
