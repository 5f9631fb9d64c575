//! uturn's one test kit: the place a test, a benchmark or a fuzz target gets its harness.
//!
//! - [`engine`] (always): the sans-IO engine on a virtual clock, the long-term-credential
//!   signing client and the request builders.
//! - `cds` (feature `fakes`): a CDS fake (STUNner's config discovery server), kept while
//!   STUNner's operator, the real CDS server, cannot be built here (the Go module proxy refuses
//!   `github.com/l7mp/stunner-gateway-operator`).
//! - `stunnerd`, `turn_client`, `link`, `peers`, `turncat`, `tls` (feature `process`): the
//!   stunnerd process driver with its wait, log and probe helpers; TURN clients that talk to
//!   it over loopback; echo peers; the turncat driver; certificates.
//! - `kube` (feature `kube`): a real etcd and kube-apiserver on loopback (built by
//!   `.ci/go-components`), with static tokens for an admin and user `uturn`, RBAC on, an
//!   audit log of uturn's requests, outages and a second API server on the same etcd.
//! - `netns` (feature `process`): the one network-namespace topology: a test describes the
//!   namespaces, routers, links, checksum offloads and NATed VIP it needs, and gets them made
//!   and, on drop, removed with everything running in them.
//! - `frames` (feature `process`): Ethernet/IPv4/UDP frames built by hand, with their
//!   checksums, for the offload's programs under `BPF_PROG_TEST_RUN`.
//! - `cluster` (feature `process`): gateway pods, a client and a peer in network namespaces
//!   behind a service VIP that a test moves from pod to pod (kube-proxy's view of a flow).
//!
//! The fuzz workspace builds this crate with default features only, so the instrumented
//! build carries no sockets, processes, tokio or HTTP stack.

pub mod engine;

#[cfg(feature = "fakes")]
pub mod cds;

#[cfg(feature = "kube")]
pub mod kube;

#[cfg(feature = "process")]
pub mod cluster;
#[cfg(feature = "process")]
pub mod frames;
#[cfg(feature = "process")]
pub mod link;
#[cfg(feature = "process")]
pub mod netns;
#[cfg(feature = "process")]
pub mod peers;
#[cfg(feature = "process")]
pub mod stunnerd;
#[cfg(feature = "process")]
pub mod tls;
#[cfg(feature = "process")]
pub mod turn_client;
#[cfg(feature = "process")]
pub mod turncat;
