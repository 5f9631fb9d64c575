//! uturn's one test kit: the place a test, a benchmark or a fuzz target gets its harness.
//!
//! - [`engine`] (always): the sans-IO engine on a virtual clock, the long-term-credential
//!   signing client and the request builders.
//! - `apiserver`, `cds` (feature `fakes`): a Kubernetes API-server fake (EndpointSlices and
//!   Services, LIST and WATCH) and a CDS fake (STUNner's config discovery server).
//! - `stunnerd`, `turn_client`, `link`, `peers`, `turncat`, `tls` (feature `process`): the
//!   stunnerd process driver with its wait, log and probe helpers; TURN clients that talk to
//!   it over loopback; echo peers; the turncat driver; certificates.
//! - `cluster` (feature `process`): gateway pods, a client and a peer in network namespaces
//!   behind a service VIP that a test moves from pod to pod (kube-proxy's view of a flow).
//!
//! The fuzz workspace builds this crate with default features only, so the instrumented
//! build carries no sockets, processes, tokio or HTTP stack.

pub mod engine;

#[cfg(feature = "fakes")]
pub mod apiserver;
#[cfg(feature = "fakes")]
pub mod cds;

#[cfg(feature = "process")]
pub mod cluster;
#[cfg(feature = "process")]
pub mod link;
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
