//! Killing workers mid-request: a prefill worker dies during a prefill (another one takes
//! over; or, alone, the client gets a typed error fast), a decode worker dies mid-stream (the
//! request continues on another decode worker with exactly the tokens of an undisturbed run;
//! alone, the stream ends with an error event). Nothing hangs. One cluster at a time (they
//! are large).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pd_proto::v1 as pb;
use pd_tests::{Cluster, Options};
use serde_json::{json, Value};
use tokio::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// A completion whose prompt takes a few seconds to prefill.
fn long_prompt_body() -> Value {
    json!({"prompt": "The history of the river valley begins with small farming villages. ".repeat(110),
           "max_tokens": 8, "temperature": 0})
}

/// Waits until one prefill worker is computing; returns its index.
async fn running_prefill(cluster: &Cluster) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        for i in 0..cluster.prefill.len() {
            if cluster.prefill_load(i).await.is_some_and(|l| l.running_prefills > 0) {
                return i;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no prefill worker started the prefill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_prefill_worker_is_replaced_by_another() {
    let _guard = ONE_AT_A_TIME.lock().await;
    let mut cluster = Cluster::start(2).await;
    let url = cluster.url("/v1/completions");
    let request = tokio::spawn(async move {
        let r = reqwest::Client::new().post(url).json(&long_prompt_body()).send().await.expect("request");
        (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
    });
    let victim = running_prefill(&cluster).await;
    cluster.prefill[victim].kill();
    let (status, body) = tokio::time::timeout(Duration::from_secs(60), request).await.expect("no hang").expect("task");
    assert_eq!(status, 200, "the other prefill worker completed it: {body}");
    assert!(body["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0), "{body}");
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_only_prefill_worker_fails_fast_with_a_typed_error() {
    let _guard = ONE_AT_A_TIME.lock().await;
    let mut cluster = Cluster::start(1).await;
    let url = cluster.url("/v1/completions");
    let request = tokio::spawn(async move {
        let r = reqwest::Client::new().post(url).json(&long_prompt_body()).send().await.expect("request");
        (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
    });
    running_prefill(&cluster).await;
    cluster.prefill[0].kill();
    let killed = Instant::now();
    let (status, body) = tokio::time::timeout(Duration::from_secs(10), request).await.expect("no hang").expect("task");
    assert!(killed.elapsed() < Duration::from_secs(5), "error after {:?}", killed.elapsed());
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["type"], "service_unavailable", "{body}");
    cluster.wait_kv_free(Duration::from_secs(5)).await; // the reservation is freed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_decode_worker_ends_the_stream_with_an_error_event() {
    let _guard = ONE_AT_A_TIME.lock().await;
    let mut cluster = Cluster::start(1).await;
    let body = json!({"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 400, "temperature": 0, "stream": true});
    let r = reqwest::Client::new().post(cluster.url("/v1/completions")).json(&body).send().await.expect("request");
    assert_eq!(r.status().as_u16(), 200);
    let mut stream = r.bytes_stream();
    let mut text = String::new();
    while !text.contains("data: ") {
        text.push_str(&String::from_utf8_lossy(&stream.next().await.expect("data").expect("chunk")));
    }
    cluster.decode.kill();
    let killed = Instant::now();
    let rest = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(bytes) => text.push_str(&String::from_utf8_lossy(&bytes)),
                Err(_) => break,
            }
        }
    })
    .await;
    assert!(rest.is_ok(), "the stream hung after the decode worker died");
    assert!(killed.elapsed() < Duration::from_secs(5), "ended after {:?}", killed.elapsed());
    assert!(text.contains("event: error"), "the stream ends with an error event: {text}");
    assert!(!text.contains("[DONE]"), "a failed stream never reports success");
}

/// Streams `request` over gRPC; kills the decode worker serving it (SIGKILL) once `kill_after`
/// tokens arrived, if given. Returns the token ids and the final message.
async fn generate(
    cluster: &mut Cluster,
    request: pb::GenerateRequest,
    kill_after: Option<usize>,
) -> (Vec<u32>, Option<pb::GenerationDone>, Option<usize>) {
    let mut client =
        pb::generation_client::GenerationClient::connect(format!("http://{}", cluster.grpc)).await.expect("grpc");
    let mut stream = client.generate(request).await.expect("generate").into_inner();
    let (mut tokens, mut done, mut killed) = (Vec::new(), None, None);
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Some(message) =
        tokio::time::timeout_at(deadline.into(), stream.message()).await.expect("no hang").expect("stream")
    {
        match message.message {
            Some(pb::generate_response::Message::Token(t)) => tokens.push(t.token_id),
            Some(pb::generate_response::Message::Done(d)) => done = Some(d),
            Some(pb::generate_response::Message::ChoiceDone(c)) => panic!("one answer has no choice_done: {c:?}"),
            None => {}
        }
        if killed.is_none() && Some(tokens.len()) == kill_after {
            killed = Some(kill_serving_decode(cluster).await);
        }
    }
    (tokens, done, killed)
}

/// SIGKILLs the decode worker that runs a sequence now; returns its index.
async fn kill_serving_decode(cluster: &mut Cluster) -> usize {
    let mut serving = None;
    for (i, addr) in cluster.decode_addrs.clone().iter().enumerate() {
        let mut c = pb::decode_worker_client::DecodeWorkerClient::connect(format!("http://{addr}"))
            .await
            .expect("decode worker");
        let load = c.load(pb::LoadRequest::default()).await.expect("load").into_inner();
        if load.running_sequences > 0 {
            serving = Some(i);
        }
    }
    let i = serving.expect("a decode worker runs the stream");
    if i == 0 {
        cluster.decode.kill()
    } else {
        cluster.more_decode[i - 1].kill()
    }
    i
}

/// Streams `body` over HTTP (SSE); kills the serving decode worker after `kill_after` token
/// chunks, if given. Returns the text, the usage's completion tokens, whether `[DONE]` came,
/// and the killed worker.
async fn sse_text(
    cluster: &mut Cluster,
    body: &Value,
    kill_after: Option<usize>,
) -> (String, Option<u64>, bool, Option<usize>) {
    let r = reqwest::Client::new().post(cluster.url("/v1/completions")).json(body).send().await.expect("request");
    assert_eq!(r.status().as_u16(), 200);
    let mut stream = r.bytes_stream();
    let (mut buffer, mut text, mut chunks) = (String::new(), String::new(), 0);
    let (mut usage, mut done, mut killed) = (None, false, None);
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Some(chunk) = tokio::time::timeout_at(deadline.into(), stream.next()).await.expect("no hang") {
        buffer.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            assert!(!event.contains("event: error"), "the stream failed: {event}");
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).expect("json chunk");
            if let Some(t) = v["choices"][0]["text"].as_str() {
                text.push_str(t);
                chunks += 1;
            }
            usage = usage.or(v["usage"]["completion_tokens"].as_u64());
        }
        if killed.is_none() && Some(chunks) == kill_after {
            killed = Some(kill_serving_decode(cluster).await);
        }
    }
    (text, usage, done, killed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_workers_stream_continues_on_another_with_the_same_tokens() {
    let _guard = ONE_AT_A_TIME.lock().await;
    let router_args = vec!["--quarantine-ms".into(), "300".into()];
    let options = Options { prefill: 1, extra_decode: 1, router_args, ..Options::default() };
    let mut cluster = Cluster::start_with(options).await;
    let request = |temperature: f32| pb::GenerateRequest {
        prompt: "Once upon a time, in a town by the sea,".into(),
        sampling: Some(pb::SamplingParams {
            temperature,
            top_p: 0.95,
            seed: Some(1234),
            max_tokens: 120,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    for temperature in [0.8, 0.0] {
        let (expected, done, _) = generate(&mut cluster, request(temperature), None).await;
        assert_eq!((expected.len(), done.map(|d| d.completion_tokens)), (120, Some(120)), "the undisturbed run");
        let (got, done, killed) = generate(&mut cluster, request(temperature), Some(20)).await;
        let killed = killed.expect("a decode worker was killed");
        assert_eq!(got, expected, "after decode worker {killed} died, the tokens at temperature {temperature}");
        let done = done.expect("the request finished");
        assert_eq!((done.completion_tokens, done.finish_reason.as_str()), (120, "length"));
        // Bring the killed worker back for the next round, after its quarantine.
        cluster.restart_decode(killed);
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    // Over HTTP (SSE), greedy: the same text as an undisturbed run, then usage and [DONE].
    let body = json!({"prompt": "Once upon a time, in a town by the sea,", "max_tokens": 120, "temperature": 0,
                      "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let (expected, usage, done, _) = sse_text(&mut cluster, &body, None).await;
    assert_eq!((usage, done), (Some(120), true));
    let (got, usage, done, killed) = sse_text(&mut cluster, &body, Some(20)).await;
    assert!(killed.is_some(), "a decode worker was killed");
    assert_eq!(got, expected, "the streamed text after a decode worker died");
    assert_eq!((usage, done), (Some(120), true));
    let (metrics, migrations) = migrations(&cluster).await;
    assert_eq!(migrations, 3.0, "each loss counted once:\n{metrics}");
}

/// Streams a request for several answers over gRPC; kills the serving decode worker once
/// `kill_after` tokens (of all answers) arrived, if given. Returns each answer's tokens (id
/// and log probability), its completion tokens, and the final message.
async fn generate_answers(
    cluster: &mut Cluster,
    request: pb::GenerateRequest,
    kill_after: Option<usize>,
) -> (Vec<Vec<(u32, f32)>>, Vec<Option<u32>>, Option<pb::GenerationDone>) {
    let n = request.n as usize;
    let mut client =
        pb::generation_client::GenerationClient::connect(format!("http://{}", cluster.grpc)).await.expect("grpc");
    let mut stream = client.generate(request).await.expect("generate").into_inner();
    let (mut tokens, mut ended, mut done) = (vec![Vec::new(); n], vec![None; n], None);
    let (mut count, mut killed) = (0, false);
    let deadline = Instant::now() + Duration::from_secs(90);
    while let Some(message) =
        tokio::time::timeout_at(deadline.into(), stream.message()).await.expect("no hang").expect("stream")
    {
        match message.message {
            Some(pb::generate_response::Message::Token(t)) => {
                assert!(ended[t.index as usize].is_none(), "a token of answer {} after its end", t.index);
                let logprob = t.logprobs.map_or(f32::NAN, |l| l.logprob);
                tokens[t.index as usize].push((t.token_id, logprob));
                count += 1;
            }
            Some(pb::generate_response::Message::ChoiceDone(c)) => {
                assert!(
                    ended[c.index as usize].replace(c.completion_tokens).is_none(),
                    "answer {} ended twice",
                    c.index
                );
            }
            Some(pb::generate_response::Message::Done(d)) => done = Some(d),
            None => {}
        }
        if !killed && Some(count) == kill_after {
            kill_serving_decode(cluster).await;
            killed = true;
        }
    }
    assert!(kill_after.is_none() || killed, "a decode worker was killed");
    (tokens, ended, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_answers_continue_each_on_its_own_leg_with_the_same_tokens() {
    let _guard = ONE_AT_A_TIME.lock().await;
    let router_args = vec!["--quarantine-ms".into(), "300".into()];
    let options = Options { prefill: 1, extra_decode: 1, router_args, ..Options::default() };
    let mut cluster = Cluster::start_with(options).await;
    let request = pb::GenerateRequest {
        prompt: "Once upon a time, in a town by the sea,".into(),
        n: 3,
        sampling: Some(pb::SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            logprobs: true,
            seed: Some(99),
            max_tokens: 60,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let (expected, ended, done) = generate_answers(&mut cluster, request.clone(), None).await;
    assert!(expected.iter().all(|t| t.len() == 60), "the undisturbed run: {expected:?}");
    let ids = |tokens: &[(u32, f32)]| tokens.iter().map(|t| t.0).collect::<Vec<_>>();
    assert_eq!(ended, vec![Some(60); 3]);
    assert_ne!(ids(&expected[0]), ids(&expected[1]), "each answer samples with its own seed");
    assert_eq!(done.map(|d| d.completion_tokens), Some(180));
    // Killed once about a sixth of the tokens arrived: every answer moves, each its own way.
    let (got, ended, done) = generate_answers(&mut cluster, request, Some(30)).await;
    // A migrated leg's KV comes from a prefill of the tokens sent, not from the decode steps
    // that made them: its logits differ in the last bits (about 1e-4 in a log probability),
    // which can move a draw that landed at the edge of an unlikely token. So each answer
    // agrees token for token up to where one of the two runs drew a token below 1%, and
    // keeps its length; together the answers agree well past the kill (30 tokens).
    let mut agreed = 0;
    for (i, (got, expected)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(got.len(), 60, "answer {i}'s length");
        let Some(m) = got.iter().zip(expected).position(|(g, e)| g.0 != e.0) else {
            agreed += 60;
            continue;
        };
        let unlikely = got[m].1.min(expected[m].1) < 0.01f32.ln();
        assert!(unlikely, "answer {i} after its decode worker died, from token {m}:\n{got:?}\n{expected:?}");
        agreed += m;
    }
    assert!(agreed >= 90, "the answers agreed on {agreed} tokens, 30 of them before the kill");
    assert_eq!(ended, vec![Some(60); 3], "each answer's own count, from the request's start");
    let done = done.expect("the request finished");
    assert_eq!((done.completion_tokens, done.prompt_tokens > 0), (180, true), "{done:?}");
    let (metrics, migrations) = migrations(&cluster).await;
    assert_eq!(migrations, 1.0, "one loss, one migration of three answers:\n{metrics}");
}

/// The router's /metrics text and its `pd_migrations_total` summed over every reason.
async fn migrations(cluster: &Cluster) -> (String, f64) {
    let metrics = Cluster::scrape(&cluster.http).await;
    let total = metrics
        .lines()
        .filter(|l| l.starts_with("pd_migrations_total{"))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum();
    (metrics, total)
}
