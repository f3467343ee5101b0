//! Stale state after restarts and abort storms, on the real processes: a decode worker and a
//! prefill worker killed and restarted on the same address (cached channels in the router and
//! in the prefill worker's KV senders, the router's view of the fleet) cost no request once the
//! worker is back; hundreds of clients leaving mid-request (before an answer, during the KV
//! transfer, mid-stream) leave no reservation, no running sequence and no queued prefill, and
//! the cluster serves normally right after.

use std::time::{Duration, Instant};

use pd_tests::{Cluster, Options};
use serde_json::{json, Value};

const PROMPT: &str = "The lighthouse keeper climbed the stairs every evening and";

async fn complete(cluster: &Cluster, prompt: &str) -> (u16, String) {
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
    match client.post(cluster.url("/v1/completions")).json(&body).send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            (status, v["choices"][0]["text"].as_str().map_or_else(|| v.to_string(), str::to_string))
        }
        Err(e) => (0, e.to_string()),
    }
}

/// Waits until `url` answers 200.
async fn wait_ready(url: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !reqwest::get(url).await.is_ok_and(|r| r.status().is_success()) {
        assert!(Instant::now() < deadline, "{what} never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_restarted_on_their_address_cost_no_request_once_back() {
    restarts_cost_no_request(Options { prefill: 1, ..Options::default() }).await;
}

/// The same over UCX, with the decode worker's UCX listener on a fixed port, so the
/// restarted worker must listen on it again (its old connections in TIME_WAIT) and advertises
/// the same `ucx://` endpoint the prefill worker has a cached, now dead, UCX connection to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_restarted_on_their_address_cost_no_request_once_back_over_ucx() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port();
    let decode_args =
        ["--kv-transport".to_string(), "ucx".into(), "--kv-ucx-listen".into(), format!("127.0.0.1:{port}")];
    let env = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")].map(|(k, v)| (k.to_string(), v.to_string())).to_vec();
    restarts_cost_no_request(Options { prefill: 1, decode_args: decode_args.to_vec(), env, ..Options::default() })
        .await;
}

async fn restarts_cost_no_request(options: Options) {
    let mut cluster = Cluster::start_with(options).await;
    let (status, expected) = complete(&cluster, PROMPT).await;
    assert_eq!(status, 200, "{expected}");
    for round in 0..2 {
        let what = if round == 0 { "decode" } else { "prefill" };
        if round == 0 {
            cluster.restart_decode(0);
            wait_ready(&format!("http://{}/ready", cluster.decode_metrics), "the restarted decode worker").await;
        } else {
            cluster.restart_prefill(0);
            wait_ready(&format!("http://{}/ready", cluster.prefill_metrics[0]), "the restarted prefill worker").await;
        }
        // Back: from now on every request is served, with the answer of before.
        for i in 0..8 {
            let (status, text) = complete(&cluster, PROMPT).await;
            assert_eq!((status, text.as_str()), (200, expected.as_str()), "request {i} after the {what} restart");
        }
        let four = (0..4).map(|_| complete(&cluster, PROMPT));
        for (status, text) in futures_util::future::join_all(four).await {
            assert_eq!((status, text.as_str()), (200, expected.as_str()), "concurrent, after the {what} restart");
        }
    }
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_storm_leaks_no_reservation_and_the_cluster_serves_right_after() {
    const CLIENTS: usize = 200;
    let cluster = Cluster::start(1).await;
    let (status, expected) = complete(&cluster, PROMPT).await;
    assert_eq!(status, 200, "{expected}");
    let document = "The keeper wrote the weather in his log and watched the ships pass. ".repeat(12);
    // Each client leaves after 0-0.5 s: while queued, while its prompt is prefilled or its
    // KV in transfer, or mid-stream; distinct prompts, so each one is prefilled and shipped.
    // Waves of 8 at once (admitted, not refused as overload), 200 clients in all.
    const WAVE: usize = 8;
    for wave in 0..CLIENTS / WAVE {
        let storm = (0..WAVE).map(|j| {
            let i = wave * WAVE + j;
            let (url, prompt) = (cluster.url("/v1/completions"), format!("{i}. {document}"));
            async move {
                let body = json!({"prompt": prompt, "max_tokens": 64, "ignore_eos": true, "stream": true});
                let leave = Duration::from_millis((i as u64 * 37) % 500);
                let _ = tokio::time::timeout(leave, async {
                    let r = reqwest::Client::new().post(&url).json(&body).send().await?;
                    r.bytes().await
                })
                .await;
            }
        });
        futures_util::future::join_all(storm).await;
    }
    // The storm reached the workers: the decode worker reserved KV for many of the clients
    // (a reservation per admitted request; the rest were refused as overload or left in the
    // router's queue).
    let metrics = Cluster::scrape(&cluster.decode_metrics).await;
    let reservations: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("pd_prefix_cache_queries_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(reservations >= 20.0, "the storm barely reached the workers: {reservations} reservations");
    // Nothing is left behind: no KV block, no waiting transfer, no running sequence, no
    // queued or running prefill.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let decode = cluster.decode_load().await;
        let prefill = cluster.prefill_load(0).await.expect("prefill load");
        let idle = decode.free_blocks == decode.total_blocks
            && decode.running_sequences + decode.waiting_transfers == 0
            && prefill.running_prefills + prefill.queued_prefills == 0;
        if idle {
            break;
        }
        assert!(Instant::now() < deadline, "still held 20 s after {CLIENTS} clients left: {decode:?} {prefill:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And it serves at once, with the answer of before.
    for i in 0..4 {
        let (status, text) = complete(&cluster, PROMPT).await;
        assert_eq!((status, text.as_str()), (200, expected.as_str()), "request {i} after the storm");
    }
}
