//! Scoring a prompt here (`DecodeWorker.Score`), for colocated serving where no prefill pool
//! exists: echo requests with `logprobs` (what evaluation harnesses send for loglikelihoods)
//! are answered by the decode worker's own batch. The prompt joins the batch with blocks of
//! its own for the prompt and one output token (no cached prefix: a cached block has no
//! logits to score with), every position's logits scored as its chunks run beside the
//! streams (`batch::Scoring`); the first output token is then sampled as any sequence's
//! first, and the sequence leaves, its blocks freed (its full ones offered to the prefix
//! cache).

use pd_kv_transfer::convert::{logprobs_to_pb, score_job_from_pb};
use pd_proto::v1 as pb;
use pd_telemetry::{StageLabels, StageSpan};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::batch::{Admission, Event, Received, Scoring, Start};
use crate::error::DecodeError;
use crate::service::DecodeService;

impl DecodeService {
    /// Scores `req` in the batch (see the module docs); `span` is the request's `decode.score`.
    /// A refusal before the batch is counted as any request's; a failure in the batch keeps
    /// the batch's status.
    pub(crate) async fn score_here(
        &self,
        req: pb::ScoreRequest,
        span: &StageSpan,
        labels: StageLabels,
    ) -> Result<pb::ScoreResponse, Status> {
        let mut rx = self.admit_scored(req, span, labels).map_err(|e| self.refuse(span, e))?;
        let mut first = None;
        while let Some(event) = rx.events.recv().await {
            match event?.event {
                Some(pb::decode_event::Event::Token(t)) => first = Some(t),
                Some(pb::decode_event::Event::Finished(f)) => {
                    let token = first.ok_or_else(|| Status::internal("the batch finished without a token"))?;
                    // Sent by the batch before the first token.
                    let prompt_logprobs =
                        rx.scored.try_recv().map_err(|_| Status::internal("the batch dropped the prompt's scores"))?;
                    return Ok(pb::ScoreResponse {
                        prompt_logprobs: prompt_logprobs.iter().map(logprobs_to_pb).collect(),
                        first_token: token.token_id,
                        first_logprobs: token.logprobs,
                        queue_ms: f.queue_ms,
                        prefill_ms: f.prefill_ms,
                    });
                }
                _ => {}
            }
        }
        Err(DecodeError::LoopStopped.to_status())
    }

    /// Checks `req`, takes its blocks and joins it to the batch.
    fn admit_scored(
        &self,
        req: pb::ScoreRequest,
        span: &StageSpan,
        labels: StageLabels,
    ) -> Result<Joined, DecodeError> {
        let mut job = score_job_from_pb(req, self.engine.model().config())?;
        // One output token: the first after the prompt, as a prefill worker's Score gives.
        job.sampling.max_tokens = 1;
        job.sampling.min_tokens = 0;
        let blocks = self.engine.blocks();
        let own = blocks.allocate(blocks.blocks_for(job.prompt.len() + 1)).map_err(DecodeError::OutOfBlocks)?;
        span.set("gen_ai.usage.input_tokens", job.prompt.len() as i64);
        let (events, rx) = mpsc::unbounded_channel::<Event>();
        let (sink, scored) = oneshot::channel();
        self.batcher.admit(Admission {
            index: 0,
            kv: pd_engine::SequenceKv::new(own),
            start: Start::Prompt { from: 0 },
            prompt: job.prompt,
            params: job.sampling,
            cached_tokens: 0,
            received: Received::default(),
            events,
            span: StageSpan::start("decode.generate", span.context()),
            labels,
            forks: Vec::new(),
            score: Some(Scoring { top: job.top, sink }),
        })?;
        Ok(Joined { events: rx, scored })
    }
}

/// A scored prompt in the batch: its stream, and where its scores arrive.
struct Joined {
    events: mpsc::UnboundedReceiver<Event>,
    scored: oneshot::Receiver<Vec<pd_engine::TokenLogprobs>>,
}
