//! The prefill pipeline of one prompt: open the transfer, hand the prompt to the step loop
//! (`steps`, which computes it chunk by chunk beside other prompts), ship each layer's KV to
//! the decode worker as soon as the prompt's last step has written it (so the transfer
//! overlaps the remaining layers' compute), then sample the first token and commit. A
//! failure anywhere aborts the transfer (the receiver frees its blocks) and drops the source
//! blocks here.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use pd_engine::{Engine, SamplingParams, SequenceKv};
use pd_kv_transfer::engine_io::layer_frames;
use pd_kv_transfer::{CommitReceipt, KvSender, KvTransfer, TransferHeader};

use crate::error::PrefillError;
use crate::steps::{Finished, StepEvent, Steps};

/// One prompt to prefill and ship. `header` names the destination; its geometry must be
/// `geometry_of(engine, ..)` and its block list as long as the prompt from `ship_from` needs.
#[derive(Debug)]
pub struct PrefillJob {
    pub engine: Arc<Engine>,
    pub prompt: Vec<u32>,
    pub header: TransferHeader,
    /// How the first token is sampled.
    pub sampling: SamplingParams,
    /// Leading prompt tokens the receiver already holds (whole blocks): not shipped.
    pub ship_from: usize,
}

/// What a pipelined prefill-and-send measured.
#[derive(Debug)]
pub struct PrefillSent {
    pub first_token: u32,
    /// The first token's log probabilities, when the request asked for them.
    pub first_logprobs: Option<pd_engine::TokenLogprobs>,
    /// The prompt's KV on the prefill side (drop it to free the blocks).
    pub source: SequenceKv,
    pub receipt: CommitReceipt,
    /// Time of the steps the prompt was in (other prompts' chunks in them included).
    pub prefill_time: Duration,
    /// From submission to the prompt's first step.
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
    /// Leading prompt tokens this worker's prefix cache held (not computed).
    pub cached_tokens: usize,
}

/// Token counts of the chunks a prompt of `len` tokens runs as: full chunks, then the rest.
pub fn chunk_plan(len: usize, chunk: usize) -> Vec<usize> {
    let chunk = chunk.max(1);
    (0..len).step_by(chunk).map(|start| chunk.min(len - start)).collect()
}

async fn send_layer<T: KvTransfer>(
    job: &PrefillJob,
    layer: u32,
    blocks: &[u32],
    transfer: &mut T,
) -> Result<(), PrefillError> {
    let shipped = &blocks[(job.ship_from / job.engine.blocks().block_size()).min(blocks.len())..];
    for frame in layer_frames(&job.engine, layer, shipped, &job.header.geometry)? {
        transfer.send(frame).await?;
    }
    Ok(())
}

/// Prefills `job.prompt` on the step loop `steps`, ships every layer as soon as the prompt's
/// last step computed it, then commits with the first token sampled with `job.sampling`.
/// `progress` sees the prompt's `Started` and `Chunk` events (for the load gauges).
pub async fn prefill_and_send<S: KvSender>(
    job: PrefillJob,
    sender: &S,
    steps: &Steps,
    progress: impl FnMut(&StepEvent) + Send,
) -> Result<PrefillSent, PrefillError> {
    if job.prompt.is_empty() {
        return Err(PrefillError::Invalid("prompt_tokens is empty".into()));
    }
    // Checked (and a constraint compiled) before any KV moves.
    pd_engine::Sampler::for_sequence(&job.sampling, &job.prompt, job.engine.tokenizer())?;
    let bs = job.engine.blocks().block_size();
    if job.ship_from >= job.prompt.len() || !job.ship_from.is_multiple_of(bs) {
        let m = format!("{} cached tokens of a {}-token prompt in {bs}-token blocks", job.ship_from, job.prompt.len());
        return Err(PrefillError::Invalid(m));
    }
    let needed = job.engine.blocks().blocks_for(job.prompt.len()) - job.ship_from / bs;
    if needed != job.header.block_ids.len() {
        let message = format!("{needed} source blocks for {} destination blocks", job.header.block_ids.len());
        return Err(PrefillError::Incompatible(pd_kv_transfer::TransferError::Incompatible(message)));
    }
    let mut transfer = sender.start(job.header.clone()).await?;
    match compute_and_ship(&job, &mut transfer, steps, progress).await {
        Ok(computed) => sample_and_commit(&job, transfer, computed).await,
        Err(e) => {
            transfer.abort(&e.to_string()).await;
            Err(e)
        }
    }
}

/// What the steps computed, before the first token is sampled.
struct Computed {
    finished: Finished,
    waited: Duration,
    compute_started: SystemTime,
    chunks: Vec<(usize, SystemTime)>,
    layers: u32,
    last_layer_at: Option<Instant>,
    cached: usize,
}

/// Follows the prompt through the step loop, shipping layers during its last step.
async fn compute_and_ship<T: KvTransfer>(
    job: &PrefillJob,
    transfer: &mut T,
    steps: &Steps,
    mut progress: impl FnMut(&StepEvent) + Send,
) -> Result<Computed, PrefillError> {
    let submitted = Instant::now();
    let mut events = steps.submit(job.prompt.clone())?;
    let (mut blocks, mut started, mut waited, mut cached) = (Vec::new(), SystemTime::now(), Duration::ZERO, 0);
    let (mut chunks, mut layers, mut last_layer_at, mut shipping) = (Vec::new(), 0, None, Ok(()));
    while let Some(event) = events.recv().await {
        progress(&event);
        match event {
            StepEvent::Started { blocks: b, cached: c, at } => {
                (blocks, started, waited, cached) = (b, at, submitted.elapsed(), c)
            }
            StepEvent::Chunk { tokens, at } => chunks.push((tokens, at)),
            StepEvent::Layer(layer, at) if shipping.is_ok() => {
                (layers, last_layer_at) = (layers + 1, Some(at));
                shipping = send_layer(job, layer as u32, &blocks, transfer).await;
            }
            StepEvent::Layer(..) => {}
            StepEvent::Failed(e) => return Err(e.into()),
            StepEvent::Done(finished) => {
                shipping?;
                return Ok(Computed {
                    finished: *finished,
                    waited,
                    compute_started: started,
                    chunks,
                    layers,
                    last_layer_at,
                    cached,
                });
            }
        }
    }
    Err(PrefillError::Thread("the prefill step loop stopped".into()))
}

async fn sample_and_commit<T: KvTransfer>(
    job: &PrefillJob,
    transfer: T,
    computed: Computed,
) -> Result<PrefillSent, PrefillError> {
    let Computed { finished, waited, compute_started, chunks, layers, last_layer_at, cached } = computed;
    let sampled = pd_engine::Sampler::for_sequence(&job.sampling, &job.prompt, job.engine.tokenizer())
        .and_then(|mut s| s.draw(&finished.logits));
    let first = match sampled {
        Ok(t) => t,
        Err(e) => {
            transfer.abort(&format!("prefill failed: {e}")).await;
            return Err(e.into());
        }
    };
    let commit = pd_proto::v1::KvCommit {
        first_token: first.token,
        prompt_tokens: (job.prompt.len() - job.ship_from) as u32,
        first_logprobs: first.logprobs.as_ref().map(pd_kv_transfer::convert::logprobs_to_pb),
    };
    let receipt = transfer.commit(commit).await?;
    Ok(PrefillSent {
        first_token: first.token,
        first_logprobs: first.logprobs,
        source: finished.kv,
        receipt,
        prefill_time: finished.compute_time,
        waited,
        last_layer_to_commit: last_layer_at.map(|t| t.elapsed()).unwrap_or_default(),
        prefill_end_to_commit: finished.ended.elapsed(),
        compute_started,
        compute_ended: finished.ended_wall,
        chunks,
        layers,
        cached_tokens: cached,
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
