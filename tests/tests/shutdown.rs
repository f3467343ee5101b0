//! Graceful shutdown on SIGTERM, on the real processes (what Kubernetes does on a rolling
//! update or scale-down): a decode worker refuses new streams, lets running ones finish (or
//! ends them with a typed error once the grace period is over) and exits with every KV
//! block free; a prefill worker finishes the prefill it accepted; the router fails
//! `/ready` before it exits.

use std::time::{Duration, Instant};

use pd_tests::{sse_events, Cluster, Options};
use serde_json::{json, Value};

fn chat(max_tokens: u32) -> Value {
    json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{ "role": "user", "content": "Tell me a long story about a lighthouse keeper." }],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    })
}

/// The SSE payloads of a stream: (chunks with a token, the error event if any, saw [DONE]).
fn summarize(events: &[(Instant, String)]) -> (usize, Option<Value>, bool) {
    let mut tokens = 0;
    let mut error = None;
    let mut done = false;
    for (_, data) in events {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).expect("json event");
        if v.get("error").is_some() {
            error = Some(v);
        } else if v["choices"][0]["finish_reason"].is_null() {
            tokens += 1;
        }
    }
    (tokens, error, done)
}

async fn metric(addr: &str, name: &str) -> Option<f64> {
    let text = reqwest::get(format!("http://{addr}/metrics")).await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} ")).and_then(|v| v.parse().ok()))
}

/// The streams these tests need running together go as the batch class: its ITL SLO is
/// loose, so the router does not hold them back when a busy machine slows decode steps
/// (interactive streams stop joining near 75% of their 100 ms ITL SLO).
const BATCH: &[(&str, &str)] = &[("x-pd-class", "batch")];

/// Waits until the decode worker runs `n` sequences.
async fn wait_running(cluster: &Cluster, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&cluster.decode_metrics, "pd_running_decode_sequences").await.unwrap_or(0.0) < n {
        assert!(Instant::now() < deadline, "the streams never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_worker_drains_running_streams_then_exits_with_no_kv_used() {
    let options = Options {
        prefill: 1,
        decode_args: vec!["--grace-ms".into(), "60000".into()],
        capture_logs: true,
        ..Options::default()
    };
    let mut cluster = Cluster::start_with(options).await;
    let url = cluster.url("/v1/chat/completions");
    let streams: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { sse_events(&url, &chat(48), BATCH).await })
        })
        .collect();
    wait_running(&cluster, 3.0).await;
    cluster.decode.terminate();
    // Not ready any more, and new streams are refused (no decode worker takes them).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let ready = reqwest::get(format!("http://{}/ready", cluster.decode_metrics)).await.expect("ready").status();
    assert_eq!(ready.as_u16(), 503, "a draining decode worker is not ready");
    let refused = reqwest::Client::new().post(&url).json(&chat(4)).send().await.expect("request");
    assert_eq!(refused.status().as_u16(), 503, "new streams are refused while draining");
    // The running streams finish normally.
    for s in streams {
        let events = s.await.expect("stream task");
        let (tokens, error, done) = summarize(&events);
        assert!(error.is_none(), "a running stream must finish: {error:?}");
        assert!(done, "[DONE] ends the stream");
        assert_eq!(tokens, 48, "the whole output arrives");
    }
    let status = cluster.decode.exited(Duration::from_secs(10)).await.expect("the decode worker exits after draining");
    assert!(status.success(), "clean exit: {status}");
    let log = cluster.log("pd-decode");
    let drained = log.lines().find(|l| l.contains("drained")).unwrap_or_else(|| panic!("no drain line:\n{log}"));
    assert!(drained.contains("kv_cache_usage=0"), "every KV block free before exit: {drained}");
    assert!(!log.contains("grace period over"), "nothing was cut off:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_worker_ends_streams_with_a_typed_error_after_the_grace_period() {
    let options = Options {
        prefill: 1,
        decode_args: vec!["--grace-ms".into(), "300".into()],
        capture_logs: true,
        ..Options::default()
    };
    let mut cluster = Cluster::start_with(options).await;
    let url = cluster.url("/v1/chat/completions");
    let streams: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { sse_events(&url, &chat(1000), BATCH).await })
        })
        .collect();
    wait_running(&cluster, 2.0).await;
    let stopped = Instant::now();
    cluster.decode.terminate();
    for s in streams {
        let events = tokio::time::timeout(Duration::from_secs(10), s)
            .await
            .expect("streams end soon after the grace period")
            .expect("task");
        let (tokens, error, done) = summarize(&events);
        assert!(tokens < 1000, "cut off before the end");
        assert!(!done, "no [DONE] for a stream that did not finish");
        let error = error.expect("an error event");
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("shut down"), "the error names the shutdown: {error}");
        assert_eq!(error["error"]["type"], "service_unavailable");
    }
    let status = cluster.decode.exited(Duration::from_secs(10)).await.expect("exits");
    assert!(status.success(), "{status}");
    assert!(stopped.elapsed() < Duration::from_secs(10));
    let log = cluster.log("pd-decode");
    assert!(log.contains("grace period over"), "{log}");
    let drained = log.lines().find(|l| l.contains("drained")).expect("drain line");
    assert!(drained.contains("kv_cache_usage=0"), "{drained}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_worker_finishes_the_prefill_it_accepted() {
    let mut cluster = Cluster::start_with(Options { prefill: 1, ..Options::default() }).await;
    // A long prompt keeps the prefill worker busy for a while.
    let prompt = "The lighthouse keeper wrote in his log every night. ".repeat(130);
    let body = json!({ "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4 });
    let url = cluster.url("/v1/completions");
    let request = tokio::spawn({
        let url = url.clone();
        async move { reqwest::Client::new().post(&url).json(&body).send().await.expect("request") }
    });
    let metrics = cluster.prefill_metrics[0].clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&metrics, "pd_waiting_prefill_tokens").await.unwrap_or(0.0) == 0.0 {
        assert!(Instant::now() < deadline, "the prefill never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cluster.prefill[0].terminate();
    let response = request.await.expect("task");
    assert_eq!(response.status().as_u16(), 200, "the accepted prefill completes");
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["usage"]["completion_tokens"], 4);
    let status = cluster.prefill[0].exited(Duration::from_secs(10)).await.expect("exits once idle");
    assert!(status.success(), "{status}");
    // The router notices at its next refresh (readiness fails: the prefill pool is empty) and
    // then prefills on the decode worker instead of failing the request.
    let deadline = Instant::now() + Duration::from_secs(5);
    while reqwest::get(cluster.url("/ready")).await.is_ok_and(|r| r.status().is_success()) {
        assert!(Instant::now() < deadline, "the router still reports a prefill worker");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let served = reqwest::Client::new()
        .post(&url)
        .json(&json!({ "model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2 }))
        .send()
        .await
        .expect("request");
    assert_eq!(served.status().as_u16(), 200, "served by the decode worker");
    let metrics = reqwest::get(cluster.url("/metrics")).await.expect("metrics").text().await.expect("text");
    let line = "pd_route_decisions_total{reason=\"no_prefill_worker\",where=\"local\"} 1";
    assert!(metrics.contains(line), "{line} in\n{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_fails_readiness_before_it_exits() {
    let options =
        Options { prefill: 1, router_args: vec!["--drain-delay-ms".into(), "1500".into()], ..Options::default() };
    let mut cluster = Cluster::start_with(options).await;
    let ready = |c: &Cluster| reqwest::get(c.url("/ready"));
    assert_eq!(ready(&cluster).await.expect("ready").status().as_u16(), 200);
    cluster.router.terminate();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(cluster.router.running(), "still running during the drain delay");
    assert_eq!(ready(&cluster).await.expect("ready while draining").status().as_u16(), 503, "/ready fails first");
    // Requests that still arrive during the delay are served.
    let r = reqwest::Client::new()
        .post(cluster.url("/v1/completions"))
        .json(&json!({ "model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 2 }))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status().as_u16(), 200);
    let status = cluster.router.exited(Duration::from_secs(10)).await.expect("the router exits after the drain delay");
    assert!(status.success(), "{status}");
}
