//! The autoscaling signals for real: Debian's Prometheus (scripts/install-k8s-tools.sh)
//! scrapes a running cluster (router, prefill worker, decode worker, labelled as the
//! `kubernetes-pods` job labels pods) and evaluates the KEDA ScaledObjects' own queries, taken
//! from the rendered cpu-dev overlay, while the load changes. Idle, every signal is 0; while
//! streams run and a document is prefilled, the decode signals (running sequences, KV usage)
//! and the prefill backlog (waiting prompt tokens) rise; once the load is gone they are 0
//! again, as docs/kubernetes.md ("Autoscaling signals") says they move.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pd_tests::{Cluster, Proc};
use serde_json::{json, Value};

/// One Prometheus trigger of a ScaledObject: the Deployment it scales, its query, threshold
/// and metric type.
struct Trigger {
    target: String,
    query: String,
    threshold: f64,
    metric_type: String,
}

fn triggers() -> Vec<Trigger> {
    let (_file, objects) = pd_tests::k8s::render("cpu-dev");
    let mut out = Vec::new();
    for so in objects.iter().filter(|o| o["kind"] == "ScaledObject") {
        let target = so["spec"]["scaleTargetRef"]["name"].as_str().expect("target").to_string();
        for t in so["spec"]["triggers"].as_array().expect("triggers").iter().filter(|t| t["type"] == "prometheus") {
            out.push(Trigger {
                target: target.clone(),
                query: t["metadata"]["query"].as_str().expect("query").to_string(),
                threshold: t["metadata"]["threshold"].as_str().and_then(|v| v.parse().ok()).expect("threshold"),
                metric_type: t["metricType"].as_str().unwrap_or("AverageValue").to_string(),
            });
        }
    }
    out
}

/// Prometheus on a free loopback port, scraping `targets` four times a second (a short prefill
/// is seen even on a fast machine).
fn prometheus(dir: &Path, targets: &[String]) -> (Proc, String) {
    let config = dir.join("prometheus.yml");
    let list = targets.iter().map(|t| format!("\"{t}\"")).collect::<Vec<_>>().join(", ");
    let yaml = format!(
        "global: {{ scrape_interval: 250ms, evaluation_interval: 1s }}\nscrape_configs:\n  - job_name: pd\n    static_configs:\n      - targets: [{list}]\n        labels: {{ namespace: pd }}\n"
    );
    std::fs::write(&config, yaml).expect("prometheus.yml");
    // A port the OS picked, handed to Prometheus (it cannot report one it chose itself).
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let addr = format!("127.0.0.1:{port}");
    let mut command = Command::new("prometheus");
    command
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address={addr}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).expect("log file"));
    let child = command.spawn().expect("starting prometheus (scripts/install-k8s-tools.sh installs it)");
    (Proc { child, name: "prometheus".into() }, addr)
}

/// The query's value now (None: no series, or Prometheus not answering yet).
async fn value(prometheus: &str, query: &str) -> Option<f64> {
    let url = format!("http://{prometheus}/api/v1/query");
    let r = reqwest::Client::new().get(url).query(&[("query", query)]).send().await.ok()?;
    let body: Value = r.json().await.ok()?;
    body["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}

/// A request's status and body.
async fn answer(request: reqwest::RequestBuilder) -> (u16, String) {
    let r = request.send().await.expect("request");
    (r.status().as_u16(), r.text().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keda_queries_follow_the_load_in_a_real_prometheus() {
    let triggers = triggers();
    assert_eq!(triggers.len(), 4, "two Prometheus triggers for prefill, two for decode");
    let cluster = Cluster::start(1).await;
    let dir = tempfile::tempdir().expect("dir");
    let targets = [cluster.http.clone(), cluster.prefill_metrics[0].clone(), cluster.decode_metrics.clone()];
    let (_prometheus, prom) = prometheus(dir.path(), &targets);
    let deadline = Instant::now() + Duration::from_secs(60);
    while value(&prom, "sum(up{namespace=\"pd\"})").await != Some(3.0) {
        let log = std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
        assert!(Instant::now() < deadline, "Prometheus never scraped all three targets:\n{log}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // Idle: every signal evaluates, to 0.
    for t in &triggers {
        assert_eq!(value(&prom, &t.query).await, Some(0.0), "{} idle: {}", t.target, t.query);
    }

    // Load: six streams and a ~500-token document, all at once.
    let mut load = Vec::new();
    for i in 0..6 {
        let url = cluster.url("/v1/completions");
        load.push(tokio::spawn(async move {
            let body = json!({"prompt": format!("Story {i}: once upon a time"), "max_tokens": 96,
                              "temperature": 0, "ignore_eos": true});
            answer(reqwest::Client::new().post(url).json(&body)).await
        }));
    }
    let url = cluster.url("/v1/completions");
    load.push(tokio::spawn(async move {
        let document = "The lighthouse keeper wrote in his log every night. ".repeat(50);
        let body = json!({"prompt": document, "max_tokens": 1});
        answer(reqwest::Client::new().post(url).header("x-pd-class", "batch").json(&body)).await
    }));
    let mut most: BTreeMap<&str, f64> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(180);
    while load.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
        for t in &triggers {
            if let Some(v) = value(&prom, &t.query).await {
                let m = most.entry(t.query.as_str()).or_insert(0.0);
                *m = m.max(v);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for task in load {
        let (status, body) = task.await.expect("task");
        assert_eq!(status, 200, "{body}");
    }
    println!("| deployment | query | threshold | most under load | replicas KEDA asks for at that, from 1 |");
    println!("|---|---|---|---|---|");
    for t in &triggers {
        let v = most.get(t.query.as_str()).copied().unwrap_or(0.0);
        // The HPA KEDA drives, from one replica: AverageValue wants ceil(total / target),
        // Value ceil(replicas x value / target): the same at one replica.
        let replicas = (v / t.threshold).ceil().max(1.0);
        println!("| {} | `{}` | {} ({}) | {v} | {replicas} |", t.target, t.query, t.threshold, t.metric_type);
    }
    let peak = |metric: &str| {
        triggers
            .iter()
            .filter(|t| t.query.contains(metric))
            .map(|t| most.get(t.query.as_str()).copied().unwrap_or(0.0))
            .fold(0.0, f64::max)
    };
    assert!(peak("pd_running_decode_sequences") >= 2.0, "the decode batch signal rose: {most:?}");
    assert!(peak("pd_kv_cache_usage_ratio") > 0.0, "the KV usage signal rose: {most:?}");
    assert!(peak("pd_waiting_prefill_tokens") >= 100.0, "the prefill backlog signal rose: {most:?}");

    // After: back to 0 within a few scrapes.
    let deadline = Instant::now() + Duration::from_secs(20);
    for t in &triggers {
        while value(&prom, &t.query).await != Some(0.0) {
            assert!(
                Instant::now() < deadline,
                "{} still {:?} after the load: {}",
                t.target,
                value(&prom, &t.query).await,
                t.query
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}
