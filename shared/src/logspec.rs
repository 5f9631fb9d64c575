//! stunnerd's log level spec: `scope:LEVEL[,scope:LEVEL…]`, applied left to right, where
//! scope `all` sets the default and every scope named so far (stunnerd.md §1).

use std::collections::BTreeMap;
use std::fmt;

/// A log level, ordered from quietest to most verbose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Level {
    /// Nothing is logged.
    Disable,
    /// Errors only.
    Error,
    /// Warnings and errors.
    Warn,
    /// The default.
    #[default]
    Info,
    /// Debugging detail.
    Debug,
    /// Everything.
    Trace,
}

impl Level {
    /// Every level, quietest first; `Level::ALL[level as usize] == level`.
    pub const ALL: [Level; 6] = [
        Level::Disable,
        Level::Error,
        Level::Warn,
        Level::Info,
        Level::Debug,
        Level::Trace,
    ];

    /// The name a log spec uses: `DISABLE`, `ERROR`, `WARN`, `INFO`, `DEBUG` or `TRACE`.
    pub fn name(&self) -> &'static str {
        match self {
            Level::Disable => "DISABLE",
            Level::Error => "ERROR",
            Level::Warn => "WARN",
            Level::Info => "INFO",
            Level::Debug => "DEBUG",
            Level::Trace => "TRACE",
        }
    }

    /// Parses a level [`Level::name`], case-insensitively.
    pub fn parse(s: &str) -> Option<Level> {
        Level::ALL
            .into_iter()
            .find(|level| level.name().eq_ignore_ascii_case(s))
    }

    /// The label printed in log lines: the name, except `WARNING` for [`Level::Warn`] (as
    /// stunnerd prints it); [`Level::Disable`] never prints.
    pub fn label(&self) -> &'static str {
        match self {
            Level::Warn => "WARNING",
            other => other.name(),
        }
    }

    /// Whether a message at `message` level passes a logger set to `self`.
    pub fn enables(&self, message: Level) -> bool {
        message != Level::Disable && message <= *self
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The effective levels: a default plus per-scope overrides.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogSpec {
    default: Level,
    scopes: BTreeMap<String, Level>,
}

impl LogSpec {
    /// Parses a spec on top of the default `all:INFO`; malformed items are skipped.
    pub fn parse(spec: &str) -> LogSpec {
        let mut log_spec = LogSpec::default();
        log_spec.apply(spec);
        log_spec
    }

    /// Applies a spec on top of the current levels, as stunnerd does on every reconcile:
    /// scopes the spec does not mention keep their level unless an `all` item resets them.
    pub fn apply(&mut self, spec: &str) {
        for item in spec.split(',') {
            let Some((scope, level)) = item.split_once(':') else {
                continue;
            };
            let (scope, Some(level)) = (scope.trim(), Level::parse(level.trim())) else {
                continue;
            };
            if scope.eq_ignore_ascii_case("all") {
                self.default = level;
                self.scopes.values_mut().for_each(|l| *l = level);
            } else if !scope.is_empty() {
                self.scopes.insert(scope.to_owned(), level);
            }
        }
    }

    /// The level of scopes without an explicit one.
    pub fn default_level(&self) -> Level {
        self.default
    }

    /// The level of `scope`.
    pub fn level_for(&self, scope: &str) -> Level {
        self.scopes.get(scope).copied().unwrap_or(self.default)
    }

    /// The scopes with an explicit level, by name.
    pub fn scopes(&self) -> impl Iterator<Item = (&str, Level)> {
        self.scopes
            .iter()
            .map(|(scope, level)| (scope.as_str(), *level))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_quiet_to_verbose() {
        assert!(Level::ALL.windows(2).all(|w| w[0] < w[1]));
        assert!(Level::Info.enables(Level::Warn));
        assert!(!Level::Info.enables(Level::Debug));
        assert!(!Level::Disable.enables(Level::Error));
        assert!(!Level::Trace.enables(Level::Disable));
    }

    #[test]
    fn all_lists_every_level_at_its_own_index() {
        for (index, level) in Level::ALL.into_iter().enumerate() {
            assert_eq!(level as usize, index, "{level:?}");
            assert_eq!(Level::parse(level.name()), Some(level));
        }
    }

    #[test]
    fn level_names_parse_case_insensitively() {
        let cases = [
            ("DISABLE", Some(Level::Disable)),
            ("error", Some(Level::Error)),
            ("Warn", Some(Level::Warn)),
            ("info", Some(Level::Info)),
            ("DeBuG", Some(Level::Debug)),
            ("TRACE", Some(Level::Trace)),
            ("WARNING", None),
            ("", None),
            ("verbose", None),
        ];
        for (input, want) in cases {
            assert_eq!(Level::parse(input), want, "input {input:?}");
        }
    }

    #[test]
    fn labels_match_stunnerd_log_lines() {
        let cases = [
            (Level::Trace, "TRACE"),
            (Level::Debug, "DEBUG"),
            (Level::Info, "INFO"),
            (Level::Warn, "WARNING"),
            (Level::Error, "ERROR"),
        ];
        for (level, label) in cases {
            assert_eq!(level.label(), label);
            assert_eq!(level.to_string(), label);
        }
    }

    /// A spec, the default it yields, and the levels of some scopes.
    type SpecCase = (&'static str, Level, &'static [(&'static str, Level)]);

    #[test]
    fn spec_is_applied_left_to_right() {
        // (spec, default, [(scope, level)])
        let cases: &[SpecCase] = &[
            ("", Level::Info, &[("turn", Level::Info)]),
            ("all:INFO", Level::Info, &[("turn", Level::Info)]),
            (
                "all:INFO,turn:DEBUG",
                Level::Info,
                &[("turn", Level::Debug), ("auth", Level::Info)],
            ),
            ("turn:DEBUG,all:INFO", Level::Info, &[("turn", Level::Info)]),
            ("all:WARN", Level::Warn, &[("stunner", Level::Warn)]),
            ("ALL:trace", Level::Trace, &[("x", Level::Trace)]),
            ("all:INFO,turn:WARN", Level::Info, &[("turn", Level::Warn)]),
            (
                "stunner:TRACE,all:INFO",
                Level::Info,
                &[("stunner", Level::Info)],
            ),
            (
                "turn:DEBUG,all:ERROR,auth:TRACE",
                Level::Error,
                &[
                    ("turn", Level::Error),
                    ("auth", Level::Trace),
                    ("x", Level::Error),
                ],
            ),
            ("all:DISABLE", Level::Disable, &[("turn", Level::Disable)]),
            // Malformed items are skipped.
            ("turn", Level::Info, &[("turn", Level::Info)]),
            (
                "turn:LOUD,auth:DEBUG",
                Level::Info,
                &[("turn", Level::Info), ("auth", Level::Debug)],
            ),
            ("turn:DEBUG:x", Level::Info, &[("turn", Level::Info)]),
            (":DEBUG", Level::Info, &[("", Level::Info)]),
            (",,all:debug,", Level::Debug, &[("turn", Level::Debug)]),
            (" turn : debug ", Level::Info, &[("turn", Level::Debug)]),
            // Scopes other than `all` are case-sensitive.
            (
                "Turn:DEBUG",
                Level::Info,
                &[("turn", Level::Info), ("Turn", Level::Debug)],
            ),
        ];
        for (spec, default, scopes) in cases {
            let parsed = LogSpec::parse(spec);
            assert_eq!(parsed.default_level(), *default, "spec {spec:?}");
            for (scope, level) in *scopes {
                assert_eq!(
                    parsed.level_for(scope),
                    *level,
                    "spec {spec:?} scope {scope}"
                );
            }
        }
    }

    #[test]
    fn scopes_lists_explicit_levels() {
        let spec = LogSpec::parse("turn:DEBUG,auth:WARN,all:ERROR,stunner:TRACE");
        let scopes: Vec<_> = spec.scopes().collect();
        assert_eq!(
            scopes,
            [
                ("auth", Level::Error),
                ("stunner", Level::Trace),
                ("turn", Level::Error)
            ]
        );
    }

    #[test]
    fn apply_keeps_scopes_the_new_spec_does_not_name() {
        let mut spec = LogSpec::parse("all:INFO,turn:DEBUG");
        spec.apply("stunner:TRACE");
        assert_eq!(spec.level_for("turn"), Level::Debug);
        assert_eq!(spec.level_for("stunner"), Level::Trace);
        spec.apply("all:WARN");
        assert_eq!(spec.level_for("turn"), Level::Warn);
        assert_eq!(spec.level_for("stunner"), Level::Warn);
    }
}
