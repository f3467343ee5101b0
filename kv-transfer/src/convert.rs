//! The one place where `pd.v1` messages and engine types meet: sampling parameters (router ->
//! workers), the KV wire dtype, and the KV target a decode worker hands out (decode worker ->
//! router -> prefill worker). Every worker and the router convert through here, so the rules
//! (what is required, what 0 means) cannot drift apart.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use pd_engine::{OutputConstraint, SamplingParams, WireDType};
use pd_proto::v1 as pb;

use crate::error::TransferError;
use crate::wire::{KvGeometry, TransferHeader};

/// A field of a pd.v1 message that does not convert, named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidField {
    pub field: &'static str,
    pub message: String,
}

impl InvalidField {
    fn new(field: &'static str, message: impl Into<String>) -> Self {
        InvalidField { field, message: message.into() }
    }
}

/// The engine's sampling parameters of a request. `sampling` and its `seed` are required (the
/// router draws one when the client gave none); on the wire 0 means "off" for `top_k`, `top_p`
/// and `repetition_penalty` and greedy for `temperature`; `max_tokens` must be >= 1.
pub fn sampling_from_pb(
    sampling: Option<&pb::SamplingParams>,
    output_offset: u32,
) -> Result<SamplingParams, InvalidField> {
    let s = sampling.ok_or_else(|| InvalidField::new("sampling", "is required"))?;
    let seed = s.seed.ok_or_else(|| InvalidField::new("sampling.seed", "is required between workers"))?;
    let mut logit_bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|(&id, &b)| (id, b)).collect();
    logit_bias.sort_by_key(|&(id, _)| id);
    let params = SamplingParams {
        temperature: s.temperature as f64,
        top_k: (s.top_k > 0).then_some(s.top_k as usize),
        top_p: (s.top_p > 0.0).then_some(s.top_p as f64),
        seed,
        max_tokens: s.max_tokens as usize,
        stop_token_ids: s.stop_token_ids.clone(),
        stop_strings: s.stop.clone(),
        ignore_eos: s.ignore_eos,
        output_offset: output_offset as usize,
        repetition_penalty: if s.repetition_penalty == 0.0 { 1.0 } else { s.repetition_penalty },
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        logit_bias,
        min_tokens: s.min_tokens as usize,
        logprobs: s.logprobs.then_some(s.top_logprobs as usize),
        constraint: constraint_from_pb(s.constraint.as_ref())?,
    };
    params.validate().map_err(|e| InvalidField::new("sampling", e.to_string()))?;
    Ok(params)
}

/// A `ScoreRequest` checked against the model that scores it (prefill worker, or a decode
/// worker under colocated serving): the prompt, the alternatives per position, and the
/// sampling of the first output token.
#[derive(Debug, Clone)]
pub struct ScoreJob {
    pub prompt: Vec<u32>,
    pub top: usize,
    pub sampling: SamplingParams,
}

/// Checks `req` against `config`: a prompt within the context and the vocabulary, at most
/// `MAX_TOP_LOGPROBS` alternatives, valid sampling.
pub fn score_job_from_pb(req: pb::ScoreRequest, config: &pd_engine::ModelConfig) -> Result<ScoreJob, InvalidField> {
    if req.prompt_tokens.is_empty() {
        return Err(InvalidField::new("prompt_tokens", "is empty"));
    }
    let max = config.max_position;
    if req.prompt_tokens.len() > max {
        let message = format!("{} tokens exceed the context length of {max}", req.prompt_tokens.len());
        return Err(InvalidField::new("prompt_tokens", message));
    }
    let vocab = config.vocab_size;
    if let Some((i, id)) = req.prompt_tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(InvalidField::new("prompt_tokens", format!("[{i}] ({id}) is outside the vocabulary of {vocab}")));
    }
    let top = req.top_logprobs as usize;
    if top > pd_engine::MAX_TOP_LOGPROBS {
        let message = format!("{top} is above {}", pd_engine::MAX_TOP_LOGPROBS);
        return Err(InvalidField::new("top_logprobs", message));
    }
    let sampling = sampling_from_pb(req.sampling.as_ref(), 0)?;
    Ok(ScoreJob { prompt: req.prompt_tokens, top, sampling })
}

/// The wire form of `params` (the inverse of `sampling_from_pb`).
pub fn sampling_to_pb(params: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: params.temperature as f32,
        top_k: params.top_k.unwrap_or(0) as u32,
        top_p: params.top_p.unwrap_or(0.0) as f32,
        seed: Some(params.seed),
        max_tokens: params.max_tokens as u32,
        stop_token_ids: params.stop_token_ids.clone(),
        stop: params.stop_strings.clone(),
        ignore_eos: params.ignore_eos,
        repetition_penalty: params.repetition_penalty,
        frequency_penalty: params.frequency_penalty,
        presence_penalty: params.presence_penalty,
        logit_bias: params.logit_bias.iter().copied().collect(),
        min_tokens: params.min_tokens as u32,
        logprobs: params.logprobs.is_some(),
        top_logprobs: params.logprobs.unwrap_or(0) as u32,
        constraint: params.constraint.as_ref().map(constraint_to_pb),
    }
}

/// An output constraint from the wire (None when absent; one with no kind set is refused).
pub fn constraint_from_pb(c: Option<&pb::OutputConstraint>) -> Result<Option<OutputConstraint>, InvalidField> {
    use pb::output_constraint::Kind;
    let Some(c) = c else { return Ok(None) };
    match &c.kind {
        Some(Kind::JsonSchema(s)) => Ok(Some(OutputConstraint::JsonSchema(s.clone()))),
        Some(Kind::JsonObject(true)) => Ok(Some(OutputConstraint::JsonObject)),
        Some(Kind::Regex(r)) => Ok(Some(OutputConstraint::Regex(r.clone()))),
        Some(Kind::Lark(l)) => Ok(Some(OutputConstraint::Lark(l.clone()))),
        Some(Kind::JsonObject(false)) | None => {
            Err(InvalidField::new("sampling.constraint", "names no constraint (set one of its fields)"))
        }
    }
}

/// The wire form of an output constraint.
pub fn constraint_to_pb(c: &OutputConstraint) -> pb::OutputConstraint {
    use pb::output_constraint::Kind;
    let kind = match c {
        OutputConstraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        OutputConstraint::JsonObject => Kind::JsonObject(true),
        OutputConstraint::Regex(r) => Kind::Regex(r.clone()),
        OutputConstraint::Lark(l) => Kind::Lark(l.clone()),
    };
    pb::OutputConstraint { kind: Some(kind) }
}

/// The wire form of a token's log probabilities (token texts are left to the router).
pub fn logprobs_to_pb(l: &pd_engine::TokenLogprobs) -> pb::TokenLogprobs {
    let top = l.top.iter().map(|&(token_id, logprob)| pb::TopLogprob { token_id, logprob, token: String::new() });
    pb::TokenLogprobs { logprob: l.logprob, top: top.collect(), token: String::new() }
}

pub fn dtype_to_pb(dtype: WireDType) -> pb::KvDtype {
    match dtype {
        WireDType::F16 => pb::KvDtype::F16,
        WireDType::F32 => pb::KvDtype::F32,
    }
}

pub fn dtype_from_pb(value: i32) -> Result<WireDType, TransferError> {
    match pb::KvDtype::try_from(value) {
        Ok(pb::KvDtype::F16) => Ok(WireDType::F16),
        Ok(pb::KvDtype::F32) => Ok(WireDType::F32),
        _ => Err(TransferError::Incompatible(format!("dtype code {value} is not f16 or f32"))),
    }
}

/// Where a prefill worker must send a reservation's KV: what a decode worker answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub transfer_id: String,
    /// host:port of the decode worker's KvTransfer service.
    pub kv_endpoint: String,
    pub geometry: KvGeometry,
    /// Destination blocks in token order, for the prompt from `cached_tokens` on.
    pub block_ids: Vec<u32>,
    pub lease_deadline: SystemTime,
    /// Leading prompt tokens the receiver already holds (whole blocks): not shipped.
    pub cached_tokens: u32,
}

impl Target {
    pub fn to_pb(&self) -> pb::KvTarget {
        let g = &self.geometry;
        pb::KvTarget {
            transfer_id: self.transfer_id.clone(),
            kv_endpoint: self.kv_endpoint.clone(),
            block_ids: self.block_ids.clone(),
            model_fingerprint: g.model_fingerprint,
            block_size: g.block_size,
            dtype: dtype_to_pb(g.dtype) as i32,
            num_layers: g.num_layers,
            num_kv_heads: g.num_kv_heads,
            head_dim: g.head_dim,
            lease_deadline_unix_ms: self.lease_deadline.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            cached_tokens: self.cached_tokens,
        }
    }

    pub fn from_pb(t: &pb::KvTarget) -> Result<Self, TransferError> {
        if t.transfer_id.is_empty() {
            return Err(TransferError::Protocol("target.transfer_id is empty".into()));
        }
        if t.kv_endpoint.is_empty() {
            return Err(TransferError::Protocol("target.kv_endpoint is empty".into()));
        }
        if t.cached_tokens > 0 && (t.block_size == 0 || !t.cached_tokens.is_multiple_of(t.block_size)) {
            let m = format!(
                "target.cached_tokens ({}) is not a whole number of {}-token blocks",
                t.cached_tokens, t.block_size
            );
            return Err(TransferError::Protocol(m));
        }
        Ok(Target {
            transfer_id: t.transfer_id.clone(),
            kv_endpoint: t.kv_endpoint.clone(),
            geometry: KvGeometry {
                model_fingerprint: t.model_fingerprint,
                dtype: dtype_from_pb(t.dtype)?,
                num_layers: t.num_layers,
                block_size: t.block_size,
                num_kv_heads: t.num_kv_heads,
                head_dim: t.head_dim,
            },
            block_ids: t.block_ids.clone(),
            lease_deadline: UNIX_EPOCH + std::time::Duration::from_millis(t.lease_deadline_unix_ms),
            cached_tokens: t.cached_tokens,
        })
    }

    /// The transfer header a sender opens with, for a prompt of `num_tokens` tokens.
    pub fn header(&self, num_tokens: u32, trace_context: HashMap<String, String>) -> TransferHeader {
        TransferHeader {
            transfer_id: self.transfer_id.clone(),
            geometry: self.geometry,
            block_ids: self.block_ids.clone(),
            num_tokens,
            trace_context,
        }
    }
}

/// Most cache events in one `Load` answer (the rest come with the next one).
pub const MAX_CACHE_EVENTS: usize = 4096;

/// The prefix-cache part of a worker's `Load` answer for a router following it from the point
/// `req` names: the events since then, or a snapshot when the point is of another instance or
/// no longer in the log. None when the pool has no prefix cache.
pub fn cache_events(blocks: &pd_engine::BlockManager, req: &pb::LoadRequest) -> Option<pb::CacheEvents> {
    let seed = blocks.prefix_seed()?;
    let mut out = pb::CacheEvents {
        instance: blocks.instance(),
        hash_seed: seed,
        block_size: blocks.block_size() as u32,
        ..Default::default()
    };
    let events = if req.cache_instance == blocks.instance() {
        blocks.events_since(req.cache_events_after, MAX_CACHE_EVENTS)
    } else {
        pd_engine::EventsSince::Gap
    };
    match events {
        pd_engine::EventsSince::Events(events) => {
            out.last_seq = events.last().map_or(req.cache_events_after.min(blocks.last_event()), |e| e.seq);
            out.events = events
                .into_iter()
                .map(|e| pb::CacheEvent {
                    seq: e.seq,
                    stored: e.kind == pd_engine::BlockEventKind::Stored,
                    hash: e.hash,
                })
                .collect();
        }
        pd_engine::EventsSince::Gap => {
            let (last_seq, hashes) = blocks.cached_snapshot();
            out.snapshot = true;
            out.last_seq = last_seq;
            out.snapshot_hashes = hashes;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> KvGeometry {
        KvGeometry {
            model_fingerprint: 7,
            dtype: WireDType::F16,
            num_layers: 2,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        }
    }

    #[test]
    fn sampling_round_trips_and_zero_means_off() {
        let params = SamplingParams {
            temperature: 0.5,
            top_k: Some(40),
            top_p: Some(0.9),
            seed: 11,
            max_tokens: 8,
            stop_token_ids: vec![3],
            stop_strings: vec!["\n".into()],
            ignore_eos: true,
            output_offset: 3,
            repetition_penalty: 1.25,
            frequency_penalty: 0.5,
            presence_penalty: -0.5,
            logit_bias: vec![(2, -100.0), (7, 1.5)],
            min_tokens: 2,
            logprobs: Some(5),
            constraint: Some(OutputConstraint::Regex("[a-z]+".into())),
        };
        let back = sampling_from_pb(Some(&sampling_to_pb(&params)), 3).expect("valid");
        assert_eq!(back.output_offset, 3, "the offset travels beside the sampling parameters");
        assert_eq!(back.top_k, Some(40));
        assert_eq!(
            (back.seed, back.logit_bias.clone(), back.logprobs, back.min_tokens),
            (11, params.logit_bias.clone(), Some(5), 2)
        );
        assert_eq!(back.constraint, params.constraint);
        assert_eq!((back.repetition_penalty, back.frequency_penalty, back.presence_penalty), (1.25, 0.5, -0.5));
        assert_eq!(back.stop_strings, params.stop_strings);
        assert!((back.top_p.expect("top_p") - 0.9).abs() < 1e-6);
        let greedy = sampling_from_pb(Some(&sampling_to_pb(&SamplingParams::greedy(4))), 0).expect("greedy");
        assert_eq!(greedy, SamplingParams::greedy(4));
    }

    #[test]
    fn bad_sampling_names_the_field() {
        assert_eq!(sampling_from_pb(None, 0).expect_err("missing").field, "sampling");
        let unseeded = pb::SamplingParams { max_tokens: 4, ..Default::default() };
        assert_eq!(sampling_from_pb(Some(&unseeded), 0).expect_err("no seed").field, "sampling.seed");
        let zero = pb::SamplingParams { max_tokens: 0, seed: Some(1), ..Default::default() };
        assert!(sampling_from_pb(Some(&zero), 0).expect_err("zero").message.contains("max_tokens"));
        let negative = pb::SamplingParams { max_tokens: 1, temperature: -1.0, seed: Some(1), ..Default::default() };
        assert!(sampling_from_pb(Some(&negative), 0).expect_err("negative").message.contains("temperature"));
    }

    #[test]
    fn cache_events_follow_a_pool_and_snapshot_another_instance() {
        let blocks = pd_engine::BlockManager::with_prefix_cache(8, 2, 5);
        assert!(cache_events(&pd_engine::BlockManager::new(4, 2), &pb::LoadRequest::default()).is_none());
        let (mut a, _) = blocks.allocate_prefix(&[1, 2, 3, 4, 5], 5).expect("3 blocks");
        a.register(&[1, 2, 3, 4, 5]);
        let first = cache_events(&blocks, &pb::LoadRequest::default()).expect("on");
        assert!(first.snapshot && first.snapshot_hashes.len() == 2 && first.last_seq == 2);
        let cursor = pb::LoadRequest { cache_events_after: 1, cache_instance: blocks.instance() };
        let next = cache_events(&blocks, &cursor).expect("on");
        assert!(!next.snapshot);
        assert_eq!(next.events.iter().map(|e| (e.seq, e.stored)).collect::<Vec<_>>(), vec![(2, true)]);
        let idle = cache_events(&blocks, &pb::LoadRequest { cache_events_after: 2, ..cursor }).expect("on");
        assert_eq!((idle.events.len(), idle.last_seq, idle.snapshot), (0, 2, false));
    }

    #[test]
    fn target_round_trips_and_bad_ones_are_refused() {
        let target = Target {
            transfer_id: "t".into(),
            kv_endpoint: "127.0.0.1:1".into(),
            geometry: geometry(),
            block_ids: vec![4, 9],
            lease_deadline: UNIX_EPOCH + std::time::Duration::from_millis(1_234),
            cached_tokens: 32,
        };
        assert_eq!(Target::from_pb(&target.to_pb()).expect("valid"), target);
        let header = target.header(20, HashMap::new());
        assert_eq!((header.block_ids.as_slice(), header.num_tokens), (&[4, 9][..], 20));
        let mut bad = target.to_pb();
        bad.dtype = 99;
        assert!(matches!(Target::from_pb(&bad), Err(TransferError::Incompatible(_))));
        let mut no_endpoint = target.to_pb();
        no_endpoint.kv_endpoint.clear();
        assert!(matches!(Target::from_pb(&no_endpoint), Err(TransferError::Protocol(m)) if m.contains("kv_endpoint")));
        let mut mid_block = target.to_pb();
        mid_block.cached_tokens = 20;
        assert!(matches!(Target::from_pb(&mid_block), Err(TransferError::Protocol(m)) if m.contains("cached_tokens")));
    }
}
