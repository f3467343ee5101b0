//! The cluster end to end: real pd-router, pd-prefill and pd-decode processes on loopback,
//! the real model. One cluster serves every check in order (each check leaves it idle).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pd_engine::{CacheConfig, ChatMessage, Engine, LoadOptions, SamplingParams};
use pd_proto::v1 as pb;
use pd_tests::{model_path, Cluster};
use serde_json::{json, Value};

const QUESTIONS: [&str; 5] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Hi",
];

async fn post(cluster: &Cluster, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(cluster.url(path)).json(&body).send().await.expect("request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Reads an SSE response: the data payloads with their arrival times.
async fn sse(cluster: &Cluster, body: Value) -> Vec<(Instant, String)> {
    pd_tests::sse_events(&cluster.url("/v1/chat/completions"), &body, &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_serves_requests_correctly() {
    let cluster = Cluster::start(1).await;
    let engine = Engine::load(&model_path(), LoadOptions::default(), CacheConfig::with_blocks(64)).expect("engine");

    reflection_lists_the_generation_service(&cluster).await;
    greedy_matches_the_engine(&cluster, &engine).await;
    sse_streams_incrementally(&cluster).await;
    sixteen_concurrent_streams_are_batched(&cluster).await;
    client_disconnect_frees_the_kv(&cluster).await;
    bad_input_gets_the_right_status(&cluster).await;
}

async fn reflection_lists_the_generation_service(cluster: &Cluster) {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.grpc))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut client = ServerReflectionClient::new(channel.clone());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses =
        client.server_reflection_info(tokio_stream_once(request)).await.expect("reflection call").into_inner();
    let response = responses.message().await.expect("reply").expect("one reply");
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("expected a service list, got {:?}", response.message_response);
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    // The public port lists only what it serves: not the workers' services.
    assert_eq!(names, ["grpc.health.v1.Health", "pd.v1.Generation"]);

    // v1alpha too: grpcurl and the official Python grpcio-reflection speak it.
    use tonic_reflection::pb::v1alpha as alpha;
    let mut old = alpha::server_reflection_client::ServerReflectionClient::new(channel.clone());
    let request = alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(alpha::server_reflection_request::MessageRequest::ListServices(String::new())),
    };
    let mut responses = old.server_reflection_info(tokio_stream_once(request)).await.expect("v1alpha").into_inner();
    let response = responses.message().await.expect("reply").expect("one reply");
    let Some(alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        response.message_response
    else {
        panic!("expected a v1alpha service list, got {:?}", response.message_response);
    };
    assert!(list.service.iter().any(|s| s.name == "pd.v1.Generation"), "{list:?}");

    use tonic_health::pb::health_client::HealthClient;
    let status = HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest { service: "pd.v1.Generation".into() })
        .await
        .expect("health check")
        .into_inner()
        .status;
    assert_eq!(status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
}

fn tokio_stream_once<T: Send + 'static>(item: T) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::iter(vec![item])
}

async fn greedy_matches_the_engine(cluster: &Cluster, engine: &Engine) {
    let mut grpc =
        pb::generation_client::GenerationClient::connect(format!("http://{}", cluster.grpc)).await.expect("grpc");
    for question in QUESTIONS {
        let prompt = engine.chat_prompt(&[ChatMessage::new("user", question)]).expect("prompt");
        let expected = engine.generate(&prompt, &SamplingParams::greedy(24), 512, |_| {}).expect("engine");
        let (status, body) = post(
            cluster,
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["message"]["content"], expected.text, "HTTP text for {question:?}");
        assert_eq!(body["usage"]["completion_tokens"], expected.tokens.len());
        assert_eq!(body["usage"]["prompt_tokens"], prompt.len());

        let request = pb::GenerateRequest {
            messages: vec![pb::ChatMessage { role: "user".into(), content: question.into(), ..Default::default() }],
            sampling: Some(pb::SamplingParams {
                max_tokens: 24,
                logprobs: true,
                top_logprobs: 2,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut stream = grpc.generate(request).await.expect("generate").into_inner();
        let mut tokens = Vec::new();
        let mut done = None;
        while let Some(message) = stream.message().await.expect("stream") {
            match message.message {
                Some(pb::generate_response::Message::Token(t)) => {
                    // Greedy: the token is its position's most likely one (the first token's
                    // numbers from the prefill worker, the rest from the decode worker).
                    let l = t.logprobs.as_ref().unwrap_or_else(|| panic!("logprobs of token {}", tokens.len()));
                    assert_eq!((l.top.len(), l.top[0].token_id), (2, t.token_id), "{l:?}");
                    assert!((l.logprob - l.top[0].logprob).abs() < 1e-5 && l.logprob <= 0.0, "{l:?}");
                    assert!(!l.top[1].token.is_empty() && l.top[1].logprob <= l.logprob, "{l:?}");
                    tokens.push(t.token_id)
                }
                Some(pb::generate_response::Message::Done(d)) => done = Some(d),
                Some(pb::generate_response::Message::ChoiceDone(c)) => panic!("one answer has no choice_done: {c:?}"),
                None => {}
            }
        }
        assert_eq!(tokens, expected.tokens, "gRPC tokens for {question:?}");
        assert_eq!(done.expect("done").completion_tokens as usize, expected.tokens.len());
    }
}

async fn sse_streams_incrementally(cluster: &Cluster) {
    let started = Instant::now();
    let events = sse(
        cluster,
        json!({"messages": [{"role": "user", "content": "Count from one to twenty in words."}],
               "max_tokens": 48, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(events.last().map(|(_, d)| d.as_str()), Some("[DONE]"));
    let chunks: Vec<(Instant, Value)> = events
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(t, d)| (*t, serde_json::from_str(d).expect("json")))
        .collect();
    let content: Vec<&(Instant, Value)> = chunks
        .iter()
        .filter(|(_, c)| c["choices"][0]["delta"]["content"].as_str().is_some_and(|s| !s.is_empty()))
        .collect();
    assert!(content.len() > 10, "tokens arrive one by one ({} content chunks)", content.len());
    let first = content[0].0 - started;
    let last = content[content.len() - 1].0 - started;
    // Streamed, not buffered: the chunks arrive spread over the generation (a decode step
    // per token takes milliseconds), whatever the time to the first one was.
    let spread = Duration::from_millis(content.len() as u64);
    assert!(last - first > spread, "tokens arrive as generated: first at {first:?}, last at {last:?}");
    let usage = &chunks.last().expect("usage chunk").1["usage"];
    let finish = chunks.iter().find_map(|(_, c)| c["choices"][0]["finish_reason"].as_str().map(str::to_string));
    assert!(finish.is_some(), "a finish reason is sent");
    assert!(usage["completion_tokens"].as_u64().is_some_and(|n| n as usize >= content.len() && n <= 48), "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap_or(0) + usage["completion_tokens"].as_u64().unwrap_or(0))
    );
}

async fn sixteen_concurrent_streams_are_batched(cluster: &Cluster) {
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let url = cluster.url("/v1/completions");
        let max_tokens = 20 + 4 * i;
        tasks.push(tokio::spawn(async move {
            let body = json!({"prompt": format!("Story number {i}: once upon a time"), "max_tokens": max_tokens,
                              "temperature": 0.7, "seed": i});
            let r = reqwest::Client::new().post(url).json(&body).send().await.expect("request");
            let status = r.status().as_u16();
            let body: Value = r.json().await.expect("json");
            (status, body, max_tokens)
        }));
    }
    let mut most_running = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while tasks.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
        most_running = most_running.max(cluster.decode_load().await.running_sequences);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for task in tasks {
        let (status, body, max_tokens) = task.await.expect("task");
        assert_eq!(status, 200, "{body}");
        let n = body["usage"]["completion_tokens"].as_u64().expect("usage");
        let reason = body["choices"][0]["finish_reason"].as_str().expect("finish");
        assert!(n == max_tokens && reason == "length" || n <= max_tokens && reason == "stop", "{body}");
    }
    assert!(most_running > 1, "the decode worker batched the streams (saw {most_running} running at most)");
    cluster.wait_kv_free(Duration::from_secs(5)).await;
    assert_eq!(cluster.decode_load().await.running_sequences, 0, "idle again");
}

async fn client_disconnect_frees_the_kv(cluster: &Cluster) {
    // Counting goes on for many tokens: the stream is still running when the client leaves.
    let body = json!({"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 400, "temperature": 0,
                      "stream": true, "stream_options": {"include_usage": true}});
    let r = reqwest::Client::new().post(cluster.url("/v1/completions")).json(&body).send().await.expect("request");
    let mut stream = r.bytes_stream();
    let mut received = 0;
    while received < 400 {
        received += stream.next().await.expect("data").expect("chunk").len();
    }
    assert!(cluster.decode_load().await.kv_cache_usage > 0.0, "the stream holds KV");
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let load = cluster.decode_load().await;
        if load.kv_cache_usage == 0.0 && load.running_sequences == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "KV still in use 5 s after the client left: {load:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn bad_input_gets_the_right_status(cluster: &Cluster) {
    let client = reqwest::Client::new();
    let chat = cluster.url("/v1/chat/completions");
    let completions = cluster.url("/v1/completions");
    let raw = |url: String, body: &'static str, content_type: &'static str| {
        let client = client.clone();
        async move {
            let r = client.post(url).header("content-type", content_type).body(body).send().await.expect("request");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (s, b) = raw(chat.clone(), "{not json", "application/json").await;
    assert_eq!(s, 400, "{b}");
    assert!(b["error"]["message"].as_str().is_some_and(|m| m.contains("JSON")), "{b}");
    let (s, _) = raw(chat.clone(), "{}", "text/plain").await;
    assert_eq!(s, 415);
    let long_prompt = "word ".repeat(9000);
    let too_big = "x".repeat(2 << 20);
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("/v1/chat/completions", json!({"max_tokens": 5}), 400, "messages"),
        ("/v1/completions", json!({"max_tokens": 5}), 400, "prompt"),
        ("/v1/completions", json!({"prompt": ""}), 400, "prompt"),
        ("/v1/completions", json!({"prompt": long_prompt}), 400, "prompt"),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 100000}), 400, "max_tokens"),
        ("/v1/completions", json!({"prompt": "hi", "temperature": -1}), 400, "temperature"),
        ("/v1/completions", json!({"prompt": "hi", "top_p": 0}), 400, "top_p"),
        ("/v1/completions", json!({"prompt": "hi", "top_p": 1.5}), 400, "top_p"),
        ("/v1/completions", json!({"prompt": "hi", "n": 99}), 400, "n"),
        ("/v1/completions", json!({"prompt": "hi", "logprobs": 21}), 400, "logprobs"),
        ("/v1/completions", json!({"prompt": [1, 999999]}), 400, "prompt[1]"),
        ("/v1/completions", json!({"prompt": "hi", "logit_bias": {"999999": 1}}), 400, "logit_bias"),
        ("/v1/completions", json!({"prompt": "hi", "frequency_penalty": 3}), 400, "frequency_penalty"),
        ("/v1/completions", json!({"prompt": "hi", "model": "gpt-9"}), 404, "model"),
        ("/v1/completions", json!({"prompt": too_big}), 413, ""),
    ];
    for (path, body, status, field) in cases {
        let (got, response) = post(cluster, path, body).await;
        assert_eq!(got, status, "{path} {field}: {response}");
        if !field.is_empty() {
            let message = response["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(field) || response["error"]["param"] == field, "{field}: {response}");
        }
    }
    let _ = completions;
    // Still serving.
    let (s, b) = post(
        cluster,
        "/v1/completions",
        json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let models: Value = client.get(cluster.url("/v1/models")).send().await.expect("models").json().await.expect("json");
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct");
}

/// Two routers over the same workers, each pid 1 in its own PID namespace as the 2-replica
/// router Deployment runs them: 24 concurrent requests split between them all succeed with
/// the same greedy answers, under 24 distinct request ids; a caller's own id (`x-request-id`,
/// the same on every request) is only a label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_in_their_own_pid_namespaces_share_the_workers() {
    let mut wrapper: Vec<String> = ["unshare", "--pid", "--fork", "--kill-child"].map(String::from).to_vec();
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        wrapper.splice(1..1, ["--user".to_string(), "--map-root-user".to_string()]);
    }
    let options = pd_tests::Options { prefill: 1, router_wrapper: wrapper, ..Default::default() };
    let cluster = Cluster::start_with(options).await;
    let (second, http2, _) = cluster.start_router(2);
    for router in [&cluster.router, &second] {
        assert_eq!(pid_in_namespace(router.child.id()), Some(1), "the router is pid 1 in its namespace");
    }
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !client.get(format!("http://{http2}/ready")).send().await.is_ok_and(|r| r.status().is_success()) {
        assert!(Instant::now() < deadline, "the second router never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let urls = [cluster.url("/v1/completions"), format!("http://{http2}/v1/completions")];
    let requests = (0..24).map(|i| {
        let (client, url) = (client.clone(), urls[i % 2].clone());
        let body = json!({"prompt": QUESTIONS[i % QUESTIONS.len()], "max_tokens": 8, "temperature": 0});
        async move {
            let r = client.post(url).header("x-request-id", "same-for-all").json(&body).send().await.expect("request");
            (i, r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
        }
    });
    let answers = futures_util::future::join_all(requests).await;
    let mut ids = std::collections::HashSet::new();
    let mut texts = std::collections::HashMap::new();
    for (i, status, body) in answers {
        assert_eq!(status, 200, "request {i} through router {}: {body}", i % 2);
        assert!(ids.insert(body["id"].as_str().expect("id").to_string()), "duplicate id: {body}");
        let text = body["choices"][0]["text"].as_str().expect("text").to_string();
        let first = texts.entry(i % QUESTIONS.len()).or_insert_with(|| text.clone());
        assert_eq!(*first, text, "the same greedy answer through either router");
    }
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}

/// Client libraries users pick against the real cluster (scripts/install-clients.sh installs
/// them): the official `openai` Python client for logprobs (chat and completions, streamed
/// and not), seeds, penalties, logit_bias, min_tokens, token-id prompts, /tokenize and
/// /detokenize, structured output (`parse()` with a Pydantic model, json_object, vLLM's
/// guided fields), tools (named, required, streamed, a tool-result turn), the caller's
/// request id and refusals by name (tests/clients/openai_features.py); then `instructor`
/// driving a two-turn tool conversation (tests/clients/instructor_agent.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_libraries_get_what_they_ask_for() {
    let cluster = Cluster::start(1).await;
    for script in ["openai_features.py", "instructor_agent.py"] {
        run_client_script(&cluster, script).await;
    }
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}

/// A router serving another model's chat template (`--chat-template`, here Phi-4-mini's, which
/// takes tools in the system message's own field): the `openai` client gets OpenAI tool calls
/// from the model's `functools[...]` answers, whole and streamed (tests/clients/template_tools.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_template_given_to_the_router_serves_its_tool_calls() {
    let template =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../engine/tests/data/chat_templates/microsoft-Phi-4-mini-instruct.jinja");
    let options = pd_tests::Options {
        prefill: 1,
        router_args: vec!["--chat-template".into(), template.into()],
        ..Default::default()
    };
    let cluster = Cluster::start_with(options).await;
    run_client_script(&cluster, "template_tools.py").await;
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}

/// A thinking model's `<think>` block comes back as `reasoning_content`: the router serves
/// Qwen3's template, and the `openai` client reads the block apart from the answer, whole and
/// streamed (tests/clients/reasoning.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thinking_models_reasoning_comes_back_apart_from_its_answer() {
    let template = concat!(env!("CARGO_MANIFEST_DIR"), "/../engine/tests/data/chat_templates/Qwen-Qwen3-0.6B.jinja");
    let router_args = vec!["--chat-template".into(), template.into()];
    let cluster = Cluster::start_with(pd_tests::Options { prefill: 1, router_args, ..Default::default() }).await;
    run_client_script(&cluster, "reasoning.py").await;
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}

/// Runs tests/clients/`script` against `cluster`'s router; it must print `all passed`.
async fn run_client_script(cluster: &Cluster, script: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients").join(script);
    let run = tokio::process::Command::new("python3")
        .arg(&path)
        .arg(format!("http://{}", cluster.http))
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), run).await.expect("the client script timed out");
    let out = out.expect("python3 runs (scripts/install-clients.sh installs the client libraries)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("all passed"),
        "{script}:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The pid of the wrapper's child (the router) inside its own PID namespace.
fn pid_in_namespace(wrapper: u32) -> Option<u32> {
    let children = std::fs::read_to_string(format!("/proc/{wrapper}/task/{wrapper}/children")).ok()?;
    let child = children.split_whitespace().next()?;
    let status = std::fs::read_to_string(format!("/proc/{child}/status")).ok()?;
    let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    nspid.split_whitespace().last()?.parse().ok()
}

/// A bad token id on the workers' internal API fails that request alone, typed: a decode
/// request to prefill `[1, 999999]` here and a prefill request for it, sent while a stream
/// decodes beside them, are refused naming the vocabulary, and the stream ends normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_token_on_the_internal_api_fails_only_its_own_request() {
    let cluster = Cluster::start(1).await;
    let body = json!({"prompt": "The lighthouse keeper", "max_tokens": 48, "ignore_eos": true, "stream": true});
    let r = reqwest::Client::new().post(cluster.url("/v1/completions")).json(&body).send().await.expect("stream");
    assert_eq!(r.status().as_u16(), 200);
    let mut stream = r.bytes_stream();
    let mut text = String::from_utf8_lossy(&stream.next().await.expect("a first chunk").expect("chunk")).into_owned();
    let sampling = Some(pb::SamplingParams { max_tokens: 4, seed: Some(0), ..Default::default() });
    let mut decode = pb::decode_worker_client::DecodeWorkerClient::connect(format!("http://{}", cluster.decode_addr))
        .await
        .expect("decode worker");
    let bad = pb::DecodeRequest {
        request_id: "bad-token".into(),
        prompt_tokens: vec![1, 999_999],
        sampling: sampling.clone(),
        prefill_here: true,
        ..Default::default()
    };
    let status = decode.generate(bad).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("prompt_tokens[1] (999999) is outside the vocabulary"), "{status:?}");
    let mut prefill =
        pb::prefill_worker_client::PrefillWorkerClient::connect(format!("http://{}", cluster.prefill_addrs[0]))
            .await
            .expect("prefill worker");
    let bad =
        pb::PrefillRequest { request_id: "bad".into(), prompt_tokens: vec![999_999], sampling, ..Default::default() };
    let status = prefill.prefill(bad).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("outside the vocabulary"), "{status:?}");
    while let Some(chunk) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
    }
    assert!(text.contains("[DONE]") && !text.contains("event: error"), "the stream beside them: {text}");
    assert_eq!(text.matches("\"text\":").count(), 48 + 1, "every token and the finish chunk: {text}");
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}

/// KV over UCX: the decode worker serves `--kv-transport ucx` (UCX_TLS=tcp on loopback) and
/// advertises a `ucx://` endpoint; the prefill worker connects by it. Answers are the
/// engine's greedy ones, every transfer is counted under `transport="ucx"` on the prefill
/// worker and none under gRPC, and the KV is freed after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_over_ucx_gives_the_engines_answers() {
    let env = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")].map(|(k, v)| (k.to_string(), v.to_string())).to_vec();
    let decode_args = vec!["--kv-transport".to_string(), "ucx".to_string()];
    let cluster = Cluster::start_with(pd_tests::Options { prefill: 1, env, decode_args, ..Default::default() }).await;
    let engine = Engine::load(&model_path(), LoadOptions::default(), CacheConfig::with_blocks(64)).expect("engine");
    for question in &QUESTIONS[..3] {
        let prompt = engine.chat_prompt(&[ChatMessage::new("user", question)]).expect("prompt");
        let expected = engine.generate(&prompt, &SamplingParams::greedy(24), 512, |_| {}).expect("engine");
        let body = json!({"messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0});
        let (status, body) = post(&cluster, "/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["message"]["content"], expected.text, "over UCX for {question:?}");
    }
    let metrics = Cluster::scrape(&cluster.prefill_metrics[0]).await;
    let count = |transport: &str| {
        let series = format!("pd_kv_transfers_total{{outcome=\"committed\",transport=\"{transport}\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(&series)).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
    };
    assert_eq!((count("ucx"), count("grpc")), (3.0, 0.0), "{metrics}");
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}
