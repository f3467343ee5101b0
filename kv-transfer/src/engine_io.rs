//! Connects the transfer to pd-engine: the geometry of a model's KV, reading a layer's blocks
//! as frames on the sending side, and the engine's cache as the receiving side's sink.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use candle_core::Tensor;
use pd_engine::{Engine, SequenceKv, WireDType};
use tokio::sync::mpsc;

use crate::error::TransferError;
use crate::receiver::KvSink;
use crate::wire::{frame_runs, Frame, KvGeometry, TransferHeader};
use crate::{CommitReceipt, KvSender, KvTransfer};

/// The KV geometry of `engine`'s model and cache, shipped as `dtype`.
pub fn geometry_of(engine: &Engine, dtype: WireDType) -> KvGeometry {
    let c = engine.model().config();
    KvGeometry {
        model_fingerprint: engine.model().fingerprint(),
        dtype,
        num_layers: c.num_layers as u32,
        block_size: engine.cache().block_size() as u32,
        num_kv_heads: c.num_kv_heads as u32,
        head_dim: c.head_dim as u32,
    }
}

/// Frames carrying layer `layer` of the blocks `source_blocks` (in token order).
pub fn layer_frames(
    engine: &Engine,
    layer: u32,
    source_blocks: &[u32],
    geometry: &KvGeometry,
) -> Result<Vec<Frame>, TransferError> {
    frame_runs(geometry, source_blocks.len())
        .into_iter()
        .map(|(first, count)| {
            let ids = &source_blocks[first as usize..(first + count) as usize];
            let data = pd_engine::kv::export::read_blocks(engine.cache(), layer as usize, ids, geometry.dtype)
                .map_err(|e| TransferError::Sink(e.to_string()))?;
            Ok(Frame::new(layer, first, count, data))
        })
        .collect()
}

impl KvSink for Engine {
    fn write_blocks(&self, layer: u32, block_ids: &[u32], dtype: WireDType, data: &[u8]) -> Result<(), String> {
        self.cache().write_blocks(layer, block_ids, dtype, data)
    }
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

/// Decides when the next chunk of a prompt may run, where several prompts share one engine;
/// the turn is held while that chunk computes.
pub trait ChunkScheduler: Sync {
    type Turn: Send;
    /// Waits for the turn of a prompt with `remaining_tokens` still to prefill.
    fn turn(&self, remaining_tokens: usize) -> impl std::future::Future<Output = Self::Turn> + Send;
}

/// Every chunk runs at once: for callers that own the engine.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unscheduled;

impl ChunkScheduler for Unscheduled {
    type Turn = ();

    async fn turn(&self, _remaining_tokens: usize) {}
}

/// The turn already held, or a new one (the wait added to `waited`).
async fn next_turn<C: ChunkScheduler>(
    scheduler: &C,
    held: &mut Option<C::Turn>,
    remaining: usize,
    waited: &mut Duration,
) -> C::Turn {
    if let Some(t) = held.take() {
        return t;
    }
    let asked = Instant::now();
    let t = scheduler.turn(remaining).await;
    *waited += asked.elapsed();
    t
}

enum Progress {
    Layer(usize, Instant),
    Chunk(usize, SystemTime),
}

/// Prefills `prompt` on `engine` in chunks of `chunk` tokens, each on a blocking thread when
/// `scheduler` gives it a turn (so a worker can run another prompt's chunk in between), and
/// ships every layer as soon as the last chunk has computed it, then commits with the first
/// token sampled with `sampling` (greedy when its temperature is 0).
/// `header` names the destination; its geometry must be `geometry_of(engine, ..)`.
pub async fn prefill_and_send<S: KvSender, C: ChunkScheduler>(
    engine: Arc<Engine>,
    prompt: Vec<u32>,
    chunk: usize,
    header: TransferHeader,
    sender: &S,
    sampling: &pd_engine::SamplingParams,
    scheduler: &C,
) -> Result<PrefillSent, TransferError> {
    let engine_err = |e: pd_engine::EngineError| TransferError::Sink(e.to_string());
    let thread_err = |e: tokio::task::JoinError| TransferError::Sink(format!("prefill thread: {e}"));
    pd_engine::Sampler::new(sampling).map_err(engine_err)?;
    let chunk = chunk.max(1);
    let geometry = header.geometry;
    let tokens = prompt.len() as u32;
    let needed = engine.blocks().blocks_for(prompt.len());
    if needed != header.block_ids.len() {
        return Err(TransferError::Incompatible(format!(
            "{needed} source blocks for {} destination blocks",
            header.block_ids.len()
        )));
    }
    let mut transfer = sender.start(header).await?;
    let mut done = 0;
    let mut chunks = Vec::new();
    let mut waited = Duration::ZERO;
    let mut prefill_time = Duration::ZERO;
    // Blocks are taken at the first turn, so prompts waiting for one hold none.
    let asked = Instant::now();
    let mut turn = Some(scheduler.turn(prompt.len()).await);
    waited += asked.elapsed();
    let mut source = loop {
        match engine.sequence_with_capacity(prompt.len()) {
            Ok(s) => break s,
            // Other prompts in flight hold the blocks: give the turn back and ask again; they
            // progress and free theirs (a prompt larger than the whole cache fails at once).
            Err(pd_engine::EngineError::OutOfBlocks { .. }) if needed <= engine.blocks().total_blocks() => {
                drop(turn.take());
                tokio::time::sleep(Duration::from_millis(10)).await;
                turn = Some(next_turn(scheduler, &mut turn, prompt.len(), &mut waited).await);
            }
            Err(e) => {
                transfer.abort(&format!("no KV blocks for the prompt on the prefill worker: {e}")).await;
                return Err(engine_err(e));
            }
        }
    };
    let compute_started = SystemTime::now();
    let source_blocks = source.blocks().ids().to_vec();
    // Every chunk but the last: compute only (a layer's KV ships once the last chunk wrote it).
    while prompt.len() - done > chunk {
        let this_turn = next_turn(scheduler, &mut turn, prompt.len() - done, &mut waited).await;
        let piece = prompt[done..done + chunk].to_vec();
        let compute_engine = engine.clone();
        let started = Instant::now();
        let (result, back) = tokio::task::spawn_blocking(move || {
            let mut kv = source;
            let result = compute_engine.prefill(&mut kv, &piece, piece.len());
            (result, kv)
        })
        .await
        .map_err(thread_err)?;
        prefill_time += started.elapsed();
        drop(this_turn);
        source = back;
        if let Err(e) = result {
            transfer.abort(&format!("prefill failed: {e}")).await;
            return Err(engine_err(e));
        }
        done += chunk;
        chunks.push((chunk, SystemTime::now()));
    }
    // The last chunk, shipping each layer as soon as it holds the whole prompt.
    let turn = next_turn(scheduler, &mut turn, prompt.len() - done, &mut waited).await;
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Progress>();
    let compute_engine = engine.clone();
    let last_piece = prompt[done..].to_vec();
    let compute = tokio::task::spawn_blocking(move || {
        let mut kv = source;
        let started = Instant::now();
        let chunk_tx = done_tx.clone();
        let logits: Result<Tensor, _> = compute_engine.prefill_observed(
            &mut kv,
            &last_piece,
            last_piece.len(),
            &mut |layer| {
                let _ = done_tx.send(Progress::Layer(layer, Instant::now()));
            },
            &mut |tokens| {
                let _ = chunk_tx.send(Progress::Chunk(tokens, SystemTime::now()));
            },
        );
        (logits, kv, started.elapsed(), Instant::now(), SystemTime::now())
    });
    let mut last_layer_at = None;
    let mut layers = 0;
    while let Some(progress) = done_rx.recv().await {
        let layer = match progress {
            Progress::Layer(layer, at) => {
                last_layer_at = Some(at);
                layer
            }
            Progress::Chunk(tokens, at) => {
                chunks.push((tokens, at));
                continue;
            }
        };
        layers += 1;
        for frame in layer_frames(&engine, layer as u32, &source_blocks, &geometry)? {
            transfer.send(frame).await?;
        }
    }
    let (logits, source, last_time, prefill_end, compute_ended) = compute.await.map_err(thread_err)?;
    drop(turn);
    prefill_time += last_time;
    let logits = match logits {
        Ok(l) => l,
        Err(e) => {
            transfer.abort(&format!("prefill failed: {e}")).await;
            return Err(engine_err(e));
        }
    };
    let first_token = match pd_engine::Sampler::new(sampling).and_then(|mut s| s.sample(&logits)) {
        Ok(t) => t,
        Err(e) => {
            transfer.abort(&format!("sampling the first token failed: {e}")).await;
            return Err(engine_err(e));
        }
    };
    let receipt = transfer.commit(first_token, tokens).await?;
    let last_layer_to_commit = last_layer_at.map(|t| t.elapsed()).unwrap_or_default();
    let prefill_end_to_commit = prefill_end.elapsed();
    Ok(PrefillSent {
        first_token,
        source,
        receipt,
        prefill_time,
        waited,
        last_layer_to_commit,
        prefill_end_to_commit,
        compute_started,
        compute_ended,
        chunks,
        layers,
    })
}
