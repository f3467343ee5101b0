//! The chaos suite: a router, 2 prefill and 2 decode workers, each in its own network
//! namespace joined to a bridge (the test's client in another), serve a bounded loop of
//! greedy and seeded requests while faults are injected at points drawn from a fixed seed:
//! SIGKILL of a worker (restarted under the same address a second later), SIGSTOP/SIGCONT,
//! a partition (a worker's or the router's link down, then up), a rate-limited link (`tbf`),
//! and delay, a stall past the KV timeout, and reset connections on the KV path (each decode
//! worker advertises a user-space fault proxy in the client's namespace as its KV endpoint,
//! so every prefill -> decode transfer passes through it; a cut resets its connections, linger
//! 0). After a recoverable fault every request completed with exactly the tokens of an
//! undisturbed run, within its deadline; only where the fault outlasts a stated timeout (the
//! KV stall, `Fault::may_fail`) may one end with a typed error instead; once the load stops
//! every KV block on every worker is free. The matrix of
//! faults x outcomes is printed. `PD_CHAOS_FAULTS` sets the number of faults (default 8;
//! `scripts/chaos.sh` runs more), `PD_CHAOS_SEED` the seed. Needs root (CI runs as root);
//! without it the test says why and passes without running.
//!
//! With `PD_TEST_KV_TRANSPORT=ucx` (scripts/test.sh runs the suite once more so) the decode
//! workers take KV over UCX (`--kv-transport ucx`, a fixed UCX port, so that a restarted
//! worker comes back on the address the prefill workers' cached endpoints name), UCX's TCP
//! transport on each namespace's own link (`UCX_NET_DEVICES=eth0`, `UCX_TLS=tcp`): kills,
//! stops, partitions and throttling hit the UCX path as they hit gRPC. The fault proxy speaks
//! TCP to one gRPC endpoint and cannot stand in a UCX connection, so the KV-path faults are
//! drawn only over gRPC; at the end every prefill worker must have committed KV over UCX and
//! none over gRPC.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pd_proto::v1 as pb;
use pd_tests::netns::Net;
use pd_tests::proxy::{FaultProxy, Mode};
use pd_tests::{binary, model_path, spawn_command, Proc};

const NODES: [&str; 6] = ["client", "router", "p0", "p1", "d0", "d1"];
const WORKERS: [&str; 4] = ["p0", "p1", "d0", "d1"];
const PORT: u16 = 7100;
/// The fault proxy in front of decode worker i listens on the client's address, this + i.
const PROXY_PORT: u16 = 7200;
/// Each worker's metrics port, on its namespace's address.
const METRICS_PORT: u16 = 7300;
/// A decode worker's UCX KV listener, on its namespace's address (with UCX).
const UCX_PORT: u16 = 7400;
const REQUESTS_PER_FAULT: usize = 3;
const MAX_TOKENS: u32 = 40;
/// A request that takes longer than this hangs.
const DEADLINE: Duration = Duration::from_secs(45);

const PROMPTS: [&str; 3] = [
    "The lighthouse keeper wrote in his log that",
    "Three things to pack for a hike are",
    "In the year 2050, cities will",
];

/// splitmix64: the fault schedule from a fixed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    StopCont,
    Partition,
    Throttle,
    KvDelay,
    KvStall,
    KvCut,
}

const FAULTS: [Fault; 7] =
    [Fault::Kill, Fault::StopCont, Fault::Partition, Fault::Throttle, Fault::KvDelay, Fault::KvStall, Fault::KvCut];
/// The faults that reach a UCX KV path (the fault proxy speaks gRPC's TCP only).
const UCX_FAULTS: [Fault; 4] = [Fault::Kill, Fault::StopCont, Fault::Partition, Fault::Throttle];

impl Fault {
    /// The nodes this fault can hit.
    fn targets(self) -> &'static [&'static str] {
        match self {
            Fault::Kill | Fault::StopCont => &WORKERS,
            Fault::Partition | Fault::Throttle => &["router", "p0", "p1", "d0", "d1"],
            Fault::KvDelay | Fault::KvStall | Fault::KvCut => &["d0", "d1"],
        }
    }

    /// Whether a request may end with a typed error under this fault: only where the fault
    /// outlasts a stated timeout (a stall of the KV path, 6 s, past the prefill worker's 5 s
    /// KV timeout). Every other fault is recoverable (a kill is retried or migrated, a stop, a
    /// partition is shorter than the decode lease, a slow or reset link is retried), so the
    /// request must end with exactly the undisturbed tokens.
    fn may_fail(self) -> bool {
        self == Fault::KvStall
    }
}

/// The cluster, one process per namespace.
struct Chaos {
    // Dropped in this order: the processes end before their namespaces go.
    procs: BTreeMap<&'static str, Proc>,
    net: Net,
    logs: tempfile::TempDir,
    ucx: bool,
}

impl Chaos {
    fn addr(&self, node: &str) -> String {
        format!("{}:{PORT}", self.net.addr(node))
    }

    /// The KV endpoint decode worker `node` advertises: its fault proxy.
    fn proxy_addr(&self, node: &str) -> String {
        format!("{}:{}", self.net.addr("client"), PROXY_PORT + u16::from(node == "d1"))
    }

    fn start_worker(&mut self, node: &'static str) {
        let model = model_path();
        let (bin, prefix) = if node.starts_with('d') {
            ("pd-decode", "pd-decode listening on")
        } else {
            ("pd-prefill", "pd-prefill listening on")
        };
        let mut c = self.net.command(node, &binary(bin));
        let metrics = format!("{}:{METRICS_PORT}", self.net.addr(node));
        c.args(["--listen", &self.addr(node), "--metrics-listen", &metrics, "--model"]).arg(&model);
        if node.starts_with('d') {
            c.args(["--kv-blocks", "512", "--grace-ms", "0"]);
            if self.ucx {
                let ucx = format!("{}:{UCX_PORT}", self.net.addr(node));
                c.args(["--kv-transport", "ucx", "--kv-ucx-listen", &ucx]);
            } else {
                c.args(["--advertise", &self.proxy_addr(node)]);
            }
        }
        // UCX over each namespace's link, never shared memory (which no link fault reaches).
        c.env("UCX_NET_DEVICES", "eth0").env("UCX_TLS", "tcp");
        let n = self.procs.len();
        let log = self.logs.path().join(format!("{node}-{n}.log"));
        let (proc, _) = spawn_command(c, bin, prefix, Some(log));
        self.procs.insert(node, proc);
    }

    fn start_router(&mut self) {
        let mut c = self.net.command("router", &binary("pd-router"));
        let http = format!("{}:8080", self.net.addr("router"));
        let grpc = format!("{}:8081", self.net.addr("router"));
        c.args(["--http-listen", &http, "--grpc-listen", &grpc, "--model"]).arg(model_path());
        c.args(["--prefill", &format!("{},{}", self.addr("p0"), self.addr("p1"))]);
        c.args(["--decode", &format!("{},{}", self.addr("d0"), self.addr("d1"))]);
        c.args(["--quarantine-ms", "2000"]);
        // Faults are under test, not admission: the test clusters' relaxed classes.
        c.arg("--classes").arg(pd_tests::relaxed_classes(self.logs.path()));
        let log = self.logs.path().join("router.log");
        let (proc, _) = spawn_command(c, "pd-router", "pd-router http on", Some(log));
        self.procs.insert("router", proc);
    }

    fn signal(&self, node: &str, signal: &str) {
        let pid = self.procs[node].child.id().to_string();
        let ok = std::process::Command::new("kill").args([signal, &pid]).status().is_ok_and(|s| s.success());
        assert!(ok, "kill {signal} {node}");
    }
}

fn request(prompt: &str, seeded: bool) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: prompt.into(),
        sampling: Some(pb::SamplingParams {
            temperature: if seeded { 0.8 } else { 0.0 },
            top_p: if seeded { 0.95 } else { 0.0 },
            seed: Some(77),
            max_tokens: MAX_TOKENS,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Identical,
    TypedError,
    /// Completed with other tokens, or reported success without them: a failure of pd.
    Wrong,
    Hang,
}

async fn generate(grpc: &str, req: pb::GenerateRequest) -> Result<Vec<u32>, tonic::Status> {
    let mut client = pb::generation_client::GenerationClient::connect(format!("http://{grpc}"))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut stream = client.generate(req).await?.into_inner();
    let (mut tokens, mut done) = (Vec::new(), false);
    while let Some(m) = stream.message().await? {
        match m.message {
            Some(pb::generate_response::Message::Token(t)) => tokens.push(t.token_id),
            Some(pb::generate_response::Message::Done(d)) => {
                done = d.completion_tokens as usize == tokens.len();
            }
            Some(pb::generate_response::Message::ChoiceDone(c)) => {
                return Err(tonic::Status::data_loss(format!("one answer has no choice_done: {c:?}")));
            }
            None => {}
        }
    }
    if done {
        Ok(tokens)
    } else {
        Err(tonic::Status::data_loss(format!("ended after {} tokens without a consistent end", tokens.len())))
    }
}

async fn judged(grpc: String, req: pb::GenerateRequest, expected: Vec<u32>) -> (Outcome, String) {
    match tokio::time::timeout(DEADLINE, generate(&grpc, req)).await {
        Err(_) => (Outcome::Hang, "no end within the deadline".into()),
        Ok(Ok(tokens)) if tokens == expected => (Outcome::Identical, String::new()),
        Ok(Ok(tokens)) => (Outcome::Wrong, format!("tokens {tokens:?} != {expected:?}")),
        Ok(Err(s)) if s.code() == tonic::Code::DataLoss => (Outcome::Wrong, s.message().to_string()),
        Ok(Err(s)) if !s.message().is_empty() => (Outcome::TypedError, format!("{:?}: {}", s.code(), s.message())),
        Ok(Err(s)) => (Outcome::Wrong, format!("an error without a message: {s:?}")),
    }
}

/// Load of every worker; waits until every decode worker holds no block and no prefill runs.
async fn wait_idle(chaos: &Chaos) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut busy = Vec::new();
        for node in ["d0", "d1"] {
            let url = format!("http://{}", chaos.addr(node));
            let mut c = pb::decode_worker_client::DecodeWorkerClient::connect(url).await.map_err(|e| e.to_string())?;
            let l = c.load(pb::LoadRequest::default()).await.map_err(|e| e.to_string())?.into_inner();
            if l.free_blocks != l.total_blocks || l.running_sequences + l.waiting_transfers > 0 {
                busy.push(format!("{node}: {l:?}"));
            }
        }
        for node in ["p0", "p1"] {
            let url = format!("http://{}", chaos.addr(node));
            let mut c =
                pb::prefill_worker_client::PrefillWorkerClient::connect(url).await.map_err(|e| e.to_string())?;
            let l = c.load(pb::LoadRequest::default()).await.map_err(|e| e.to_string())?.into_inner();
            if l.running_prefills + l.queued_prefills > 0 || l.waiting_prefill_tokens > 0 {
                busy.push(format!("{node}: {l:?}"));
            }
        }
        if busy.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("still holding work 30 s after the load stopped: {busy:?}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn recoverable_faults_leave_every_request_identical_and_no_block_held() {
    if !cfg!(target_os = "linux") || unsafe_geteuid() != 0 {
        eprintln!("chaos: skipped: network namespaces need root (CI runs as root)");
        return;
    }
    let net = match Net::create(&NODES) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("chaos: skipped: cannot make network namespaces here: {e}");
            return;
        }
    };
    let faults: usize = std::env::var("PD_CHAOS_FAULTS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let seed: u64 = std::env::var("PD_CHAOS_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(20261130);
    let ucx = pd_tests::default_kv_transport().as_deref() == Some("ucx");
    let mut chaos = Chaos { procs: BTreeMap::new(), net, logs: tempfile::tempdir().expect("log folder"), ucx };
    for node in WORKERS {
        chaos.start_worker(node);
    }
    chaos.start_router();
    // The client lives in its own namespace: a thread enters it and runs the load there.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        let chaos = &mut chaos;
        scope.spawn(move || {
            chaos.net.enter("client").expect("enter the client namespace");
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            let _ = tx.send(rt.block_on(run(chaos, faults, seed)));
        });
    });
    let report = rx.recv().expect("the chaos loop reported");
    if let Err(e) = &report {
        for entry in std::fs::read_dir(chaos.logs.path()).expect("logs").flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            eprintln!("--- {} (last lines)", entry.file_name().to_string_lossy());
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        panic!("chaos: {e}");
    }
}

fn unsafe_geteuid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

async fn run(chaos: &mut Chaos, faults: usize, seed: u64) -> Result<(), String> {
    let grpc = format!("{}:8081", chaos.net.addr("router"));
    let mut proxies = BTreeMap::new();
    for node in ["d0", "d1"] {
        let upstream = chaos.addr(node).parse().map_err(|e| format!("{node}'s address: {e}"))?;
        let proxy = FaultProxy::start(&chaos.proxy_addr(node), upstream)
            .await
            .map_err(|e| format!("the fault proxy for {node}: {e}"))?;
        proxies.insert(node, proxy);
    }
    // The router is ready once it answers a request; every prompt's undisturbed tokens.
    let ready = Instant::now() + Duration::from_secs(60);
    let mut expected = Vec::new();
    for (i, prompt) in PROMPTS.iter().enumerate() {
        for seeded in [false, true] {
            let tokens = loop {
                match generate(&grpc, request(prompt, seeded)).await {
                    Ok(t) => break t,
                    Err(e) if Instant::now() < ready => {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    Err(e) => return Err(format!("the undisturbed run of prompt {i} failed: {e}")),
                }
            };
            expected.push((request(prompt, seeded), tokens));
        }
    }
    let mut rng = Rng(seed);
    let mut matrix: BTreeMap<(Fault, Outcome), usize> = BTreeMap::new();
    // The longest request under each fault: how much the fault got in the way.
    let mut slowest: BTreeMap<Fault, Duration> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut injected = Vec::new();
    let drawn: &[Fault] = if chaos.ucx { &UCX_FAULTS } else { &FAULTS };
    for round in 0..faults {
        let fault = drawn[rng.below(drawn.len() as u64) as usize];
        let node = fault.targets()[rng.below(fault.targets().len() as u64) as usize];
        let at = Duration::from_millis(100 + rng.below(600));
        let picks: Vec<usize> = (0..REQUESTS_PER_FAULT).map(|_| rng.below(expected.len() as u64) as usize).collect();
        let tasks: Vec<_> = picks
            .iter()
            .map(|&k| {
                let (grpc, req, tokens) = (grpc.clone(), expected[k].0.clone(), expected[k].1.clone());
                tokio::spawn(async move {
                    let started = Instant::now();
                    let judged = judged(grpc, req, tokens).await;
                    (judged, started.elapsed())
                })
            })
            .collect();
        tokio::time::sleep(at).await;
        injected.push(format!("{fault:?} {node} at {} ms", at.as_millis()));
        match fault {
            Fault::Kill => {
                chaos.signal(node, "-KILL");
                tokio::time::sleep(Duration::from_secs(1)).await;
                chaos.start_worker(node);
            }
            Fault::StopCont => {
                chaos.signal(node, "-STOP");
                tokio::time::sleep(Duration::from_millis(1500)).await;
                chaos.signal(node, "-CONT");
            }
            Fault::Partition => {
                chaos.net.link(node, false);
                tokio::time::sleep(Duration::from_millis(1500)).await;
                chaos.net.link(node, true);
            }
            Fault::Throttle => {
                chaos.net.throttle(node, Some("1mbit"));
                tokio::time::sleep(Duration::from_secs(2)).await;
                chaos.net.throttle(node, None);
            }
            Fault::KvDelay => {
                proxies[node].set(Mode::Delay(Duration::from_millis(100)));
                tokio::time::sleep(Duration::from_secs(2)).await;
                proxies[node].set(Mode::Pass);
            }
            Fault::KvStall => {
                // Longer than the prefill worker's KV timeout (5 s): the transfer must fail
                // cleanly and the request be retried or end with a typed error.
                proxies[node].set(Mode::Stall);
                tokio::time::sleep(Duration::from_secs(6)).await;
                proxies[node].set(Mode::Pass);
            }
            Fault::KvCut => {
                for _ in 0..15 {
                    proxies[node].cut();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        for task in tasks {
            let ((outcome, detail), took) = task.await.map_err(|e| e.to_string())?;
            let slowest = slowest.entry(fault).or_insert(Duration::ZERO);
            *slowest = (*slowest).max(took);
            if matches!(outcome, Outcome::Wrong | Outcome::Hang)
                || (outcome == Outcome::TypedError && !fault.may_fail())
            {
                problems.push(format!("round {round} ({fault:?} {node}): {outcome:?}: {detail}"));
            }
            *matrix.entry((fault, outcome)).or_default() += 1;
        }
        // Let a restarted or healed worker rejoin the router's view before the next fault.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    let idle = wait_idle(chaos).await;
    let transport = if chaos.ucx { "UCX" } else { "gRPC" };
    println!("chaos matrix ({faults} faults, seed {seed}, {REQUESTS_PER_FAULT} requests each, KV over {transport}):");
    println!("| fault | identical | typed error | wrong | hang | slowest request |");
    println!("|---|---|---|---|---|---|");
    for &fault in drawn {
        let n = |o: Outcome| matrix.get(&(fault, o)).copied().unwrap_or(0);
        let row = [Outcome::Identical, Outcome::TypedError, Outcome::Wrong, Outcome::Hang].map(n);
        let slow = slowest.get(&fault).map_or("-".to_string(), |d| format!("{:.1} s", d.as_secs_f64()));
        println!("| {fault:?} | {} | {} | {} | {} | {slow} |", row[0], row[1], row[2], row[3]);
    }
    println!("blocks held after the load: {}", if idle.is_ok() { "none" } else { "some (see below)" });
    println!("faults: {}", injected.join(", "));
    idle?;
    if chaos.ucx {
        let (ucx, grpc) = committed_kv(chaos).await?;
        println!("KV transfers committed by the prefill workers: {ucx} over UCX, {grpc} over gRPC");
        if ucx == 0 || grpc > 0 {
            problems.push(format!("with UCX, {ucx} transfers were committed over UCX and {grpc} over gRPC"));
        }
    } else {
        let through: Vec<usize> = proxies.values().map(FaultProxy::accepted).collect();
        println!("KV connections through the fault proxies (d0, d1): {through:?}");
        if through.iter().sum::<usize>() == 0 {
            problems.push("no KV transfer went through the fault proxies".into());
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

/// KV transfers the prefill workers committed, over UCX and over gRPC (their metrics).
async fn committed_kv(chaos: &Chaos) -> Result<(u64, u64), String> {
    let (mut ucx, mut grpc) = (0, 0);
    for node in ["p0", "p1"] {
        let url = format!("http://{}:{METRICS_PORT}/metrics", chaos.net.addr(node));
        let text = async { reqwest::get(&url).await?.text().await }.await.map_err(|e| format!("{url}: {e}"))?;
        for line in text.lines().filter(|l| l.starts_with("pd_kv_transfers_total{") && l.contains("committed")) {
            let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) as u64;
            if line.contains("transport=\"ucx\"") {
                ucx += value;
            } else {
                grpc += value;
            }
        }
    }
    Ok((ucx, grpc))
}
