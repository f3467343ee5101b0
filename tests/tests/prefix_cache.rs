//! Prefix caching end to end, with the real binaries and model: a repeated system prompt is
//! neither recomputed by the prefill worker nor shipped to the decode worker, answers stay
//! exactly those of an uncached engine, clients see the cached tokens in `usage`, a burst with
//! cancellations leaves every block free or cached, and the router's index of the decode
//! workers' caches agrees with what the workers find, also after one of them restarted.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use pd_engine::{CacheConfig, ChatMessage, Engine, LoadOptions, SamplingParams};
use pd_tests::{model_path, Cluster, Options};
use serde_json::{json, Value};

const BLOCK: usize = 16;

const SYSTEM_A: &str = "You are the assistant of a city library. Answer in one or two short sentences. \
    The library opens at nine and closes at six, Monday to Saturday; on Sundays it is closed. Members may \
    borrow ten items for three weeks and renew them twice online. The reading room is on the second floor, \
    the children's corner on the ground floor, and the archive can be visited by appointment only.";

const SYSTEM_B: &str = "You are the assistant of a bicycle repair shop. Keep answers brief and practical. \
    A basic service costs forty euros and takes one day; a flat tire is fixed while the customer waits. \
    The shop sells tubes, tires, lights and locks, and it lends a bicycle for free during longer repairs. \
    Electric bicycles are serviced on Tuesdays and Thursdays only.";

fn body(system: &str, question: &str, max_tokens: u32) -> Value {
    json!({
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

async fn chat(cluster: &Cluster, body: &Value) -> Value {
    let r = reqwest::Client::new().post(cluster.url("/v1/chat/completions")).json(body).send().await.expect("post");
    assert_eq!(r.status().as_u16(), 200);
    r.json().await.expect("json")
}

/// The sum of every sample of `name` (all label sets) at a /metrics address.
async fn metric(addr: &str, name: &str) -> f64 {
    let text = Cluster::scrape(addr).await;
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// The router's per-request records so far (JSON log lines).
fn records(cluster: &Cluster) -> Vec<Value> {
    cluster
        .log("pd-router")
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "request finished")
        .collect()
}

fn field(record: &Value, name: &str) -> u64 {
    record[name].as_u64().or_else(|| record["fields"][name].as_u64()).unwrap_or(0)
}

fn text(record: &Value, name: &str) -> String {
    record[name].as_str().or_else(|| record["fields"][name].as_str()).unwrap_or_default().to_string()
}

fn shared(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn json_logs() -> Vec<(String, String)> {
    vec![("PD_LOG_FORMAT".into(), "json".into())]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_prefix_is_neither_recomputed_nor_shipped_and_answers_stay_the_same() {
    let options = Options { prefill: 1, capture_logs: true, env: json_logs(), ..Options::default() };
    let cluster = Cluster::start_with(options).await;
    let cache = CacheConfig { prefix_cache: false, ..CacheConfig::with_blocks(128) };
    let engine = Engine::load(&model_path(), LoadOptions::default(), cache).expect("engine");
    let prompt = |q: &str| {
        engine.chat_prompt(&[ChatMessage::new("system", SYSTEM_A), ChatMessage::new("user", q)]).expect("prompt")
    };
    let questions = ["When do you open on Saturday?", "How many books can I borrow?", "Where is the archive?"];
    let mut previous: Vec<Vec<u32>> = Vec::new();
    let mut kv_bytes = Vec::new();
    for q in questions {
        let tokens = prompt(q);
        let expected = engine.generate(&tokens, &SamplingParams::greedy(12), 512, |_| {}).expect("engine");
        let before = metric(&cluster.decode_metrics, "pd_kv_transfer_bytes_total").await;
        let answer = chat(&cluster, &body(SYSTEM_A, q, 12)).await;
        kv_bytes.push(metric(&cluster.decode_metrics, "pd_kv_transfer_bytes_total").await - before);
        assert_eq!(answer["choices"][0]["message"]["content"], expected.text, "the answer to {q:?}");
        let hit = previous.iter().map(|p| shared(p, &tokens)).max().unwrap_or(0).min(tokens.len() - 1) / BLOCK * BLOCK;
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
        assert_eq!(cached as usize, hit, "cached tokens reported for {q:?}");
        previous.push(tokens);
        // The router's index has the new cache events before the next request.
        cluster.wait_kv_free(Duration::from_secs(20)).await;
        cluster.wait_router_index_synced(Duration::from_secs(20)).await;
    }
    let second = &records(&cluster)[1];
    assert!(field(second, "cached_tokens") >= 4 * BLOCK as u64, "the system prompt was cached: {second}");
    for warm in &kv_bytes[1..] {
        assert!(*warm < kv_bytes[0] * 0.5, "a warm request ships only its suffix: {kv_bytes:?}");
    }
    let c = engine.model().config();
    let block_bytes = (BLOCK * c.num_kv_heads * c.head_dim * 2 * 2 * c.num_layers) as f64;
    let last = previous.last().expect("prompts");
    let shipped_blocks = (last.len() - (shared(&previous[0], last) / BLOCK * BLOCK)).div_ceil(BLOCK);
    assert_eq!(kv_bytes[2], shipped_blocks as f64 * block_bytes, "exactly the uncached blocks moved");
    let records = records(&cluster);
    for r in &records[1..] {
        assert_eq!(field(r, "decode_cached_tokens"), field(r, "route_decode_cached_tokens"), "router's index: {r}");
        assert_eq!(field(r, "cached_tokens"), field(r, "route_prefill_cached_tokens"), "router's index: {r}");
    }
    let hits = metric(&cluster.prefill_metrics[0], "pd_prefix_cache_hits_total").await;
    let queries = metric(&cluster.prefill_metrics[0], "pd_prefix_cache_queries_total").await;
    assert!(hits > 0.0 && hits < queries, "prefill worker's hits {hits} of {queries}");

    burst_with_cancellations_leaves_every_block_free_or_cached(&cluster).await;
}

/// 64 requests over two shared prefixes, 16 at a time (as the batch class: this is about the
/// caches, not admission); every fourth is a stream the client drops after its first chunk.
/// Afterwards no block is held anywhere.
async fn burst_with_cancellations_leaves_every_block_free_or_cached(cluster: &Cluster) {
    let limit = Arc::new(tokio::sync::Semaphore::new(16));
    let url = cluster.url("/v1/chat/completions");
    let tasks = (0..64).map(|i| {
        let (limit, url) = (limit.clone(), url.clone());
        tokio::spawn(async move {
            let _permit = limit.acquire().await.expect("semaphore");
            let system = if i % 2 == 0 { SYSTEM_A } else { SYSTEM_B };
            let mut b = body(system, &format!("Question number {i}: what should I know?"), 8);
            let client = reqwest::Client::new();
            let post = |b: &Value| client.post(&url).header("x-pd-class", "batch").json(b).send();
            if i % 4 == 3 {
                b["stream"] = json!(true);
                let r = post(&b).await.expect("post");
                let mut chunks = r.bytes_stream();
                let _ = tokio::time::timeout(Duration::from_secs(60), chunks.next()).await;
                return false; // dropped mid-stream
            }
            let r = post(&b).await.expect("post");
            let status = r.status();
            if !status.is_success() {
                eprintln!("burst request {i}: {status} {}", r.text().await.unwrap_or_default());
            }
            status.is_success()
        })
    });
    let done = futures_util::future::join_all(tasks).await;
    let ok = done.into_iter().filter(|r| matches!(r, Ok(true))).count();
    assert_eq!(ok, 48, "every request that was not cancelled succeeded");
    cluster.wait_kv_free(Duration::from_secs(20)).await;
    let load = cluster.decode_load().await;
    assert_eq!(load.running_sequences + load.waiting_transfers, 0);
    assert!(load.cache.is_some_and(|c| c.snapshot && !c.snapshot_hashes.is_empty()), "prefixes stay cached");
    let prefill = cluster.prefill_load(0).await.expect("prefill load");
    assert_eq!((prefill.running_prefills, prefill.waiting_prefill_tokens), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_decode_worker_holding_their_prefix_and_a_restart_resyncs_the_index() {
    let options = Options { prefill: 1, extra_decode: 1, capture_logs: true, env: json_logs(), ..Options::default() };
    let mut cluster = Cluster::start_with(options).await;
    let mut seen = 0;
    let mut ask = async |cluster: &Cluster, system: &str, q: &str| -> Value {
        chat(cluster, &body(system, q, 4)).await;
        cluster.wait_kv_free(Duration::from_secs(20)).await; // the answer's blocks went to the cache
        cluster.wait_router_index_synced(Duration::from_secs(20)).await;
        let all = records(cluster);
        assert_eq!(all.len(), seen + 1, "one record per request");
        seen += 1;
        all[seen - 1].clone()
    };
    // Cold: each prefix lands somewhere and is cached there.
    let first_a = ask(&cluster, SYSTEM_A, "Are you open on Sunday?").await;
    ask(&cluster, SYSTEM_B, "How much is a service?").await;
    // Warm: every request goes to a worker holding its prefix, as the router expected.
    let mut holder: HashMap<&str, String> = HashMap::new();
    for (i, system) in [SYSTEM_A, SYSTEM_B, SYSTEM_A, SYSTEM_B, SYSTEM_A, SYSTEM_B].into_iter().enumerate() {
        let r = ask(&cluster, system, &format!("Tell me one thing, number {i}.")).await;
        let decode_cached = field(&r, "decode_cached_tokens");
        assert!(decode_cached >= 4 * BLOCK as u64, "request {i} landed where its prefix is: {r}");
        assert_eq!(decode_cached, field(&r, "route_decode_cached_tokens"), "the router knew: {r}");
        let key = if system == SYSTEM_A { "a" } else { "b" };
        holder.entry(key).or_insert_with(|| text(&r, "decode_worker"));
    }
    assert_eq!(holder["a"], text(&first_a, "decode_worker"));
    // The worker holding prefix A restarts empty under the same address.
    let i = cluster.decode_addrs.iter().position(|a| *a == holder["a"]).expect("a decode worker");
    cluster.restart_decode(i);
    cluster.wait_router_index_synced(Duration::from_secs(20)).await;
    let after = ask(&cluster, SYSTEM_A, "Can I renew online?").await;
    assert_eq!(
        field(&after, "decode_cached_tokens"),
        field(&after, "route_decode_cached_tokens"),
        "the router dropped the restarted worker's old cache from its index: {after}"
    );
    let again = ask(&cluster, SYSTEM_A, "Is the reading room upstairs?").await;
    assert!(field(&again, "decode_cached_tokens") >= 4 * BLOCK as u64, "the prefix is cached again: {again}");
    assert_eq!(field(&again, "decode_cached_tokens"), field(&again, "route_decode_cached_tokens"));
}
