//! What the control thread knows of each watched Kubernetes Service: the changes a watch
//! reports, and the addresses they add up to.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Instant;
use uturn_shared::policy::unmapped_ip;

/// A change to the addresses of one watched Kubernetes Service (`<namespace>/<service>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceChange {
    /// A full relist of the Service's EndpointSlices (`Init…InitDone`): slice name → addresses.
    /// Slices missing here are gone, also those deleted while the watch was down.
    ReplaceSlices(BTreeMap<String, SliceAddresses>),
    /// One slice was added or modified.
    UpsertSlice(String, SliceAddresses),
    /// One slice was deleted.
    RemoveSlice(String),
    /// The Service's ClusterIPs (empty when the Service is gone).
    ClusterIps(Vec<IpAddr>),
    /// The API server answered again (`None`) or failed (`Some(why)`) for this Service.
    Api(Option<String>),
}

/// The addresses one EndpointSlice lists, all of them (ready, serving and terminating).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SliceAddresses {
    /// Every endpoint address in the slice.
    pub addresses: Vec<IpAddr>,
    /// The subset whose endpoint is terminating (for `/status` and logs only).
    pub terminating: Vec<IpAddr>,
}

/// What the control thread knows about one Service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceState {
    /// Slice name → its addresses.
    pub slices: BTreeMap<String, SliceAddresses>,
    /// The Service's ClusterIPs.
    pub cluster_ips: Vec<IpAddr>,
    /// The last API error, while the API server is unreachable.
    pub api_error: Option<String>,
    /// Whether a full list has been seen since the watch started.
    pub synced: bool,
    /// Which watch feeds this state: a state created anew (a Service dropped from the config
    /// and named again) gets a new id, and changes from an older watch are ignored.
    pub watch: u64,
    /// When `handle_timeout` first saw this Service waiting for its first full list.
    pub waiting_since: Option<Instant>,
    /// Whether the first full list took longer than the discovery timeout.
    pub sync_timed_out: bool,
}

impl ServiceState {
    /// Every address a peer may use: the union of all slices plus the ClusterIPs.
    pub fn addresses(&self) -> BTreeSet<IpAddr> {
        self.slices
            .values()
            .flat_map(|s| s.addresses.iter().copied())
            .chain(self.cluster_ips.iter().copied())
            .map(unmapped_ip)
            .collect()
    }

    /// The addresses of terminating endpoints.
    pub fn terminating(&self) -> BTreeSet<IpAddr> {
        self.slices
            .values()
            .flat_map(|s| s.terminating.iter().copied())
            .collect()
    }
}
