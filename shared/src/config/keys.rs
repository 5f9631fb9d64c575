//! The keys a config document may hold, per version, and the warnings for those it should
//! not: an unknown key (a typo such as `protcol` or `adress`, which stunnerd's parser ignores
//! as silently as it ignores a real unknown), and a listener `port` written as 0.
//!
//! Unknown keys are warnings, not errors: STUNner's own parser ignores them, so a document
//! that runs under stunnerd (one rendered by a newer operator with a field this version does
//! not know, say) must run here too. The warning names the key, where it is, and the nearest
//! known key.

use serde_json::{Map, Value};

/// What a known key holds.
enum Kind {
    /// A value read as it is.
    Value,
    /// A mapping whose keys are free (credentials, the license).
    Free,
    /// A mapping with these keys.
    Section(&'static [(&'static str, Kind)]),
    /// A list of mappings with these keys.
    List(&'static [(&'static str, Kind)]),
}

use Kind::{Free, List, Section, Value as V};

const ADMIN: &[(&str, Kind)] = &[
    ("name", V),
    ("loglevel", V),
    ("metrics_endpoint", V),
    ("healthcheck_endpoint", V),
    ("user_quota", V),
    ("offload_engine", V),
    ("offload_interfaces", V),
    ("state_dir", V),
    ("license_config", Free),
];
const V1_AUTH: &[(&str, Kind)] = &[("type", V), ("realm", V), ("credentials", Free)];
const V1_LISTENER: &[(&str, Kind)] = &[
    ("name", V),
    ("protocol", V),
    ("public_address", V),
    ("public_port", V),
    ("address", V),
    ("port", V),
    ("cert", V),
    ("key", V),
    ("routes", V),
];
const V1_CLUSTER: &[(&str, Kind)] = &[("name", V), ("type", V), ("protocol", V), ("endpoints", V)];
const V1: &[(&str, Kind)] = &[
    ("version", V),
    ("admin", Section(ADMIN)),
    ("auth", Section(V1_AUTH)),
    ("listeners", List(V1_LISTENER)),
    ("clusters", List(V1_CLUSTER)),
];

const V2_AUTH: &[(&str, Kind)] = &[
    ("type", V),
    ("realm", V),
    ("credentials", Free),
    ("lifetime", V),
];
const V2_LISTENER: &[(&str, Kind)] = &[
    ("name", V),
    ("protocol", V),
    ("servers", V),
    ("address", V),
    ("port", V),
    ("public_address", V),
    ("public_port", V),
    ("public_addresses", V),
    ("cert", V),
    ("key", V),
    ("pqc_mode", V),
];
const V2_SERVER: &[(&str, Kind)] = &[("name", V), ("type", V), ("clusters", V)];
const V2_TUNNEL: &[(&str, Kind)] = &[
    ("url", V),
    ("auth", Section(V2_AUTH)),
    ("insecure", V),
    ("sni", V),
];
const V2_CLUSTER: &[(&str, Kind)] = &[
    ("name", V),
    ("type", V),
    ("endpoints", V),
    ("routing_policy", V),
    ("protocol", V),
    ("tunnel", Section(V2_TUNNEL)),
    ("addresses", V),
];
const V2: &[(&str, Kind)] = &[
    ("version", V),
    ("admin", Section(ADMIN)),
    ("auth", Section(V2_AUTH)),
    ("listeners", List(V2_LISTENER)),
    ("servers", List(V2_SERVER)),
    ("clusters", List(V2_CLUSTER)),
];

/// Keys that older documents carry and that no version reads any more, with why.
const RETIRED: &[(&str, &str)] = &[
    (
        "min_relay_port",
        "a v1alpha1 key that STUNner v1 dropped: relay ports are the kernel's ephemeral \
         ports; remove it",
    ),
    (
        "max_relay_port",
        "a v1alpha1 key that STUNner v1 dropped: relay ports are the kernel's ephemeral \
         ports; remove it",
    ),
];

/// The warnings for a parsed document of `version` (`v2`, else v1's keys): one per unknown
/// key, in the document's key order (sorted, as the reader keeps it), and one per listener
/// whose `port` is written as 0.
pub(super) fn document_warnings(doc: &Value, version: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Value::Object(map) = doc {
        let schema = if version == super::API_VERSION {
            V2
        } else {
            V1
        };
        walk(map, schema, "", &mut out);
    }
    out
}

fn walk(map: &Map<String, Value>, known: &[(&str, Kind)], path: &str, out: &mut Vec<String>) {
    let at = |key: &str| {
        if path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        }
    };
    for (key, value) in map {
        // Go's encoding/json: keys match case-insensitively.
        let Some((name, kind)) = known.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)) else {
            out.push(unknown(&at(key), key, known, path));
            continue;
        };
        match (kind, value) {
            (Section(keys), Value::Object(inner)) => walk(inner, keys, &at(name), out),
            (List(keys), Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    if let Value::Object(inner) = item {
                        let item_path = format!("{}[{i}]", at(name));
                        walk(inner, keys, &item_path, out);
                        port_zero(inner, &item_path, out);
                    }
                }
            }
            // Type errors are the reader's to report.
            _ => {}
        }
    }
}

fn unknown(full: &str, key: &str, known: &[(&str, Kind)], section: &str) -> String {
    let fix = match RETIRED.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)) {
        Some((_, why)) => why.to_string(),
        None => match crate::spelling::nearest(key, known.iter().map(|(k, _)| *k)) {
            Some(near) => format!("did you mean {near:?}?"),
            None => format!(
                "the keys of {} are {}",
                if section.is_empty() {
                    "the document"
                } else {
                    section
                },
                known.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
            ),
        },
    };
    format!("config: unknown key {full:?} is ignored (stunnerd ignores it too): {fix}")
}

/// A listener port written as 0 reads as the default, 3478 (as in stunnerd): say so.
fn port_zero(listener: &Map<String, Value>, path: &str, out: &mut Vec<String>) {
    let port = super::document::lookup(listener, "port");
    let zero = match port {
        Some(Value::Number(n)) => n.as_i64() == Some(0),
        Some(Value::String(s)) => s.trim() == "0",
        _ => false,
    };
    if zero {
        out.push(format!(
            "config: {path}.port is 0, which reads as the default port {}: write the port \
             the listener should open, or leave the key out for {}",
            super::DEFAULT_PORT,
            super::DEFAULT_PORT
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warnings(doc: serde_json::Value, version: &str) -> Vec<String> {
        document_warnings(&doc, version)
    }

    #[test]
    fn a_known_document_has_no_warning_and_keys_match_case_insensitively() {
        let v1 = serde_json::json!({
            "version": "v1",
            "admin": {"name": "x", "logLevel": "all:INFO", "license_config": {"anything": 1}},
            "auth": {"type": "static", "credentials": {"whatever": "a"}},
            "listeners": [{"name": "l", "protocol": "TURN-UDP", "address": "1.2.3.4",
                           "port": 3478, "routes": ["c"]}],
            "clusters": [{"name": "c", "endpoints": ["0.0.0.0/0"]}]
        });
        assert_eq!(warnings(v1, "v1"), Vec::<String>::new());
        let v2 = serde_json::json!({
            "version": "v2",
            "auth": {"lifetime": "1h"},
            "listeners": [{"name": "l", "servers": ["s"], "pqc_mode": ""}],
            "servers": [{"name": "s", "clusters": ["c"]}],
            "clusters": [{"name": "c", "protocol": "UDP", "addresses": [],
                          "tunnel": {"url": "turn:x", "auth": {"realm": "r"}}}]
        });
        assert_eq!(warnings(v2, "v2"), Vec::<String>::new());
    }

    #[test]
    fn unknown_keys_are_named_with_their_place_and_the_nearest_known_key() {
        let doc = serde_json::json!({
            "version": "v1",
            "admin": {"metricsEndpoint": "http://:8080"},
            "listeners": [{"name": "l", "protcol": "TURN-TCP", "adress": "1.2.3.4",
                           "min_relay_port": 10000}],
            "clusters": [{"name": "c", "zzz": 1}],
            "servers": []
        });
        let got = warnings(doc, "v1");
        assert_eq!(got.len(), 6, "{got:#?}");
        assert!(
            got[0].contains("\"admin.metricsEndpoint\"") && got[0].contains("\"metrics_endpoint\""),
            "{}",
            got[0]
        );
        assert!(
            got[1].contains("\"clusters[0].zzz\"")
                && got[1].contains("the keys of clusters[0] are name, type, protocol, endpoints"),
            "{}",
            got[1]
        );
        assert!(
            got[2].contains("\"listeners[0].adress\"")
                && got[2].contains("did you mean \"address\"?"),
            "{}",
            got[2]
        );
        assert!(
            got[3].contains("\"listeners[0].min_relay_port\"") && got[3].contains("v1alpha1"),
            "{}",
            got[3]
        );
        assert!(
            got[4].contains("\"listeners[0].protcol\"")
                && got[4].contains("did you mean \"protocol\"?"),
            "{}",
            got[4]
        );
        // `servers` is a v2 key.
        assert!(got[5].contains("\"servers\""), "{}", got[5]);
        // In v2, `servers` is known and `routes` is not.
        let v2 = serde_json::json!({"version": "v2", "servers": [],
                                    "listeners": [{"name": "l", "routes": ["c"]}]});
        let got = warnings(v2, "v2");
        assert_eq!(got.len(), 1, "{got:#?}");
        assert!(got[0].contains("\"listeners[0].routes\""), "{}", got[0]);
    }

    #[test]
    fn a_port_written_as_zero_is_a_warning_with_the_fix() {
        for port in [serde_json::json!(0), serde_json::json!("0")] {
            let doc = serde_json::json!({"version": "v1",
                                         "listeners": [{"name": "l", "port": port}]});
            let got = warnings(doc, "v1");
            assert_eq!(got.len(), 1, "{got:?}");
            assert!(got[0].contains("listeners[0].port is 0"), "{}", got[0]);
        }
        let absent = serde_json::json!({"version": "v1", "listeners": [{"name": "l"}]});
        assert!(warnings(absent, "v1").is_empty());
    }
}
