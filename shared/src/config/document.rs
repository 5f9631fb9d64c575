//! From text to an unvalidated document: stunnerd's env substitution, YAML-or-JSON parsing,
//! Go `encoding/json`-style field lookup (case-insensitive keys, unknown keys ignored, `null`
//! absent), and the v1 reader (the v2 one is [`super::v2`]'s).

use super::v1::{ClusterDocument, ListenerDocument, StunnerDocument};
use super::{
    AdminConfig, AuthConfig, AuthType, ClusterProtocol, ClusterType, ConfigError, ListenerProtocol,
    API_VERSION, API_VERSION_V1, API_VERSION_V1ALPHA1, DEFAULT_PORT,
};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The value `$STUNNER_PORT` expands to: `STUNNER_PORT` if it is all digits, else
/// `STUNNER_PUBLIC_PORT` if it is an integer, else 3478.
pub(super) fn stunner_port(env: &dyn Fn(&str) -> Option<String>) -> String {
    if let Some(port) = env("STUNNER_PORT") {
        if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
            return port;
        }
    }
    env("STUNNER_PUBLIC_PORT")
        .and_then(|public| crate::go::atoi(&public))
        .map(|public| public.to_string())
        .unwrap_or_else(|| DEFAULT_PORT.to_string())
}

/// Go's `os.Expand`: replaces `$NAME`, `${NAME}` and the shell specials (`$1`, `$$`, …) with
/// `lookup(NAME)`, unset meaning empty. Bad syntax (`${}`, an unclosed `${`) is eaten; a `$`
/// followed by anything else is kept.
pub(super) fn expand_env(text: &str, lookup: &dyn Fn(&str) -> Option<String>) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut literal_start = 0;
    let mut j = 0;
    while j < bytes.len() {
        if bytes[j] == b'$' && j + 1 < bytes.len() {
            out.push_str(&text[literal_start..j]);
            let (name, width) = shell_name(&text[j + 1..]);
            if name.is_empty() {
                if width == 0 {
                    out.push('$');
                }
            } else {
                out.push_str(&lookup(name).unwrap_or_default());
            }
            j += width;
            literal_start = j + 1;
        }
        j += 1;
    }
    out.push_str(&text[literal_start.min(text.len())..]);
    out
}

fn is_shell_special(b: u8) -> bool {
    matches!(
        b,
        b'*' | b'#' | b'$' | b'@' | b'!' | b'?' | b'-' | b'0'..=b'9'
    )
}

fn is_name_byte(b: u8) -> bool {
    b == b'_' || b.is_ascii_alphanumeric()
}

/// The variable name at the start of `s` (just after a `$`) and how many bytes it spans.
/// An empty name with a non-zero width is bad syntax to be dropped.
fn shell_name(s: &str) -> (&str, usize) {
    let bytes = s.as_bytes();
    if bytes.first() == Some(&b'{') {
        if bytes.len() > 2 && is_shell_special(bytes[1]) && bytes[2] == b'}' {
            return (&s[1..2], 3);
        }
        return match bytes.iter().skip(1).position(|&b| b == b'}') {
            Some(0) => ("", 2),
            Some(offset) => (&s[1..offset + 1], offset + 2),
            None => ("", 1),
        };
    }
    if bytes.first().is_some_and(|&b| is_shell_special(b)) {
        return (&s[..1], 1);
    }
    let len = bytes.iter().take_while(|&&b| is_name_byte(b)).count();
    (&s[..len], len)
}

/// A document read from `text`: `$VAR`s expanded with `env` (`STUNNER_PORT` defaulted), then
/// parsed; with the `auth.credentials` as written before expansion (stunnerd#102: a `$` in a
/// password survives).
pub(super) fn read(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(Value, Option<BTreeMap<String, String>>), ConfigError> {
    let env_with_port = |key: &str| {
        if key == "STUNNER_PORT" {
            Some(stunner_port(env))
        } else {
            env(key)
        }
    };
    let expanded = expand_env(text, &env_with_port);
    let raw_credentials = parse_document(text)
        .ok()
        .and_then(|raw| literal_credentials(&raw));
    Ok((parse_document(&expanded)?, raw_credentials))
}

/// The document's `version` (empty when absent); an error if the document is not a mapping.
pub(super) fn version(doc: &Value) -> Result<String, ConfigError> {
    Ok(root(doc)?.string("version")?.unwrap_or_default())
}

/// The top-level section of a document (`null` reads as an empty one).
pub(super) fn root(doc: &Value) -> Result<Section<'_>, ConfigError> {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    match doc {
        Value::Null => Ok(Section {
            map: EMPTY.get_or_init(Map::new),
            path: String::new(),
        }),
        Value::Object(map) => Ok(Section {
            map,
            path: String::new(),
        }),
        other => Err(ConfigError::new(
            "config",
            render(other),
            format!(
                "the document must be a mapping with version, admin, auth, listeners, servers \
                 and clusters, not {}",
                type_name(other)
            ),
        )),
    }
}

/// Parses a config document into a JSON value: JSON as JSON, anything else as YAML (as
/// `sigs.k8s.io/yaml` callers in stunnerd do). JSON goes first because the YAML parser reads
/// YAML 1.1, which folds U+0085 (NEL) inside quoted strings into line breaks: a JSON config's
/// strings (a password, say) must be read exactly as written.
pub(super) fn parse_document(text: &str) -> Result<Value, ConfigError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let json_error = match serde_json::from_str::<Value>(text) {
        Ok(value) => return Ok(value),
        Err(e) => e,
    };
    let yaml_error = match serde_norway::from_str::<serde_norway::Value>(text) {
        Ok(mut yaml) => {
            // YAML merge keys (`<<: *anchor`), which go-yaml applies.
            let _ = yaml.apply_merge();
            match serde_json::to_value(yaml) {
                Ok(value) => return Ok(value),
                Err(e) => e.to_string(),
            }
        }
        Err(e) => e.to_string(),
    };
    let why = if text.trim_start().starts_with('{') {
        format!("could not parse config as JSON ({json_error}) or as YAML ({yaml_error})")
    } else {
        format!("could not parse config as YAML ({yaml_error})")
    };
    Err(ConfigError::new(
        "",
        "",
        format!("{why}: fix the syntax at the reported line and column"),
    ))
}

/// `auth.credentials` of a document as written, for restoring them after env substitution.
pub(super) fn literal_credentials(doc: &Value) -> Option<BTreeMap<String, String>> {
    let root = doc.as_object()?;
    let auth = lookup(root, "auth")?.as_object()?;
    let credentials = lookup(auth, "credentials")?.as_object()?;
    Some(
        credentials
            .iter()
            .filter_map(|(key, value)| match value {
                Value::String(s) => Some((key.clone(), s.clone())),
                Value::Null => Some((key.clone(), String::new())),
                _ => None,
            })
            .collect(),
    )
}

/// Go `encoding/json` field lookup: keys match case-insensitively, `null` counts as absent, and
/// of several matches the last wins. The map is in byte order, as `sigs.k8s.io/yaml` emits it.
pub(super) fn lookup<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.iter()
        .rev()
        .find(|(k, v)| k.eq_ignore_ascii_case(key) && !v.is_null())
        .map(|(_, v)| v)
}

/// A value as shown in an error: strings as written, everything else as JSON.
pub(super) fn render(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub(super) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// A JSON object being read, with the path it sits at.
pub(super) struct Section<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) path: String,
}

impl<'a> Section<'a> {
    pub(super) fn path_of(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        lookup(self.map, key)
    }

    pub(super) fn string(&self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(ConfigError::new(
                self.path_of(key),
                render(other),
                format!(
                    "must be a string, not {}: quote the value",
                    type_name(other)
                ),
            )),
        }
    }

    /// An integer written as a number or, since `$STUNNER_PORT` may expand inside quotes, as
    /// a numeric string. An empty string is absent.
    pub(super) fn integer(&self, key: &str) -> Result<Option<i64>, ConfigError> {
        let bad = |value: &Value| {
            ConfigError::new(
                self.path_of(key),
                render(value),
                "must be a whole number, e.g. 3478",
            )
        };
        match self.get(key) {
            None => Ok(None),
            Some(value @ Value::Number(n)) => n.as_i64().map(Some).ok_or_else(|| bad(value)),
            Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
            Some(value @ Value::String(s)) => crate::go::atoi(s.trim())
                .map(Some)
                .ok_or_else(|| bad(value)),
            Some(other) => Err(bad(other)),
        }
    }

    /// A listener port: 0 when absent (the default applies later), else 0-65535.
    pub(super) fn port(&self, key: &str) -> Result<u16, ConfigError> {
        match self.integer(key)? {
            None => Ok(0),
            Some(n) => u16::try_from(n).map_err(|_| {
                ConfigError::new(
                    self.path_of(key),
                    n.to_string(),
                    "must be 1-65535: set a valid port, or leave it out for 3478",
                )
            }),
        }
    }

    pub(super) fn list(&self, key: &str) -> Result<&'a [Value], ConfigError> {
        match self.get(key) {
            None => Ok(&[]),
            Some(Value::Array(items)) => Ok(items),
            Some(other) => Err(ConfigError::new(
                self.path_of(key),
                render(other),
                format!(
                    "must be a list, not {}: write it as [item, …] or one `- item` per line",
                    type_name(other)
                ),
            )),
        }
    }

    pub(super) fn strings(&self, key: &str) -> Result<Vec<String>, ConfigError> {
        self.list(key)?
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.clone()),
                other => Err(ConfigError::new(
                    format!("{}[{i}]", self.path_of(key)),
                    render(other),
                    format!(
                        "must be a string, not {}: quote the value",
                        type_name(other)
                    ),
                )),
            })
            .collect()
    }

    pub(super) fn section(&self, key: &str) -> Result<Option<Section<'a>>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => as_section(value, self.path_of(key)).map(Some),
        }
    }
}

pub(super) fn as_section(value: &Value, path: String) -> Result<Section<'_>, ConfigError> {
    match value {
        Value::Object(map) => Ok(Section { map, path }),
        other => Err(ConfigError::new(
            path,
            render(other),
            format!(
                "must be a mapping of keys to values, not {}",
                type_name(other)
            ),
        )),
    }
}

/// Reads a parsed v1 document into an unvalidated v1 config. `literal_credentials` (the
/// credentials before env substitution) replace the substituted ones key by key.
pub(crate) fn v1_config_from_document(
    doc: &Value,
    literal_credentials: Option<&BTreeMap<String, String>>,
) -> Result<StunnerDocument, ConfigError> {
    let root = root(doc)?;
    // The version picks the schema first; any other version is an empty config to stunnerd.
    let version = root.string("version")?.unwrap_or_default();
    if version != API_VERSION_V1 && version != API_VERSION_V1ALPHA1 {
        return Err(unsupported_version(&version));
    }
    let (admin, auth) = admin_and_auth(&root, literal_credentials)?;
    let listeners = root
        .list("listeners")?
        .iter()
        .enumerate()
        .map(|(i, item)| listener_from(&as_section(item, format!("listeners[{i}]"))?))
        .collect::<Result<Vec<_>, _>>()?;
    let clusters = root
        .list("clusters")?
        .iter()
        .enumerate()
        .map(|(i, item)| cluster_from(&as_section(item, format!("clusters[{i}]"))?))
        .collect::<Result<Vec<_>, _>>()?;

    Ok(StunnerDocument {
        // v1alpha1 has the same fields as far as stunnerd is concerned; the rest is dropped.
        version: API_VERSION_V1.to_owned(),
        admin,
        auth,
        listeners,
        clusters,
    })
}

pub(super) fn unsupported_version(version: &str) -> ConfigError {
    ConfigError::new(
        "version",
        version,
        format!(
            "unsupported API version: set version to \"{API_VERSION}\" or \"{API_VERSION_V1}\" \
             (or the older \"{API_VERSION_V1ALPHA1}\")"
        ),
    )
}

/// The `admin` and `auth` sections, the same in both versions.
pub(super) fn admin_and_auth(
    root: &Section<'_>,
    literal_credentials: Option<&BTreeMap<String, String>>,
) -> Result<(AdminConfig, AuthConfig), ConfigError> {
    let admin = match root.section("admin")? {
        Some(section) => admin_from(&section)?,
        None => AdminConfig::default(),
    };
    let auth = match root.section("auth")? {
        Some(section) => auth_from(&section, literal_credentials)?,
        None => AuthConfig {
            credentials: literal_credentials.cloned().unwrap_or_default(),
            ..AuthConfig::default()
        },
    };
    Ok((admin, auth))
}

fn admin_from(section: &Section<'_>) -> Result<AdminConfig, ConfigError> {
    Ok(AdminConfig {
        name: section.string("name")?.unwrap_or_default(),
        loglevel: section.string("loglevel")?.unwrap_or_default(),
        metrics_endpoint: section.string("metrics_endpoint")?.unwrap_or_default(),
        healthcheck_endpoint: section.string("healthcheck_endpoint")?,
        user_quota: section.integer("user_quota")?.unwrap_or_default(),
        offload_engine: section.string("offload_engine")?.unwrap_or_default(),
        offload_interfaces: section.strings("offload_interfaces")?,
        state_dir: section.string("state_dir")?.unwrap_or_default(),
        license_config: match section.get("license_config") {
            None => None,
            Some(value @ Value::Object(_)) => Some(value.clone()),
            Some(other) => {
                return Err(ConfigError::new(
                    section.path_of("license_config"),
                    render(other),
                    "must be a mapping with the keys key and hmac",
                ))
            }
        },
    })
}

fn auth_from(
    section: &Section<'_>,
    literal_credentials: Option<&BTreeMap<String, String>>,
) -> Result<AuthConfig, ConfigError> {
    let auth_type = match section.string("type")?.as_deref() {
        None | Some("") => AuthType::default(),
        Some(raw) => AuthType::parse(raw).ok_or_else(|| {
            ConfigError::new(
                section.path_of("type"),
                raw,
                "unknown authentication type: use static, ephemeral or none (or the old \
                 names plaintext, longterm); names are case-sensitive",
            )
        })?,
    };
    let mut credentials = BTreeMap::new();
    if let Some(creds) = section.section("credentials")? {
        // A map, not a struct: keys match exactly.
        for (key, value) in creds.map {
            let value = match value {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => {
                    return Err(ConfigError::new(
                        creds.path_of(key),
                        format!("({})", type_name(other)),
                        "credentials must be strings: quote the value (an unquoted 0123 \
                         would otherwise lose its leading zero)",
                    ))
                }
            };
            credentials.insert(key.clone(), value);
        }
    }
    // Taken literally, keys and values alike: substitution inside a key must not add a
    // second entry beside the literal one (the JSON written back would not read the same).
    if let Some(literal) = literal_credentials {
        credentials = literal.clone();
    }
    Ok(AuthConfig {
        auth_type,
        realm: section.string("realm")?.unwrap_or_default(),
        credentials,
        lifetime: section.string("lifetime")?.unwrap_or_default(),
    })
}

fn listener_from(section: &Section<'_>) -> Result<ListenerDocument, ConfigError> {
    let protocol = match section.string("protocol")?.as_deref() {
        None | Some("") => ListenerProtocol::default(),
        Some(raw) => ListenerProtocol::parse(raw).ok_or_else(|| {
            ConfigError::new(
                section.path_of("protocol"),
                raw,
                "unknown listener protocol: use TURN-UDP, TURN-TCP, TURN-TLS or TURN-DTLS",
            )
        })?,
    };
    let port = section.port("port")?;
    Ok(ListenerDocument {
        name: section.string("name")?.unwrap_or_default(),
        protocol,
        public_address: section.string("public_address")?.unwrap_or_default(),
        public_port: section.integer("public_port")?.unwrap_or_default(),
        address: section.string("address")?.unwrap_or_default(),
        port,
        cert: section.string("cert")?.unwrap_or_default(),
        key: section.string("key")?.unwrap_or_default(),
        routes: section.strings("routes")?,
    })
}

fn cluster_from(section: &Section<'_>) -> Result<ClusterDocument, ConfigError> {
    let cluster_type = match section.string("type")?.as_deref() {
        None | Some("") => ClusterType::default(),
        Some(raw) => ClusterType::parse(raw).ok_or_else(|| {
            ConfigError::new(
                section.path_of("type"),
                raw,
                "unknown cluster type: use STATIC, STRICT_DNS or KUBERNETES",
            )
        })?,
    };
    let protocol = match section.string("protocol")?.as_deref() {
        None | Some("") => ClusterProtocol::default(),
        Some(raw) => ClusterProtocol::parse(raw).ok_or_else(|| {
            ConfigError::new(
                section.path_of("protocol"),
                raw,
                "unknown cluster protocol: use UDP or TCP",
            )
        })?,
    };
    Ok(ClusterDocument {
        name: section.string("name")?.unwrap_or_default(),
        cluster_type,
        protocol,
        endpoints: section.strings("endpoints")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(key: &str) -> Option<String> {
        match key {
            "A" => Some("alpha".into()),
            "B_2" => Some("beta".into()),
            _ => None,
        }
    }

    #[test]
    fn expand_env_follows_go_os_expand() {
        let cases = [
            ("$A", "alpha"),
            ("${A}", "alpha"),
            ("x$A.y", "xalpha.y"),
            ("$B_2/$A", "beta/alpha"),
            ("$UNSET", ""),
            ("pa$$word", "paword"),
            ("${}", ""),
            ("${A", "A"),
            ("$", "$"),
            ("cost: 5$", "cost: 5$"),
            ("$ x", "$ x"),
            ("$1", ""),
            ("${1}", ""),
            ("é$Aé", "éalphaé"),
            ("$é", "$é"),
        ];
        for (input, want) in cases {
            assert_eq!(expand_env(input, &env), want, "input {input:?}");
        }
    }

    #[test]
    fn lookup_is_case_insensitive_and_skips_null() {
        let doc: Value = serde_json::json!({"LogLevel": "a", "loglevel": null});
        let map = doc.as_object().unwrap();
        assert_eq!(lookup(map, "loglevel"), Some(&Value::String("a".into())));
        assert_eq!(lookup(map, "log_level"), None);
    }
}
