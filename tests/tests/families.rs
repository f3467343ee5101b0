//! Each model family through the real cluster: router, one prefill and one decode worker
//! serving a tiny transformers checkpoint (engine/tests/data/families, made by
//! scripts/reference/families.py), the prompt as token ids over HTTP. The first token comes
//! from the prefill worker, the rest from the decode worker after the KV hand-off (KV
//! geometries differ per family: Qwen3's heads are twice as wide as hidden / heads); the 32
//! greedy tokens must be transformers' and each token's logprob within 0.02 of transformers'
//! log-softmax (the KV crosses the wire as f16).

use std::path::{Path, PathBuf};

use pd_tests::{Cluster, Options};
use serde_json::{json, Value};

struct Reference {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

impl Reference {
    fn read(dir: &Path) -> Reference {
        let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
        let v: Value = serde_json::from_str(&text).expect("reference parses");
        let ids = |key: &str| -> Vec<u32> {
            v[key].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
        };
        let rows = v["logits"].as_array().expect("logits");
        let logits = rows
            .iter()
            .map(|r| r.as_array().expect("row").iter().map(|x| x.as_f64().expect("logit") as f32).collect())
            .collect();
        Reference { prompt: ids("prompt"), greedy: ids("greedy"), logits }
    }
}

fn log_softmax_at(row: &[f32], token: u32) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|x| (x - max).exp()).sum();
    row[token as usize] - max - sum.ln()
}

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/data/families");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("reference.json").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 15, "family fixtures: {dirs:?}");
    dirs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_family_answers_with_transformers_tokens_across_the_kv_handoff() {
    for dir in fixtures() {
        let name = dir.file_name().expect("name").to_string_lossy().to_string();
        let reference = Reference::read(&dir);
        let cluster = Cluster::start_with(Options { prefill: 1, model: Some(dir.clone()), ..Options::default() }).await;
        let body = json!({
            "prompt": reference.prompt, "max_tokens": reference.greedy.len(), "temperature": 0,
            "ignore_eos": true, "logprobs": 1,
        });
        let r = reqwest::Client::new().post(cluster.url("/v1/completions")).json(&body).send().await.expect("request");
        let status = r.status().as_u16();
        let v: Value = r.json().await.expect("json");
        assert_eq!(status, 200, "{name}: {v}");
        let text = v["choices"][0]["text"].as_str().expect("text");
        let tokens: Vec<u32> = text
            .split_whitespace()
            .map(|t| t.strip_prefix('t').and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{name}: token {t}")))
            .collect();
        assert_eq!(tokens, reference.greedy, "{name}: greedy tokens through the cluster");
        let logprobs = v["choices"][0]["logprobs"]["token_logprobs"].as_array().expect("token_logprobs");
        assert_eq!(logprobs.len(), reference.greedy.len(), "{name}: one logprob per token");
        let mut worst = 0f32;
        for (step, (lp, &token)) in logprobs.iter().zip(&reference.greedy).enumerate() {
            let theirs = log_softmax_at(&reference.logits[reference.prompt.len() - 1 + step], token);
            worst = worst.max((lp.as_f64().expect("logprob") as f32 - theirs).abs());
        }
        println!("{name}: 32 greedy tokens equal, max |logprob - transformers| {worst:.4}");
        assert!(worst < 0.02, "{name}: logprobs differ from transformers' by {worst}");
        let usage = &v["usage"];
        assert_eq!(usage["prompt_tokens"].as_u64(), Some(reference.prompt.len() as u64), "{name}: {usage}");
    }
}
