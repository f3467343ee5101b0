//! Small in-test workers that speak the real pd.v1 protocol (tonic servers on port 0) and the
//! router started in-process against them, with the real model's tokenizer. The decode worker
//! reserves nothing and the prefill worker computes nothing: the script of each says what it
//! answers, so routing, retries, cancellation and streaming order can be tested exactly.
#![allow(dead_code)] // each test binary uses its own subset

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pb::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use pb::prefill_worker_server::{PrefillWorker, PrefillWorkerServer};
use pd_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

pub fn model_path() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.is_file(), "real model not found at {}: run scripts/fetch-model.sh", path.display());
    path
}

/// First tokens the prefill workers hand to decode workers, by transfer id.
pub type Commits = Arc<Mutex<HashMap<String, oneshot::Sender<u32>>>>;

/// The tokens every fake generation streams: id and text.
pub const TOKENS: &[(u32, &str)] = &[(19556, "Hello"), (28, ","), (905, " world"), (30, "!")];

/// A decode worker whose stream is scripted.
#[derive(Clone)]
pub struct FakeDecode {
    pub free_blocks: u32,
    pub commits: Commits,
    /// Requests it received.
    pub requests: Arc<AtomicUsize>,
    /// `max_tokens` of the last request.
    pub last_max_tokens: Arc<AtomicUsize>,
    /// Streams whose client went away before the end.
    pub cancelled: Arc<AtomicUsize>,
    /// Pause before each token after the first.
    pub token_delay: Duration,
    /// Ends the stream with this status after the first token, if set.
    pub fail_after_first: Option<tonic::Code>,
    /// Streams `max_tokens` tokens (cycling through `TOKENS`) instead of at most `TOKENS`.
    pub cycle: bool,
    /// Refuses every stream with this status (as a worker shutting down does), if set.
    pub refuse: Option<tonic::Code>,
}

impl FakeDecode {
    pub fn new(free_blocks: u32, commits: &Commits) -> Self {
        FakeDecode {
            free_blocks,
            commits: commits.clone(),
            requests: Arc::default(),
            last_max_tokens: Arc::default(),
            cancelled: Arc::default(),
            token_delay: Duration::from_millis(5),
            fail_after_first: None,
            cycle: false,
            refuse: None,
        }
    }
}

fn token(id: u32, text: &str) -> Result<pb::DecodeEvent, Status> {
    let t = pb::TokenEvent { token_id: id, text: text.into(), ..Default::default() };
    Ok(pb::DecodeEvent { event: Some(pb::decode_event::Event::Token(t)) })
}

impl FakeDecode {
    async fn stream(self, req: pb::DecodeRequest, tx: mpsc::Sender<Result<pb::DecodeEvent, Status>>) {
        let asked = req.sampling.map_or(1, |s| s.max_tokens as usize);
        let n = if self.cycle { asked } else { asked.min(TOKENS.len()) };
        let first = if req.prefill_here {
            TOKENS[0].0
        } else {
            let (commit_tx, commit_rx) = oneshot::channel();
            self.commits.lock().expect("commits").insert(req.request_id.clone(), commit_tx);
            let target = pb::KvTarget {
                transfer_id: req.request_id.clone(),
                kv_endpoint: "127.0.0.1:1".into(),
                block_ids: vec![0],
                dtype: pb::KvDtype::F16 as i32,
                block_size: 16,
                lease_deadline_unix_ms: (SystemTime::now() + Duration::from_secs(30))
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                ..Default::default()
            };
            let _ = tx.send(Ok(pb::DecodeEvent { event: Some(pb::decode_event::Event::Target(target)) })).await;
            tokio::select! {
                c = commit_rx => match c { Ok(t) => t, Err(_) => return },
                _ = tx.closed() => { self.cancelled.fetch_add(1, Ordering::SeqCst); return; }
            }
        };
        let mut sent = vec![(first, TOKENS.iter().find(|t| t.0 == first).map_or("?", |t| t.1))];
        sent.extend((1..n).map(|i| TOKENS[1 + (i - 1) % (TOKENS.len() - 1)]));
        for (i, (id, text)) in sent.iter().enumerate() {
            if i > 0 {
                tokio::select! {
                    _ = tokio::time::sleep(self.token_delay) => {}
                    _ = tx.closed() => { self.cancelled.fetch_add(1, Ordering::SeqCst); return; }
                }
            }
            if tx.send(token(*id, text)).await.is_err() {
                self.cancelled.fetch_add(1, Ordering::SeqCst);
                return;
            }
            if let (Some(code), 0) = (self.fail_after_first, i) {
                let _ = tx.send(Err(Status::new(code, "the decode worker failed"))).await;
                return;
            }
        }
        let finished = pb::Finished {
            finish_reason: "length".into(),
            prompt_tokens: req.prompt_tokens.len() as u32,
            completion_tokens: n as u32,
            ..Default::default()
        };
        let _ = tx.send(Ok(pb::DecodeEvent { event: Some(pb::decode_event::Event::Finished(finished)) })).await;
    }
}

#[tonic::async_trait]
impl DecodeWorker for FakeDecode {
    type GenerateStream = ReceiverStream<Result<pb::DecodeEvent, Status>>;

    async fn generate(&self, request: Request<pb::DecodeRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let max_tokens = request.get_ref().sampling.as_ref().map_or(0, |s| s.max_tokens);
        self.last_max_tokens.store(max_tokens as usize, Ordering::SeqCst);
        if let Some(code) = self.refuse {
            return Err(Status::new(code, "the decode worker is shutting down"));
        }
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(self.clone().stream(request.into_inner(), tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn score(&self, _: Request<pb::ScoreRequest>) -> Result<Response<pb::ScoreResponse>, Status> {
        Err(Status::unimplemented("the in-test decode worker does not score prompts"))
    }

    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::DecodeLoad>, Status> {
        Ok(Response::new(self.load_now()))
    }

    type LoadStreamStream = pd_proto::LoadAnswers<pb::DecodeLoad>;

    async fn load_stream(
        &self,
        request: Request<Streaming<pb::LoadRequest>>,
    ) -> Result<Response<Self::LoadStreamStream>, Status> {
        let this = self.clone();
        Ok(Response::new(pd_proto::answer_loads(request.into_inner(), move |_| Ok(this.load_now()))))
    }
}

impl FakeDecode {
    fn load_now(&self) -> pb::DecodeLoad {
        pb::DecodeLoad {
            free_blocks: self.free_blocks,
            total_blocks: 1024,
            block_size: 16,
            max_batch: 64,
            ..Default::default()
        }
    }
}

/// A prefill worker that answers after `delay` with the first token, or fails with `fail`.
#[derive(Clone)]
pub struct FakePrefill {
    pub commits: Commits,
    pub delay: Duration,
    pub fail: Option<tonic::Code>,
    pub waiting_tokens: u64,
    pub requests: Arc<AtomicUsize>,
    /// Pause before answering (holds the request's prefill slot at the router).
    pub hold: Duration,
    /// The `x-pd-class` of every request, in arrival order.
    pub classes: Arc<Mutex<Vec<String>>>,
    /// Serves `LoadStream` (false: only `Load`, as an older worker).
    pub load_stream: bool,
    /// Loads answered: with `Load`, and on `LoadStream`.
    pub loads_once: Arc<AtomicUsize>,
    pub loads_streamed: Arc<AtomicUsize>,
}

impl FakePrefill {
    pub fn new(commits: &Commits) -> Self {
        FakePrefill {
            commits: commits.clone(),
            delay: Duration::ZERO,
            fail: None,
            waiting_tokens: 0,
            requests: Arc::default(),
            hold: Duration::ZERO,
            classes: Arc::default(),
            load_stream: true,
            loads_once: Arc::default(),
            loads_streamed: Arc::default(),
        }
    }

    fn load_now(&self) -> pb::PrefillLoad {
        // One prompt at a time, so the router's queue decides who goes next.
        pb::PrefillLoad { waiting_prefill_tokens: self.waiting_tokens, max_partial_prefills: 1, ..Default::default() }
    }
}

#[tonic::async_trait]
impl PrefillWorker for FakePrefill {
    async fn score(&self, _: Request<pb::ScoreRequest>) -> Result<Response<pb::ScoreResponse>, Status> {
        Err(Status::unimplemented("the in-test prefill worker does not score prompts"))
    }

    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let class = request.metadata().get("x-pd-class").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        self.classes.lock().expect("classes").push(class);
        tokio::time::sleep(self.hold).await;
        if let Some(code) = self.fail {
            return Err(Status::new(code, "the prefill worker failed"));
        }
        let req = request.into_inner();
        let id = req.target.map(|t| t.transfer_id).unwrap_or_default();
        let commit = self.commits.lock().expect("commits").remove(&id);
        let first = TOKENS[0].0;
        // The response goes out first; the commit reaches the decode worker after `delay`,
        // as when the decode worker's batch step is slow.
        let delay = self.delay;
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if let Some(c) = commit {
                let _ = c.send(first);
            }
        });
        Ok(Response::new(pb::PrefillResponse { first_token: first, ..Default::default() }))
    }

    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::PrefillLoad>, Status> {
        self.loads_once.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(self.load_now()))
    }

    type LoadStreamStream = pd_proto::LoadAnswers<pb::PrefillLoad>;

    async fn load_stream(
        &self,
        request: Request<Streaming<pb::LoadRequest>>,
    ) -> Result<Response<Self::LoadStreamStream>, Status> {
        if !self.load_stream {
            return Err(Status::unimplemented("pd.v1.PrefillWorker/LoadStream"));
        }
        let this = self.clone();
        Ok(Response::new(pd_proto::answer_loads(request.into_inner(), move |_| {
            this.loads_streamed.fetch_add(1, Ordering::SeqCst);
            Ok(this.load_now())
        })))
    }
}

/// Serves a fake worker on a port of its own; the address.
pub async fn serve_decode(worker: FakeDecode) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let server = tonic::transport::Server::builder().add_service(DecodeWorkerServer::new(worker));
    tokio::spawn(server.serve_with_incoming(pd_proto::nodelay_incoming(listener)));
    addr
}

pub async fn serve_prefill(worker: FakePrefill) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let server = tonic::transport::Server::builder().add_service(PrefillWorkerServer::new(worker));
    tokio::spawn(server.serve_with_incoming(pd_proto::nodelay_incoming(listener)));
    addr
}

/// A router serving in this process; stops when dropped.
pub struct Router {
    pub http: String,
    pub grpc: String,
    _stop: oneshot::Sender<()>,
}

pub async fn start_router(prefill: Vec<String>, decode: Vec<String>) -> Router {
    start_router_with(prefill, decode, pd_router::classes::Classes::load(None).expect("classes")).await
}

/// A router with its own traffic classes.
pub async fn start_router_with(
    prefill: Vec<String>,
    decode: Vec<String>,
    classes: pd_router::classes::Classes,
) -> Router {
    start_router_config(prefill, decode, |c| c.classes = classes).await
}

/// A router with the test defaults as changed by `change`.
pub async fn start_router_config(
    prefill: Vec<String>,
    decode: Vec<String>,
    change: impl FnOnce(&mut pd_router::Config),
) -> Router {
    let mut config = pd_router::Config {
        model: model_path(),
        chat_template: None,
        separate_reasoning: true,
        model_name: "SmolLM2-135M-Instruct".into(),
        prefill_workers: prefill,
        decode_workers: decode,
        classes: pd_router::classes::Classes::load(None).expect("classes"),
        schedule: pd_router::schedule::ScheduleConfig::default(),
        limits: pd_router::Limits {
            max_tokens: 4096,
            default_completion_tokens: 16,
            default_chat_tokens: 512,
            max_n: 8,
        },
        body_limit: 1 << 20,
        drain_delay: Duration::ZERO,
        tls: None,
        log_content: false,
        header_read_timeout: Duration::from_secs(30),
        body_read_timeout: Duration::from_secs(30),
    };
    change(&mut config);
    let http = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (http_addr, grpc_addr) = (http.local_addr().expect("addr"), grpc.local_addr().expect("addr"));
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(pd_router::run(config, http, grpc, async move {
        let _ = stopped.await;
    }));
    let router = Router { http: format!("http://{http_addr}"), grpc: format!("http://{grpc_addr}"), _stop: stop };
    let client = reqwest::Client::new();
    for _ in 0..200 {
        if client.get(format!("{}/ready", router.http)).send().await.is_ok_and(|r| r.status().is_success()) {
            return router;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the router did not become ready");
}

/// The `data:` payloads of an SSE body and the `event: error` ones, in order.
pub fn sse_events(body: &str) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    let mut event = None;
    for line in body.lines() {
        if let Some(e) = line.strip_prefix("event: ").or_else(|| line.strip_prefix("event:")) {
            event = Some(e.trim().to_string());
        } else if let Some(d) = line.strip_prefix("data: ").or_else(|| line.strip_prefix("data:")) {
            out.push((event.take(), d.trim().to_string()));
        }
    }
    out
}
