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

/// The scopes a spec may name: stunnerd's (a spec written for it keeps working, even where
/// uturn logs nothing under that scope) and `all`; `listener-`, `cluster-` and `relay-` take a
/// name after them.
pub const KNOWN_SCOPES: &[&str] = &[
    "all",
    "stunnerd",
    "stunner",
    "auth",
    "admin",
    "turn",
    "cds-client",
    "config-file-client",
    "dns-resolver",
    "metrics",
    "license",
    "cds-fwd",
    "offload",
];
const SCOPE_PREFIXES: &[&str] = &["listener-", "cluster-", "relay-"];

/// What is wrong with one item of a spec (stunnerd skips such items silently).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecProblem {
    /// Not `scope:LEVEL`.
    Malformed(String),
    /// A level that is none of the six.
    UnknownLevel {
        /// The item.
        item: String,
        /// The nearest level name, if one is close.
        nearest: Option<&'static str>,
    },
    /// A scope neither stunnerd nor uturn logs under: its level changes nothing.
    UnknownScope {
        /// The scope.
        scope: String,
        /// The nearest known scope, if one is close.
        nearest: Option<&'static str>,
    },
}

impl SpecProblem {
    /// Whether the item is skipped (a malformed item or an unknown level), rather than
    /// applied to a scope that nothing logs under.
    pub fn is_skipped(&self) -> bool {
        !matches!(self, SpecProblem::UnknownScope { .. })
    }
}

impl fmt::Display for SpecProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let levels = "DISABLE, ERROR, WARN, INFO, DEBUG or TRACE";
        match self {
            SpecProblem::Malformed(item) => write!(
                f,
                "item {item:?} is not scope:LEVEL: write e.g. all:INFO or all:INFO,stunner:DEBUG"
            ),
            SpecProblem::UnknownLevel { item, nearest } => {
                write!(f, "item {item:?} names no level uturn knows: ")?;
                match nearest {
                    Some(level) => write!(f, "did you mean {level}? (levels: {levels})"),
                    None => write!(f, "use {levels}"),
                }
            }
            SpecProblem::UnknownScope { scope, nearest } => {
                write!(
                    f,
                    "scope {scope:?} is not one stunnerd or uturn logs under: "
                )?;
                if let Some(known) = nearest {
                    write!(f, "did you mean {known}? ")?;
                }
                write!(
                    f,
                    "(scopes: {}, listener-<name>, cluster-<name>, relay-<name>)",
                    KNOWN_SCOPES.join(", ")
                )
            }
        }
    }
}

/// The problems of each item of `spec`, in order; empty for a spec that is all good.
pub fn check(spec: &str) -> Vec<SpecProblem> {
    let mut problems = Vec::new();
    for item in spec.split(',').filter(|item| !item.trim().is_empty()) {
        let Some((scope, level)) = item.split_once(':') else {
            problems.push(SpecProblem::Malformed(item.to_owned()));
            continue;
        };
        let scope = scope.trim();
        if scope.is_empty() {
            problems.push(SpecProblem::Malformed(item.to_owned()));
            continue;
        }
        if Level::parse(level.trim()).is_none() {
            problems.push(SpecProblem::UnknownLevel {
                item: item.to_owned(),
                nearest: crate::spelling::nearest(
                    level.trim(),
                    Level::ALL.iter().map(|level| level.name()),
                ),
            });
            continue;
        }
        let known = KNOWN_SCOPES.iter().any(|k| k.eq_ignore_ascii_case(scope))
            || SCOPE_PREFIXES
                .iter()
                .any(|p| scope.len() > p.len() && scope.starts_with(p));
        if !known {
            problems.push(SpecProblem::UnknownScope {
                scope: scope.to_owned(),
                nearest: crate::spelling::nearest(scope, KNOWN_SCOPES.iter().copied()),
            });
        }
    }
    problems
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
    fn check_names_each_skipped_item_and_each_unknown_scope() {
        assert_eq!(check(""), []);
        assert_eq!(
            check("all:INFO,turn:DEBUG,listener-udp:TRACE,stunnerd:warn"),
            []
        );
        let problems = check("all:INFOO,foo,stunerd:DEBUG,:INFO,xyz:ERROR");
        assert_eq!(
            problems,
            [
                SpecProblem::UnknownLevel {
                    item: "all:INFOO".into(),
                    nearest: Some("INFO")
                },
                SpecProblem::Malformed("foo".into()),
                SpecProblem::UnknownScope {
                    scope: "stunerd".into(),
                    nearest: Some("stunnerd")
                },
                SpecProblem::Malformed(":INFO".into()),
                SpecProblem::UnknownScope {
                    scope: "xyz".into(),
                    nearest: None
                },
            ]
        );
        assert!(problems[0].is_skipped() && problems[1].is_skipped());
        assert!(!problems[2].is_skipped());
        assert!(problems[0].to_string().contains("did you mean INFO?"));
        assert!(problems[2].to_string().contains("did you mean stunnerd?"));
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
