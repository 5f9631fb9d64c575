//! What a config change does, counted as stunnerd counts it for its "Reconciliation ready"
//! line: objects new, changed and deleted (by name), listeners started and restarted.

use uturn_shared::config::StunnerConfig;
use uturn_shared::snapshot::{ListenerSpec, RelayAddresses};

/// What a config change did, in stunnerd's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reconciliation {
    /// Objects that did not exist before.
    pub new: usize,
    /// Objects whose config changed.
    pub changed: usize,
    /// Objects that were removed.
    pub deleted: usize,
    /// Listeners opened (new ones).
    pub started: usize,
    /// Listeners closed and reopened (protocol, address, port, cert/key or realm changed);
    /// their allocations are dropped.
    pub restarted: usize,
}

/// Counts the objects of one kind that `new` adds, changes or deletes from `old` (by name).
fn objects<T: PartialEq>(
    old: &[T],
    new: &[T],
    name: impl Fn(&T) -> &String,
    count: &mut impl FnMut(bool, bool, bool),
) {
    for item in new {
        let before = old.iter().find(|o| name(o) == name(item));
        count(before.is_some(), true, before.is_some_and(|b| b != item));
    }
    for item in old {
        if !new.iter().any(|n| name(n) == name(item)) {
            count(true, false, false);
        }
    }
}

/// Counts what going from `old` to `new` does, object by object (matched by name).
pub fn reconcile(old: &StunnerConfig, new: &StunnerConfig) -> Reconciliation {
    let mut summary = Reconciliation::default();
    let mut count = |before: bool, after: bool, changed: bool| match (before, after) {
        (false, true) => summary.new += 1,
        (true, false) => summary.deleted += 1,
        (true, true) if changed => summary.changed += 1,
        _ => {}
    };
    count(true, true, old.admin != new.admin);
    count(true, true, old.auth != new.auth);
    // Objects of the documents as written: a v1 config's listeners and clusters, a v2
    // config's listeners, servers and clusters (stunnerd's counts for each).
    match (&old.v1, &new.v1) {
        (Some(old), Some(new)) => {
            objects(&old.listeners, &new.listeners, |l| &l.name, &mut count);
            objects(&old.clusters, &new.clusters, |c| &c.name, &mut count);
        }
        _ => {
            objects(&old.listeners, &new.listeners, |l| &l.name, &mut count);
            objects(&old.servers, &new.servers, |s| &s.name, &mut count);
            objects(&old.clusters, &new.clusters, |c| &c.name, &mut count);
        }
    }
    for l in &new.listeners {
        match old.listeners.iter().find(|o| o.name == l.name) {
            None => summary.started += 1,
            Some(before) => {
                // The environment is the process's, the same on both sides.
                let env = RelayAddresses::default();
                let after = ListenerSpec::from_config(new, l, 0, env);
                if after.restarts_from(&ListenerSpec::from_config(old, before, 0, env)) {
                    summary.restarted += 1;
                }
            }
        }
    }
    summary
}
