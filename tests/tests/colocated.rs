//! Colocated serving and conditional disaggregation, on the real processes: the decode
//! worker prefills prompts in its own batch (chunked across steps, or whole in one step) and
//! gives the engine's greedy answer either way; with a prefill pool and
//! `--local-prefill-max-tokens` (and no minimum prefill wait), short prompts stay on the
//! decode worker and long ones go to the prefill worker, each decision counted with its
//! reason in `pd_route_decisions_total`.

use pd_engine::{CacheConfig, ChatMessage, Engine, LoadOptions, SamplingParams};
use pd_tests::{model_path, Cluster, Options};
use serde_json::{json, Value};

const QUESTIONS: [&str; 3] = [
    "What is the capital of France?",
    "Name three primary colors.",
    // Long enough for several 16-token chunks and more than one KV block.
    "Summarize in one sentence: the lighthouse keeper climbed the stairs every evening, lit the lamp, wrote the weather in his log, and watched the ships pass until dawn, year after year, until the day the lamp was replaced by an automatic beacon.",
];

async fn chat(cluster: &Cluster, question: &str) -> (String, Value) {
    let body = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{ "role": "user", "content": question }],
        "max_tokens": 24,
        "temperature": 0,
    });
    let r = reqwest::Client::new().post(cluster.url("/v1/chat/completions")).json(&body).send().await.expect("request");
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.expect("json");
    (v["choices"][0]["message"]["content"].as_str().expect("content").to_string(), v)
}

fn engine_answer(engine: &Engine, question: &str) -> String {
    let template = engine.chat_template().expect("chat template");
    let prompt = template.render(&[ChatMessage::new("user", question)], true).expect("render");
    let tokens = engine.tokenizer().encode(&prompt).expect("encode");
    let params = SamplingParams::greedy(24);
    engine.generate(&tokens, &params, 512, |_| {}).expect("generate").text
}

async fn colocated_matches_engine(policy: &str) {
    let options =
        Options { prefill: 0, decode_args: vec!["--prefill-policy".into(), policy.into()], ..Options::default() };
    let cluster = Cluster::start_with(options).await;
    let engine = Engine::load(&model_path(), LoadOptions::default(), CacheConfig::with_blocks(64)).expect("engine");
    for q in QUESTIONS {
        let (answer, _) = chat(&cluster, q).await;
        assert_eq!(answer, engine_answer(&engine, q), "{policy}: {q}");
    }
    // Concurrent prompts share steps with each other's decodes; all complete.
    let tasks: Vec<_> = QUESTIONS
        .iter()
        .cycle()
        .take(6)
        .map(|q| {
            let url = cluster.url("/v1/chat/completions");
            let body = json!({ "messages": [{ "role": "user", "content": q }], "max_tokens": 16, "temperature": 0 });
            tokio::spawn(
                async move { reqwest::Client::new().post(url).json(&body).send().await.expect("request").status() },
            )
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.expect("task").as_u16(), 200, "{policy}");
    }
    cluster.wait_kv_free(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_chunked_prefill_gives_the_engines_answers() {
    colocated_matches_engine("chunked:16").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_naive_prefill_gives_the_engines_answers() {
    colocated_matches_engine("naive").await;
}

async fn kv_bytes_sent(cluster: &Cluster) -> f64 {
    let text = Cluster::scrape(&cluster.prefill_metrics[0]).await;
    text.lines()
        .find_map(|l| l.strip_prefix("pd_kv_transfer_bytes_total "))
        .and_then(|v| v.parse().ok())
        .expect("counter")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_stay_on_the_decode_worker() {
    let options = Options {
        prefill: 1,
        router_args: ["--local-prefill-max-tokens", "45", "--local-prefill-min-wait-ms", "0"]
            .map(String::from)
            .to_vec(),
        ..Options::default()
    };
    let cluster = Cluster::start_with(options).await;
    let (_, short) = chat(&cluster, QUESTIONS[0]).await;
    assert!(short["usage"]["prompt_tokens"].as_u64().expect("tokens") <= 45);
    assert_eq!(kv_bytes_sent(&cluster).await, 0.0, "a short prompt is prefilled on the decode worker");
    let (answer, long) = chat(&cluster, QUESTIONS[2]).await;
    assert!(long["usage"]["prompt_tokens"].as_u64().expect("tokens") > 45);
    assert!(kv_bytes_sent(&cluster).await > 0.0, "a long prompt goes to the prefill worker");
    let engine = Engine::load(&model_path(), LoadOptions::default(), CacheConfig::with_blocks(64)).expect("engine");
    assert_eq!(answer, engine_answer(&engine, QUESTIONS[2]));
    // Each decision is counted with its reason.
    let metrics = reqwest::get(cluster.url("/metrics")).await.expect("metrics").text().await.expect("text");
    for line in [
        "pd_route_decisions_total{reason=\"short_prompt_prefill_busy\",where=\"local\"} 1",
        "pd_route_decisions_total{reason=\"long_prompt\",where=\"remote\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
}
