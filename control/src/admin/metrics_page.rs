//! The metrics page: the dataplane records its counters through the `metrics` facade into a
//! recorder this page owns, the Prometheus exporter renders them, and the process's metrics
//! follow ([`super::process_metrics`]).

use crate::MetricsSource;
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

    /// The page's body: what `dataplane` records now, then the process's metrics.
    pub(crate) fn render(&self, dataplane: &MetricsSource) -> String {
        dataplane(&self.recorder);
        let mut body = self.recorder.0.handle().render();
        super::process_metrics::render(&mut body);
        body
    }
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
