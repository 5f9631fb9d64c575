//! The metrics page: the dataplane records its counters through the `metrics` facade into a
//! recorder this page owns, the Prometheus exporter renders them, and the process's metrics
//! follow ([`super::process_metrics`]).

use super::MetricsSource;
use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString, Unit,
};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use metrics_util::MetricKindMask;
use std::time::Duration;

/// A gauge not set for this long is dropped from the page at the next scrape.
const GAUGE_IDLE: Duration = Duration::from_secs(1);

/// One metrics page. Each has a recorder of its own, not the process-global one, so two
/// control planes in one process never see each other's metrics.
pub(crate) struct MetricsPage {
    recorder: ExactLabels,
}

impl MetricsPage {
    /// A page with nothing recorded yet.
    pub(crate) fn new() -> MetricsPage {
        MetricsPage {
            // Every scrape sets each gauge that still exists (a listener's, a certificate's);
            // one no scrape set again (its listener is gone) leaves the page instead of
            // showing its last value for good.
            recorder: ExactLabels(
                PrometheusBuilder::new()
                    .idle_timeout(MetricKindMask::GAUGE, Some(GAUGE_IDLE))
                    .build_recorder(),
            ),
        }
    }

    /// The page's body: what `dataplane` records now, then the process's metrics, in the
    /// same order at every scrape ([`in_order`]).
    pub(crate) fn render(&self, dataplane: &MetricsSource) -> String {
        dataplane(&self.recorder);
        let mut body = in_order(&self.recorder.0.handle().render());
        super::process_metrics::render(&mut body);
        body
    }
}

/// The exporter's text with its families sorted by name and each counter's or gauge's samples
/// sorted (the exporter keeps them in hash maps, so two scrapes would list them in different
/// orders, which makes scrapes hard to compare). Families stay whole, each after its HELP and
/// TYPE lines; other kinds (histograms, whose buckets have an order) keep their samples as
/// they are.
fn in_order(text: &str) -> String {
    let mut families: Vec<(&str, Vec<&str>)> = text
        .split("\n\n")
        .filter(|family| !family.trim().is_empty())
        .map(|family| {
            let mut lines: Vec<&str> = family.lines().collect();
            let name = lines
                .iter()
                .find_map(|l| {
                    l.strip_prefix("# TYPE ")
                        .or_else(|| l.strip_prefix("# HELP "))
                })
                .or_else(|| lines.first().copied())
                .and_then(|l| l.split([' ', '{']).next())
                .unwrap_or("");
            let sortable = lines.iter().any(|l| {
                l.strip_prefix("# TYPE ")
                    .is_some_and(|t| t.ends_with(" counter") || t.ends_with(" gauge"))
            });
            if sortable {
                let samples = lines.iter().position(|l| !l.starts_with('#'));
                if let Some(first) = samples {
                    lines[first..].sort_unstable();
                }
            }
            (name, lines)
        })
        .collect();
    families.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = String::with_capacity(text.len());
    for (_, lines) in families {
        for line in lines {
            out.push_str(line);
            out.push('\n');
        }
        out.push('\n');
    }
    out
}

/// The exporter's recorder, handed label values it escapes exactly. Its sanitizer reads a
/// backslash that is followed by `\`, `"` or `n` as an escape already written and keeps it
/// (so `a\"b` would come out as `a"b`); doubling every backslash first makes each one of
/// the value come out as `\\`, as the text format asks.
struct ExactLabels(PrometheusRecorder);

impl ExactLabels {
    fn key<'a>(key: &'a Key) -> std::borrow::Cow<'a, Key> {
        if !key.labels().any(|label| label.value().contains('\\')) {
            return std::borrow::Cow::Borrowed(key);
        }
        let labels: Vec<Label> = key
            .labels()
            .map(|label| Label::new(label.key().to_string(), label.value().replace('\\', "\\\\")))
            .collect();
        std::borrow::Cow::Owned(Key::from_parts(key.name().to_string(), labels))
    }
}

impl Recorder for ExactLabels {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.0.register_counter(&ExactLabels::key(key), metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.0.register_gauge(&ExactLabels::key(key), metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.0.register_histogram(&ExactLabels::key(key), metadata)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn source(name: &'static str, value: u64) -> MetricsSource {
        Arc::new(move |recorder: &dyn Recorder| {
            metrics::with_local_recorder(recorder, || {
                metrics::describe_counter!("test_total", "A test counter");
                metrics::counter!("test_total", "name" => name).absolute(value);
            })
        })
    }

    #[test]
    fn label_values_are_escaped_as_the_text_format_asks() {
        let page = MetricsPage::new();
        let body = page.render(&source("a\\\"b\\\\c\\nd\"e\nf\\", 7));
        assert!(
            body.contains("# HELP test_total A test counter\n# TYPE test_total counter\n"),
            "{body}"
        );
        assert!(
            body.contains("test_total{name=\"a\\\\\\\"b\\\\\\\\c\\\\nd\\\"e\\nf\\\\\"} 7\n"),
            "{body}"
        );
        assert!(body.contains("\nprocess_open_fds "), "{body}");
    }

    #[test]
    fn families_and_their_samples_come_in_the_same_order_at_every_scrape() {
        let page = MetricsPage::new();
        let many = |recorder: &dyn Recorder| {
            metrics::with_local_recorder(recorder, || {
                for family in ["zeta_total", "alpha_total", "mid_total"] {
                    metrics::describe_counter!(family, "A test counter");
                    for name in ["q", "b", "x", "a", "m"] {
                        metrics::counter!(family, "name" => name).absolute(1);
                    }
                }
                metrics::gauge!("beta").set(2.0);
            })
        };
        let source: MetricsSource = Arc::new(many);
        // The recorded part (the process's own metrics, open descriptors say, move).
        let recorded = |body: String| body.split("# HELP process_").next().unwrap().to_string();
        let first = recorded(page.render(&source));
        for _ in 0..5 {
            assert_eq!(recorded(page.render(&source)), first);
        }
        let order: Vec<&str> = first
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(order, sorted, "{first}");
        assert!(
            first.contains("# HELP alpha_total A test counter\n# TYPE alpha_total counter\nalpha_total{name=\"a\"} 1\n"),
            "{first}"
        );
    }

    #[test]
    fn pages_keep_their_own_metrics_and_counters_follow_the_source() {
        let (first, second) = (MetricsPage::new(), MetricsPage::new());
        assert!(first
            .render(&source("first", 3))
            .contains("test_total{name=\"first\"} 3\n"));
        let body = second.render(&source("second", 5));
        assert!(body.contains("test_total{name=\"second\"} 5\n"), "{body}");
        assert!(!body.contains("first"), "{body}");
        assert!(first
            .render(&source("first", 4))
            .contains("test_total{name=\"first\"} 4\n"));
    }
}
