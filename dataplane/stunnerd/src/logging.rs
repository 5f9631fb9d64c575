//! stunnerd's log format: `HH:MM:SS.micro file:line: scope LEVEL: msg` (or JSON), filtered by
//! a log spec whose scopes are tracing targets.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use uturn_shared::logspec::{Level, LogSpec};

/// `--log-format`: how each log line is written.
// No `///` on the variants: clap would print them as a second list in `--help`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LogFormat {
    // stunnerd's `HH:MM:SS.micro file:line: scope LEVEL: msg`.
    Text,
    // One JSON object per line, with stunnerd's field names.
    Json,
}

/// The tracing filter that lets through what a logger set to `level` prints.
fn filter(level: Level) -> LevelFilter {
    match level {
        Level::Disable => LevelFilter::OFF,
        Level::Error => LevelFilter::ERROR,
        Level::Warn => LevelFilter::WARN,
        Level::Info => LevelFilter::INFO,
        Level::Debug => LevelFilter::DEBUG,
        Level::Trace => LevelFilter::TRACE,
    }
}

/// The stunnerd level of a tracing event, whose [`Level::label`] is printed.
fn level_of(level: tracing::Level) -> Level {
    match level {
        tracing::Level::ERROR => Level::Error,
        tracing::Level::WARN => Level::Warn,
        tracing::Level::INFO => Level::Info,
        tracing::Level::DEBUG => Level::Debug,
        tracing::Level::TRACE => Level::Trace,
    }
}

/// stunnerd's line layout, in text or JSON.
struct StunnerFormat {
    json: bool,
}

impl<S, N> FormatEvent<S, N> for StunnerFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        let label = level_of(*meta.level()).label();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let secs = now.as_secs() % 86_400;
        let mut message = String::new();
        ctx.format_fields(Writer::new(&mut message), event)?;
        let file = meta
            .file()
            .and_then(|f| f.rsplit('/').next())
            .unwrap_or("?");
        if self.json {
            let line = serde_like_json(&[
                ("time", &format!("{}", now.as_secs_f64())),
                ("level", label),
                ("scope", meta.target()),
                ("caller", &format!("{file}:{}", meta.line().unwrap_or(0))),
                ("msg", &message),
            ]);
            return writeln!(writer, "{line}");
        }
        writeln!(
            writer,
            "{:02}:{:02}:{:02}.{:06} {}:{}: {} {}: {}",
            secs / 3600,
            (secs / 60) % 60,
            secs % 60,
            now.subsec_micros(),
            file,
            meta.line().unwrap_or(0),
            meta.target(),
            label,
            message
        )
    }
}

fn serde_like_json(fields: &[(&str, &str)]) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "\"{k}\":\"");
        for c in v.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push('}');
    out
}

type ReloadHandle = tracing_subscriber::reload::Handle<Targets, tracing_subscriber::Registry>;

static RELOAD: std::sync::OnceLock<ReloadHandle> = std::sync::OnceLock::new();

fn targets(spec: &str) -> Targets {
    let spec = LogSpec::parse(spec);
    let mut targets = Targets::new().with_default(filter(spec.default_level()));
    for (scope, level) in spec.scopes() {
        targets = targets.with_target(scope.to_string(), filter(level));
    }
    // The STUN parser logs every malformed datagram; never let wire input format log lines.
    targets
        .with_target("stun_types", LevelFilter::ERROR)
        .with_target("stun_proto", LevelFilter::ERROR)
        .with_target("turn_types", LevelFilter::ERROR)
}

/// Installs the global logger for `spec`, writing lines in `format`.
pub(crate) fn init(spec: &str, format: LogFormat) {
    let (filter, handle) = tracing_subscriber::reload::Layer::new(targets(spec));
    let layer = tracing_subscriber::fmt::layer()
        .event_format(StunnerFormat {
            json: format == LogFormat::Json,
        })
        .with_writer(std::io::stdout);
    if tracing_subscriber::registry()
        .with(filter)
        .with(layer)
        .try_init()
        .is_ok()
    {
        let _ = RELOAD.set(handle);
    }
}

/// Switches the running logger to `spec` (an `admin.loglevel` from a new config).
pub(crate) fn set_spec(spec: &str) {
    if let Some(handle) = RELOAD.get() {
        if handle.reload(targets(spec)).is_ok() {
            tracing::info!(target: "stunnerd", "Setting loglevel to {spec:?}");
        }
    }
}

/// `admin.loglevel`, followed as each config is applied, unless `-l` or `-v` set the spec.
pub(crate) struct FollowedLevel {
    /// Whether the config's level is followed (no `-l`, no `-v`).
    follow: bool,
    /// The spec the log runs with.
    running: std::sync::Mutex<String>,
}

impl FollowedLevel {
    /// The log running with `spec`; with `follow`, each config's `admin.loglevel` replaces it.
    pub(crate) fn new(spec: String, follow: bool) -> FollowedLevel {
        FollowedLevel {
            follow,
            running: std::sync::Mutex::new(spec),
        }
    }

    /// Runs the log with `loglevel` (an applied config's) if it is followed and differs.
    pub(crate) fn apply(&self, loglevel: &str) {
        let Ok(mut running) = self.running.lock() else {
            return;
        };
        if self.follow && *running != loglevel {
            *running = loglevel.to_owned();
            set_spec(loglevel);
        }
    }
}
