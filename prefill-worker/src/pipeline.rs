//! The prefill pipeline: one prompt computed chunk by chunk on the shared engine, each layer's
//! KV shipped to the decode worker as soon as the last chunk has written it (so the transfer
//! overlaps the remaining layers' compute), then the first token sampled and committed.
//!
//! Stages, in order: `take_blocks` (at the first turn, so prompts waiting for a turn hold no
//! blocks), `compute_chunk` for every chunk but the last, `ship_last_chunk` (compute and
//! send, layer by layer), `sample_and_commit`. A `ChunkScheduler` gives each chunk its turn
//! on the engine; a failure anywhere aborts the transfer (the receiver frees its blocks) and
//! drops the source blocks here.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use candle_core::Tensor;
use pd_engine::{Engine, EngineError, SamplingParams, SequenceKv};
use pd_kv_transfer::engine_io::layer_frames;
use pd_kv_transfer::{CommitReceipt, KvSender, KvTransfer, TransferHeader};
use tokio::sync::mpsc;

use crate::error::PrefillError;

/// Decides when the next chunk of a prompt may run, where several prompts share one engine;
/// the turn is held while that chunk computes.
pub trait ChunkScheduler: Sync {
    type Turn: Send;
    /// Waits for the turn of a prompt with `remaining_tokens` still to prefill.
    fn turn(&self, remaining_tokens: usize) -> impl std::future::Future<Output = Self::Turn> + Send;
}

/// Every chunk runs at once: for callers that own the engine (tests, benchmarks).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unscheduled;

impl ChunkScheduler for Unscheduled {
    type Turn = ();

    async fn turn(&self, _remaining_tokens: usize) {}
}

/// One prompt to prefill and ship. `header` names the destination; its geometry must be
/// `geometry_of(engine, ..)` and its block list as long as the prompt needs.
#[derive(Debug)]
pub struct PrefillJob {
    pub engine: Arc<Engine>,
    pub prompt: Vec<u32>,
    /// Tokens per chunk (at least 1).
    pub chunk: usize,
    pub header: TransferHeader,
    /// How the first token is sampled.
    pub sampling: SamplingParams,
}

/// What a pipelined prefill-and-send measured.
#[derive(Debug)]
pub struct PrefillSent {
    pub first_token: u32,
    /// The prompt's KV on the prefill side (drop it to free the blocks).
    pub source: SequenceKv,
    pub receipt: CommitReceipt,
    /// Prefill compute, summed over the chunks (waits for turns excluded).
    pub prefill_time: Duration,
    /// Waiting for the scheduler's turns, the first one included.
    pub waited: Duration,
    /// From the last layer's KV being written (its attention and MLP, and the logits, still
    /// to compute) to the receiver's commit confirmation.
    pub last_layer_to_commit: Duration,
    /// From the prefill's logits being ready to the commit confirmation: what the transfer
    /// adds to time-to-first-token.
    pub prefill_end_to_commit: Duration,
    /// Wall-clock start of the first chunk and end of the last, and the end of each chunk
    /// with its tokens (for trace spans and events).
    pub compute_started: SystemTime,
    pub compute_ended: SystemTime,
    pub chunks: Vec<(usize, SystemTime)>,
    /// Layers shipped.
    pub layers: u32,
}

/// Token counts of the chunks a prompt of `len` tokens runs as: full chunks, then the rest.
pub fn chunk_plan(len: usize, chunk: usize) -> Vec<usize> {
    let chunk = chunk.max(1);
    (0..len).step_by(chunk).map(|start| chunk.min(len - start)).collect()
}

/// Turns and their waits, for one prompt.
struct Turns<'a, C: ChunkScheduler> {
    scheduler: &'a C,
    held: Option<C::Turn>,
    waited: Duration,
}

impl<C: ChunkScheduler> Turns<'_, C> {
    /// The turn already held, or a new one (its wait counted).
    async fn take(&mut self, remaining: usize) -> C::Turn {
        if let Some(t) = self.held.take() {
            return t;
        }
        let asked = Instant::now();
        let t = self.scheduler.turn(remaining).await;
        self.waited += asked.elapsed();
        t
    }
}

fn thread_err(e: tokio::task::JoinError) -> PrefillError {
    PrefillError::Thread(e.to_string())
}

/// The prompt's source blocks, taken at its first turn. When prompts in flight hold them all,
/// gives the turn back and asks again (they progress and free theirs); a prompt larger than
/// the whole cache fails at once.
async fn take_blocks<C: ChunkScheduler>(
    engine: &Engine,
    len: usize,
    turns: &mut Turns<'_, C>,
) -> Result<SequenceKv, EngineError> {
    turns.held = Some(turns.take(len).await);
    loop {
        match engine.sequence_with_capacity(len) {
            Ok(s) => return Ok(s),
            Err(EngineError::OutOfBlocks { .. })
                if engine.blocks().blocks_for(len) <= engine.blocks().total_blocks() =>
            {
                drop(turns.held.take());
                tokio::time::sleep(Duration::from_millis(10)).await;
                turns.held = Some(turns.take(len).await);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs one chunk (not the last) on a blocking thread; gives the sequence back.
async fn compute_chunk(
    engine: &Arc<Engine>,
    kv: SequenceKv,
    piece: Vec<u32>,
) -> (Result<(), PrefillError>, Option<SequenceKv>) {
    let engine = engine.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let mut kv = kv;
        let result = engine.prefill(&mut kv, &piece, piece.len()).map(|_| ());
        (result, kv)
    })
    .await;
    match joined {
        Ok((result, kv)) => (result.map_err(PrefillError::from), Some(kv)),
        Err(e) => (Err(thread_err(e)), None),
    }
}

enum Progress {
    Layer(usize, Instant),
    Chunk(usize, SystemTime),
}

/// What the last chunk's compute gives back.
struct LastChunk {
    /// When the last layer's KV was written.
    last_layer_at: Option<Instant>,
    logits: Result<Tensor, EngineError>,
    source: SequenceKv,
    compute_time: Duration,
    ended: Instant,
    ended_wall: SystemTime,
}

/// Computes the last chunk on a blocking thread and ships each layer as soon as it holds the
/// whole prompt. Chunk events go to `chunks`; returns the layers shipped and the compute.
async fn ship_last_chunk<T: KvTransfer>(
    engine: &Arc<Engine>,
    source: SequenceKv,
    piece: Vec<u32>,
    header: &TransferHeader,
    transfer: &mut T,
    chunks: &mut Vec<(usize, SystemTime)>,
) -> Result<(u32, LastChunk), PrefillError> {
    let source_blocks = source.blocks().ids().to_vec();
    let (progress_tx, mut progress) = mpsc::unbounded_channel::<Progress>();
    let compute_engine = engine.clone();
    let compute = tokio::task::spawn_blocking(move || {
        let mut kv = source;
        let started = Instant::now();
        let chunk_tx = progress_tx.clone();
        let logits = compute_engine.prefill_observed(
            &mut kv,
            &piece,
            piece.len(),
            &mut |layer| drop(progress_tx.send(Progress::Layer(layer, Instant::now()))),
            &mut |tokens| drop(chunk_tx.send(Progress::Chunk(tokens, SystemTime::now()))),
        );
        LastChunk {
            last_layer_at: None,
            logits,
            source: kv,
            compute_time: started.elapsed(),
            ended: Instant::now(),
            ended_wall: SystemTime::now(),
        }
    });
    let (mut layers, mut last_layer_at) = (0, None);
    let mut shipping = Ok(());
    while let Some(p) = progress.recv().await {
        match p {
            Progress::Chunk(tokens, at) => chunks.push((tokens, at)),
            Progress::Layer(layer, at) if shipping.is_ok() => {
                (layers, last_layer_at) = (layers + 1, Some(at));
                shipping = send_layer(engine, layer as u32, &source_blocks, header, transfer).await;
            }
            Progress::Layer(..) => {}
        }
    }
    let last = LastChunk { last_layer_at, ..compute.await.map_err(thread_err)? };
    shipping.map(|()| (layers, last))
}

async fn send_layer<T: KvTransfer>(
    engine: &Engine,
    layer: u32,
    source_blocks: &[u32],
    header: &TransferHeader,
    transfer: &mut T,
) -> Result<(), PrefillError> {
    for frame in layer_frames(engine, layer, source_blocks, &header.geometry)? {
        transfer.send(frame).await?;
    }
    Ok(())
}

/// Prefills `job.prompt` in chunks, each when `scheduler` gives it a turn (so a worker can run
/// another prompt's chunk in between), ships every layer as soon as the last chunk computed
/// it, then commits with the first token sampled with `job.sampling`.
pub async fn prefill_and_send<S: KvSender, C: ChunkScheduler>(
    job: PrefillJob,
    sender: &S,
    scheduler: &C,
) -> Result<PrefillSent, PrefillError> {
    if job.prompt.is_empty() {
        return Err(PrefillError::Invalid("prompt_tokens is empty".into()));
    }
    pd_engine::Sampler::new(&job.sampling)?;
    let needed = job.engine.blocks().blocks_for(job.prompt.len());
    if needed != job.header.block_ids.len() {
        let message = format!("{needed} source blocks for {} destination blocks", job.header.block_ids.len());
        return Err(PrefillError::Incompatible(pd_kv_transfer::TransferError::Incompatible(message)));
    }
    let mut transfer = sender.start(job.header.clone()).await?;
    let mut turns = Turns { scheduler, held: None, waited: Duration::ZERO };
    match run_chunks(&job, &mut transfer, &mut turns).await {
        Ok(computed) => sample_and_commit(&job, transfer, computed, turns.waited).await,
        Err(e) => {
            transfer.abort(&e.to_string()).await;
            Err(e)
        }
    }
}

/// What the chunks computed, before the first token is sampled.
struct Computed {
    last: LastChunk,
    prefill_time: Duration,
    compute_started: SystemTime,
    chunks: Vec<(usize, SystemTime)>,
    layers: u32,
}

async fn run_chunks<T: KvTransfer, C: ChunkScheduler>(
    job: &PrefillJob,
    transfer: &mut T,
    turns: &mut Turns<'_, C>,
) -> Result<Computed, PrefillError> {
    let len = job.prompt.len();
    let mut source = take_blocks(&job.engine, len, turns).await?;
    let compute_started = SystemTime::now();
    let plan = chunk_plan(len, job.chunk);
    let (mut done, mut prefill_time, mut chunks) = (0, Duration::ZERO, Vec::new());
    for &tokens in &plan[..plan.len() - 1] {
        let turn = turns.take(len - done).await;
        let started = Instant::now();
        let (result, back) = compute_chunk(&job.engine, source, job.prompt[done..done + tokens].to_vec()).await;
        prefill_time += started.elapsed();
        drop(turn);
        result?;
        source = back.ok_or_else(|| PrefillError::Thread("the sequence was lost with its thread".into()))?;
        done += tokens;
        chunks.push((tokens, SystemTime::now()));
    }
    let turn = turns.take(len - done).await;
    let piece = job.prompt[done..].to_vec();
    let (layers, last) = ship_last_chunk(&job.engine, source, piece, &job.header, transfer, &mut chunks).await?;
    drop(turn);
    prefill_time += last.compute_time;
    Ok(Computed { last, prefill_time, compute_started, chunks, layers })
}

async fn sample_and_commit<T: KvTransfer>(
    job: &PrefillJob,
    transfer: T,
    computed: Computed,
    waited: Duration,
) -> Result<PrefillSent, PrefillError> {
    let Computed { last, prefill_time, compute_started, chunks, layers } = computed;
    let sampled = last.logits.and_then(|logits| pd_engine::Sampler::new(&job.sampling)?.sample(&logits));
    let first_token = match sampled {
        Ok(t) => t,
        Err(e) => {
            transfer.abort(&format!("prefill failed: {e}")).await;
            return Err(e.into());
        }
    };
    let receipt = transfer.commit(first_token, job.prompt.len() as u32).await?;
    Ok(PrefillSent {
        first_token,
        source: last.source,
        receipt,
        prefill_time,
        waited,
        last_layer_to_commit: last.last_layer_at.map(|t| t.elapsed()).unwrap_or_default(),
        prefill_end_to_commit: last.ended.elapsed(),
        compute_started,
        compute_ended: last.ended_wall,
        chunks,
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::chunk_plan;

    #[test]
    fn chunks_cover_the_prompt_with_the_rest_last() {
        assert_eq!(chunk_plan(600, 256), vec![256, 256, 88]);
        assert_eq!(chunk_plan(256, 256), vec![256]);
        assert_eq!(chunk_plan(5, 256), vec![5]);
        assert_eq!(chunk_plan(3, 0), vec![1, 1, 1]);
        assert_eq!(chunk_plan(0, 16), Vec::<usize>::new());
    }
}
