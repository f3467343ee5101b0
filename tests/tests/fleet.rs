//! The fleet tools end to end with the real binaries: `pd-bench profile` measures a real
//! prefill + decode pair and fits a cost model; `pd-sim-worker` serves simulated workers with
//! it; the real `pd-router` routes a pd-bench run over them; `pd-bench plan` turns that run
//! into a capacity plan; `pd-bench simulate` runs the same traffic in virtual time.
//! And a simulated decode worker lost mid-stream costs no request: the router migrates its
//! streams. That test moves KV over the transport `PD_TEST_KV_TRANSPORT` names (UCX in
//! scripts/test.sh's second pass: every frame into the real registry), and checks what
//! pd-sim-worker counted of it when stopped.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use pd_tests::{binary, model_path, spawn_command, Proc};
use serde_json::{json, Value};

fn run(name: &str, args: &[&str]) -> Output {
    let out = Command::new(binary(name)).args(args).output().unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(
        out.status.success(),
        "{name} {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn model() -> String {
    model_path().to_str().expect("utf-8 path").to_string()
}

/// A real worker on port 0: the process and its address.
fn worker(name: &str, extra: &[&str]) -> (Proc, String) {
    let mut command = Command::new(binary(name));
    command.args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--model", &model()]).args(extra);
    let (proc, lines) = spawn_command(command, name, &format!("{name} listening on"), None);
    (proc, lines.last().cloned().unwrap_or_default())
}

/// Simulated workers: the process and (prefill, decode) address lists; stderr to `log`.
fn sim_workers(
    cost: &Path,
    prefill: usize,
    decode: usize,
    extra: &[&str],
    log: Option<PathBuf>,
) -> (Proc, String, String) {
    let mut command = Command::new(binary("pd-sim-worker"));
    command.arg("--cost").arg(cost).args(["--prefill", &prefill.to_string(), "--decode", &decode.to_string()]);
    command.args(extra);
    let (proc, lines) = spawn_command(command, "pd-sim-worker", "PD_DECODE_WORKERS=", log);
    let prefill = lines.iter().find_map(|l| l.strip_prefix("PD_PREFILL_WORKERS=")).expect("prefill line").to_string();
    (proc, prefill, lines.last().cloned().expect("decode line"))
}

/// The real router over `prefill` and `decode`: the process and its HTTP address.
/// The real router over `prefill` and `decode`, with the test clusters' relaxed classes
/// (written to `dir`): the simulated workers run at rates measured on a busy machine, and
/// what is under test is the chain, not admission.
fn router(prefill: &str, decode: &str, dir: &Path) -> (Proc, String) {
    let classes = pd_tests::relaxed_classes(dir);
    let mut command = Command::new(binary("pd-router"));
    command.args(["--http-listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--model", &model()]);
    command.args(["--prefill", prefill, "--decode", decode]);
    command.arg("--classes").arg(classes);
    let (proc, lines) = spawn_command(command, "pd-router", "pd-router http on", None);
    let http = lines.last().and_then(|l| l.split_whitespace().next()).expect("http address").to_string();
    (proc, http)
}

async fn wait_ready(http: &str) {
    let client = reqwest::Client::new();
    for _ in 0..200 {
        if client.get(format!("http://{http}/ready")).send().await.is_ok_and(|r| r.status().is_success()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the router at {http} never became ready");
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profile_simulate_route_and_plan() {
    let dir = tempfile::tempdir().expect("dir");
    let cost = dir.path().join("cost.json");
    // 1. A real pair, measured (small cells: this is about the chain, not the numbers).
    {
        let (_decode, decode) = worker("pd-decode", &["--kv-blocks", "1024"]);
        let (_prefill, prefill) = worker("pd-prefill", &["--step-target-ms", "60000"]);
        let cost = cost.to_str().expect("path");
        let args = [
            "profile",
            "--prefill",
            &prefill,
            "--decode",
            &decode,
            "--out",
            cost,
            "--prefill-lengths",
            "8,16,32,64",
            "--batches",
            "1,2",
            "--contexts",
            "16,64",
            "--decode-tokens",
            "12",
        ];
        run("pd-bench", &args);
    }
    let profile = read_json(&cost);
    assert_eq!(profile["measured"]["prefill"].as_array().map(Vec::len), Some(4), "{profile}");
    assert_eq!(profile["measured"]["decode"].as_array().map(Vec::len), Some(4), "{profile}");
    assert_eq!(profile["kv"]["bytes_per_token"], json!(23040), "SmolLM2's f16 K and V: 30 x 3 x 64 x 2 x 2 bytes");
    assert_eq!(profile["worker"]["kv_blocks"], json!(1024));
    for f in ["fixed_ms", "per_row_ms"] {
        assert!(profile["decode"][f].as_f64().is_some_and(|v| v >= 0.0), "{f}: {profile}");
    }
    assert!(
        profile["decode"]["fixed_ms"].as_f64().unwrap_or(0.0) + profile["decode"]["per_row_ms"].as_f64().unwrap_or(0.0)
            > 1.0
    );

    // 2. Simulated workers with that model, the real router over them, a pd-bench run.
    let (_sim, prefill, decode) = sim_workers(&cost, 2, 2, &[], None);
    assert_eq!((prefill.split(',').count(), decode.split(',').count()), (2, 2));
    let (_router, http) = router(&prefill, &decode, dir.path());
    wait_ready(&http).await;
    let runs = dir.path().join("run");
    let scenario = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/scenarios/smoke.txt");
    let url = format!("http://{http}");
    let (scenario, runs_s) = (scenario.to_str().expect("path"), runs.to_str().expect("path"));
    run("pd-bench", &["run", "--quiet", "--url", &url, "--model", &model(), "--scenario", scenario, "--out", runs_s]);
    let requests = read_json(&runs.join("requests.json"));
    let requests = requests.as_array().expect("requests");
    assert!(requests.len() >= 8, "{}", requests.len());
    for r in requests {
        assert!(r["error"].is_null(), "a request through simulated workers failed: {r}");
        let streamed = r["token_ms"].as_array().expect("tokens").len() as u64;
        assert_eq!(Some(streamed), r["requested_output_tokens"].as_u64(), "{r}");
    }

    // 3. The capacity plan of that run.
    let plan = dir.path().join("plan");
    let requests_path = runs.join("requests.json");
    let args = ["plan", "--cost", cost.to_str().expect("path"), "--requests", requests_path.to_str().expect("path")];
    run("pd-bench", &[&args[..], &["--out", plan.to_str().expect("path"), "--window-s", "4"]].concat());
    let p = read_json(&plan.join("plan.json"));
    assert!(p["prefill"]["replicas"].as_u64().is_some_and(|r| r >= 2), "one serving + one spare at least: {p}");
    assert!(p["decode"]["replicas"].as_u64().is_some_and(|r| r >= 2), "{p}");
    let classes: Vec<&str> =
        p["classes"].as_array().expect("classes").iter().filter_map(|c| c["class"].as_str()).collect();
    assert_eq!(classes, ["batch", "interactive"]);
    assert!(std::fs::read_to_string(plan.join("plan.md")).expect("plan.md").contains("| prefill |"));
    assert!(plan.join("rates.svg").is_file());

    // 4. The same traffic and fleet in virtual time: the real scheduler, no router process.
    let virt = dir.path().join("virtual");
    let args = ["simulate", "--scenario", scenario, "--cost", cost.to_str().expect("path"), "--prefill", "2"];
    run(
        "pd-bench",
        &[&args[..], &["--decode", "2", "--replicas", "3", "--out", virt.to_str().expect("path")]].concat(),
    );
    let simulated = read_json(&virt.join("requests.json"));
    let simulated = simulated.as_array().expect("requests");
    let batch = |rs: &[Value]| rs.iter().filter(|r| r["class"] == "batch").count();
    assert_eq!(batch(simulated), batch(requests), "the periodic class sends what it sent in real time");
    for r in simulated {
        assert!(r["error"].is_null(), "a request in virtual time failed: {r}");
        assert_eq!(r["token_ms"].as_array().map(|t| t.len() as u64), r["requested_output_tokens"].as_u64(), "{r}");
    }
    let v = read_json(&virt.join("virtual.json"));
    assert_eq!(v["totals"]["held_blocks"], json!(0), "{v}");
    assert_eq!(v["replicas"].as_array().map(Vec::len), Some(3), "{v}");
    assert!(std::fs::read_to_string(virt.join("report.md")).expect("report.md").contains("| interactive"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_decode_worker_lost_mid_stream_costs_no_request() {
    let dir = tempfile::tempdir().expect("dir");
    let cost = dir.path().join("cost.json");
    let model = json!({
        "source": "test: 20 ms decode steps",
        "prefill": {"fixed_ms": 5.0, "per_token_ms": 0.0, "per_pair_us": 0.0},
        "decode": {"fixed_ms": 20.0, "per_row_ms": 0.0, "per_context_us": 0.0},
        "kv": {"bytes_per_token": 1000, "commit_fixed_ms": 0.0, "commit_ms_per_mb": 0.0},
        "worker": {"block_size": 16, "kv_blocks": 4096, "max_batch": 64, "max_position": 8192}
    });
    std::fs::write(&cost, model.to_string()).expect("cost");
    // Streams of 60 tokens take 1.2 s; decode worker 0 is lost 1.5 s in, while 8 run.
    let transport = pd_tests::default_kv_transport().unwrap_or_else(|| "grpc".into());
    let log = dir.path().join("sim.log");
    let args = ["--lose", "decode:0@1.5", "--kv-transport", &transport];
    let (mut sim, prefill, decode) = sim_workers(&cost, 2, 2, &args, Some(log.clone()));
    let (_router, http) = router(&prefill, &decode, dir.path());
    wait_ready(&http).await;
    let started = tokio::time::Instant::now();
    tokio::time::sleep_until(started + Duration::from_millis(800)).await;
    let client = reqwest::Client::new();
    let requests = (0..8).map(|i| {
        let body = json!({"prompt": format!("request {i} of the loss test"), "max_tokens": 60, "ignore_eos": true});
        let r = client.post(format!("http://{http}/v1/completions")).json(&body).timeout(Duration::from_secs(30));
        async move {
            let response = r.send().await.expect("post");
            (response.status().as_u16(), response.json::<Value>().await.expect("json"))
        }
    });
    let answers = futures_util::future::join_all(requests).await;
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], json!(60), "{body}");
    }
    // The loss happened while they ran, and the router no longer routes to the lost worker.
    assert!(started.elapsed() > Duration::from_millis(1500));
    let lost = decode.split(',').next().expect("decode 0");
    let metrics =
        client.get(format!("http://{http}/metrics")).send().await.expect("metrics").text().await.expect("text");
    let migrated: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("pd_migrations_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(migrated >= 1.0, "no stream was migrated off {lost}:\n{metrics}");

    // Every request's KV went over the transport asked for, and no UCX reservation is left.
    sim.terminate();
    assert!(sim.exited(Duration::from_secs(10)).await.is_some(), "pd-sim-worker did not stop on SIGTERM");
    let text = std::fs::read_to_string(&log).expect("sim log");
    let summary = text.lines().find(|l| l.contains("KV hand-offs committed")).unwrap_or_else(|| panic!("{text}"));
    let count = |what: &str| -> u64 {
        let (before, _) = summary.split_once(what).unwrap_or_else(|| panic!("{what}: {summary}"));
        before.rsplit(|c: char| !c.is_ascii_digit()).find(|w| !w.is_empty()).and_then(|n| n.parse().ok()).expect(what)
    };
    eprintln!("pd-sim-worker over {transport}: {summary}");
    let (over, other) = if transport == "ucx" { (" over ucx", " over grpc") } else { (" over grpc", " over ucx") };
    assert!(count(over) >= 8, "8 requests, and again for each migrated one: {summary}");
    assert_eq!(count(other), 0, "{summary}");
    assert!(summary.ends_with("; 0 blocks held by UCX reservations"), "{summary}");
}
