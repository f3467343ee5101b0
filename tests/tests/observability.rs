//! Observability end to end, on the real processes: one request is one trace across
//! pd-router, pd-prefill and pd-decode (collected by an OTLP receiver inside the test), each
//! process's /metrics counts it with the right labels and returns to idle, and the router
//! logs one consistent record for it. Export failures never affect serving.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use pd_engine::{CacheConfig, Engine, LoadOptions};
use pd_tests::{model_path, sse_events, Cluster, Options};
use serde_json::{json, Value};

/// Spans received, with the `service.name` of the process that sent them.
#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<(String, Span)>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().expect("spans");
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    AnyValue::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                spans.extend(ss.spans.into_iter().map(|s| (service.clone(), s)));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Receiver {
    async fn start(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream_incoming(listener))
                .await;
        });
        format!("http://{addr}")
    }

    fn spans(&self) -> Vec<(String, Span)> {
        self.0.lock().expect("spans").clone()
    }
}

fn tokio_stream_incoming(
    listener: tokio::net::TcpListener,
) -> impl futures_util::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |l| async move {
        let conn = l.accept().await.map(|(s, _)| s);
        Some((conn, l))
    })
}

fn int_attr(span: &Span, key: &str) -> Option<i64> {
    span.attributes.iter().find(|kv| kv.key == key).and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
        AnyValue::IntValue(i) => Some(*i),
        _ => None,
    })
}

/// Checks the Prometheus text format line by line; returns `name{labels}` -> value.
fn parse_prometheus(text: &str) -> HashMap<String, f64> {
    let mut samples = HashMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(comment) = line.strip_prefix('#') {
            let kind = comment.split_whitespace().next().unwrap_or("");
            assert!(["HELP", "TYPE"].contains(&kind), "unexpected comment line: {line}");
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value: {line}"));
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name: {line}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "unclosed labels: {line}");
        }
        samples.insert(series.to_string(), value);
    }
    samples
}

fn sample(samples: &HashMap<String, f64>, series: &str) -> f64 {
    *samples.get(series).unwrap_or_else(|| {
        let mut names: Vec<_> =
            samples.keys().filter(|k| k.starts_with(&series[..series.find('{').unwrap_or(series.len())])).collect();
        names.sort();
        panic!("no sample `{series}`; similar: {names:?}")
    })
}

/// The KV bytes of a prompt of `tokens` tokens in f16, from the model's geometry.
fn kv_bytes(tokens: usize) -> u64 {
    let engine = Engine::load(&model_path(), LoadOptions::default(), CacheConfig::with_blocks(8)).expect("engine");
    let c = engine.model().config();
    let block = engine.cache().block_size();
    let blocks = tokens.div_ceil(block);
    // Whole blocks travel: K and V of every layer, f16.
    (blocks * block * c.kv_bytes_per_token(2)) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_with_metrics_and_a_record() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let options = Options {
        prefill: 1,
        env: vec![("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint), ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into())],
        router_args: vec!["--log-format".into(), "json".into()],
        capture_logs: true,
        ..Options::default()
    };
    let cluster = Cluster::start_with(options).await;
    let body = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{ "role": "user", "content": "Name three primary colors." }],
        "max_tokens": 12,
        "temperature": 0,
        "stream": true,
        "stream_options": { "include_usage": true },
    });
    let events = sse_events(&cluster.url("/v1/chat/completions"), &body, &[("x-pd-class", "batch")]).await;
    let chunks: Vec<Value> = events.iter().filter_map(|(_, d)| serde_json::from_str(d).ok()).collect();
    let streamed_tokens = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["finish_reason"].is_null() && !c["choices"].as_array().is_some_and(|a| a.is_empty())
        })
        .count();
    let usage = chunks.iter().find(|c| c["usage"].is_object()).expect("usage chunk")["usage"].clone();
    let prompt_tokens = usage["prompt_tokens"].as_u64().expect("prompt tokens") as usize;
    let completion_tokens = usage["completion_tokens"].as_u64().expect("completion tokens") as usize;
    assert_eq!(streamed_tokens, completion_tokens, "one chunk per token");
    let expected_kv = kv_bytes(prompt_tokens);
    let bucket = pd_telemetry_bucket(prompt_tokens);

    // --- one trace across the three processes --------------------------------------------
    let wanted = [
        "router.request",
        "router.queue",
        "router.route",
        "prefill.queue",
        "prefill.compute",
        "kv.send",
        "kv.receive",
        "decode.admit",
        "decode.generate",
    ];
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = receiver.spans();
        let names: HashSet<&str> = spans.iter().map(|(_, s)| s.name.as_str()).collect();
        if wanted.iter().all(|w| names.contains(w)) {
            break spans;
        }
        assert!(Instant::now() < deadline, "spans missing after 20 s; got {names:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let trace_ids: HashSet<&[u8]> = spans.iter().map(|(_, s)| s.trace_id.as_slice()).collect();
    assert_eq!(trace_ids.len(), 1, "one request, one trace id");
    let services: HashSet<&str> = spans.iter().map(|(svc, _)| svc.as_str()).collect();
    assert_eq!(services, HashSet::from(["pd-router", "pd-prefill", "pd-decode"]));
    let (_, root) = spans.iter().find(|(_, s)| s.name == "router.request").expect("root");
    assert!(root.parent_span_id.is_empty(), "router.request is the root");
    let parents: HashMap<&[u8], &[u8]> =
        spans.iter().map(|(_, s)| (s.span_id.as_slice(), s.parent_span_id.as_slice())).collect();
    for (service, span) in &spans {
        // Walk up: every span reaches the router's root.
        let mut id = span.span_id.as_slice();
        let mut hops = 0;
        while id != root.span_id.as_slice() {
            id = parents
                .get(id)
                .copied()
                .unwrap_or_else(|| panic!("{service} {} has a parent outside the trace", span.name));
            hops += 1;
            assert!(hops < 10, "parent cycle");
        }
    }
    let by_name =
        |name: &str| spans.iter().find(|(_, s)| s.name == name).map(|(svc, s)| (svc.as_str(), s)).expect(name);
    let (svc, send) = by_name("kv.send");
    assert_eq!(svc, "pd-prefill");
    assert_eq!(int_attr(send, "pd.kv.bytes"), Some(expected_kv as i64), "kv.send bytes");
    let (svc, recv) = by_name("kv.receive");
    assert_eq!(svc, "pd-decode");
    assert_eq!(int_attr(recv, "pd.kv.bytes"), Some(expected_kv as i64), "kv.receive bytes");
    assert_eq!(recv.parent_span_id, send.span_id, "kv.receive is a child of kv.send (context in the KV header)");
    let (_, compute) = by_name("prefill.compute");
    assert!(compute.events.iter().any(|e| e.name == "prefill.chunk"), "an event per chunk");
    let (_, generate) = by_name("decode.generate");
    assert_eq!(int_attr(generate, "gen_ai.usage.output_tokens"), Some(completion_tokens as i64));
    assert_eq!(int_attr(root, "gen_ai.usage.input_tokens"), Some(prompt_tokens as i64));
    assert_eq!(int_attr(root, "gen_ai.request.max_tokens"), Some(12));

    // --- metrics ------------------------------------------------------------------------
    let labels = format!("class=\"batch\",input_bucket=\"{bucket}\"");
    let router = parse_prometheus(&Cluster::scrape(&cluster.http).await);
    assert_eq!(sample(&router, &format!("pd_time_to_first_token_seconds_count{{{labels}}}")), 1.0);
    assert_eq!(
        sample(&router, &format!("pd_inter_token_latency_seconds_count{{{labels}}}")),
        (completion_tokens - 1) as f64
    );
    assert_eq!(sample(&router, &format!("pd_e2e_request_latency_seconds_count{{{labels}}}")), 1.0);
    assert_eq!(sample(&router, &format!("pd_time_to_first_token_seconds_bucket{{{labels},le=\"+Inf\"}}")), 1.0);
    assert_eq!(sample(&router, "pd_requests_total{class=\"batch\",outcome=\"ok\"}"), 1.0);
    // The failure counters' label sets exist at 0 before any failure (alerts can be written).
    for reason in ["stream_ended", "unavailable", "stream_broken"] {
        assert_eq!(sample(&router, &format!("pd_migrations_total{{reason=\"{reason}\"}}")), 0.0);
    }
    assert_eq!(sample(&router, "pd_requests_rejected_total{reason=\"overloaded\"}"), 0.0);
    let prefill = parse_prometheus(&Cluster::scrape(&cluster.prefill_metrics[0]).await);
    assert_eq!(sample(&prefill, "pd_kv_transfer_bytes_total"), expected_kv as f64);
    assert_eq!(sample(&prefill, &format!("pd_request_prefill_time_seconds_count{{{labels}}}")), 1.0);
    assert_eq!(sample(&prefill, &format!("pd_request_queue_time_seconds_count{{{labels}}}")), 1.0);
    assert_eq!(sample(&prefill, "pd_waiting_prefill_tokens"), 0.0);
    assert_eq!(sample(&prefill, "pd_queue_oldest_age_seconds"), 0.0);
    let decode = parse_prometheus(&Cluster::scrape(&cluster.decode_metrics).await);
    assert_eq!(sample(&decode, "pd_kv_transfer_bytes_total"), expected_kv as f64);
    assert_eq!(sample(&decode, &format!("pd_kv_transfer_time_seconds_count{{{labels}}}")), 1.0);
    assert_eq!(sample(&decode, &format!("pd_request_decode_time_seconds_count{{{labels}}}")), 1.0);
    assert_eq!(sample(&decode, "pd_running_decode_sequences"), 0.0);
    assert_eq!(sample(&decode, "pd_kv_cache_usage_ratio"), 0.0);

    // --- the request record -------------------------------------------------------------
    let log = cluster.log("pd-router");
    let records: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "request finished")
        .collect();
    assert_eq!(records.len(), 1, "one record per request; log:\n{log}");
    let r = &records[0];
    for field in [
        "request_id",
        "class",
        "input_tokens",
        "output_tokens",
        "queue_ms",
        "prefill_ms",
        "kv_transfer_ms",
        "ttft_ms",
        "decode_ms",
        "itl_p50_ms",
        "itl_p95_ms",
        "e2e_ms",
        "prefill_worker",
        "decode_worker",
        "outcome",
    ] {
        assert!(!r[field].is_null(), "record lacks `{field}`: {r}");
    }
    assert_eq!(r["class"], "batch");
    assert_eq!(r["outcome"], "ok");
    assert_eq!(r["input_tokens"].as_u64(), Some(prompt_tokens as u64));
    assert_eq!(r["output_tokens"].as_u64(), Some(completion_tokens as u64), "output tokens = streamed tokens");
    assert_eq!(r["prefill_worker"], cluster.prefill_addrs[0].as_str());
    assert_eq!(r["decode_worker"], cluster.decode_addr.as_str());
    let ms = |f: &str| r[f].as_f64().unwrap_or_else(|| panic!("`{f}` is not a number: {r}"));
    for f in ["queue_ms", "prefill_ms", "kv_transfer_ms", "ttft_ms", "decode_ms", "itl_p50_ms", "itl_p95_ms", "e2e_ms"]
    {
        assert!(ms(f) >= 0.0, "{f} negative: {r}");
    }
    assert!(ms("ttft_ms") >= ms("prefill_ms"), "ttft includes prefill: {r}");
    assert!(ms("e2e_ms") >= ms("ttft_ms"), "{r}");
    assert!(ms("itl_p95_ms") >= ms("itl_p50_ms"), "{r}");
    assert_eq!(r["trace_id"].as_str().map(str::len), Some(32), "the record names its trace");

    // --- what users wrote and got stays out of logs and traces ---------------------------
    let answer: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert!(answer.trim().len() >= 6, "a real answer to look for: {answer:?}");
    for content in ["Name three primary colors", answer.trim()] {
        for (service, span) in &spans {
            assert!(!format!("{span:?}").contains(content), "{service} put {content:?} in span {}", span.name);
        }
        for process in ["pd-router", "pd-prefill-0", "pd-decode"] {
            assert!(!cluster.log(process).contains(content), "{process} logged {content:?}");
        }
    }
}

fn pd_telemetry_bucket(tokens: usize) -> &'static str {
    // Same ranges as pd_telemetry::input_bucket (checked in its unit test).
    match tokens {
        0..=128 => "1-128",
        129..=512 => "129-512",
        513..=2048 => "513-2048",
        2049..=8192 => "2049-8192",
        _ => "8193+",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_warns_once_and_serving_goes_on() {
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let options = Options {
        prefill: 1,
        env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), format!("http://{closed}")),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "50".into()),
        ],
        capture_logs: true,
        ..Options::default()
    };
    let cluster = Cluster::start_with(options).await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let r = client
            .post(cluster.url("/v1/completions"))
            .json(&json!({ "model": "SmolLM2-135M-Instruct", "prompt": "The sky is", "max_tokens": 4 }))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 200, "serving works without a collector");
        tokio::time::sleep(Duration::from_millis(400)).await; // several export attempts
    }
    for name in ["pd-router", "pd-prefill-0", "pd-decode"] {
        let log = cluster.log(name);
        let warnings = log.lines().filter(|l| l.contains("exporting spans failed")).count();
        assert_eq!(warnings, 1, "{name} warns exactly once:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_nothing_exports() {
    let options = Options { prefill: 1, capture_logs: true, ..Options::default() };
    let cluster = Cluster::start_with(options).await;
    let r = reqwest::Client::new()
        .post(cluster.url("/v1/completions"))
        .json(&json!({ "model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 2 }))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status().as_u16(), 200);
    for name in ["pd-router", "pd-prefill-0", "pd-decode"] {
        let log = cluster.log(name);
        assert!(!log.contains("OTLP") && !log.contains("exporting spans"), "{name} must not export:\n{log}");
        assert!(log.contains("request finished") || name != "pd-router", "the router logs its record:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_log_content_the_record_carries_prompt_answer_and_tenant() {
    let dir = tempfile::tempdir().expect("folder");
    let classes = dir.path().join("classes.toml");
    let built_in = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/classes/default.toml"))
        .expect("the built-in classes");
    std::fs::write(&classes, format!("{built_in}\n[tenants.acme]\napi_keys = [\"k-acme\"]\n")).expect("write");
    let mut router_args: Vec<String> = ["--log-format", "json", "--log-content", "--classes"].map(String::from).into();
    router_args.push(classes.display().to_string());
    let options = Options { prefill: 1, capture_logs: true, router_args, ..Options::default() };
    let cluster = Cluster::start_with(options).await;
    let prompt = "The capital of France is";
    let body: Value = reqwest::Client::new()
        .post(cluster.url("/v1/completions"))
        .bearer_auth("k-acme")
        .json(&json!({ "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4, "temperature": 0 }))
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("JSON");
    let answer = body["choices"][0]["text"].as_str().expect("text").to_string();
    let log = cluster.log("pd-router");
    let record = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "request finished")
        .unwrap_or_else(|| panic!("no record in:\n{log}"));
    assert_eq!(record["tenant"], "acme", "{record}");
    assert!(record["prompt"].as_str().is_some_and(|p| p.contains(prompt)), "{record}");
    assert_eq!(record["completion"].as_str(), Some(answer.as_str()), "{record}");
}
