//! Typed errors of the engine. Each variant names the phase that failed, so callers (the
//! workers) can map them to an API status without parsing messages. Nothing in the engine
//! panics on bad input: model files, prompts, KV bytes and parameters all end up here.

use std::path::PathBuf;

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model file or folder could not be read from disk.
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The GGUF container is malformed or truncated.
    #[error("{path} is not a usable GGUF file: {reason}")]
    InvalidGguf { path: PathBuf, reason: String },
    /// The checkpoint is of an architecture the engine does not run.
    #[error("unsupported model architecture `{0}`: this engine runs llama, mistral, qwen2, qwen3, phi3 and gemma2")]
    UnsupportedArchitecture(String),
    /// A checkpoint setting that changes the model's math and that the engine does not
    /// implement (serving it anyway would give wrong tokens without an error).
    #[error("model setting `{field}` is not supported: {reason}")]
    UnsupportedSetting { field: String, reason: String },
    /// The checkpoint holds a tensor the architecture as configured does not use.
    #[error("tensor `{0}` is not used by the model as its config describes it (a setting pd does not read?)")]
    UnusedTensor(String),
    /// A hyperparameter is missing or has an unusable value.
    #[error("model metadata: {0}")]
    Metadata(String),
    /// A weight the architecture needs is not in the checkpoint.
    #[error("model is missing tensor `{0}`")]
    MissingTensor(String),
    /// A weight is present but has the wrong shape.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape { name: String, got: Vec<usize>, expected: Vec<usize> },
    /// A Hugging Face model folder is incomplete or inconsistent.
    #[error("model folder {path}: {reason}")]
    ModelFolder { path: PathBuf, reason: String },
    /// The tokenizer could not be built or failed on the input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be parsed or rendered.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A sequence would grow past the model's context length.
    #[error("sequence of {tokens} tokens exceeds the context length of {max} tokens")]
    ContextOverflow { tokens: usize, max: usize },
    /// The KV cache has fewer free blocks than the request needs.
    #[error("out of KV blocks: need {needed}, {free} free of {total}")]
    OutOfBlocks { needed: usize, free: usize, total: usize },
    /// KV bytes do not fit this model or this reservation.
    #[error("KV import refused: {0}")]
    KvImport(String),
    /// A forward batch is malformed (empty sequence, unknown blocks, ...).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// The caller stopped a forward between layers (`Model::forward_observed`): no sequence
    /// advanced, and the step can be run again as it was.
    #[error("the step was stopped by its caller after {layers} of its layers")]
    Preempted { layers: usize },
    /// Sampling parameters out of range.
    #[error("invalid sampling parameters: {0}")]
    InvalidSampling(String),

    /// An output constraint (JSON schema, regex, grammar) that does not compile, or a sequence
    /// the constraint cannot continue.
    #[error("output constraint: {0}")]
    Constraint(String),
    /// Engine settings out of range.
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// The CUDA device asked for cannot be opened (no GPU visible to the process, a driver
    /// older than the build's CUDA, an ordinal past the last device).
    #[error("cannot open CUDA device {ordinal}: {reason} (is a GPU visible to this process? nvidia-smi lists them; in a container the NVIDIA runtime must mount the driver and the device)")]
    Device { ordinal: usize, reason: String },
    /// A CUDA driver call or one of the engine's own kernels failed (feature `cuda`).
    #[error("CUDA {what}: {reason}")]
    Cuda { what: String, reason: String },
    /// The tensor library failed while computing.
    #[error("tensor computation failed: {0}")]
    Compute(#[from] candle_core::Error),
}

/// Result type of the engine.
pub type Result<T> = std::result::Result<T, EngineError>;
