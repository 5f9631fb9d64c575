//! Discovery: the peer addresses of KUBERNETES clusters (a Service's EndpointSlices and
//! ClusterIPs, [`kubernetes`]) and STRICT_DNS clusters (a hostname's addresses, [`dns`]). Each
//! watch or resolver is a task that reports its own update type through an
//! [`Outbox`](crate::outbox::Outbox).

pub mod dns;
pub mod kubernetes;
