//! A simulated prefill worker: the real `pd.v1.PrefillWorker` service with no model. Prompts
//! are planned into steps as the real prefill worker plans them: the same planner
//! (`pd_prefill::step::plan`: request-parallel chunks, short prompts first, at most one
//! long prompt per step) with the same planning model, which starts at the real worker's
//! default and learns its scale from every step's time exactly as the real one does. Each
//! step lasts what the worker's cost model (the measured truth) predicts. A finished prompt's KV goes to the decode
//! worker's KvTransfer endpoint as the real protocol's control messages (header, then commit
//! after the cost model's hand-off time, no frames), or, to a `ucx://` endpoint, as every
//! frame of it over UCX (`crate::kv`); the response carries the same
//! timings as the real worker's. `Load` reports waiting tokens, running and queued prefills
//! and the short-prompt rate the real worker reports. A step of long prompts only, none
//! finishing, stops when a short prompt arrives in its first three quarters (the real
//! worker's preemption between layers): its time is lost and its chunks run again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_kv_transfer::kv_commit;
use pd_kv_transfer::transport::Transport;
use pd_prefill::senders::Senders;
use pd_prefill::step::{plan, Candidate, CostModel, StepConfig, STOPPABLE_SHARE};
use pd_prefill::steps::short_prompt_rate;
use pd_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot, Notify};
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

use crate::cost::WorkerCost;
use crate::kv::Handoffs;

/// How long a UCX sender waits for a connection or an answer.
const KV_TIMEOUT: Duration = Duration::from_secs(5);

type KvClient = pb::kv_transfer_client::KvTransferClient<Channel>;

/// A prompt being prefilled.
struct Job {
    id: u64,
    len: usize,
    done: usize,
    arrived: Instant,
    last_turn: Instant,
    started: Option<Instant>,
    finished: oneshot::Sender<Timings>,
}

/// Queue and compute times of one prompt.
struct Timings {
    queue_ms: f64,
    prefill_ms: f64,
}

/// One planned prefill step: (job id, tokens) of each prompt in it, its chunks as the cost
/// model takes them ((tokens, tokens before)), and whether a short prompt's arrival stops it.
#[derive(Debug)]
pub(crate) struct Planned {
    pub chosen: Vec<(u64, usize)>,
    pub chunks: Vec<(usize, usize)>,
    pub preemptible: bool,
}

/// Buffers `plan_step` fills again at every step (virtual time plans millions of steps).
#[derive(Debug, Default)]
pub(crate) struct PlanScratch {
    ids: Vec<u64>,
    cands: Vec<Candidate>,
}

/// The real prefill worker's plan for the next step over `jobs` ((id, prompt length, tokens
/// done, time since its last chunk) each), `since_short` after the last short prompt arrived.
pub(crate) fn plan_step(
    step: &StepConfig,
    planner: &CostModel,
    jobs: impl Iterator<Item = (u64, usize, usize, Duration)>,
    since_short: Option<Duration>,
    scratch: &mut PlanScratch,
) -> Planned {
    let PlanScratch { ids, cands } = scratch;
    ids.clear();
    cands.clear();
    for (id, len, done, waited) in jobs {
        ids.push(id);
        cands.push(Candidate { remaining: len - done, done, len, waited });
    }
    let picked = plan(cands, &step.for_step(since_short), planner);
    Planned {
        chunks: picked.iter().map(|&(i, t)| (t, cands[i].done)).collect(),
        chosen: picked.iter().map(|&(i, t)| (ids[i], t)).collect(),
        preemptible: step.preemptible(picked.iter().map(|&(i, t)| (cands[i].len, t, cands[i].done))),
    }
}

/// A prefill worker's `Load` answer: `jobs` as (prompt length, tokens done) each; `rate`: its
/// planning model's short-prompt rate.
pub(crate) fn load_of(step: &StepConfig, jobs: impl Iterator<Item = (usize, usize)>, rate: f64) -> pb::PrefillLoad {
    let (mut waiting, mut running, mut all) = (0, 0, 0);
    for (len, done) in jobs {
        waiting += len - done;
        running += usize::from(done > 0);
        all += 1;
    }
    pb::PrefillLoad {
        waiting_prefill_tokens: waiting as u64,
        running_prefills: running as u32,
        queued_prefills: (all - running) as u32,
        prefill_tokens_per_s: rate,
        max_partial_prefills: step.max_prompts as u32,
        cache: None,
    }
}

#[derive(Default)]
struct State {
    /// When the last short prompt arrived (`StepConfig::for_step`).
    last_short: Option<Instant>,
    jobs: Vec<Job>,
    next_id: u64,
}

/// One simulated prefill worker; cheap to clone (shared state).
#[derive(Clone)]
pub struct SimPrefill {
    cost: Arc<WorkerCost>,
    step: StepConfig,
    /// `short_prompt_rate` of the planning model (f64 bits), for `Load`.
    rate: Arc<AtomicU64>,
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
    /// Woken (only if waiting) when a short prompt arrives: a preemptible step stops.
    short_arrived: Arc<Notify>,
    channels: Arc<Mutex<HashMap<String, KvClient>>>,
    /// UCX senders by endpoint, as the real prefill worker keeps them.
    senders: Senders,
    handoffs: Arc<Handoffs>,
    lost: Arc<AtomicBool>,
}

impl SimPrefill {
    /// A worker planning with `step`, counting its hand-offs in `handoffs`; its step loop
    /// runs on the current tokio runtime.
    pub fn start(cost: Arc<WorkerCost>, step: StepConfig, handoffs: Arc<Handoffs>) -> Self {
        let worker = SimPrefill {
            cost,
            step,
            rate: Arc::new(AtomicU64::new(short_prompt_rate(&CostModel::default()).to_bits())),
            state: Arc::default(),
            wake: Arc::new(Notify::new()),
            short_arrived: Arc::new(Notify::new()),
            channels: Arc::default(),
            senders: Senders::new(KV_TIMEOUT, None),
            handoffs,
            lost: Arc::new(AtomicBool::new(false)),
        };
        tokio::spawn(worker.clone().step_loop());
        worker
    }

    /// The worker crashes: its prefills fail with UNAVAILABLE, and so does every later call.
    pub fn lose(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.lock().jobs.clear();
        self.wake.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_alive(&self) -> Result<(), Status> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(Status::unavailable("simulated prefill worker lost"));
        }
        Ok(())
    }

    async fn step_loop(self) {
        let mut planner = CostModel::default();
        let mut clock = crate::StepClock::default();
        let mut scratch = PlanScratch::default();
        loop {
            let Planned { chosen, chunks, preemptible } = {
                let s = self.lock();
                let now = Instant::now();
                let jobs = s.jobs.iter().map(|j| (j.id, j.len, j.done, now.duration_since(j.last_turn)));
                plan_step(&self.step, &planner, jobs, s.last_short.map(|t| now.duration_since(t)), &mut scratch)
            };
            if chosen.is_empty() {
                clock.idle();
                self.wake.notified().await;
                continue;
            }
            let started = clock.start();
            let took = Duration::from_secs_f64(self.cost.prefill_step_ms(&chunks) / 1e3);
            let end = clock.end(started, took);
            if preemptible {
                let stopped = tokio::select! {
                    _ = tokio::time::sleep_until((started + took.mul_f64(STOPPABLE_SHARE)).into()) => false,
                    _ = self.short_arrived.notified() => true,
                };
                if stopped {
                    clock.idle();
                    continue; // nothing advanced; the planner learns nothing from a cut step
                }
            }
            tokio::time::sleep_until(end.into()).await;
            planner.observe(&chunks, took);
            self.rate.store(short_prompt_rate(&planner).to_bits(), Ordering::Relaxed);
            self.apply_step(&chosen, started);
        }
    }

    fn apply_step(&self, chosen: &[(u64, usize)], started: Instant) {
        let mut s = self.lock();
        let now = Instant::now();
        for &(id, tokens) in chosen {
            if let Some(j) = s.jobs.iter_mut().find(|j| j.id == id) {
                j.started.get_or_insert(started);
                j.done = (j.done + tokens).min(j.len);
                j.last_turn = now;
            }
        }
        let (done, rest): (Vec<Job>, Vec<Job>) = std::mem::take(&mut s.jobs).into_iter().partition(|j| j.done >= j.len);
        s.jobs = rest;
        drop(s);
        for j in done {
            let start = j.started.unwrap_or(started);
            let timings = Timings {
                queue_ms: start.duration_since(j.arrived).as_secs_f64() * 1e3,
                prefill_ms: now.duration_since(start).as_secs_f64() * 1e3,
            };
            let _ = j.finished.send(timings);
        }
    }

    async fn client(&self, endpoint: &str) -> Result<KvClient, Status> {
        if let Some(c) = self.channels.lock().unwrap_or_else(|p| p.into_inner()).get(endpoint) {
            return Ok(c.clone());
        }
        let uri = format!("http://{endpoint}");
        let channel = Channel::from_shared(uri)
            .map_err(|e| Status::invalid_argument(format!("target.kv_endpoint {endpoint:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .map_err(|e| Status::unavailable(format!("cannot reach the KV endpoint {endpoint}: {e}")))?;
        let client = KvClient::new(channel);
        self.channels.lock().unwrap_or_else(|p| p.into_inner()).insert(endpoint.into(), client.clone());
        Ok(client)
    }

    /// The prompt's KV to the target (control messages over gRPC, every frame over UCX):
    /// the hand-off's time in ms and the bytes the receiver confirmed.
    async fn ship(&self, target: &pb::KvTarget, prompt: usize, first_token: u32) -> Result<(f64, u64), Status> {
        let started = Instant::now();
        let uncached = prompt.saturating_sub(target.cached_tokens as usize);
        let modelled = Duration::from_secs_f64(self.cost.kv_commit_ms(uncached) / 1e3);
        let shipped = match Transport::of_endpoint(&target.kv_endpoint).0 {
            Transport::Ucx => {
                let commit = kv_commit(first_token, prompt as u32);
                crate::kv::send_frames(&self.senders, &self.handoffs, target, commit, modelled)
                    .await
                    .map_err(|e| e.to_status())
            }
            Transport::Grpc => self.ship_control(target, prompt, uncached, first_token, modelled).await,
        };
        match shipped {
            Ok(bytes) => Ok((started.elapsed().as_secs_f64() * 1e3, bytes)),
            Err(e) => {
                self.handoffs.failed();
                Err(e)
            }
        }
    }

    /// Header, the modelled hand-off time, commit; the receiver's answer to each.
    async fn ship_control(
        &self,
        target: &pb::KvTarget,
        prompt: usize,
        uncached: usize,
        first_token: u32,
        modelled: Duration,
    ) -> Result<u64, Status> {
        use pb::kv_sender_message::Message;
        let (tx, rx) = mpsc::channel(4);
        let header = pb::KvTransferHeader {
            transfer_id: target.transfer_id.clone(),
            block_ids: target.block_ids.clone(),
            block_size: target.block_size,
            num_tokens: uncached as u32,
            ..Default::default()
        };
        let _ = tx.send(pb::KvSenderMessage { message: Some(Message::Header(header)) }).await;
        let mut client = self.client(&target.kv_endpoint).await?;
        let mut replies = client.transfer(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
        let refused = |r: pb::KvRefused| Status::failed_precondition(format!("KV refused ({}): {}", r.kind, r.reason));
        match replies.message().await?.and_then(|m| m.message) {
            Some(pb::kv_receiver_message::Message::Accepted(_)) => {}
            Some(pb::kv_receiver_message::Message::Refused(r)) => return Err(refused(r)),
            _ => return Err(Status::internal("the KV receiver did not accept the header")),
        }
        tokio::time::sleep(modelled).await;
        let commit = kv_commit(first_token, prompt as u32);
        let _ = tx.send(pb::KvSenderMessage { message: Some(Message::Commit(commit)) }).await;
        match replies.message().await?.and_then(|m| m.message) {
            Some(pb::kv_receiver_message::Message::Committed(c)) => {
                self.handoffs.grpc_committed();
                Ok(c.bytes)
            }
            Some(pb::kv_receiver_message::Message::Refused(r)) => Err(refused(r)),
            _ => Err(Status::internal("the KV receiver did not confirm the commit")),
        }
    }
}

#[tonic::async_trait]
impl pb::prefill_worker_server::PrefillWorker for SimPrefill {
    async fn score(&self, _: Request<pb::ScoreRequest>) -> Result<Response<pb::ScoreResponse>, Status> {
        // A cost model has no logits to score a prompt with.
        Err(Status::unimplemented("the simulated prefill worker does not score prompts (echo with logprobs)"))
    }

    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        self.check_alive()?;
        let req = request.into_inner();
        if req.prompt_tokens.is_empty() {
            return Err(Status::invalid_argument("prompt_tokens is empty"));
        }
        let Some(target) = req.target else { return Err(Status::invalid_argument("target is required")) };
        if target.cached_tokens as usize >= req.prompt_tokens.len() {
            return Err(Status::invalid_argument("target.cached_tokens must be fewer than the prompt's tokens"));
        }
        let (finished, timings) = oneshot::channel();
        {
            let mut s = self.lock();
            let now = Instant::now();
            let id = s.next_id;
            s.next_id += 1;
            let len = req.prompt_tokens.len();
            if self.step.is_short(len) {
                s.last_short = Some(now);
            }
            s.jobs.push(Job { id, len, done: 0, arrived: now, last_turn: now, started: None, finished });
        }
        self.wake.notify_one();
        if self.step.is_short(req.prompt_tokens.len()) {
            self.short_arrived.notify_waiters();
        }
        let t = timings.await.map_err(|_| Status::unavailable("simulated prefill worker lost"))?;
        let first_token = crate::FIRST_TOKEN;
        let (kv_commit_ms, kv_bytes) = self.ship(&target, req.prompt_tokens.len(), first_token).await?;
        Ok(Response::new(pb::PrefillResponse {
            first_token,
            queue_ms: t.queue_ms,
            prefill_ms: t.prefill_ms,
            kv_commit_ms,
            kv_bytes,
            cached_tokens: 0,
            // A simulated worker has no model and no log probabilities to report.
            first_logprobs: None,
        }))
    }

    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::PrefillLoad>, Status> {
        self.load_now().map(Response::new)
    }

    type LoadStreamStream = pd_proto::LoadAnswers<pb::PrefillLoad>;

    async fn load_stream(
        &self,
        request: Request<Streaming<pb::LoadRequest>>,
    ) -> Result<Response<Self::LoadStreamStream>, Status> {
        self.check_alive()?;
        let this = self.clone();
        Ok(Response::new(pd_proto::answer_loads(request.into_inner(), move |_| this.load_now())))
    }
}

impl SimPrefill {
    fn load_now(&self) -> Result<pb::PrefillLoad, Status> {
        self.check_alive()?;
        let s = self.lock();
        let rate = f64::from_bits(self.rate.load(Ordering::Relaxed));
        Ok(load_of(&self.step, s.jobs.iter().map(|j| (j.len, j.done)), rate))
    }
}
