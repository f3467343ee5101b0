//! Test helpers: a tiny random-weight Llama built in memory, written as a Hugging Face folder
//! or a GGUF file, and the path of the real model.
#![allow(dead_code)] // each test binary uses its own subset

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use pd_engine::loader::{RawTensor, TensorSource};
use pd_engine::{ModelConfig, RopeStyle};

pub fn tiny_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 48,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        max_position: 96,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        rope_style: RopeStyle::Halves,
        rope_scaling: Default::default(),
        parts: Default::default(),
    }
}

/// Random weights under GGUF names, seeded by candle's RNG via a fixed-content generator.
pub fn tiny_weights(config: &ModelConfig, seed: u64) -> HashMap<String, Tensor> {
    let dev = Device::Cpu;
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut rand = |shape: &[usize], scale: f32| {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 2.0 * scale
            })
            .collect();
        Tensor::from_vec(values, shape, &dev).expect("tensor")
    };
    let c = config;
    let (h, q, kv, f) = (c.hidden_size, c.num_heads * c.head_dim, c.kv_width(), c.intermediate_size);
    let mut w = HashMap::new();
    w.insert("token_embd.weight".to_string(), rand(&[c.vocab_size, h], 1.0));
    w.insert("output_norm.weight".to_string(), (rand(&[h], 0.1) + 1.0).expect("norm"));
    w.insert("output.weight".to_string(), rand(&[c.vocab_size, h], 0.3));
    for i in 0..c.num_layers {
        let mut put = |name: &str, t: Tensor| w.insert(format!("blk.{i}.{name}.weight"), t);
        put("attn_norm", (rand(&[h], 0.1) + 1.0).expect("norm"));
        put("attn_q", rand(&[q, h], 0.3));
        put("attn_k", rand(&[kv, h], 0.3));
        put("attn_v", rand(&[kv, h], 0.3));
        put("attn_output", rand(&[h, q], 0.3));
        put("ffn_norm", (rand(&[h], 0.1) + 1.0).expect("norm"));
        put("ffn_gate", rand(&[f, h], 0.3));
        put("ffn_up", rand(&[f, h], 0.3));
        put("ffn_down", rand(&[h, f], 0.3));
    }
    w
}

/// Serves tensors from a map.
pub struct MapSource(pub HashMap<String, Tensor>);

impl TensorSource for MapSource {
    fn take(&mut self, name: &str) -> pd_engine::Result<Option<RawTensor>> {
        Ok(self.0.remove(name).map(RawTensor::Dense))
    }

    fn contains(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// Hugging Face name of a GGUF tensor name (test-side copy of the mapping).
fn hf_name(gguf: &str) -> String {
    let fixed = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ];
    if let Some((_, hf)) = fixed.iter().find(|(g, _)| *g == gguf) {
        return hf.to_string();
    }
    let rest = gguf.strip_prefix("blk.").expect("layer tensor");
    let (layer, part) = rest.split_once('.').expect("layer.part");
    let part = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        other => panic!("unknown part {other}"),
    };
    format!("model.layers.{layer}.{part}")
}

/// A tokenizer over 64 single-character tokens ("a".."z", "A".."Z", digits, space, ...).
pub fn tiny_tokenizer() -> tokenizers::Tokenizer {
    pd_engine::Tokenizer::characters().expect("character tokenizer").inner().clone()
}

/// Writes the tiny model as a Hugging Face folder.
pub fn write_hf_folder(dir: &Path, config: &ModelConfig, weights: &HashMap<String, Tensor>) {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "max_position_embeddings": config.max_position,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "bos_token_id": 62,
        "eos_token_id": 63,
    });
    std::fs::write(dir.join("config.json"), json.to_string()).expect("config.json");
    let tensors: HashMap<String, Tensor> = weights.iter().map(|(k, v)| (hf_name(k), v.clone())).collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("safetensors");
    tiny_tokenizer().save(dir.join("tokenizer.json"), false).expect("tokenizer.json");
    let template = serde_json::json!({
        "chat_template": "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"
    });
    std::fs::write(dir.join("tokenizer_config.json"), template.to_string()).expect("tokenizer_config.json");
}

/// Writes the tiny model as a GGUF file with `metadata_overrides` applied and the tensors
/// named in `skip` left out.
pub fn write_gguf(
    path: &Path,
    config: &ModelConfig,
    weights: &HashMap<String, Tensor>,
    architecture: &str,
    skip: &[&str],
) {
    let tokenizer = tiny_tokenizer();
    let tokens: Vec<Value> =
        (0..config.vocab_size as u32).map(|i| Value::String(tokenizer.id_to_token(i).expect("token"))).collect();
    let arch = architecture;
    let metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.embedding_length"), Value::U32(config.hidden_size as u32)),
        (format!("{arch}.feed_forward_length"), Value::U32(config.intermediate_size as u32)),
        (format!("{arch}.block_count"), Value::U32(config.num_layers as u32)),
        (format!("{arch}.attention.head_count"), Value::U32(config.num_heads as u32)),
        (format!("{arch}.attention.head_count_kv"), Value::U32(config.num_kv_heads as u32)),
        (format!("{arch}.context_length"), Value::U32(config.max_position as u32)),
        (format!("{arch}.rope.freq_base"), Value::F32(config.rope_theta)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(config.rms_norm_eps as f32)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(63)),
    ];
    let qtensors: Vec<(String, QTensor)> = weights
        .iter()
        .filter(|(name, _)| !skip.contains(&name.as_str()))
        .map(|(name, t)| (name.clone(), QTensor::quantize(t, GgmlDType::F32).expect("qtensor")))
        .collect();
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path).expect("create gguf");
    gguf_file::write(&mut file, &md, &ts).expect("write gguf");
}

/// The real model: `PD_MODEL`, else the file `scripts/fetch-model.sh` puts in models/.
pub fn real_model_path() -> PathBuf {
    let path = std::env::var_os("PD_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(path.is_file(), "real model not found at {}: run scripts/fetch-model.sh (or set PD_MODEL)", path.display());
    path
}

/// Deterministic token ids below the tiny vocabulary's 64.
pub fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + salt * 13 + 3) % 64).collect()
}

/// Largest absolute difference of two tensors, on any devices, as f32.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let host =
        |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(candle_core::DType::F32)).expect("to host f32");
    (host(a) - host(b))
        .expect("same shape")
        .abs()
        .expect("abs")
        .max_all()
        .expect("max")
        .to_scalar::<f32>()
        .expect("scalar")
}

/// Runs `chunks` one after another for one sequence; returns the logits after the last.
pub fn run_alone(
    model: &pd_engine::Model,
    cache: &pd_engine::KvCache,
    kv: &mut pd_engine::SequenceKv,
    chunks: &[&[u32]],
) -> Tensor {
    let mut last = None;
    for chunk in chunks {
        let out =
            model.forward(cache, &mut [pd_engine::BatchSeq { tokens: chunk, kv, want_logits: true }]).expect("forward");
        last = Some(out.squeeze(0).expect("row"));
    }
    last.expect("at least one chunk")
}

/// llama.cpp's tokenizer test cases beside a vocabulary file `path` (`<path>.inp`, `<path>.out`),
/// split as its tests/test-tokenizer-0.cpp splits them.
pub fn llama_cpp_vocab_cases(path: &Path) -> Vec<(String, Vec<u32>)> {
    let raw = std::fs::read_to_string(path.with_extension("gguf.inp")).expect(".inp");
    let out = std::fs::read_to_string(path.with_extension("gguf.out")).expect(".out");
    let sep = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < raw.len() {
        match raw[pos..].find(sep) {
            Some(next) => {
                inputs.push(raw[pos..pos + next].to_string());
                pos += next + sep.len();
            }
            None => {
                inputs.push(raw[pos..].to_string());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|t| t.parse().expect("an id")).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "as many inputs as outputs");
    inputs.into_iter().zip(outputs).collect()
}
