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

pub mod certs;
pub mod k8s;
pub mod netns;
pub mod proxy;

/// The KV transport of every decode worker a test starts without choosing one:
/// `PD_TEST_KV_TRANSPORT` (`grpc` or `ucx`; scripts/test.sh runs the cluster, faults and
/// restart suites once more with `ucx`); unset: the workers' default (gRPC).
pub fn default_kv_transport() -> Option<String> {
    let transport = std::env::var("PD_TEST_KV_TRANSPORT").ok().filter(|t| !t.is_empty())?;
    assert!(matches!(transport.as_str(), "grpc" | "ucx"), "PD_TEST_KV_TRANSPORT={transport}: not grpc or ucx");
    Some(transport)
}

/// The path of pd binary `name` in the test's target directory.
pub fn binary(name: &str) -> PathBuf {
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
    /// Sends SIGTERM (what Kubernetes sends to stop a pod).
    pub fn terminate(&self) {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("kill");
        assert!(status.success(), "kill -TERM {}", self.name);
    }

    /// The exit status if the process ended within `timeout`.
    pub async fn exited(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// True while the process runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

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

/// How to start a cluster.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Prefill workers.
    pub prefill: usize,
    /// Decode workers beyond the first.
    pub extra_decode: usize,
    /// Environment variables for every process.
    pub env: Vec<(String, String)>,
    /// Extra flags per binary.
    pub router_args: Vec<String>,
    pub decode_args: Vec<String>,
    pub prefill_args: Vec<String>,
    /// A command the router runs under (e.g. `unshare --pid --fork`: pid 1 in its own PID
    /// namespace, as in a container); empty: started directly.
    pub router_wrapper: Vec<String>,
    /// Write each process's stderr (its log) to a file in a temporary folder instead of the
    /// test's stderr (see `Cluster::log`).
    pub capture_logs: bool,
    /// The checkpoint every process serves (a GGUF file or a Hugging Face folder); unset: the
    /// real model (`model_path`).
    pub model: Option<PathBuf>,
    /// Keep the router's built-in traffic classes. Unset, and with no `--classes` among
    /// `router_args`, the router gets `relaxed_classes` instead (see there).
    pub builtin_classes: bool,
}

/// The built-in traffic classes (deploy/classes/default.toml) with the interactive class's
/// TTFT SLO, queue age and ITL SLO made loose, written to `dir`: what a test cluster's router
/// runs with unless the test chooses. Admission sheds load by the prefill and decode rates it
/// measures, and on a shared 2-core machine, with other tests' clusters running beside this
/// one, those rates drop far enough that a test about something else (batching, a client
/// library, a migration) gets a 429, or sees its streams held back from the batch, at load
/// the shipped limits were never meant to refuse. Admission itself is tested in the router's
/// unit tests (schedule::policy) against rates the test sets.
pub fn relaxed_classes(dir: &std::path::Path) -> PathBuf {
    let built_in = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/classes/default.toml"))
        .expect("the built-in classes");
    let mut relaxed = built_in.clone();
    let loose = [
        ("ttft_slo_ms = 1500\n", "ttft_slo_ms = 120000\n"),
        ("itl_slo_ms = 100\n", "itl_slo_ms = 10000\n"),
        ("max_queue_age_ms = 3000\n", "max_queue_age_ms = 120000\n"),
    ];
    for (shipped, loose) in loose {
        assert_eq!(
            built_in.matches(shipped).count(),
            1,
            "the built-in classes no longer say `{shipped}`: update relaxed_classes"
        );
        relaxed = relaxed.replace(shipped, loose);
    }
    let path = dir.join("classes.toml");
    std::fs::write(&path, relaxed).expect("write the relaxed classes");
    path
}

impl Options {
    fn model(&self) -> String {
        let path = self.model.clone().unwrap_or_else(model_path);
        path.to_str().expect("utf-8 path").to_string()
    }
}

/// Starts `name` with `args` and waits for the stdout line starting with `prefix`; returns
/// the lines printed up to it (the last one without its prefix).
fn spawn(name: &str, args: &[String], prefix: &str, options: &Options, log: Option<PathBuf>) -> (Proc, Vec<String>) {
    let mut command = Command::new(binary(name));
    command.args(args).env("UCX_NET_DEVICES", "lo").envs(options.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    spawn_command(command, name, prefix, log)
}

/// Starts `command` (pd binary `name`, perhaps behind a wrapper such as `ip netns exec`) and
/// waits for the stdout line starting with `prefix`; returns the lines printed up to it (the
/// last one without its prefix). Its stderr goes to `log`, or to the test's stderr.
pub fn spawn_command(mut command: Command, name: &str, prefix: &str, log: Option<PathBuf>) -> (Proc, Vec<String>) {
    let stderr = match &log {
        Some(path) => {
            Stdio::from(std::fs::File::create(path).unwrap_or_else(|e| panic!("log file {}: {e}", path.display())))
        }
        None => Stdio::inherit(),
    };
    let mut child =
        command.stdout(Stdio::piped()).stderr(stderr).spawn().unwrap_or_else(|e| panic!("starting {name}: {e}"));
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
    let mut lines = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => {
                lines.push(line[prefix.len()..].trim().to_string());
                return (proc, lines);
            }
            Ok(line) => lines.push(line),
            Err(_) => break,
        }
    }
    drop(proc);
    panic!("{name} did not print `{prefix}`");
}

/// A decode worker listening on `listen`: the process, its gRPC and its metrics address.
fn spawn_decode(listen: &str, options: &Options, log: Option<PathBuf>) -> (Proc, String, String) {
    let model = options.model();
    let mut args =
        strings(&["--listen", listen, "--metrics-listen", "127.0.0.1:0", "--model", &model, "--kv-blocks", "1024"]);
    args.extend(options.decode_args.iter().cloned());
    if let Some(transport) = default_kv_transport() {
        if !args.iter().any(|a| a == "--kv-transport") {
            args.extend(["--kv-transport".to_string(), transport]);
        }
    }
    let (proc, lines) = spawn("pd-decode", &args, "pd-decode listening on", options, log);
    let addr = lines.last().cloned().unwrap_or_default();
    let metrics = printed(&lines, "pd-decode metrics on");
    (proc, addr, metrics)
}

fn spawn_prefill(listen: &str, options: &Options, log: Option<PathBuf>) -> (Proc, String, String) {
    let model = options.model();
    let mut args = strings(&["--listen", listen, "--metrics-listen", "127.0.0.1:0", "--model", &model]);
    args.extend(options.prefill_args.iter().cloned());
    let (proc, lines) = spawn("pd-prefill", &args, "pd-prefill listening on", options, log);
    let addr = lines.last().cloned().unwrap_or_default();
    let metrics = printed(&lines, "pd-prefill metrics on");
    (proc, addr, metrics)
}

/// The address printed after `prefix` among `lines`.
fn printed(lines: &[String], prefix: &str) -> String {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(prefix))
        .map(|a| a.trim().to_string())
        .unwrap_or_else(|| panic!("no `{prefix}` line in {lines:?}"))
}

/// A router over the given workers: the process, its HTTP and its gRPC address.
fn spawn_router(
    prefill: &[String],
    decode: &[String],
    options: &Options,
    log: Option<PathBuf>,
) -> (Proc, String, String) {
    let model = options.model();
    let mut args = strings(&["--http-listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--model", &model]);
    if !prefill.is_empty() {
        args.extend(["--prefill".to_string(), prefill.join(",")]);
    }
    args.extend(["--decode".to_string(), decode.join(",")]);
    args.extend(options.router_args.iter().cloned());
    let (router, lines) = match options.router_wrapper.split_first() {
        None => spawn("pd-router", &args, "pd-router http on", options, log),
        Some((program, wrapper_args)) => {
            let mut command = Command::new(program);
            command.args(wrapper_args).arg(binary("pd-router")).args(&args).env("UCX_NET_DEVICES", "lo");
            command.envs(options.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            spawn_command(command, "pd-router", "pd-router http on", log)
        }
    };
    // "<http> grpc on <grpc>"
    let line = lines.last().cloned().unwrap_or_default();
    let mut parts = line.split_whitespace();
    let http = parts.next().expect("http address").to_string();
    let grpc = parts.nth(2).expect("grpc address").to_string();
    (router, http, grpc)
}

/// A router, one decode worker (or more) and `prefill` prefill workers (none: colocated
/// serving).
pub struct Cluster {
    pub router: Proc,
    pub decode: Proc,
    /// Decode workers beyond the first (`Options::extra_decode`).
    pub more_decode: Vec<Proc>,
    /// Every decode worker's gRPC and metrics address, the first one first.
    pub decode_addrs: Vec<String>,
    pub decode_metrics_all: Vec<String>,
    pub prefill: Vec<Proc>,
    pub http: String,
    pub grpc: String,
    pub decode_addr: String,
    pub prefill_addrs: Vec<String>,
    /// HTTP address of the decode worker's /metrics, /health, /ready.
    pub decode_metrics: String,
    pub prefill_metrics: Vec<String>,
    logs: Option<tempfile::TempDir>,
    /// Holds the router's classes file (`relaxed_classes`) while the cluster runs.
    _config: tempfile::TempDir,
    options: Options,
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

impl Cluster {
    pub async fn start(prefill: usize) -> Cluster {
        Self::start_with(Options { prefill, ..Options::default() }).await
    }

    pub async fn start_with(mut options: Options) -> Cluster {
        let config = tempfile::tempdir().expect("config folder");
        if !options.builtin_classes && !options.router_args.iter().any(|a| a == "--classes") {
            let classes = relaxed_classes(config.path());
            options.router_args.extend(["--classes".to_string(), classes.display().to_string()]);
        }
        let logs = options.capture_logs.then(|| tempfile::tempdir().expect("log folder"));
        let log = |name: &str| logs.as_ref().map(|d| d.path().join(format!("{name}.log")));
        let mut decodes = Vec::new();
        let (mut decode_addrs, mut decode_metrics_all) = (Vec::new(), Vec::new());
        for i in 0..=options.extra_decode {
            let name = if i == 0 { "pd-decode".to_string() } else { format!("pd-decode-{i}") };
            let (proc, addr, metrics) = spawn_decode("127.0.0.1:0", &options, log(&name));
            decodes.push(proc);
            decode_addrs.push(addr);
            decode_metrics_all.push(metrics);
        }
        let decode = decodes.remove(0);
        let (decode_addr, decode_metrics) = (decode_addrs[0].clone(), decode_metrics_all[0].clone());
        let mut workers = Vec::new();
        let mut addrs = Vec::new();
        let mut prefill_metrics = Vec::new();
        for i in 0..options.prefill {
            let (p, addr, metrics) = spawn_prefill("127.0.0.1:0", &options, log(&format!("pd-prefill-{i}")));
            workers.push(p);
            addrs.push(addr);
            prefill_metrics.push(metrics);
        }
        let (router, http, grpc) = spawn_router(&addrs, &decode_addrs, &options, log("pd-router"));
        let cluster = Cluster {
            router,
            decode,
            more_decode: decodes,
            decode_addrs,
            decode_metrics_all,
            prefill: workers,
            http,
            grpc,
            decode_addr,
            prefill_addrs: addrs,
            decode_metrics,
            prefill_metrics,
            logs,
            _config: config,
            options,
        };
        cluster.wait_ready().await;
        cluster
    }

    /// Another router over the same workers, with the same flags and wrapper: its process, HTTP
    /// and gRPC address (its log goes to `pd-router-<n>` when logs are captured).
    pub fn start_router(&self, n: usize) -> (Proc, String, String) {
        let log = self.logs.as_ref().map(|d| d.path().join(format!("pd-router-{n}.log")));
        spawn_router(&self.prefill_addrs, &self.decode_addrs, &self.options, log)
    }

    /// Kills decode worker `i` (SIGKILL) and starts a new one on the same address, as a
    /// restarted pod behind the same name; its log goes to `pd-decode-<i>-restarted`.
    pub fn restart_decode(&mut self, i: usize) {
        let proc = if i == 0 { &mut self.decode } else { &mut self.more_decode[i - 1] };
        proc.kill();
        let log = self.logs.as_ref().map(|d| d.path().join(format!("pd-decode-{i}-restarted.log")));
        let deadline = Instant::now() + Duration::from_secs(10);
        let (new, addr, metrics) = loop {
            // The old socket may take a moment to be released.
            match std::panic::catch_unwind(|| spawn_decode(&self.decode_addrs[i], &self.options, log.clone())) {
                Ok(started) => break started,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
                Err(e) => std::panic::resume_unwind(e),
            }
        };
        assert_eq!(addr, self.decode_addrs[i], "restarted on the same address");
        self.decode_metrics_all[i] = metrics.clone();
        if i == 0 {
            self.decode = new;
            self.decode_metrics = metrics;
        } else {
            self.more_decode[i - 1] = new;
        }
    }

    /// Kills prefill worker `i` (SIGKILL) and starts a new one on the same address, as a
    /// restarted pod behind the same name; its log goes to `pd-prefill-<i>-restarted`.
    pub fn restart_prefill(&mut self, i: usize) {
        self.prefill[i].kill();
        let log = self.logs.as_ref().map(|d| d.path().join(format!("pd-prefill-{i}-restarted.log")));
        let deadline = Instant::now() + Duration::from_secs(10);
        let (new, addr, metrics) = loop {
            match std::panic::catch_unwind(|| spawn_prefill(&self.prefill_addrs[i], &self.options, log.clone())) {
                Ok(started) => break started,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
                Err(e) => std::panic::resume_unwind(e),
            }
        };
        assert_eq!(addr, self.prefill_addrs[i], "restarted on the same address");
        self.prefill[i] = new;
        self.prefill_metrics[i] = metrics;
    }

    /// What a process wrote to stderr so far (`pd-router`, `pd-decode`, `pd-prefill-0`, ...),
    /// when the cluster was started with `capture_logs`.
    pub fn log(&self, name: &str) -> String {
        let dir = self.logs.as_ref().expect("start the cluster with capture_logs");
        std::fs::read_to_string(dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// The Prometheus text of the HTTP server at `addr` (`/metrics`).
    pub async fn scrape(addr: &str) -> String {
        reqwest::get(format!("http://{addr}/metrics")).await.expect("scrape").text().await.expect("metrics body")
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
        let mut client =
            pd_proto::v1::decode_worker_client::DecodeWorkerClient::connect(format!("http://{}", self.decode_addr))
                .await
                .expect("connect to the decode worker");
        client.load(pd_proto::v1::LoadRequest::default()).await.expect("load").into_inner()
    }

    /// Waits (up to `timeout`) until no decode worker holds KV blocks; panics naming the load
    /// otherwise. The first worker must answer; one beyond it that does not was killed by the
    /// test and holds nothing. A sequence's blocks are freed when it leaves the batch, just
    /// after its last token went out, so a client can see its answer a step before that.
    pub async fn wait_kv_free(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        for (i, addr) in self.decode_addrs.iter().enumerate() {
            loop {
                let load = async {
                    let mut client =
                        pd_proto::v1::decode_worker_client::DecodeWorkerClient::connect(format!("http://{addr}"))
                            .await
                            .ok()?;
                    client.load(pd_proto::v1::LoadRequest::default()).await.ok()
                };
                let Some(load) = load.await else {
                    assert!(i > 0, "the first decode worker {addr} does not answer its load query");
                    break;
                };
                let load = load.into_inner();
                if load.free_blocks == load.total_blocks {
                    break;
                }
                assert!(Instant::now() < deadline, "KV blocks of {addr} still in use after {timeout:?}: {load:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// Waits (up to `timeout`) until the router's prefix index credits every decode worker
    /// with the blocks that worker reports cached (`pd_router_indexed_blocks` against its
    /// `pd_kv_cached_blocks`), i.e. a refresh has applied its latest cache events. Panics
    /// naming both otherwise.
    pub async fn wait_router_index_synced(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let router = Self::scrape(&self.http).await;
            let mut differ = Vec::new();
            for (addr, metrics) in self.decode_addrs.iter().zip(&self.decode_metrics_all) {
                let held = metric(&Self::scrape(metrics).await, "pd_kv_cached_blocks").unwrap_or(0.0);
                let series = format!("pd_router_indexed_blocks{{pool=\"decode\",worker=\"{addr}\"}}");
                let indexed = metric(&router, &series);
                if indexed != Some(held) {
                    differ.push(format!("{addr}: worker {held}, router {indexed:?}"));
                }
            }
            if differ.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "the router's prefix index lags after {timeout:?}: {differ:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A prefill worker's load report.
    pub async fn prefill_load(&self, i: usize) -> Option<pd_proto::v1::PrefillLoad> {
        let mut client = pd_proto::v1::prefill_worker_client::PrefillWorkerClient::connect(format!(
            "http://{}",
            self.prefill_addrs[i]
        ))
        .await
        .ok()?;
        client.load(pd_proto::v1::LoadRequest::default()).await.ok().map(|r| r.into_inner())
    }
}

/// Posts `body` to `url` with `headers` and reads the SSE response: each `data:` payload with
/// its arrival time. Panics unless the status is 200.
pub async fn sse_events(url: &str, body: &serde_json::Value, headers: &[(&str, &str)]) -> Vec<(Instant, String)> {
    use futures_util::StreamExt;
    let mut request = reqwest::Client::new().post(url).json(body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let r = request.send().await.expect("request");
    assert_eq!(r.status().as_u16(), 200);
    let mut stream = r.bytes_stream();
    let mut buffer = String::new();
    let mut events = Vec::new();
    while let Some(chunk) = stream.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            for line in event.lines() {
                if let Some(data) = line.strip_prefix("data: ") {
                    events.push((Instant::now(), data.to_string()));
                }
            }
        }
    }
    events
}

/// The value of the sample `series` (a name, with its labels if any, as the exposition writes
/// them) in Prometheus text, if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}
