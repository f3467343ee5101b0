//! The engine facade: a loaded model, its KV cache and block pool, tokenizer and chat
//! template, with the operations the workers build on (chunked prefill, batched steps,
//! single-sequence generation, KV export/import). Synchronous; the workers own the threads.

use std::ops::{ControlFlow, Range};
use std::path::Path;

use candle_core::Tensor;

use crate::chat::{ChatMessage, ChatTemplate};
use crate::config::{CacheConfig, LoadOptions};
use crate::error::{EngineError, Result};
use crate::kv::blocks::{BlockAllocation, BlockManager};
use crate::kv::cache::{KvCache, SequenceKv};
use crate::kv::export::{self, WireDType};
use crate::kv::prefix;
use crate::loader::gguf::GgufFile;
use crate::loader::hf::HfFolder;
use crate::model::{BatchSeq, Model};
use crate::sampling::{FinishReason, OutputTracker, Sampler, SamplingParams, TokenOutput};
use crate::tokenizer::Tokenizer;

/// A model with everything needed to turn text into tokens and back.
#[derive(Debug)]
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

/// Loads a GGUF file or a Hugging Face folder.
pub fn load_model(path: &Path, options: LoadOptions) -> Result<LoadedModel> {
    let device = options.device.to_device()?;
    if path.is_dir() {
        let mut folder = HfFolder::open(path, &device)?;
        let config = folder.model_config()?;
        let tokenizer = Tokenizer::from_file(&folder.tokenizer_path()?, folder.eos_ids(), folder.bos_id())?;
        let template = folder.chat_template()?;
        let model = Model::load(config, &mut folder, options.weights, &device)?;
        let chat_template = compile_template(template, &tokenizer)?;
        return Ok(LoadedModel { model, tokenizer, chat_template });
    }
    let mut file = GgufFile::open(path, &device)?;
    let config = file.model_config()?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    if tokenizer.vocab_size() < config.vocab_size {
        return Err(EngineError::Tokenizer(format!(
            "tokenizer has {} tokens, the model {}",
            tokenizer.vocab_size(),
            config.vocab_size
        )));
    }
    let template = file.chat_template();
    let model = Model::load(config, &mut file, options.weights, &device)?;
    let chat_template = compile_template(template, &tokenizer)?;
    Ok(LoadedModel { model, tokenizer, chat_template })
}

/// The text side of a model (tokenizer, chat template, context length) without its weights:
/// what a router needs to validate and tokenize requests.
#[derive(Debug)]
pub struct TextSide {
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub max_position: usize,
}

/// Reads only the tokenizer, chat template and context length of a GGUF file or folder.
pub fn load_text_side(path: &Path) -> Result<TextSide> {
    let device = candle_core::Device::Cpu;
    if path.is_dir() {
        let folder = HfFolder::open(path, &device)?;
        let config = folder.model_config()?;
        let tokenizer = Tokenizer::from_file(&folder.tokenizer_path()?, folder.eos_ids(), folder.bos_id())?;
        let chat_template = compile_template(folder.chat_template()?, &tokenizer)?;
        return Ok(TextSide { tokenizer, chat_template, max_position: config.max_position });
    }
    let file = GgufFile::open(path, &device)?;
    let config = file.model_config()?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let chat_template = compile_template(file.chat_template(), &tokenizer)?;
    Ok(TextSide { tokenizer, chat_template, max_position: config.max_position })
}

fn compile_template(source: Option<String>, tokenizer: &Tokenizer) -> Result<Option<ChatTemplate>> {
    let text_of = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
    source
        .map(|s| ChatTemplate::new(&s, &text_of(tokenizer.bos_id()), &text_of(tokenizer.eos_ids().first().copied())))
        .transpose()
}

/// A finished single-sequence generation.
#[derive(Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    /// The sequence's KV (prompt and generated tokens but the last one).
    pub kv: SequenceKv,
}

/// Model + KV cache + block pool.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    cache: KvCache,
    blocks: BlockManager,
}

impl Engine {
    pub fn new(mut loaded: LoadedModel, cache: CacheConfig) -> Result<Self> {
        let kv = KvCache::new(loaded.model.config(), &cache, loaded.model.device())?;
        loaded.model.limit_positions(cache.num_blocks * cache.block_size)?;
        // The file's tensors as read, before repacking, and the rotary tables' unused rows
        // are freed by now: memory that mimalloc (every pd binary's allocator) would keep
        // for reuse until a later allocation purges it (82 MiB at Llama-3.2-1B geometry).
        // Hand it back now.
        // SAFETY: mi_collect takes no pointers; it only frees pages mimalloc owns.
        unsafe { libmimalloc_sys::mi_collect(true) };
        let blocks = if cache.prefix_cache {
            let seed = prefix::hash_seed(loaded.model.fingerprint(), cache.block_size);
            BlockManager::with_prefix_cache(cache.num_blocks, cache.block_size, seed)
        } else {
            kv.block_manager()
        };
        Ok(Engine {
            blocks,
            cache: kv,
            model: loaded.model,
            tokenizer: loaded.tokenizer,
            chat_template: loaded.chat_template,
        })
    }

    pub fn load(path: &Path, options: LoadOptions, cache: CacheConfig) -> Result<Self> {
        Engine::new(load_model(path, options)?, cache)
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// An empty sequence; blocks are taken as it grows.
    pub fn new_sequence(&self) -> SequenceKv {
        SequenceKv::new(self.blocks.empty_allocation())
    }

    /// Prompt tokens for a chat, rendered with the model's template.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| EngineError::ChatTemplate("the model has no chat template".into()))?;
        self.tokenizer.encode(&template.render(messages, true)?)
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// One batched step (see `Model::forward`).
    pub fn forward(&self, batch: &mut [BatchSeq<'_>]) -> Result<Tensor> {
        self.model.forward(&self.cache, batch)
    }

    /// Runs `tokens` into `kv` in chunks of at most `chunk` tokens; returns the `[vocab]`
    /// logits after the last one.
    pub fn prefill(&self, kv: &mut SequenceKv, tokens: &[u32], chunk: usize) -> Result<Tensor> {
        self.prefill_observed(kv, tokens, chunk, &mut |_| {}, &mut |_| {})
    }

    /// `prefill`, calling `layer_done(l)` once layer `l` holds the K/V of the whole prompt
    /// (during the last chunk), so its blocks can be shipped while later layers compute, and
    /// `chunk_done(tokens)` after each chunk (for per-chunk trace events).
    pub fn prefill_observed(
        &self,
        kv: &mut SequenceKv,
        tokens: &[u32],
        chunk: usize,
        layer_done: &mut dyn FnMut(usize),
        chunk_done: &mut dyn FnMut(usize),
    ) -> Result<Tensor> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidBatch("empty prompt".into()));
        }
        let max = self.model.config().max_position;
        if kv.len() + tokens.len() > max {
            return Err(EngineError::ContextOverflow { tokens: kv.len() + tokens.len(), max });
        }
        let chunk = chunk.max(1);
        let mut logits = None;
        let pieces = tokens.chunks(chunk);
        let last = pieces.len() - 1;
        for (i, piece) in pieces.enumerate() {
            let mut batch = [BatchSeq { tokens: piece, kv: &mut *kv, want_logits: i == last }];
            let out = if i == last {
                self.model.forward_observed(&self.cache, &mut batch, &mut |l| {
                    layer_done(l);
                    ControlFlow::Continue(())
                })?
            } else {
                self.model.forward(&self.cache, &mut batch)?
            };
            if i == last {
                logits = Some(out.squeeze(0)?);
            }
            chunk_done(piece.len());
        }
        logits.ok_or_else(|| EngineError::InvalidBatch("empty prompt".into()))
    }

    /// Generates from `prompt` in a fresh sequence, calling `on_token` for every token.
    /// The prompt's cached prefix is reused and its full blocks are cached for later prompts.
    pub fn generate(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        chunk: usize,
        mut on_token: impl FnMut(&TokenOutput),
    ) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidBatch("empty prompt".into()));
        }
        let (mut kv, cached) = self.sequence_for_prompt(prompt, prompt.len())?;
        let logits = self.prefill(&mut kv, &prompt[cached..], chunk)?;
        self.cache_prefix(&mut kv, prompt);
        self.continue_generation(kv, logits, params, &mut on_token)
    }

    /// A sequence for `prompt` with blocks for `capacity` tokens, whose leading blocks are the
    /// prompt's cached prefix (shared, already computed), and how many tokens those hold: the
    /// prefill starts at that position.
    pub fn sequence_for_prompt(&self, prompt: &[u32], capacity: usize) -> Result<(SequenceKv, usize)> {
        let (blocks, cached) = self.blocks.allocate_prefix(prompt, capacity)?;
        let mut kv = SequenceKv::new(blocks);
        kv.commit_len(cached);
        Ok((kv, cached))
    }

    /// Offers the full blocks of `kv`, whose first `tokens.len()` positions hold `tokens`'
    /// K/V, to the prefix cache.
    pub fn cache_prefix(&self, kv: &mut SequenceKv, tokens: &[u32]) {
        kv.cache_prefix(tokens);
    }

    /// Generates from a sequence whose KV holds the prompt and whose next-token logits are
    /// `logits` (after a prefill here, or an import from another process).
    pub fn continue_generation(
        &self,
        kv: SequenceKv,
        logits: Tensor,
        params: &SamplingParams,
        on_token: &mut impl FnMut(&TokenOutput),
    ) -> Result<Generation> {
        let mut sampler = Sampler::for_sequence(params, &[], &self.tokenizer)?;
        let first = sampler.sample(&logits)?;
        self.decode_loop(kv, first, sampler, params, on_token)
    }

    /// Generates after `first_token`, which was sampled elsewhere (by a prefill worker) from
    /// the logits after the prompt whose KV `kv` holds. Later tokens use a sampler seeded with
    /// `params.seed` from here on.
    pub fn decode_from(
        &self,
        kv: SequenceKv,
        first_token: u32,
        params: &SamplingParams,
        on_token: &mut impl FnMut(&TokenOutput),
    ) -> Result<Generation> {
        let mut sampler = Sampler::for_sequence(params, &[], &self.tokenizer)?;
        sampler.accept(first_token)?;
        self.decode_loop(kv, first_token, sampler, params, on_token)
    }

    fn decode_loop(
        &self,
        mut kv: SequenceKv,
        mut token: u32,
        mut sampler: Sampler,
        params: &SamplingParams,
        on_token: &mut impl FnMut(&TokenOutput),
    ) -> Result<Generation> {
        let mut tracker = OutputTracker::new(params.clone(), &self.tokenizer);
        loop {
            let out = tracker.push(token, &self.tokenizer)?;
            on_token(&out);
            if let Some(finish) = out.finish {
                return Ok(Generation {
                    tokens: tracker.generated().to_vec(),
                    text: tracker.text().to_string(),
                    finish,
                    kv,
                });
            }
            let logits =
                self.forward(&mut [BatchSeq { tokens: &[token], kv: &mut kv, want_logits: true }])?.squeeze(0)?;
            token = sampler.sample(&logits)?;
        }
    }

    /// A sequence with blocks for `tokens` tokens taken up front (so its block ids are known
    /// before the prefill, e.g. to ship its KV layer by layer).
    pub fn sequence_with_capacity(&self, tokens: usize) -> Result<SequenceKv> {
        Ok(SequenceKv::new(self.blocks.allocate(self.blocks.blocks_for(tokens))?))
    }

    /// Another sequence over `kv`'s first `valid` positions (its full blocks shared, a partly
    /// filled one copied) growing into `growth`: one of `n` answers sampled from one prompt.
    /// `growth` must hold the fork's positions from `valid`'s block on.
    pub fn fork_sequence(&self, kv: &SequenceKv, valid: usize, growth: BlockAllocation) -> Result<SequenceKv> {
        kv.fork(&self.cache, valid, growth)
    }

    /// `kv`'s K/V for `layers` as bytes.
    pub fn export_kv(&self, kv: &SequenceKv, layers: Range<usize>, dtype: WireDType) -> Result<Vec<u8>> {
        export::export_kv(&self.model, &self.cache, kv, layers, dtype)
    }

    /// A new sequence holding the KV in `bytes` (all layers).
    pub fn import_kv(&self, bytes: &[u8]) -> Result<SequenceKv> {
        export::import_kv(&self.model, &self.cache, &self.blocks, bytes)
    }
}
