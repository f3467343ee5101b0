//! Prometheus metrics with docs/design.md's names and vLLM's meanings, one registry per process.
//!
//! Each process registers only what it measures (`RouterMetrics`, `PrefillMetrics`,
//! `DecodeMetrics`), so a gauge that drives autoscaling never shows a misleading zero from a
//! process that does not own it. Histograms are classic Prometheus histograms (aggregatable
//! across pods) with buckets from 1 ms to 5 min. Latency histograms carry the labels
//! `class` (traffic class, from the request) and `input_bucket` (prompt length range).

use std::sync::Mutex;

use prometheus::{
    Counter, Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
    TextEncoder,
};

/// Histogram buckets in seconds: milliseconds to minutes.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

/// Metric names (docs/design.md, Observability). Autoscalers and dashboards use these.
pub mod names {
    pub const TTFT: &str = "pd_time_to_first_token_seconds";
    pub const ITL: &str = "pd_inter_token_latency_seconds";
    pub const E2E: &str = "pd_e2e_request_latency_seconds";
    pub const QUEUE_TIME: &str = "pd_request_queue_time_seconds";
    pub const PREFILL_TIME: &str = "pd_request_prefill_time_seconds";
    pub const KV_TRANSFER_TIME: &str = "pd_kv_transfer_time_seconds";
    pub const KV_TRANSFER_BYTES: &str = "pd_kv_transfer_bytes_total";
    pub const KV_TRANSFERS: &str = "pd_kv_transfers_total";
    pub const DECODE_TIME: &str = "pd_request_decode_time_seconds";
    pub const WAITING_PREFILL_TOKENS: &str = "pd_waiting_prefill_tokens";
    pub const RUNNING_DECODE_SEQUENCES: &str = "pd_running_decode_sequences";
    pub const KV_CACHE_USAGE: &str = "pd_kv_cache_usage_ratio";
    pub const QUEUE_OLDEST_AGE: &str = "pd_queue_oldest_age_seconds";
    pub const REJECTED: &str = "pd_requests_rejected_total";
    pub const PREFILL_RETRIES: &str = "pd_prefill_retries_total";
    pub const REQUESTS: &str = "pd_requests_total";
    pub const ROUTE_DECISIONS: &str = "pd_route_decisions_total";
    pub const ROUTER_QUEUE_TIME: &str = "pd_router_queue_time_seconds";
    pub const ROUTER_QUEUED: &str = "pd_router_queued_requests";
    pub const ROUTER_INDEXED_BLOCKS: &str = "pd_router_indexed_blocks";
    pub const MIGRATIONS: &str = "pd_migrations_total";
    pub const PREFIX_QUERIES: &str = "pd_prefix_cache_queries_total";
    pub const PREFIX_HITS: &str = "pd_prefix_cache_hits_total";
    pub const CACHED_BLOCKS: &str = "pd_kv_cached_blocks";
    pub const PREEMPTIONS: &str = "pd_preemptions_total";
    pub const PREEMPTED_COMPUTE: &str = "pd_preempted_compute_seconds_total";
}

/// Upper bounds of the input-length buckets, in prompt tokens.
const INPUT_BUCKETS: &[(usize, &str)] = &[(128, "1-128"), (512, "129-512"), (2048, "513-2048"), (8192, "2049-8192")];

/// The `input_bucket` label of a prompt of `tokens` tokens.
pub fn input_bucket(tokens: usize) -> &'static str {
    INPUT_BUCKETS.iter().find(|(max, _)| tokens <= *max).map(|(_, l)| *l).unwrap_or("8193+")
}

/// The labels of a request's stage histograms: its traffic class and its prompt's input bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageLabels {
    pub class: String,
    pub input_bucket: &'static str,
}

impl StageLabels {
    pub fn new(class: &RequestClass, prompt_tokens: usize) -> Self {
        StageLabels { class: class.as_str().to_string(), input_bucket: input_bucket(prompt_tokens) }
    }

    /// Records `seconds` in `histogram` under these labels.
    pub fn observe(&self, histogram: &HistogramVec, seconds: f64) {
        histogram.with_label_values(&[self.class.as_str(), self.input_bucket]).observe(seconds);
    }
}

/// A request's traffic class (`x-pd-class` header or metadata): 1 to 32 characters of
/// `a-z 0-9 _ -`, so label cardinality stays bounded by what operators name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestClass(String);

impl RequestClass {
    /// The header and metadata key that carries the class.
    pub const HEADER: &'static str = "x-pd-class";

    pub fn parse(s: &str) -> Result<Self, String> {
        let ok = (1..=32).contains(&s.len())
            && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if ok {
            Ok(RequestClass(s.to_string()))
        } else {
            Err(format!(
                "class `{}` must be 1-32 characters of a-z, 0-9, `_` and `-`",
                s.chars().take(40).collect::<String>()
            ))
        }
    }

    /// The class in a worker request's metadata (the router checked it; default otherwise).
    pub fn from_metadata(metadata: &tonic::metadata::MetadataMap) -> Self {
        metadata
            .get(Self::HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| Self::parse(s).ok())
            .unwrap_or_else(Self::default_class)
    }

    /// The class of a request that names none.
    pub fn default_class() -> Self {
        RequestClass("default".into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

type ScrapeHook = Box<dyn Fn() + Send + Sync>;

/// One process's registry.
pub struct Metrics {
    registry: Registry,
    hooks: Mutex<Vec<ScrapeHook>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

// Registering a well-formed, unique metric cannot fail; the names are constants above.
#[allow(clippy::expect_used)]
impl Metrics {
    pub fn new() -> Self {
        Metrics { registry: Registry::new(), hooks: Mutex::new(Vec::new()) }
    }

    pub fn histogram(&self, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
        let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()), labels)
            .expect("valid histogram");
        self.registry.register(Box::new(h.clone())).expect("unique metric name");
        h
    }

    pub fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter");
        self.registry.register(Box::new(c.clone())).expect("unique metric name");
        c
    }

    pub fn counter(&self, name: &str, help: &str) -> IntCounter {
        let c = IntCounter::new(name, help).expect("valid counter");
        self.registry.register(Box::new(c.clone())).expect("unique metric name");
        c
    }

    pub fn float_counter(&self, name: &str, help: &str) -> Counter {
        let c = Counter::new(name, help).expect("valid counter");
        self.registry.register(Box::new(c.clone())).expect("unique metric name");
        c
    }

    pub fn gauge(&self, name: &str, help: &str) -> Gauge {
        let g = Gauge::new(name, help).expect("valid gauge");
        self.registry.register(Box::new(g.clone())).expect("unique metric name");
        g
    }

    pub fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid gauge");
        self.registry.register(Box::new(g.clone())).expect("unique metric name");
        g
    }

    /// Runs `hook` before every scrape (for gauges read from live state).
    pub fn on_scrape(&self, hook: impl Fn() + Send + Sync + 'static) {
        if let Ok(mut hooks) = self.hooks.lock() {
            hooks.push(Box::new(hook));
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        if let Ok(hooks) = self.hooks.lock() {
            hooks.iter().for_each(|h| h());
        }
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

const STAGE_LABELS: &[&str] = &["class", "input_bucket"];

/// What the router measures: latency as the client sees it.
#[derive(Debug, Clone)]
pub struct RouterMetrics {
    pub ttft: HistogramVec,
    pub itl: HistogramVec,
    pub e2e: HistogramVec,
    pub requests: IntCounterVec,
    pub rejected: IntCounterVec,
    /// Prefills re-sent to another prefill worker after a failure.
    pub prefill_retries: IntCounter,
    /// Requests re-issued to another decode worker after theirs was lost, by why.
    pub migrations: IntCounterVec,
    /// Where each prompt was prefilled (`where`: local or remote) and why.
    pub route_decisions: IntCounterVec,
    /// Time a request waited in the router's class queue before dispatch.
    pub queue_time: HistogramVec,
    /// Requests waiting in the router's queues, by class.
    pub queued: GaugeVec,
    /// Blocks the router's prefix index credits to each worker, by pool and worker address.
    pub indexed_blocks: GaugeVec,
}

impl RouterMetrics {
    pub fn register(m: &Metrics) -> Self {
        RouterMetrics {
            ttft: m.histogram(names::TTFT, "Request arrival to the first token sent to the client.", STAGE_LABELS),
            itl: m.histogram(names::ITL, "Every gap between consecutive tokens sent to a client.", STAGE_LABELS),
            e2e: m.histogram(names::E2E, "Request arrival to its last token.", STAGE_LABELS),
            requests: m.counter_vec(names::REQUESTS, "Finished requests by outcome.", &["class", "outcome"]),
            rejected: m.counter_vec(names::REJECTED, "Requests refused before generating, by reason.", &["reason"]),
            prefill_retries: m
                .counter(names::PREFILL_RETRIES, "Prefills re-sent to another prefill worker after a failure."),
            migrations: m.counter_vec(
                names::MIGRATIONS,
                "Requests continued on another decode worker after theirs was lost mid-stream, by why.",
                &["reason"],
            ),
            route_decisions: m.counter_vec(
                names::ROUTE_DECISIONS,
                "Where prompts were prefilled (local: on the decode worker) and why.",
                &["where", "reason"],
            ),
            queue_time: m.histogram(
                names::ROUTER_QUEUE_TIME,
                "Request arrival to its dispatch from the router's class queue.",
                &["class"],
            ),
            queued: m.gauge_vec(names::ROUTER_QUEUED, "Requests waiting in the router's queues.", &["class"]),
            indexed_blocks: m.gauge_vec(
                names::ROUTER_INDEXED_BLOCKS,
                "Cached KV blocks the router's prefix index credits to each worker (its view of pd_kv_cached_blocks).",
                &["pool", "worker"],
            ),
        }
    }
}

/// What a prefill worker measures.
#[derive(Debug, Clone)]
pub struct PrefillMetrics {
    pub queue_time: HistogramVec,
    pub prefill_time: HistogramVec,
    pub kv_transfer_bytes: IntCounter,
    /// Transfers by transport (`grpc`, `ucx`) and outcome (`committed`, `failed`).
    pub kv_transfers: IntCounterVec,
    pub waiting_tokens: Gauge,
    pub oldest_age: Gauge,
    pub rejected: IntCounterVec,
    pub prefix: PrefixMetrics,
    /// Prefill steps stopped between layers for a short prompt, and the compute they threw
    /// away (their chunks ran again).
    pub preemptions: IntCounter,
    pub preempted_compute: Counter,
}

impl PrefillMetrics {
    pub fn register(m: &Metrics) -> Self {
        PrefillMetrics {
            queue_time: m.histogram(
                names::QUEUE_TIME,
                "Prefill request arrival to the start of its compute.",
                STAGE_LABELS,
            ),
            prefill_time: m.histogram(names::PREFILL_TIME, "Prefill compute, first chunk to last layer.", STAGE_LABELS),
            kv_transfer_bytes: m.counter(names::KV_TRANSFER_BYTES, "KV bytes sent to decode workers and committed."),
            kv_transfers: m.counter_vec(
                names::KV_TRANSFERS,
                "Prefill-to-decode KV transfers, by transport and outcome.",
                &["transport", "outcome"],
            ),
            waiting_tokens: m.gauge(names::WAITING_PREFILL_TOKENS, "Prompt tokens of queued and running prefills."),
            oldest_age: m
                .gauge(names::QUEUE_OLDEST_AGE, "Age of the oldest prefill still waiting to start (0 when none)."),
            rejected: m.counter_vec(names::REJECTED, "Prefill requests refused, by reason.", &["reason"]),
            prefix: PrefixMetrics::register(m),
            preemptions: m.counter(
                names::PREEMPTIONS,
                "Prefill steps of long prompts stopped between layers for a short prompt (their chunks ran again).",
            ),
            preempted_compute: m
                .float_counter(names::PREEMPTED_COMPUTE, "Compute of preempted prefill steps, thrown away and redone."),
        }
    }
}

/// A worker's prefix cache (vLLM's meanings: prompt tokens looked up, and found).
#[derive(Debug, Clone)]
pub struct PrefixMetrics {
    pub queries: IntCounter,
    pub hits: IntCounter,
    pub cached_blocks: Gauge,
}

impl PrefixMetrics {
    pub fn register(m: &Metrics) -> Self {
        PrefixMetrics {
            queries: m.counter(names::PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache."),
            hits: m.counter(names::PREFIX_HITS, "Prompt tokens found in the prefix cache (not computed again)."),
            cached_blocks: m.gauge(names::CACHED_BLOCKS, "KV blocks whose content the prefix cache can reuse."),
        }
    }

    /// One prompt of `prompt` tokens whose first `cached` were found.
    pub fn observe(&self, prompt: usize, cached: usize) {
        self.queries.inc_by(prompt as u64);
        self.hits.inc_by(cached as u64);
    }
}

/// What a decode worker measures.
#[derive(Debug, Clone)]
pub struct DecodeMetrics {
    pub kv_transfer_time: HistogramVec,
    pub kv_transfer_bytes: IntCounter,
    pub decode_time: HistogramVec,
    pub running: Gauge,
    pub kv_usage: Gauge,
    pub rejected: IntCounterVec,
    pub prefix: PrefixMetrics,
}

impl DecodeMetrics {
    pub fn register(m: &Metrics) -> Self {
        DecodeMetrics {
            kv_transfer_time: m.histogram(
                names::KV_TRANSFER_TIME,
                "KV receive, header accepted to commit.",
                STAGE_LABELS,
            ),
            kv_transfer_bytes: m.counter(names::KV_TRANSFER_BYTES, "KV bytes received and committed."),
            decode_time: m.histogram(
                names::DECODE_TIME,
                "First token to last token on the decode worker.",
                STAGE_LABELS,
            ),
            running: m.gauge(names::RUNNING_DECODE_SEQUENCES, "Sequences in the running decode batch."),
            kv_usage: m.gauge(names::KV_CACHE_USAGE, "Used KV blocks / all KV blocks (reservations included)."),
            rejected: m.counter_vec(names::REJECTED, "Decode requests refused, by reason.", &["reason"]),
            prefix: PrefixMetrics::register(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_buckets_cover_every_length() {
        assert_eq!(input_bucket(1), "1-128");
        assert_eq!(input_bucket(128), "1-128");
        assert_eq!(input_bucket(129), "129-512");
        assert_eq!(input_bucket(2048), "513-2048");
        assert_eq!(input_bucket(2049), "2049-8192");
        assert_eq!(input_bucket(100_000), "8193+");
    }

    #[test]
    fn classes_are_bounded() {
        assert!(RequestClass::parse("interactive").is_ok());
        assert!(RequestClass::parse("batch-document_2").is_ok());
        for bad in ["", "Interactive", "a b", "x".repeat(33).as_str(), "é"] {
            let err = RequestClass::parse(bad).expect_err("bad class");
            assert!(err.contains("class"), "{err}");
        }
    }

    #[test]
    fn render_has_histograms_with_labels_and_scrape_hooks_run() {
        let m = Metrics::new();
        let r = RouterMetrics::register(&m);
        let class = RequestClass::parse("interactive").expect("class");
        StageLabels::new(&class, 100).observe(&r.ttft, 0.2);
        let g = m.gauge("pd_test_gauge", "test");
        let g2 = g.clone();
        m.on_scrape(move || g2.set(7.0));
        let text = m.render();
        assert!(
            text.contains(
                "pd_time_to_first_token_seconds_bucket{class=\"interactive\",input_bucket=\"1-128\",le=\"0.25\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("pd_time_to_first_token_seconds_count{class=\"interactive\",input_bucket=\"1-128\"} 1"));
        assert!(text.contains("pd_test_gauge 7"));
        assert!(text.contains("le=\"300\""));
    }
}
