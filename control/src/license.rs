//! `--license`: the `admin.license_config` every config gets, the first one and each one an
//! origin sends later (uturn has no licensed features; the value is kept and shown redacted).

use uturn_shared::config::StunnerConfig;

/// The license a `--license` JSON gives: `{"key": …, "hmac": …}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct License(serde_json::Value);

impl License {
    /// Reads the JSON licensegen writes, `{"license_config":{"key":…,"hmac":…}}` or the bare
    /// `{"key":…,"hmac":…}`, both strings non-empty.
    pub fn parse(json: &str) -> Result<License, String> {
        let bad = || {
            "invalid --license: expecting the JSON licensegen writes, \
             {\"license_config\":{\"key\":\"…\",\"hmac\":\"…\"}} or {\"key\":\"…\",\"hmac\":\"…\"}, \
             with both fields non-empty"
                .to_owned()
        };
        let value: serde_json::Value = serde_json::from_str(json).map_err(|_| bad())?;
        let inner = value.get("license_config").unwrap_or(&value);
        let field = |key: &str| {
            inner
                .get(key)
                .and_then(|v| v.as_str())
                .filter(|v| !v.is_empty())
        };
        match (field("key"), field("hmac")) {
            (Some(key), Some(hmac)) => Ok(License(serde_json::json!({"key": key, "hmac": hmac}))),
            _ => Err(bad()),
        }
    }

    /// Replaces `config`'s `admin.license_config` with this license.
    pub fn apply(&self, config: &mut StunnerConfig) {
        config.admin.license_config = Some(self.0.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_of_licensegen_json_give_the_same_license() {
        let wrapped = License::parse(r#"{"license_config":{"key":"k","hmac":"h"}}"#).unwrap();
        let bare = License::parse(r#"{"key":"k","hmac":"h","extra":1}"#).unwrap();
        assert_eq!(wrapped, bare);
        let mut config = StunnerConfig::zero("ns/name");
        bare.apply(&mut config);
        assert_eq!(
            config.admin.license_config,
            Some(serde_json::json!({"key": "k", "hmac": "h"}))
        );
        for bad in ["", "{}", r#"{"key":"k"}"#, r#"{"key":"","hmac":"h"}"#] {
            assert!(
                License::parse(bad).unwrap_err().contains("--license"),
                "{bad}"
            );
        }
    }
}
