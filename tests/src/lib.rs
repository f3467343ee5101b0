//! pd-tests: starts the real pd binaries as processes on loopback (ports picked by the OS)
//! for end-to-end tests, and stops them when the `Cluster` is dropped.
//!
//! The binaries are taken from the same target directory as the test executable; build them
//! first with `cargo build --release --bins` (scripts/test.sh does).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The real model used by the cluster tests.
pub fn model_path() -> PathBuf {
    let path = std::env::var_os("PD_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(path.is_file(), "real model not found at {}: run scripts/fetch-model.sh", path.display());
    path
}

fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe.parent().and_then(|d| d.parent()).expect("target directory");
    let path = dir.join(name);
    assert!(path.is_file(), "{} is missing: build the binaries first (cargo build --release --bins)", path.display());
    path
}

/// One running process; killed when dropped.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    /// Kills the process now (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `name` with `args` and waits for the stdout line starting with `prefix`.
fn spawn(name: &str, args: &[&str], prefix: &str) -> (Proc, String) {
    let mut child = Command::new(binary(name))
        .args(args)
        .env("UCX_NET_DEVICES", "lo")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    let stdout = child.stdout.take().expect("stdout");
    // Owned from here on: killed on every path, a failed start included.
    let proc = Proc { child, name: name.to_string() };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => {
                let rest = line[prefix.len()..].trim().to_string();
                return (proc, rest);
            }
            Ok(_) => continue,
            Err(_) => break,
        }
    }
    drop(proc);
    panic!("{name} did not print `{prefix}`");
}

/// A router, one decode worker and `prefill` prefill workers.
pub struct Cluster {
    pub router: Proc,
    pub decode: Proc,
    pub prefill: Vec<Proc>,
    pub http: String,
    pub grpc: String,
    pub decode_addr: String,
    pub prefill_addrs: Vec<String>,
}

impl Cluster {
    pub async fn start(prefill: usize) -> Cluster {
        let model = model_path();
        let model = model.to_str().expect("utf-8 path");
        let (decode, decode_addr) =
            spawn("pd-decode", &["--listen", "127.0.0.1:0", "--model", model, "--kv-blocks", "1024"], "pd-decode listening on");
        let mut workers = Vec::new();
        let mut addrs = Vec::new();
        for _ in 0..prefill {
            let (p, a) = spawn("pd-prefill", &["--listen", "127.0.0.1:0", "--model", model], "pd-prefill listening on");
            workers.push(p);
            addrs.push(a);
        }
        let (router, line) = spawn(
            "pd-router",
            &[
                "--http-listen",
                "127.0.0.1:0",
                "--grpc-listen",
                "127.0.0.1:0",
                "--prefill",
                &addrs.join(","),
                "--decode",
                &decode_addr,
                "--model",
                model,
            ],
            "pd-router http on",
        );
        // "<http> grpc on <grpc>"
        let mut parts = line.split_whitespace();
        let http = parts.next().expect("http address").to_string();
        let grpc = parts.nth(2).expect("grpc address").to_string();
        let cluster = Cluster { router, decode, prefill: workers, http, grpc, decode_addr, prefill_addrs: addrs };
        cluster.wait_ready().await;
        cluster
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.http, path)
    }

    async fn wait_ready(&self) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(r) = client.get(self.url("/ready")).send().await {
                if r.status().is_success() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the cluster never became ready");
    }

    /// The decode worker's load report.
    pub async fn decode_load(&self) -> pd_proto::v1::DecodeLoad {
        let mut client = pd_proto::v1::decode_worker_client::DecodeWorkerClient::connect(format!("http://{}", self.decode_addr))
            .await
            .expect("connect to the decode worker");
        client.load(pd_proto::v1::LoadRequest {}).await.expect("load").into_inner()
    }

    /// A prefill worker's load report.
    pub async fn prefill_load(&self, i: usize) -> Option<pd_proto::v1::PrefillLoad> {
        let mut client =
            pd_proto::v1::prefill_worker_client::PrefillWorkerClient::connect(format!("http://{}", self.prefill_addrs[i])).await.ok()?;
        client.load(pd_proto::v1::LoadRequest {}).await.ok().map(|r| r.into_inner())
    }
}
