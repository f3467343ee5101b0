//! The router in-process against small pd.v1 workers: routing choice, prefill retries,
//! cancellation, streaming order (the first token comes straight from the prefill worker),
//! and every bad input over HTTP and gRPC.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use pd_proto::v1 as pb;
use serde_json::{json, Value};

async fn chat(router: &Router, body: Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", router.http))
        .json(&body)
        .send()
        .await
        .expect("request")
}

fn hello(max_tokens: u32, stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens, "stream": stream, "temperature": 0})
}

async fn cluster() -> (Router, FakeDecode, FakePrefill) {
    let commits = Commits::default();
    let decode = FakeDecode::new(100, &commits);
    let prefill = FakePrefill::new(&commits);
    let router =
        start_router(vec![serve_prefill(prefill.clone()).await], vec![serve_decode(decode.clone()).await]).await;
    (router, decode, prefill)
}

#[tokio::test]
async fn a_request_streams_every_token_once_in_order_then_the_end() {
    let (router, _, _) = cluster().await;
    let body = chat(&router, hello(4, true)).await.text().await.expect("body");
    let events = sse_events(&body);
    let texts: Vec<String> = events
        .iter()
        .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(texts, TOKENS.iter().map(|t| t.1.to_string()).collect::<Vec<_>>(), "{body}");
    assert_eq!(events.last().map(|e| e.1.as_str()), Some("[DONE]"));
    let whole: Value = chat(&router, hello(4, false)).await.json().await.expect("json");
    assert_eq!(whole["choices"][0]["message"]["content"], "Hello, world!");
    assert_eq!(whole["usage"]["completion_tokens"], 4);
}

#[tokio::test]
async fn the_first_token_comes_from_the_prefill_worker_before_the_decode_worker_commits_it() {
    let commits = Commits::default();
    let decode = FakeDecode::new(100, &commits);
    let mut prefill = FakePrefill::new(&commits);
    // The decode worker gets the commit (and streams the first token) only after 1.5 s.
    prefill.delay = Duration::from_millis(1500);
    let router = start_router(vec![serve_prefill(prefill).await], vec![serve_decode(decode).await]).await;
    let started = Instant::now();
    let mut response = chat(&router, hello(2, true)).await;
    let first = response.chunk().await.expect("read").expect("a first chunk");
    let first_at = started.elapsed();
    assert!(String::from_utf8_lossy(&first).contains("Hello"), "{first:?}");
    assert!(first_at < Duration::from_millis(1200), "first token after {first_at:?}: it waited for the decode worker");
    let mut rest = String::new();
    while let Some(chunk) = response.chunk().await.expect("read") {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!rest.contains("Hello"), "the committed echo of the first token is not sent again: {rest}");
    assert!(rest.contains("[DONE]"));
}

#[tokio::test]
async fn the_decode_worker_with_the_most_free_blocks_is_chosen() {
    let commits = Commits::default();
    let (small, big) = (FakeDecode::new(10, &commits), FakeDecode::new(500, &commits));
    let prefill = FakePrefill::new(&commits);
    let decode = vec![serve_decode(small.clone()).await, serve_decode(big.clone()).await];
    let router = start_router(vec![serve_prefill(prefill).await], decode).await;
    for _ in 0..3 {
        assert!(chat(&router, hello(2, false)).await.status().is_success());
    }
    assert_eq!((small.requests.load(Ordering::SeqCst), big.requests.load(Ordering::SeqCst)), (0, 3));
}

/// A rolling update: the decode worker chosen first (most free blocks) is shutting down and
/// refuses the stream (UNAVAILABLE) before the router's refresh has seen it go; the request
/// opens on the other one, and the refusing worker is passed over after that.
#[tokio::test]
async fn a_decode_worker_refusing_as_it_shuts_down_is_replaced_by_another() {
    let commits = Commits::default();
    let mut leaving = FakeDecode::new(500, &commits);
    leaving.refuse = Some(tonic::Code::Unavailable);
    let staying = FakeDecode::new(10, &commits);
    let prefill = FakePrefill::new(&commits);
    let decode = vec![serve_decode(leaving.clone()).await, serve_decode(staying.clone()).await];
    let router = start_router(vec![serve_prefill(prefill).await], decode).await;
    for _ in 0..3 {
        let whole: Value = chat(&router, hello(3, false)).await.json().await.expect("json");
        assert_eq!(whole["choices"][0]["message"]["content"], "Hello, world", "{whole}");
    }
    assert_eq!((leaving.requests.load(Ordering::SeqCst), staying.requests.load(Ordering::SeqCst)), (1, 3));
    // With no other decode worker, the refusal reaches the client after the tries.
    let mut alone = FakeDecode::new(500, &commits);
    alone.refuse = Some(tonic::Code::Unavailable);
    let prefill = FakePrefill::new(&commits);
    let router = start_router(vec![serve_prefill(prefill).await], vec![serve_decode(alone.clone()).await]).await;
    let r = chat(&router, hello(3, false)).await;
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.text().await.expect("body").contains("shutting down"));
    assert_eq!(alone.requests.load(Ordering::SeqCst), 3, "tried three times, then the error");
}

#[tokio::test]
async fn a_failing_prefill_worker_is_replaced_by_another() {
    let commits = Commits::default();
    let decode = FakeDecode::new(100, &commits);
    let mut broken = FakePrefill::new(&commits);
    broken.fail = Some(tonic::Code::Unavailable);
    let mut busy = FakePrefill::new(&commits);
    busy.waiting_tokens = 10_000; // chosen second
    let prefill = vec![serve_prefill(broken.clone()).await, serve_prefill(busy.clone()).await];
    let router = start_router(prefill, vec![serve_decode(decode).await]).await;
    let whole: Value = chat(&router, hello(3, false)).await.json().await.expect("json");
    assert_eq!(whole["choices"][0]["message"]["content"], "Hello, world");
    assert_eq!((broken.requests.load(Ordering::SeqCst), busy.requests.load(Ordering::SeqCst)), (1, 1));
    let metrics = reqwest::get(format!("{}/metrics", router.http)).await.expect("metrics").text().await.expect("text");
    assert!(metrics.contains("pd_prefill_retries_total 1"), "{metrics}");
}

#[tokio::test]
async fn a_lone_failing_prefill_worker_fails_the_request_with_503_and_a_bad_request_is_not_retried() {
    let commits = Commits::default();
    let decode = FakeDecode::new(100, &commits);
    let mut broken = FakePrefill::new(&commits);
    broken.fail = Some(tonic::Code::Unavailable);
    let router = start_router(vec![serve_prefill(broken.clone()).await], vec![serve_decode(decode).await]).await;
    let response = chat(&router, hello(3, false)).await;
    assert_eq!(response.status(), 503);
    let body: Value = response.json().await.expect("json");
    assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("prefill")), "{body}");
    let mut refusing = FakePrefill::new(&commits);
    refusing.fail = Some(tonic::Code::InvalidArgument);
    let decode = FakeDecode::new(100, &commits);
    let router = start_router(vec![serve_prefill(refusing.clone()).await], vec![serve_decode(decode).await]).await;
    assert_eq!(chat(&router, hello(3, false)).await.status(), 503);
    assert_eq!(refusing.requests.load(Ordering::SeqCst), 1, "INVALID_ARGUMENT is not retried");
}

#[tokio::test]
async fn no_reachable_worker_is_503_and_not_ready() {
    let router_dead = {
        // Workers that are not there: the router starts but is not ready.
        let config_decode = vec!["127.0.0.1:1".to_string()];
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = http.local_addr().expect("addr");
        let config = pd_router::Config {
            model: model_path(),
            chat_template: None,
            separate_reasoning: true,
            model_name: "SmolLM2-135M-Instruct".into(),
            prefill_workers: Vec::new(),
            decode_workers: config_decode,
            classes: pd_router::classes::Classes::load(None).expect("classes"),
            schedule: pd_router::schedule::ScheduleConfig::default(),
            limits: pd_router::Limits {
                max_tokens: 64,
                default_completion_tokens: 16,
                default_chat_tokens: 64,
                max_n: 8,
            },
            body_limit: 1 << 20,
            drain_delay: Duration::ZERO,
            tls: None,
            log_content: false,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
        };
        tokio::spawn(pd_router::run(config, http, grpc, std::future::pending()));
        format!("http://{addr}")
    };
    let client = reqwest::Client::new();
    let mut status = None;
    for _ in 0..100 {
        if let Ok(r) = client.get(format!("{router_dead}/ready")).send().await {
            status = Some(r.status());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status.map(|s| s.as_u16()), Some(503));
    let r =
        client.post(format!("{router_dead}/v1/chat/completions")).json(&hello(2, false)).send().await.expect("request");
    assert_eq!(r.status(), 503);
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_cancels_the_decode_stream() {
    let commits = Commits::default();
    let mut decode = FakeDecode::new(100, &commits);
    decode.token_delay = Duration::from_millis(400);
    let prefill = FakePrefill::new(&commits);
    let router = start_router(vec![serve_prefill(prefill).await], vec![serve_decode(decode.clone()).await]).await;
    let mut response = chat(&router, hello(4, true)).await;
    response.chunk().await.expect("read").expect("first chunk");
    drop(response);
    let deadline = Instant::now() + Duration::from_secs(5);
    while decode.cancelled.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(decode.cancelled.load(Ordering::SeqCst), 1, "the decode worker saw its stream closed");
}

#[tokio::test]
async fn a_client_that_stops_reading_loses_the_request_after_the_send_timeout() {
    let commits = Commits::default();
    let mut decode = FakeDecode::new(100, &commits);
    (decode.cycle, decode.token_delay) = (true, Duration::from_millis(3));
    let prefill = FakePrefill::new(&commits);
    let (p, d) = (serve_prefill(prefill).await, serve_decode(decode.clone()).await);
    let router = start_router_config(vec![p], vec![d], |c| {
        c.schedule.client_send_timeout = Duration::from_millis(300);
    })
    .await;
    // A 1 KiB HTTP/2 stream window that the client never reopens: the router can hand it
    // only a few tokens, then its relay waits on the client.
    let channel = tonic::transport::Endpoint::from_shared(router.grpc.clone())
        .expect("endpoint")
        .initial_stream_window_size(1024)
        .connect()
        .await
        .expect("connect");
    let mut client = pb::generation_client::GenerationClient::new(channel);
    let request = pb::GenerateRequest {
        prompt: "Hi".into(),
        sampling: Some(pb::SamplingParams { max_tokens: 1000, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = client.generate(request).await.expect("accepted").into_inner();
    // Without the timeout the decode stream would wait on this client for good.
    let deadline = Instant::now() + Duration::from_secs(5);
    while decode.cancelled.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(decode.cancelled.load(Ordering::SeqCst), 1, "the decode stream was cancelled, not left waiting");
    // Reading now: what was queued, then the reason (never a success).
    let mut tokens = 0;
    let end = loop {
        match stream.message().await {
            Ok(Some(pb::GenerateResponse { message: Some(pb::generate_response::Message::Token(_)) })) => tokens += 1,
            Ok(Some(other)) => panic!("no end was earned: {other:?}"),
            Ok(None) => panic!("the stream closed silently after {tokens} tokens"),
            Err(status) => break status,
        }
    };
    assert!(tokens < 1000, "{tokens}");
    assert_eq!(end.code(), tonic::Code::DeadlineExceeded, "{end:?}");
    assert!(end.message().contains("took no event for 300 ms"), "{end:?}");
}

#[tokio::test]
async fn silent_and_slowloris_connections_are_closed_after_the_header_read_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let commits = Commits::default();
    let (p, d) = (serve_prefill(FakePrefill::new(&commits)).await, serve_decode(FakeDecode::new(100, &commits)).await);
    let router = start_router_config(vec![p], vec![d], |c| c.header_read_timeout = Duration::from_millis(300)).await;
    let addr = router.http.trim_start_matches("http://").to_string();
    let silent = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let mut slow = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    slow.write_all(b"GET /health HTTP/1.1\r\nhost: pd\r\n").await.expect("half a head");
    for (what, mut stream) in [("silent", silent), ("half a head", slow)] {
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
        assert!(read.is_ok(), "the {what} connection is still open 5 s later");
        let text = String::from_utf8_lossy(&answer);
        assert!(answer.is_empty() || text.starts_with("HTTP/1.1 408"), "{what}: {text}");
    }
    let health = reqwest::get(format!("{}/health", router.http)).await.expect("health");
    assert_eq!(health.status(), 200, "the router still serves");
}

#[tokio::test]
async fn a_trickled_body_gets_408_within_the_body_read_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let commits = Commits::default();
    let (p, d) = (serve_prefill(FakePrefill::new(&commits)).await, serve_decode(FakeDecode::new(100, &commits)).await);
    let router = start_router_config(vec![p], vec![d], |c| c.body_read_timeout = Duration::from_millis(300)).await;
    let addr = router.http.trim_start_matches("http://").to_string();
    let mut slow = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let head =
        "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    slow.write_all(head.as_bytes()).await.expect("head");
    slow.write_all(b"{\"prompt\":").await.expect("a few bytes of the body");
    // Keep trickling a byte now and then; the answer must come anyway.
    let trickle = async {
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if slow.write_all(b" ").await.is_err() {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(700), trickle).await;
    let mut answer = vec![0u8; 4096];
    let n =
        tokio::time::timeout(Duration::from_secs(5), slow.read(&mut answer)).await.expect("answered").expect("read");
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("did not arrive within 300 ms"), "{text}");
    let health = reqwest::get(format!("{}/health", router.http)).await.expect("health");
    assert_eq!(health.status(), 200, "the router still serves");
}

#[tokio::test]
async fn a_decode_failure_after_the_first_token_ends_the_stream_with_an_error_event() {
    let commits = Commits::default();
    let mut decode = FakeDecode::new(100, &commits);
    decode.fail_after_first = Some(tonic::Code::Unavailable);
    let prefill = FakePrefill::new(&commits);
    let router = start_router(vec![serve_prefill(prefill).await], vec![serve_decode(decode).await]).await;
    let body = chat(&router, hello(4, true)).await.text().await.expect("body");
    let events = sse_events(&body);
    let last = events.last().expect("events");
    assert_eq!(last.0.as_deref(), Some("error"), "{body}");
    assert!(!body.contains("[DONE]"), "a failed stream never reports success");
    let whole = chat(&router, hello(4, false)).await;
    assert_eq!(whole.status(), 503);
}

#[tokio::test]
async fn grpc_generate_streams_the_same_tokens_and_names_the_request() {
    let (router, _, _) = cluster().await;
    let mut client = pb::generation_client::GenerationClient::connect(router.grpc.clone()).await.expect("connect");
    let request = pb::GenerateRequest {
        messages: vec![pb::ChatMessage { role: "user".into(), content: "Hi".into(), ..Default::default() }],
        sampling: Some(pb::SamplingParams { max_tokens: 4, ..Default::default() }),
        request_id: "grpc-1".into(),
        ..Default::default()
    };
    let mut stream = client.generate(request).await.expect("generate").into_inner();
    let mut texts = Vec::new();
    let mut done = None;
    while let Some(m) = stream.message().await.expect("message") {
        match m.message {
            Some(pb::generate_response::Message::Token(t)) => texts.push(t.text),
            Some(pb::generate_response::Message::Done(d)) => done = Some(d),
            Some(pb::generate_response::Message::ChoiceDone(c)) => panic!("one answer has no choice_done: {c:?}"),
            None => {}
        }
    }
    assert_eq!(texts.concat(), "Hello, world!");
    let done = done.expect("done");
    // The caller's id is a label; the answer names the router's own id.
    assert!(done.request_id.starts_with("req-") && done.request_id != "grpc-1", "{}", done.request_id);
    assert_eq!(done.completion_tokens, 4);
}

/// Bad HTTP inputs: (path, content type, body, status, param named in the error).
const HTTP_CASES: &[(&str, &str, &str, u16, Option<&str>)] = &[
    ("/v1/chat/completions", "application/json", "{not json", 400, None),
    ("/v1/chat/completions", "application/json", "[1, 2]", 422, None),
    ("/v1/chat/completions", "text/plain", r#"{"messages":[]}"#, 415, None),
    ("/v1/chat/completions", "application/json", r#"{}"#, 400, Some("messages")),
    ("/v1/chat/completions", "application/json", r#"{"messages":[]}"#, 400, Some("messages")),
    ("/v1/chat/completions", "application/json", r#"{"messages":"hi"}"#, 400, Some("messages")),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"robot","content":"x"}]}"#,
        400,
        Some("messages[0].role"),
    ),
    ("/v1/chat/completions", "application/json", r#"{"messages":[{"role":"user"}]}"#, 400, Some("messages[0].content")),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":7}]}"#,
        400,
        Some("messages[0].content"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"model":"gpt-9"}"#,
        404,
        Some("model"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
        400,
        Some("max_tokens"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":5000}"#,
        400,
        Some("max_tokens"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
        400,
        Some("max_tokens"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}"#,
        400,
        Some("max_completion_tokens"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"temperature":3}"#,
        400,
        Some("temperature"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
        400,
        Some("temperature"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"top_p":0}"#,
        400,
        Some("top_p"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"top_k":0}"#,
        400,
        Some("top_k"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}"#,
        400,
        Some("stop"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"stop":[""]}"#,
        400,
        Some("stop"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"stop":7}"#,
        400,
        Some("stop"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"n":9}"#,
        400,
        Some("n"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
        400,
        Some("stream"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"stream_options":3}"#,
        400,
        Some("stream_options"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"seed":-5}"#,
        400,
        Some("seed"),
    ),
    (
        "/v1/chat/completions",
        "application/json",
        r#"{"messages":[{"role":"user","content":"x"}],"tools":[]}"#,
        400,
        Some("tools"),
    ),
    ("/v1/chat/completions", "application/json", r#"{"prompt":"x"}"#, 400, Some("prompt")),
    ("/v1/completions", "application/json", r#"{}"#, 400, Some("prompt")),
    ("/v1/completions", "application/json", r#"{"prompt":""}"#, 400, Some("prompt")),
    ("/v1/completions", "application/json", r#"{"prompt":["a",""]}"#, 400, Some("prompt")),
    ("/v1/completions", "application/json", r#"{"prompt":5}"#, 400, Some("prompt")),
    ("/v1/completions", "application/json", r#"{"prompt":"x","messages":[]}"#, 400, Some("messages")),
    ("/v1/completions", "application/json", r#"{"prompt":"x","max_tokens":8000}"#, 400, Some("max_tokens")),
];

#[tokio::test]
async fn every_bad_http_input_gets_its_status_and_names_the_field() {
    let (router, decode, _) = cluster().await;
    let client = reqwest::Client::new();
    for (path, content_type, body, status, param) in HTTP_CASES {
        let r = client
            .post(format!("{}{path}", router.http))
            .header("content-type", *content_type)
            .body(body.to_string())
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), *status, "{path} {body}");
        let json: Value = r.json().await.expect("an OpenAI error body");
        assert_eq!(json["error"]["param"].as_str(), *param, "{path} {body}: {json}");
        assert!(json["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let header = client
        .post(format!("{}/v1/chat/completions", router.http))
        .header("x-pd-class", "Not A Class")
        .json(&hello(2, false))
        .send()
        .await
        .expect("request");
    assert_eq!(header.status(), 400);
    let huge = "x".repeat(2 << 20);
    let r = client
        .post(format!("{}/v1/completions", router.http))
        .header("content-type", "application/json")
        .body(format!(r#"{{"prompt":"{huge}"}}"#))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 413);
    assert_eq!(decode.requests.load(Ordering::SeqCst), 0, "no bad request reached a worker");
}

#[tokio::test]
async fn every_bad_grpc_input_is_invalid_argument_naming_the_field() {
    let (router, decode, _) = cluster().await;
    let mut client = pb::generation_client::GenerationClient::connect(router.grpc.clone()).await.expect("connect");
    let user =
        |content: &str| vec![pb::ChatMessage { role: "user".into(), content: content.into(), ..Default::default() }];
    let sampling = |f: fn(&mut pb::SamplingParams)| {
        let mut s = pb::SamplingParams { max_tokens: 4, ..Default::default() };
        f(&mut s);
        Some(s)
    };
    let cases: Vec<(pb::GenerateRequest, tonic::Code, &str)> = vec![
        (pb::GenerateRequest::default(), tonic::Code::InvalidArgument, "prompt"),
        (
            pb::GenerateRequest { prompt: "x".into(), messages: user("y"), ..Default::default() },
            tonic::Code::InvalidArgument,
            "prompt",
        ),
        (
            pb::GenerateRequest {
                messages: vec![pb::ChatMessage { role: "robot".into(), content: "x".into(), ..Default::default() }],
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "messages[0].role",
        ),
        (
            pb::GenerateRequest { prompt: "x".into(), model: "gpt-9".into(), ..Default::default() },
            tonic::Code::NotFound,
            "gpt-9",
        ),
        (
            pb::GenerateRequest {
                prompt: "x".into(),
                sampling: sampling(|s| s.max_tokens = 5000),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "sampling.max_tokens",
        ),
        (
            pb::GenerateRequest {
                prompt: "x".into(),
                sampling: sampling(|s| s.temperature = 9.0),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "temperature",
        ),
        (
            pb::GenerateRequest { prompt: "x".into(), sampling: sampling(|s| s.top_p = 1.5), ..Default::default() },
            tonic::Code::InvalidArgument,
            "top_p",
        ),
        (
            pb::GenerateRequest {
                prompt: "x".into(),
                sampling: sampling(|s| s.stop = vec!["a".into(); 5]),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "stop",
        ),
        (
            pb::GenerateRequest {
                prompt: "x".into(),
                sampling: sampling(|s| s.stop = vec![String::new()]),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "stop",
        ),
        (
            pb::GenerateRequest { messages: user("y"), chat_template_kwargs_json: "[1]".into(), ..Default::default() },
            tonic::Code::InvalidArgument,
            "chat_template_kwargs_json",
        ),
        (
            pb::GenerateRequest {
                messages: user("y"),
                chat_template_kwargs_json: r#"{"add_generation_prompt": false}"#.into(),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "chat_template_kwargs_json.add_generation_prompt",
        ),
        (
            pb::GenerateRequest {
                prompt: "x".into(),
                chat_template_kwargs_json: r#"{"enable_thinking": false}"#.into(),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "chat_template_kwargs_json",
        ),
    ];
    for (request, code, named) in cases {
        let status = client.generate(request.clone()).await.expect_err("refused");
        assert_eq!(status.code(), code, "{request:?}: {status:?}");
        assert!(status.message().contains(named), "{request:?}: {}", status.message());
    }
    assert_eq!(decode.requests.load(Ordering::SeqCst), 0, "no bad request reached a worker");
}

#[tokio::test]
async fn grpc_and_http_chat_take_the_same_default_length() {
    let (router, decode, _) = cluster().await;
    let mut client = pb::generation_client::GenerationClient::connect(router.grpc.clone()).await.expect("connect");
    let request = pb::GenerateRequest {
        messages: vec![pb::ChatMessage { role: "user".into(), content: "Hi".into(), ..Default::default() }],
        ..Default::default()
    };
    let mut stream = client.generate(request).await.expect("generate").into_inner();
    while stream.message().await.expect("message").is_some() {}
    assert_eq!(decode.last_max_tokens.load(Ordering::SeqCst), 512);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}]});
    assert!(chat(&router, body).await.status().is_success());
    assert_eq!(decode.last_max_tokens.load(Ordering::SeqCst), 512);
}

#[tokio::test]
async fn completions_stream_text_and_the_usage_chunk_when_asked() {
    let (router, _, _) = cluster().await;
    let body = json!({"prompt": "Say hi", "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}});
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", router.http))
        .json(&body)
        .send()
        .await
        .expect("request");
    let text = response.text().await.expect("body");
    let chunks: Vec<Value> = sse_events(&text).iter().filter_map(|(_, d)| serde_json::from_str(d).ok()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, "Hello, world");
    let finish = chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("length"));
    let usage = chunks.last().expect("chunks")["usage"].clone();
    assert_eq!(
        (usage["completion_tokens"].as_u64(), chunks.last().expect("last")["choices"].as_array().map(Vec::len)),
        (Some(3), Some(0))
    );
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
}

#[tokio::test]
async fn models_health_and_metrics_answer() {
    let (router, _, _) = cluster().await;
    let models: Value =
        reqwest::get(format!("{}/v1/models", router.http)).await.expect("models").json().await.expect("json");
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct");
    assert_eq!(reqwest::get(format!("{}/health", router.http)).await.expect("health").status(), 200);
    assert!(chat(&router, hello(2, false)).await.status().is_success());
    let metrics = reqwest::get(format!("{}/metrics", router.http)).await.expect("metrics").text().await.expect("text");
    assert!(
        metrics.contains("pd_time_to_first_token_seconds_count{class=\"interactive\",input_bucket=\"1-128\"} 1"),
        "{metrics}"
    );
}

/// `--chat-template`: another template replaces the model's own, keeping the model's special
/// tokens; a file that cannot be read or does not compile is refused naming the flag and path.
#[test]
fn a_chat_template_file_replaces_the_models_own_or_is_refused_by_name() {
    let text = || pd_engine::load_text_side(&model_path()).expect("text side");
    let dir = std::env::temp_dir().join(format!("pd-chat-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let good = dir.join("good.jinja");
    std::fs::write(&good, "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}")
        .expect("write");
    let side = pd_router::with_chat_template(text(), &good).expect("compiles");
    let template = side.chat_template.as_ref().expect("a template");
    let rendered = template.render(&[pd_engine::ChatMessage::new("user", "Hi")], false).expect("renders");
    assert_eq!(rendered, "[user] Hi<|im_end|>", "the model's eos token");
    let missing = dir.join("missing.jinja");
    let err = pd_router::with_chat_template(text(), &missing).expect_err("no file").to_string();
    assert!(err.contains("--chat-template") && err.contains("missing.jinja"), "{err}");
    let bad = dir.join("bad.jinja");
    std::fs::write(&bad, "{% for %}").expect("write");
    let err = pd_router::with_chat_template(text(), &bad).expect_err("does not compile").to_string();
    assert!(err.contains("--chat-template") && err.contains("does not compile"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn loads_reach_the_router_on_streams_and_from_older_workers_without_them() {
    // One prefill worker serves `LoadStream`; the other only `Load`, as an older binary during
    // a rolling upgrade. The load of each steers the choice, whichever of them is busy.
    for older_is_busy in [true, false] {
        let commits = Commits::default();
        let decode = FakeDecode::new(100, &commits);
        let mut older = FakePrefill::new(&commits);
        older.load_stream = false;
        let mut newer = FakePrefill::new(&commits);
        if older_is_busy {
            older.waiting_tokens = 10_000;
        } else {
            newer.waiting_tokens = 10_000;
        }
        let prefill = vec![serve_prefill(older.clone()).await, serve_prefill(newer.clone()).await];
        let router = start_router(prefill, vec![serve_decode(decode).await]).await;
        // Several rounds: the stream stays open and answers each of them.
        let deadline = Instant::now() + Duration::from_secs(10);
        while newer.loads_streamed.load(Ordering::SeqCst) < 3 || older.loads_once.load(Ordering::SeqCst) < 3 {
            assert!(Instant::now() < deadline, "fewer than 3 refresh rounds in 10 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let whole: Value = chat(&router, hello(3, false)).await.json().await.expect("json");
        assert_eq!(whole["choices"][0]["message"]["content"], "Hello, world");
        let chosen = (older.requests.load(Ordering::SeqCst), newer.requests.load(Ordering::SeqCst));
        assert_eq!(chosen, if older_is_busy { (0, 1) } else { (1, 0) }, "the idle worker prefills");
        assert_eq!(older.loads_streamed.load(Ordering::SeqCst), 0);
        assert_eq!(newer.loads_once.load(Ordering::SeqCst), 0, "the stream answered every round");
    }
}
