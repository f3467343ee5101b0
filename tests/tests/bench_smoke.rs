//! pd-bench against the real local cluster, briefly: the report files appear and agree with
//! each other and with the raw data (counts add up, p50 <= p95 <= p99, every requested
//! token arrived, the server's usage matches the stream).

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use pd_tests::{model_path, Cluster};
use serde_json::Value;

fn binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    exe.parent().and_then(Path::parent).expect("target dir").join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_bench_writes_a_consistent_report() {
    // Under test is the report's consistency, not admission: the test cluster's relaxed
    // classes (pd_tests::relaxed_classes), so a busy machine's slow prefill does not turn
    // smoke requests into 429s.
    let cluster = Cluster::start(1).await;
    let out = tempfile::tempdir().expect("out dir");
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/scenarios/smoke.txt");
    let run = Command::new(binary("pd-bench"))
        .args(["run", "--quiet", "--label", "smoke/base", "--url", &format!("http://{}", cluster.http)])
        .arg("--model")
        .arg(model_path())
        .arg("--scenario")
        .arg(&scenario)
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("run pd-bench");
    assert!(
        run.status.success(),
        "pd-bench failed:\n{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    for file in ["summary.json", "requests.json", "report.md", "ttft.svg", "itl.svg", "timeline.svg"] {
        assert!(out.path().join(file).is_file(), "{file} missing");
    }
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("summary.json")).expect("summary"))
            .expect("json");
    let requests: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("requests.json")).expect("raw")).expect("json");
    assert!(requests.len() >= 8, "the smoke run sends requests: {}", requests.len());

    // Raw data: no errors, exact output lengths, usage = streamed tokens.
    for r in &requests {
        assert!(r["error"].is_null(), "request failed: {r}");
        let streamed = r["token_ms"].as_array().expect("tokens").len() as u64;
        assert_eq!(Some(streamed), r["requested_output_tokens"].as_u64(), "ignore_eos gives exactly max_tokens");
        assert_eq!(r["reported_output_tokens"].as_u64(), Some(streamed));
    }

    // Rows: per class, bucket rows add up to the class's requests.
    let mut by_class: HashMap<String, usize> = HashMap::new();
    for r in &requests {
        *by_class.entry(r["class"].as_str().expect("class").to_string()).or_default() += 1;
    }
    let rows = summary["rows"].as_array().expect("rows");
    for (class, count) in &by_class {
        let bucket_sum: u64 = rows
            .iter()
            .filter(|r| {
                r["class"] == class.as_str()
                    && !["all", "cold", "warm"].contains(&r["input_bucket"].as_str().unwrap_or(""))
            })
            .map(|r| r["requests"].as_u64().expect("requests"))
            .sum();
        assert_eq!(bucket_sum, *count as u64, "{class}: bucket rows add up");
        // The class with a shared prefix also splits into cold and warm requests.
        let split: Vec<u64> = rows
            .iter()
            .filter(|r| {
                r["class"] == class.as_str() && ["cold", "warm"].contains(&r["input_bucket"].as_str().unwrap_or(""))
            })
            .map(|r| r["requests"].as_u64().expect("requests"))
            .collect();
        if class == "batch" {
            assert_eq!((split.len(), split.iter().sum::<u64>()), (2, *count as u64), "{class}: cold + warm rows");
        } else {
            assert!(split.is_empty(), "{class} has no shared prefix");
        }
        if let Some(all) = rows.iter().find(|r| r["class"] == class.as_str() && r["input_bucket"] == "all") {
            assert_eq!(all["requests"].as_u64(), Some(*count as u64));
        }
    }
    let interactive_buckets = rows.iter().filter(|r| r["class"] == "interactive" && r["input_bucket"] != "all").count();
    assert_eq!(interactive_buckets, 1, "16..64 tokens is one bucket");
    assert!(rows.iter().any(|r| r["class"] == "batch" && r["input_bucket"] == "129-512"));
    for row in rows {
        for metric in ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"] {
            let s = &row[metric];
            let (p50, p95, p99, max) = (s["p50"].as_f64(), s["p95"].as_f64(), s["p99"].as_f64(), s["max"].as_f64());
            if s["count"].as_u64().unwrap_or(0) > 0 {
                let (p50, p95, p99, max) = (p50.expect("p50"), p95.expect("p95"), p99.expect("p99"), max.expect("max"));
                assert!(0.0 <= p50 && p50 <= p95 && p95 <= p99 && p99 <= max, "{metric} of {row}");
            }
        }
        assert_eq!(row["errors"].as_u64(), Some(0));
        assert!(row["goodput_rps"].as_f64().expect("goodput") >= 0.0);
        // ITL samples = tokens - 1 per request.
        let class = row["class"].as_str().expect("class");
        if row["input_bucket"] == "all" || rows.iter().filter(|r| r["class"] == class).count() == 1 {
            let gaps: u64 = requests
                .iter()
                .filter(|r| r["class"] == class)
                .map(|r| r["token_ms"].as_array().map_or(0, |t| t.len() as u64 - 1))
                .sum();
            assert_eq!(row["itl_ms"]["count"].as_u64(), Some(gaps), "{class}: every gap pooled");
        }
    }
    let md = std::fs::read_to_string(out.path().join("report.md")).expect("markdown");
    assert_eq!(md.lines().filter(|l| l.starts_with("| interactive") || l.starts_with("| batch")).count(), rows.len());
}
