//! Address forms inside a config: cluster endpoints (STUNner v2's `IP[/len][:port[-port]]`,
//! `[IPv6[/len]]:port`, domains; v1's `IP[/len][:<min-max>]`, which the v1 converter rewrites)
//! and the admin HTTP endpoints (`http://addr:port/path`).

use serde::Serialize;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A STATIC cluster endpoint: an IP prefix and an inclusive peer port range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct StaticEndpoint {
    /// Network address (host bits cleared); IPv4-mapped IPv6 is stored as IPv4.
    pub addr: IpAddr,
    /// Prefix length: 32 or 128 for a plain IP.
    pub prefix_len: u8,
    /// Lowest peer port admitted.
    pub port_min: u16,
    /// Highest peer port admitted (a range with `port_min > port_max` admits nothing).
    pub port_max: u16,
}

const ENDPOINT_FORMS: &str = "write an IP (10.0.0.1), a prefix (10.0.0.0/8, fd00::/64), \
                              optionally followed by a port range (10.0.0.1:<5000-6000>)";

impl StaticEndpoint {
    /// Parses `IP`, `IP/len`, either optionally followed by `:<MIN-MAX>`; no range means
    /// ports 1-65535. Range bounds are not sanity-checked (as stunnerd), except that they must
    /// be port numbers; an upper bound above 65535 means 65535.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (prefix, ports) = split_port_range(s)?;
        let (ip_text, len_text) = match prefix.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (prefix, None),
        };
        let ip: IpAddr = ip_text.parse().map_err(|_| {
            format!("invalid endpoint {s:?}: {ip_text:?} is not an IP address; {ENDPOINT_FORMS}")
        })?;
        let (port_min, port_max) = ports.unwrap_or((1, u16::MAX));
        StaticEndpoint::of_prefix(ip, len_text, port_min, port_max).map_err(|max_len| {
            format!(
                "invalid endpoint {s:?}: prefix length {:?} must be 0-{max_len}; \
                 {ENDPOINT_FORMS}",
                len_text.unwrap_or_default()
            )
        })
    }

    /// The endpoint of `ip` with prefix length `len_text` (none: the whole address), its host
    /// bits cleared; the longest valid length if `len_text` is not one.
    fn of_prefix(
        ip: IpAddr,
        len_text: Option<&str>,
        port_min: u16,
        port_max: u16,
    ) -> Result<StaticEndpoint, u8> {
        let max_len = if ip.is_ipv4() { 32 } else { 128 };
        let prefix_len = match len_text {
            None => max_len,
            Some(len) => len
                .parse::<u8>()
                .ok()
                .filter(|n| len.bytes().all(|b| b.is_ascii_digit()) && *n <= max_len)
                .ok_or(max_len)?,
        };
        let (ip, prefix_len) = canonical_prefix(ip, prefix_len);
        Ok(StaticEndpoint {
            addr: masked(ip, prefix_len),
            prefix_len,
            port_min,
            port_max,
        })
    }

    /// Whether this endpoint admits peer `ip` (ports aside, as at permission time) by the peer
    /// policy: [`crate::policy::endpoint_admits`], so `0.0.0.0/0` does not admit `127.0.0.1`.
    /// The rules that need the whole snapshot (the gateway's own addresses, 6to4 and Teredo
    /// relays) are [`crate::snapshot::Snapshot::admits`]'s.
    pub fn admits_ip(&self, ip: IpAddr) -> bool {
        crate::policy::endpoint_admits(self.addr, self.prefix_len, ip)
    }

    /// Whether `port` lies in the endpoint's port range.
    pub fn admits_port(&self, port: u16) -> bool {
        (self.port_min..=self.port_max).contains(&port)
    }

    /// Whether this endpoint admits `peer`: its IP by [`StaticEndpoint::admits_ip`], its port
    /// by [`StaticEndpoint::admits_port`] (per-datagram admission).
    pub fn admits(&self, peer: SocketAddr) -> bool {
        self.admits_ip(peer.ip()) && self.admits_port(peer.port())
    }
}

/// A cluster endpoint as the running config writes it (STUNner v2's syntax): an IP or a
/// prefix, or a domain name, each with an optional port or port range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// An IP or prefix with the ports it names (1-65535 when none).
    Ip(StaticEndpoint),
    /// A domain name, resolved by the control plane, with the ports it names.
    Domain {
        /// The name to resolve.
        host: String,
        /// Lowest port named.
        port_min: u16,
        /// Highest port named.
        port_max: u16,
    },
}

const V2_FORMS: &str = "write an IP (10.0.0.1, 2001:db8::7), a prefix (10.0.0.0/16, fd00::/64) \
                        or a domain (media.default.svc), optionally with a port or a port \
                        range (10.0.0.1:5000, 10.0.0.0/16:5000-6000, [fd00::/64]:5000-6000)";

impl Endpoint {
    /// Parses an endpoint of the v2 syntax: `host[:port[-port]]` where the host is an IP, an
    /// IP prefix or a domain, and an IPv6 host with a port is written in brackets
    /// (`[2001:db8::/32]:5000-6000`); an IPv6 host without a port needs none.
    pub fn parse(s: &str) -> Result<Endpoint, String> {
        let invalid = || format!("invalid endpoint {s:?}: {V2_FORMS}");
        if s.contains("://") {
            return Err(invalid());
        }
        let (host, ports) = split_v2_port(s).ok_or_else(invalid)?;
        if host.is_empty() {
            return Err(format!("invalid endpoint {s:?}: empty host; {V2_FORMS}"));
        }
        let (port_min, port_max) = match ports {
            None => (1, u16::MAX),
            Some(ports) => parse_v2_ports(s, ports)?,
        };
        let (ip_text, len_text) = match host.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (host, None),
        };
        let Ok(ip) = ip_text.parse::<IpAddr>() else {
            if len_text.is_none() && is_domain(host) {
                return Ok(Endpoint::Domain {
                    host: host.to_owned(),
                    port_min,
                    port_max,
                });
            }
            return Err(invalid());
        };
        StaticEndpoint::of_prefix(ip, len_text, port_min, port_max)
            .map(Endpoint::Ip)
            .map_err(|_| invalid())
    }

    /// Whether the endpoint names ports narrower than every port.
    pub fn restricts_ports(&self) -> bool {
        let (min, max) = match self {
            Endpoint::Ip(e) => (e.port_min, e.port_max),
            Endpoint::Domain {
                port_min, port_max, ..
            } => (*port_min, *port_max),
        };
        (min, max) != (1, u16::MAX)
    }
}

/// Splits `host[:ports]`: `[host]:ports` or `[host]`, else a single `:` separates the ports
/// (more than one is a bare IPv6 host). `None` when the brackets are malformed.
fn split_v2_port(s: &str) -> Option<(&str, Option<&str>)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        return match after {
            "" => Some((inside, None)),
            _ => Some((inside, Some(after.strip_prefix(':')?))),
        };
    }
    match s.matches(':').count() {
        1 => s.split_once(':').map(|(host, ports)| (host, Some(ports))),
        _ => Some((s, None)),
    }
}

/// `port` or `min-max`, each 1-65535 and `min <= max`.
fn parse_v2_ports(s: &str, ports: &str) -> Result<(u16, u16), String> {
    let number = |t: &str| {
        t.parse::<u32>()
            .ok()
            .filter(|_| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
    };
    let bad_port = || format!("invalid port in endpoint {s:?}: a port is 1-65535; {V2_FORMS}");
    match ports.split_once('-') {
        None => {
            let port = number(ports)
                .and_then(|n| u16::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(bad_port)?;
            Ok((port, port))
        }
        Some((low, high)) => {
            let low = number(low)
                .and_then(|n| u16::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(bad_port)?;
            let high = number(high)
                .and_then(|n| u16::try_from(n).ok())
                .filter(|&n| n >= low)
                .ok_or_else(|| {
                    format!(
                        "invalid port range in endpoint {s:?}: write MIN-MAX with \
                         1 <= MIN <= MAX <= 65535"
                    )
                })?;
            Ok((low, high))
        }
    }
}

/// A DNS name: dot-separated labels of letters, digits, `-` and `_`.
fn is_domain(host: &str) -> bool {
    host.len() <= 253
        && host.trim_end_matches('.').split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// Rewrites a v1 endpoint (`X:<a-b>`) into the v2 syntax as STUNner v2's converter does:
/// `X:<a-b>` → `X:a-b`, `X:<p-p>` → `X:p`, `X:<1-65535>` → `X`, an IPv6 host with a port in
/// brackets. v1 read a lower bound of 0 as 0 and an upper bound over 65535 as 65535; as no
/// peer has port 0, those become 1 and 65535.
pub fn v1_endpoint_to_v2(s: &str) -> Result<String, String> {
    let (host, ports) = split_port_range(s)?;
    let Some((low, high)) = ports else {
        return Ok(host.to_owned());
    };
    let low = low.max(1);
    if (low, high) == (1, u16::MAX) {
        return Ok(host.to_owned());
    }
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    Ok(if low == high {
        format!("{host}:{low}")
    } else {
        format!("{host}:{low}-{high}")
    })
}

/// A KUBERNETES cluster endpoint: a Service, `<namespace>/<service>[:<min-max>]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ServiceEndpoint {
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name (its EndpointSlices carry `kubernetes.io/service-name=<name>`).
    pub name: String,
    /// Lowest peer port admitted.
    pub port_min: u16,
    /// Highest peer port admitted.
    pub port_max: u16,
}

const SERVICE_FORMS: &str = "write <namespace>/<service>, optionally followed by a port range \
                             (media/media-server:<10000-20000>)";

impl ServiceEndpoint {
    /// Parses `<namespace>/<service>[:<MIN-MAX>]`; both names must be DNS-1123 labels, as
    /// Kubernetes requires. No range means ports 1-65535.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (service, ports) = split_port_range(s)?;
        let Some((namespace, name)) = service.split_once('/') else {
            return Err(format!(
                "invalid Kubernetes endpoint {s:?}: no namespace; {SERVICE_FORMS}"
            ));
        };
        for (what, label) in [("namespace", namespace), ("service name", name)] {
            let valid = !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-');
            if !valid {
                return Err(format!(
                    "invalid Kubernetes endpoint {s:?}: {what} {label:?} is not a DNS-1123 \
                     label (lower-case letters, digits and '-', at most 63); {SERVICE_FORMS}"
                ));
            }
        }
        let (port_min, port_max) = ports.unwrap_or((1, u16::MAX));
        Ok(ServiceEndpoint {
            namespace: namespace.to_string(),
            name: name.to_string(),
            port_min,
            port_max,
        })
    }

    /// Parses `<namespace>/<service>[:port[-port]]` (the v2 syntax of [`Endpoint::parse`]).
    pub fn parse_v2(s: &str) -> Result<Self, String> {
        let (service, ports) = match s.split_once(':') {
            Some((service, ports)) => (service, Some(parse_v2_ports(s, ports)?)),
            None => (s, None),
        };
        let mut endpoint = ServiceEndpoint::parse(service)
            .map_err(|why| why.replace(":<10000-20000>", ":10000-20000"))?;
        if let Some((low, high)) = ports {
            endpoint.port_min = low;
            endpoint.port_max = high;
        }
        Ok(endpoint)
    }

    /// `<namespace>/<service>`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// An inclusive `(min, max)` port range.
type PortRange = (u16, u16);

/// Splits a trailing `:<MIN-MAX>` off (stunnerd's `^(.*):<([0-9]+)-([0-9]+)>$`).
fn split_port_range(s: &str) -> Result<(&str, Option<PortRange>), String> {
    let Some(body) = s.strip_suffix('>') else {
        return Ok((s, None));
    };
    let Some(colon) = body.rfind(":<") else {
        return Ok((s, None));
    };
    let Some((low, high)) = body[colon + 2..].split_once('-') else {
        return Ok((s, None));
    };
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    if !digits(low) || !digits(high) {
        return Ok((s, None));
    }
    let bound = |t: &str| t.parse::<u64>().unwrap_or(u64::MAX);
    let (low, high) = (bound(low), bound(high));
    let low = u16::try_from(low).map_err(|_| {
        format!("invalid endpoint {s:?}: port range starts above 65535; use :<MIN-MAX> with ports 0-65535")
    })?;
    let high = u16::try_from(high).unwrap_or(u16::MAX);
    Ok((&s[..colon], Some((low, high))))
}

/// IPv4-mapped IPv6 prefixes become IPv4 prefixes, so they match peers the way IPv4 does.
fn canonical_prefix(ip: IpAddr, prefix_len: u8) -> (IpAddr, u8) {
    match (ip, crate::policy::unmapped_ip(ip)) {
        (IpAddr::V6(_), v4 @ IpAddr::V4(_)) if prefix_len >= 96 => (v4, prefix_len - 96),
        _ => (ip, prefix_len),
    }
}

fn masked(ip: IpAddr, prefix_len: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let mask = u32::MAX
                .checked_shl(32 - u32::from(prefix_len.min(32)))
                .unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX
                .checked_shl(128 - u32::from(prefix_len.min(128)))
                .unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

/// Where an admin HTTP server listens and the path it serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct HttpEndpoint {
    /// Bind address: an empty host is `0.0.0.0`, `localhost` is `127.0.0.1`.
    pub addr: SocketAddr,
    /// URL path; `/` when empty.
    pub path: String,
}

const HTTP_FORMS: &str = "use http://<address>:<port>/<path>, e.g. http://:8080/metrics";

/// Parses an admin endpoint URL: `http://:8086` is 0.0.0.0:8086 path `/`, a missing port is
/// `default_port`, `http://[::1]:9000/x` is IPv6. The host must be an IP or `localhost`.
pub fn parse_http_endpoint(url: &str, default_port: u16) -> Result<HttpEndpoint, String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!(
            "invalid URL {url:?}: missing http:// scheme; {HTTP_FORMS}"
        ));
    };
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(format!(
            "invalid URL {url:?}: scheme {scheme:?} is not supported; {HTTP_FORMS}"
        ));
    }
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let path_end = tail.find(['?', '#']).unwrap_or(tail.len());
    let path = match &tail[..path_end] {
        "" => "/".to_owned(),
        path => path.to_owned(),
    };
    if authority.contains('@') {
        return Err(format!(
            "invalid URL {url:?}: user info is not supported; {HTTP_FORMS}"
        ));
    }
    let (host, port) = split_host_port(authority)
        .map_err(|why| format!("invalid URL {url:?}: {why}; {HTTP_FORMS}"))?;
    let ip = host_ip(host).ok_or_else(|| {
        format!(
            "invalid URL {url:?}: host {host:?} must be an IP address or localhost; {HTTP_FORMS}"
        )
    })?;
    let port = match port {
        None => default_port,
        Some(port) => port,
    };
    Ok(HttpEndpoint {
        addr: SocketAddr::new(ip, port),
        path,
    })
}

/// An empty host is the IPv4 wildcard, `localhost` is IPv4 loopback, otherwise an IP literal.
pub(super) fn host_ip(host: &str) -> Option<IpAddr> {
    if host.is_empty() {
        Some(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    } else if host.eq_ignore_ascii_case("localhost") {
        Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
    } else {
        host.parse().ok()
    }
}

/// Splits `host[:port]` or `[v6][:port]`; an empty port (`host:`) is no port.
pub(super) fn split_host_port(authority: &str) -> Result<(&str, Option<u16>), String> {
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let Some((host, after)) = bracketed.split_once(']') else {
            return Err("missing ] after the IPv6 address".to_owned());
        };
        match after.strip_prefix(':') {
            Some(port) => (host, port),
            None if after.is_empty() => (host, ""),
            None => return Err(format!("unexpected {after:?} after ]")),
        }
    } else {
        match authority.split_once(':') {
            Some((_, port)) if port.contains(':') => {
                return Err("write IPv6 addresses in brackets, e.g. [::1]:8080".to_owned())
            }
            Some((host, port)) => (host, port),
            None => (authority, ""),
        }
    };
    if port.is_empty() {
        return Ok((host, None));
    }
    if !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("port {port:?} is not a number"));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("port {port:?} must be 0-65535"))?;
    Ok((host, Some(port)))
}
