//! A simulated decode worker: the real `pd.v1.DecodeWorker` and `KvTransfer` services with
//! no model. It reserves blocks for prompt + output (refusing with RESOURCE_EXHAUSTED when
//! they are not free, like the real worker), hands out a KV target naming its own KvTransfer
//! endpoint, waits for a prefill worker's header and commit (frames, if any, are counted and
//! dropped), and then generates `max_tokens` tokens in a batch loop whose steps last what the
//! cost model says for the running rows and their contexts. Prompts sent with `prefill_here`
//! are computed in the batch in the chunks the real worker's planner (`pd_decode::plan`, its
//! default `chunked` policy) gives them.
//! Its `Load` answers like the real one (free blocks, running, waiting transfers, step time).
//! With a UCX inbox (`crate::kv`), the transfer arrives over UCX into the real registry, every
//! frame checked, instead of as control messages on its gRPC KvTransfer service.
//!
//! A worker can be lost (`lose`): its streams end unfinished and every call is UNAVAILABLE,
//! which is what the router sees of a crashed worker.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pd_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::cost::WorkerCost;
use pd_decode::batch::PrefillPolicy;
use pd_decode::plan::{plan, Row};

/// How prompts prefilled here share steps: the real decode worker's default policy.
const POLICY: PrefillPolicy = PrefillPolicy::Chunked { step_tokens: 256 };
/// Lease of a reservation when the request names none.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Text of every generated token after the first (the simulation has no tokenizer).
pub const TOKEN_TEXT: &str = " tok";
/// Id of every generated token after the first.
pub const TOKEN_ID: u32 = 1_000;

type Events = mpsc::UnboundedSender<Result<pb::DecodeEvent, Status>>;

/// A reservation waiting for its KV.
struct Pending {
    blocks: usize,
    commit: oneshot::Sender<Committed>,
}

/// What a committed transfer hands the sequence.
struct Committed {
    first_token: u32,
    kv_ms: f64,
    kv_bytes: u64,
}

/// A sequence in the batch.
struct Seq {
    events: Events,
    blocks: usize,
    prompt: usize,
    /// Prompt tokens still to compute here (prefill_here).
    prompt_left: usize,
    generated: u32,
    max_tokens: u32,
    first_at: Option<Instant>,
    kv_ms: f64,
    kv_bytes: u64,
    prefill_ms: f64,
}

#[derive(Default)]
struct State {
    free_blocks: usize,
    pending: HashMap<String, Pending>,
    running: Vec<Seq>,
    /// Smoothed step time (0 while idle).
    step_ms: f64,
}

/// One simulated decode worker; cheap to clone (shared state).
#[derive(Clone)]
pub struct SimDecode {
    cost: Arc<WorkerCost>,
    kv_endpoint: String,
    /// Where KV arrives with `--kv-transport ucx`.
    ucx: Option<Arc<crate::kv::UcxInbox>>,
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
    lost: Arc<AtomicBool>,
}

fn now_nanos() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

fn token(id: u32, text: &str) -> pb::DecodeEvent {
    let t = pb::TokenEvent {
        token_id: id,
        text: text.into(),
        server_time_unix_nanos: now_nanos(),
        logprobs: None,
        index: 0,
    };
    pb::DecodeEvent { event: Some(pb::decode_event::Event::Token(t)) }
}

impl SimDecode {
    /// A worker whose KvTransfer service is reached at `kv_endpoint`, or that takes KV over
    /// UCX at `ucx`'s endpoint; its batch loop runs on the current tokio runtime.
    pub fn start(cost: Arc<WorkerCost>, kv_endpoint: String, ucx: Option<Arc<crate::kv::UcxInbox>>) -> Self {
        let state = State { free_blocks: cost.worker.kv_blocks as usize, ..State::default() };
        let worker = SimDecode {
            cost,
            kv_endpoint,
            ucx,
            state: Arc::new(Mutex::new(state)),
            wake: Arc::new(Notify::new()),
            lost: Arc::new(AtomicBool::new(false)),
        };
        tokio::spawn(worker.clone().batch_loop());
        worker
    }

    /// The worker crashes: running streams end unfinished, reservations vanish, every later
    /// call is UNAVAILABLE.
    pub fn lose(&self) {
        self.lost.store(true, Ordering::SeqCst);
        let mut s = self.lock();
        s.running.clear();
        s.pending.clear();
        self.wake.notify_one();
        if let Some(ucx) = &self.ucx {
            ucx.lose();
        }
    }

    /// Blocks held by UCX reservations (0 once every transfer ended; 0 over gRPC).
    pub fn ucx_held_blocks(&self) -> usize {
        self.ucx.as_ref().map_or(0, |u| u.held_blocks())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_alive(&self) -> Result<(), Status> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(Status::unavailable("simulated decode worker lost"));
        }
        Ok(())
    }

    /// Blocks for prompt + output, or RESOURCE_EXHAUSTED naming the shortfall.
    fn take_blocks(&self, s: &mut State, tokens: usize) -> Result<usize, Status> {
        let blocks = self.cost.blocks_for(tokens);
        if blocks > s.free_blocks {
            let m =
                format!("out of KV blocks: {blocks} needed, {} free of {}", s.free_blocks, self.cost.worker.kv_blocks);
            return Err(Status::resource_exhausted(m));
        }
        s.free_blocks -= blocks;
        Ok(blocks)
    }

    fn check(&self, req: &pb::DecodeRequest) -> Result<(usize, u32), Status> {
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is required"));
        }
        if req.prompt_tokens.is_empty() {
            return Err(Status::invalid_argument("prompt_tokens is empty"));
        }
        if req.n > 1 {
            return Err(Status::invalid_argument("n: the simulated decode worker serves one answer per request"));
        }
        let max_tokens = req.sampling.as_ref().map(|s| s.max_tokens).unwrap_or(0);
        if max_tokens == 0 {
            return Err(Status::invalid_argument("sampling.max_tokens must be at least 1"));
        }
        let (prompt, max) = (req.prompt_tokens.len(), self.cost.worker.max_position as usize);
        if prompt + max_tokens as usize > max {
            let m = format!("prompt_tokens ({prompt}) + max_tokens ({max_tokens}) exceed the context length of {max}");
            return Err(Status::invalid_argument(m));
        }
        Ok((prompt, max_tokens))
    }

    fn seq(events: Events, blocks: usize, prompt: usize, max_tokens: u32) -> Seq {
        Seq {
            events,
            blocks,
            prompt,
            prompt_left: 0,
            generated: 0,
            max_tokens,
            first_at: None,
            kv_ms: 0.0,
            kv_bytes: 0,
            prefill_ms: 0.0,
        }
    }

    fn target(&self, req: &pb::DecodeRequest, blocks: usize, lease: Duration) -> pb::KvTarget {
        let deadline = SystemTime::now() + lease;
        let deadline_ms = deadline.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        let prompt_blocks = self.cost.blocks_for(req.prompt_tokens.len()).min(blocks);
        pb::KvTarget {
            transfer_id: req.request_id.clone(),
            kv_endpoint: self.kv_endpoint.clone(),
            block_ids: (0..prompt_blocks as u32).collect(),
            model_fingerprint: 0,
            block_size: self.cost.worker.block_size,
            dtype: pb::KvDtype::F16 as i32,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
            lease_deadline_unix_ms: deadline_ms,
            cached_tokens: 0,
        }
    }

    /// Reserves the prompt's blocks in the UCX registry (undoing the pending entry if that
    /// fails), and hands the registry's outcome to the pending entry as a gRPC commit would.
    fn reserve_ucx(
        &self,
        ucx: &crate::kv::UcxInbox,
        req: &pb::DecodeRequest,
        lease: Duration,
    ) -> Result<pb::KvTarget, Status> {
        let id = req.request_id.clone();
        let (target, outcome) = match ucx.reserve(&id, req.prompt_tokens.len(), lease) {
            Ok(r) => r,
            Err(e) => {
                let mut s = self.lock();
                if let Some(p) = s.pending.remove(&id) {
                    s.free_blocks += p.blocks;
                }
                return Err(e);
            }
        };
        let worker = self.clone();
        tokio::spawn(async move {
            let outcome = outcome.await;
            let mut s = worker.lock();
            let Some(p) = s.pending.remove(&id) else { return };
            match outcome {
                Ok(Ok(c)) => {
                    let kv_ms = c.receive_time.as_secs_f64() * 1e3;
                    let committed = Committed { first_token: c.first_token, kv_ms, kv_bytes: c.bytes };
                    if p.commit.send(committed).is_err() {
                        s.free_blocks += p.blocks;
                    }
                }
                // Failed or expired: the sequence's task sees its commit channel closed.
                _ => s.free_blocks += p.blocks,
            }
        });
        Ok(target)
    }

    /// Waits for the transfer's commit, then puts the sequence in the batch; on lease expiry
    /// or a client that left, frees the blocks.
    async fn await_commit(self, id: String, mut rx: oneshot::Receiver<Committed>, mut seq: Seq, lease: Duration) {
        // A commit that raced the lease or the client's departure still hands its blocks
        // over (the receiver no longer holds them), so it is taken here in every case.
        let outcome = tokio::select! {
            c = &mut rx => c.ok(),
            _ = tokio::time::sleep(lease) => rx.try_recv().ok(),
            _ = seq.events.closed() => rx.try_recv().ok(),
        };
        let mut s = self.lock();
        let Some(c) = outcome else {
            if s.pending.remove(&id).is_some() {
                s.free_blocks += seq.blocks;
            }
            if let Some(ucx) = &self.ucx {
                ucx.abort(&id, "the sequence ended before its KV was committed");
            }
            if !self.lost.load(Ordering::SeqCst) {
                let m = "the KV transfer was aborted, or the reservation's lease ended before its commit";
                let _ = seq.events.send(Err(Status::deadline_exceeded(m)));
            }
            return;
        };
        seq.kv_ms = c.kv_ms;
        seq.kv_bytes = c.kv_bytes;
        seq.generated = 1;
        seq.first_at = Some(Instant::now());
        if seq.events.send(Ok(token(c.first_token, ""))).is_err() {
            s.free_blocks += seq.blocks;
            return;
        }
        if seq.generated >= seq.max_tokens {
            let _ = seq.events.send(Ok(finished(&seq)));
            s.free_blocks += seq.blocks;
            return;
        }
        s.running.push(seq);
        drop(s);
        self.wake.notify_one();
    }

    /// The step loop: one step over the first `max_batch` sequences, sleeping what it costs.
    async fn batch_loop(self) {
        let max_batch = self.cost.worker.max_batch as usize;
        let mut clock = crate::StepClock::default();
        loop {
            let step = {
                let s = self.lock();
                if s.running.is_empty() {
                    None
                } else {
                    let rows: Vec<StepRow> = s
                        .running
                        .iter()
                        .take(max_batch)
                        .map(|q| StepRow {
                            prompt: q.prompt,
                            prompt_left: q.prompt_left,
                            generated: q.generated as usize,
                        })
                        .collect();
                    let mut takes = Vec::with_capacity(rows.len());
                    let ms = plan_step(&self.cost, &rows, &mut takes);
                    Some((ms, takes))
                }
            };
            let Some((ms, takes)) = step else {
                self.lock().step_ms = 0.0;
                clock.idle();
                self.wake.notified().await;
                continue;
            };
            let start = clock.start();
            tokio::time::sleep_until(clock.end(start, Duration::from_secs_f64(ms / 1e3)).into()).await;
            self.apply_step(ms, &takes);
        }
    }

    /// After a step of `ms` that ran `takes` tokens of the first sequences (sequences that
    /// joined during the step come after them): prompt chunks advance, every generating row
    /// gets a token, finished and abandoned sequences free their blocks.
    fn apply_step(&self, ms: f64, takes: &[usize]) {
        let mut s = self.lock();
        s.step_ms = smoothed(s.step_ms, ms);
        let mut freed = 0;
        let mut keep = Vec::with_capacity(s.running.len());
        for (i, mut q) in std::mem::take(&mut s.running).into_iter().enumerate() {
            if let Some(&take) = takes.get(i) {
                step_one(&mut q, take, ms);
            }
            if q.events.is_closed() || q.generated >= q.max_tokens {
                if q.generated >= q.max_tokens {
                    let _ = q.events.send(Ok(finished(&q)));
                }
                freed += q.blocks;
            } else {
                keep.push(q);
            }
        }
        s.running = keep;
        s.free_blocks += freed;
    }
}

/// What a sequence in a decode step is: its prompt's length, the prompt tokens still to
/// compute here (prefill_here), the tokens generated so far.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepRow {
    pub prompt: usize,
    pub prompt_left: usize,
    pub generated: usize,
}

/// One decode step over `rows` (the first `max_batch` sequences): what the cost model says it
/// lasts (ms); `takes` gets the tokens each row runs in it as the real worker's planner gives
/// them (a prompt chunk, or one token). A batch of decoding rows only (the common case) is
/// costed without building the planner's rows.
pub(crate) fn plan_step(cost: &WorkerCost, rows: &[StepRow], takes: &mut Vec<usize>) -> f64 {
    takes.clear();
    if rows.iter().all(|q| q.prompt_left == 0) {
        takes.resize(rows.len(), 1);
        let context = rows.iter().map(|q| cost.attended(q.prompt + q.generated)).sum();
        return cost.decode_step_ms(rows.len(), context, &[]);
    }
    let kinds: Vec<Row> = rows
        .iter()
        .map(|q| if q.prompt_left > 0 { Row::Prompt { left: q.prompt_left } } else { Row::Decode })
        .collect();
    takes.extend(plan(POLICY, &kinds));
    let (mut decoding, mut context, mut chunks) = (0, 0, Vec::new());
    for (q, &take) in rows.iter().zip(takes.iter()) {
        if q.prompt_left > 0 {
            if take > 0 {
                chunks.push((take, q.prompt - q.prompt_left));
            }
        } else {
            decoding += 1;
            context += cost.attended(q.prompt + q.generated);
        }
    }
    cost.decode_step_ms(decoding, context, &chunks)
}

/// The step time a decode worker reports after a step of `ms` (0 before: idle).
pub(crate) fn smoothed(step_ms: f64, ms: f64) -> f64 {
    if step_ms == 0.0 {
        ms
    } else {
        0.8 * step_ms + 0.2 * ms
    }
}

/// A decode worker's `Load` answer.
pub(crate) fn load_of(
    cost: &WorkerCost,
    free_blocks: usize,
    running: usize,
    pending: usize,
    step_ms: f64,
) -> pb::DecodeLoad {
    let total = cost.worker.kv_blocks;
    pb::DecodeLoad {
        free_blocks: free_blocks as u32,
        total_blocks: total,
        running_sequences: running as u32,
        waiting_transfers: pending as u32,
        kv_cache_usage: 1.0 - free_blocks as f64 / f64::from(total.max(1)),
        block_size: cost.worker.block_size,
        max_batch: cost.worker.max_batch,
        step_ms,
        cache: None,
    }
}

/// One sequence's part of a step: a prompt chunk of `take` tokens, or one token.
fn step_one(q: &mut Seq, take: usize, ms: f64) {
    if q.generated >= q.max_tokens {
        return;
    }
    if q.prompt_left > 0 {
        let t = q.prompt_left.min(take);
        q.prompt_left -= t;
        q.prefill_ms += ms;
        if q.prompt_left > 0 || t == 0 {
            return;
        }
    }
    let text = if q.generated == 0 { "" } else { TOKEN_TEXT };
    if q.events.send(Ok(token(if q.generated == 0 { crate::FIRST_TOKEN } else { TOKEN_ID }, text))).is_ok() {
        q.generated += 1;
        q.first_at.get_or_insert_with(Instant::now);
    }
}

fn finished(q: &Seq) -> pb::DecodeEvent {
    let decode_ms = q.first_at.map(|t| t.elapsed().as_secs_f64() * 1e3).unwrap_or(0.0);
    let f = pb::Finished {
        index: 0,
        finish_reason: "length".into(),
        prompt_tokens: q.prompt as u32,
        completion_tokens: q.generated,
        kv_transfer_ms: q.kv_ms,
        decode_ms,
        kv_bytes: q.kv_bytes,
        queue_ms: 0.0,
        prefill_ms: q.prefill_ms,
        cached_tokens: 0,
    };
    pb::DecodeEvent { event: Some(pb::decode_event::Event::Finished(f)) }
}

#[tonic::async_trait]
impl pb::decode_worker_server::DecodeWorker for SimDecode {
    type GenerateStream = UnboundedReceiverStream<Result<pb::DecodeEvent, Status>>;

    async fn generate(&self, request: Request<pb::DecodeRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        self.check_alive()?;
        let req = request.into_inner();
        let (prompt, max_tokens) = self.check(&req)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let lease = if req.lease_ms > 0 { Duration::from_millis(req.lease_ms.into()) } else { DEFAULT_LEASE };
        let mut s = self.lock();
        let blocks = self.take_blocks(&mut s, prompt + max_tokens as usize)?;
        let mut seq = Self::seq(tx.clone(), blocks, prompt, max_tokens);
        if req.prefill_here {
            seq.prompt_left = prompt;
            s.running.push(seq);
            drop(s);
            self.wake.notify_one();
        } else {
            let (commit, committed) = oneshot::channel();
            s.pending.insert(req.request_id.clone(), Pending { blocks, commit });
            drop(s);
            let target = match &self.ucx {
                None => self.target(&req, blocks, lease),
                Some(ucx) => self.reserve_ucx(ucx, &req, lease)?,
            };
            let _ = tx.send(Ok(pb::DecodeEvent { event: Some(pb::decode_event::Event::Target(target)) }));
            tokio::spawn(self.clone().await_commit(req.request_id, committed, seq, lease));
        }
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn score(&self, _: Request<pb::ScoreRequest>) -> Result<Response<pb::ScoreResponse>, Status> {
        // A cost model has no logits to score a prompt with.
        Err(Status::unimplemented("the simulated decode worker does not score prompts (echo with logprobs)"))
    }

    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::DecodeLoad>, Status> {
        self.load_now().map(Response::new)
    }

    type LoadStreamStream = pd_proto::LoadAnswers<pb::DecodeLoad>;

    async fn load_stream(
        &self,
        request: Request<Streaming<pb::LoadRequest>>,
    ) -> Result<Response<Self::LoadStreamStream>, Status> {
        self.check_alive()?;
        let this = self.clone();
        Ok(Response::new(pd_proto::answer_loads(request.into_inner(), move |_| this.load_now())))
    }
}

impl SimDecode {
    fn load_now(&self) -> Result<pb::DecodeLoad, Status> {
        self.check_alive()?;
        let s = self.lock();
        Ok(load_of(&self.cost, s.free_blocks, s.running.len(), s.pending.len(), s.step_ms))
    }
}

#[tonic::async_trait]
impl pb::kv_transfer_server::KvTransfer for SimDecode {
    type TransferStream = UnboundedReceiverStream<Result<pb::KvReceiverMessage, Status>>;

    async fn transfer(
        &self,
        request: Request<Streaming<pb::KvSenderMessage>>,
    ) -> Result<Response<Self::TransferStream>, Status> {
        self.check_alive()?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(self.clone().receive(request.into_inner(), tx));
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

type Replies = mpsc::UnboundedSender<Result<pb::KvReceiverMessage, Status>>;

fn reply(tx: &Replies, m: pb::kv_receiver_message::Message) {
    let _ = tx.send(Ok(pb::KvReceiverMessage { message: Some(m) }));
}

fn refuse(tx: &Replies, kind: &str, reason: String) {
    reply(tx, pb::kv_receiver_message::Message::Refused(pb::KvRefused { reason, kind: kind.into() }));
}

impl SimDecode {
    /// One KV stream: header (a reservation must exist), frames (counted), then commit or abort.
    async fn receive(self, mut stream: Streaming<pb::KvSenderMessage>, tx: Replies) {
        use pb::kv_sender_message::Message;
        let header = match stream.message().await {
            Ok(Some(pb::KvSenderMessage { message: Some(Message::Header(h)) })) => h,
            _ => return refuse(&tx, "protocol", "the first message of a transfer must be its header".into()),
        };
        let accepted_at = Instant::now();
        if !self.lock().pending.contains_key(&header.transfer_id) {
            return refuse(&tx, "unknown_transfer", format!("no reservation {}", header.transfer_id));
        }
        reply(&tx, pb::kv_receiver_message::Message::Accepted(pb::KvAccepted { max_frames_in_flight: 8 }));
        let (mut frames, mut frame_bytes) = (0u32, 0u64);
        loop {
            let first_token = match stream.message().await {
                Ok(Some(pb::KvSenderMessage { message: Some(Message::Frame(f)) })) => {
                    frames += 1;
                    frame_bytes += f.data.len() as u64;
                    continue;
                }
                Ok(Some(pb::KvSenderMessage { message: Some(Message::Commit(c)) })) => Some(c.first_token),
                _ => None,
            };
            let mut s = self.lock();
            let Some(p) = s.pending.remove(&header.transfer_id) else {
                return refuse(&tx, "unknown_transfer", format!("reservation {} ended", header.transfer_id));
            };
            let Some(first_token) = first_token else {
                s.free_blocks += p.blocks;
                return;
            };
            drop(s);
            let shipped = u64::from(header.num_tokens);
            let kv_bytes = if frame_bytes > 0 { frame_bytes } else { shipped * self.cost.kv.bytes_per_token };
            let kv_ms = accepted_at.elapsed().as_secs_f64() * 1e3;
            if p.commit.send(Committed { first_token, kv_ms, kv_bytes }).is_err() {
                // The sequence gave up meanwhile (lease or client); its task freed nothing
                // since the reservation was still pending: free it here.
                self.lock().free_blocks += p.blocks;
                return refuse(&tx, "expired", format!("reservation {} ended", header.transfer_id));
            }
            let committed = pb::KvCommitted { bytes: kv_bytes, frames };
            return reply(&tx, pb::kv_receiver_message::Message::Committed(committed));
        }
    }
}
