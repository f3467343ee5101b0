//! The router's scheduling in-process against small pd.v1 workers that run one prefill at a
//! time: a request over its class's queue budget gets 429 with Retry-After at once (gRPC:
//! RESOURCE_EXHAUSTED with RetryInfo), batch work waits while interactive work goes first,
//! and class limits and unknown classes are refused naming the limit.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pd_proto::v1 as pb;
use pd_router::classes::Classes;
use serde_json::{json, Value};

const CLASSES: &str = r#"
default = "interactive"

[classes.interactive]
priority = 10
max_input_tokens = 40
max_output_tokens = 8
ttft_slo_ms = 20000
itl_slo_ms = 100
max_queued_tokens = 40
max_queue_age_ms = 20000

[classes.batch]
priority = 0
max_input_tokens = 40
max_output_tokens = 8
ttft_slo_ms = 60000
itl_slo_ms = 1000
max_queued_tokens = 10000
max_queue_age_ms = 60000
"#;

/// A router with the classes above, one decode worker and one prefill worker that holds
/// each prefill for `hold`.
async fn cluster(hold: Duration) -> (Router, FakePrefill) {
    let commits = Commits::default();
    let decode = FakeDecode::new(100, &commits);
    let prefill = FakePrefill { hold, ..FakePrefill::new(&commits) };
    let classes = Classes::parse(CLASSES).expect("classes");
    let router =
        start_router_with(vec![serve_prefill(prefill.clone()).await], vec![serve_decode(decode).await], classes).await;
    (router, prefill)
}

fn send(router: &Router, class: &str, body: Value) -> tokio::task::JoinHandle<(u16, Option<String>, String)> {
    let (url, class) = (format!("{}/v1/chat/completions", router.http), class.to_string());
    tokio::spawn(async move {
        let r = reqwest::Client::new().post(url).header("x-pd-class", class).json(&body).send().await.expect("send");
        let status = r.status().as_u16();
        let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
        (status, retry, r.text().await.unwrap_or_default())
    })
}

fn hi(max_tokens: u32) -> Value {
    json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens})
}

#[tokio::test]
async fn over_the_class_queue_budget_is_429_with_retry_after_at_once_on_http_and_grpc() {
    let (router, _) = cluster(Duration::from_millis(1500)).await;
    let running = send(&router, "interactive", hi(2)); // takes the one prefill slot
    tokio::time::sleep(Duration::from_millis(200)).await;
    let queued = send(&router, "interactive", hi(2)); // ~30 of the class's 40 queued tokens
    tokio::time::sleep(Duration::from_millis(200)).await;
    let asked = Instant::now();
    let (status, retry, body) = send(&router, "interactive", hi(2)).await.expect("task");
    let answered = asked.elapsed();
    assert_eq!(status, 429, "{body}");
    assert!(retry.and_then(|r| r.parse::<u64>().ok()).is_some_and(|s| s >= 1), "Retry-After in seconds");
    assert!(body.contains("class `interactive`") && body.contains("max_queued_tokens"), "{body}");
    assert!(answered < Duration::from_millis(1000), "refused without waiting for a slot: {answered:?}");

    let mut client = pb::generation_client::GenerationClient::connect(router.grpc.clone()).await.expect("connect");
    let request = pb::GenerateRequest {
        messages: vec![pb::ChatMessage { role: "user".into(), content: "Hi".into(), ..Default::default() }],
        sampling: Some(pb::SamplingParams { max_tokens: 2, ..Default::default() }),
        ..Default::default()
    };
    let status = client.generate(request).await.expect_err("over budget");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    use tonic_types::StatusExt;
    let delay = status.get_details_retry_info().and_then(|r| r.retry_delay);
    assert!(delay.is_some_and(|d| d >= Duration::from_secs(1)), "RetryInfo detail: {delay:?}");

    for task in [running, queued] {
        let (status, _, body) = task.await.expect("task");
        assert_eq!(status, 200, "admitted requests complete: {body}");
    }
}

#[tokio::test]
async fn batch_waits_while_interactive_requests_go_first_and_is_then_served() {
    let (router, prefill) = cluster(Duration::from_millis(400)).await;
    let first = send(&router, "interactive", hi(2));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let batch = send(&router, "batch", hi(2)); // queued first ...
    tokio::time::sleep(Duration::from_millis(100)).await;
    let interactive = send(&router, "interactive", hi(2)); // ... overtaken by this one
    for task in [first, interactive, batch] {
        let (status, _, body) = task.await.expect("task");
        assert_eq!(status, 200, "{body}");
    }
    let order = prefill.classes.lock().expect("classes").clone();
    assert_eq!(order, vec!["interactive", "interactive", "batch"], "dispatch order at the prefill worker");
}

#[tokio::test]
async fn class_limits_and_unknown_classes_are_refused_naming_the_limit() {
    let (router, _) = cluster(Duration::ZERO).await;
    let (status, _, body) = send(&router, "interactive", hi(9)).await.expect("task");
    assert_eq!(status, 400);
    assert!(body.contains("max_output_tokens") && body.contains("interactive"), "{body}");
    let long = json!({"messages": [{"role": "user", "content": "word ".repeat(60)}], "max_tokens": 2});
    let (status, _, body) = send(&router, "batch", long).await.expect("task");
    assert_eq!(status, 400);
    assert!(body.contains("max_input_tokens") && body.contains("batch"), "{body}");
    let (status, _, body) = send(&router, "gold", hi(2)).await.expect("task");
    assert_eq!(status, 400);
    assert!(body.contains("gold") && body.contains("x-pd-class"), "{body}");
    // A request without max_tokens takes the class's limit instead of the server default.
    let (status, _, body) =
        send(&router, "interactive", json!({"messages": [{"role": "user", "content": "Hi"}]})).await.expect("task");
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn tenants_need_a_known_key_and_are_held_to_their_rate() {
    let file = CLASSES.replace("default = \"interactive\"", "default = \"interactive\"\nrequire_api_key = true")
        + "\n[tenants.acme]\napi_keys = [\"k-acme\"]\nrequests_per_s = 0.5\nburst = 2\n";
    let commits = Commits::default();
    let classes = Classes::parse(&file).expect("classes");
    let decode = serve_decode(FakeDecode::new(100, &commits)).await;
    let router = start_router_with(vec![serve_prefill(FakePrefill::new(&commits)).await], vec![decode], classes).await;
    let url = format!("{}/v1/chat/completions", router.http);
    let post = |key: Option<&'static str>| {
        let mut r = reqwest::Client::new().post(&url).json(&hi(2));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let none = post(None).await.expect("send");
    assert_eq!(none.status().as_u16(), 401);
    assert_eq!(none.headers().get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));
    let body: Value = none.json().await.expect("json");
    assert_eq!(body["error"]["type"], "authentication_error");
    assert_eq!(post(Some("k-other")).await.expect("send").status().as_u16(), 401);
    for _ in 0..2 {
        assert_eq!(post(Some("k-acme")).await.expect("send").status().as_u16(), 200, "within the burst");
    }
    let over = post(Some("k-acme")).await.expect("send");
    assert_eq!(over.status().as_u16(), 429);
    assert_eq!(over.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("2"));
    assert!(over.text().await.unwrap_or_default().contains("requests_per_s"));
    // gRPC: UNAUTHENTICATED without a key.
    let mut client = pb::generation_client::GenerationClient::connect(router.grpc.clone()).await.expect("connect");
    let request = pb::GenerateRequest {
        prompt: "Hi".into(),
        sampling: Some(pb::SamplingParams { max_tokens: 2, ..Default::default() }),
        ..Default::default()
    };
    let status = client.generate(request).await.expect_err("no key");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
}
