//! Request-parallel prefill on the real processes: a short prompt that arrives while a long
//! document is being prefilled stops the document's step (preemption, counted in
//! `pd_preemptions_total`) or runs in the next one, so it is answered about as fast as on a
//! quiet cluster (within a few steps), long before the document; prompts that do not fit the
//! prefill worker's blocks wait instead of failing.

use std::time::{Duration, Instant};

use pd_tests::{Cluster, Options};
use serde_json::json;

async fn metric(addr: &str, name: &str) -> f64 {
    let text = Cluster::scrape(addr).await;
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} ")).and_then(|v| v.parse().ok())).unwrap_or(0.0)
}

/// Response time of a short completion (2 tokens).
async fn short_request(url: &str) -> Duration {
    let body = json!({ "model": "SmolLM2-135M-Instruct", "prompt": "Hello, my name is", "max_tokens": 2 });
    let asked = Instant::now();
    let r = reqwest::Client::new().post(url).json(&body).send().await.expect("short request");
    assert_eq!(r.status().as_u16(), 200);
    asked.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_prompt_during_a_document_prefill_is_answered_within_a_few_steps_of_quiet() {
    const STEP_MS: u64 = 100;
    let prefill_args = vec!["--step-target-ms".into(), STEP_MS.to_string()];
    let cluster = Cluster::start_with(Options { prefill: 1, prefill_args, ..Options::default() }).await;
    let url = cluster.url("/v1/completions");
    let mut quiet = Duration::ZERO;
    for _ in 0..3 {
        quiet = quiet.max(short_request(&url).await);
    }
    let document = "The lighthouse keeper wrote in his log every night. ".repeat(150);
    let long = tokio::spawn({
        let url = url.clone();
        async move {
            let body = json!({ "model": "SmolLM2-135M-Instruct", "prompt": document, "max_tokens": 2 });
            let r =
                reqwest::Client::new().post(&url).header("x-pd-class", "batch").json(&body).send().await.expect("long");
            (r.status().as_u16(), Instant::now())
        }
    });
    let metrics = cluster.prefill_metrics[0].clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&metrics, "pd_waiting_prefill_tokens").await < 1000.0 {
        assert!(Instant::now() < deadline, "the long prefill never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // well into the document
    let during = short_request(&url).await;
    let short_done = Instant::now();
    assert!(!long.is_finished(), "the short prompt is answered while the document is still in prefill");
    // One step to wait for, the short prompt's own steps now shared with the document's
    // chunk, and noise on a shared machine: a few steps, not the document's seconds.
    let allowed = quiet + Duration::from_millis(6 * STEP_MS);
    assert!(during <= allowed, "short request during the document {during:?}, quiet {quiet:?}");
    // A short prompt arriving in the first three quarters of one of the document's steps
    // stops it between layers; one arriving later waits for the step. A few more questions
    // while the document lasts, until one was caught mid-step.
    for _ in 0..5 {
        if metric(&metrics, "pd_preemptions_total").await >= 1.0 || long.is_finished() {
            break;
        }
        short_request(&url).await;
    }
    assert!(metric(&metrics, "pd_preemptions_total").await >= 1.0, "no document step was preempted");
    assert!(metric(&metrics, "pd_preempted_compute_seconds_total").await > 0.0);
    let (status, long_done) = long.await.expect("task");
    assert_eq!(status, 200, "the document completes too");
    assert!(short_done < long_done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_wait_for_prefill_kv_blocks_instead_of_failing() {
    // 48 blocks of 16 tokens: room for one ~500-token prompt at a time, not two. Sent as
    // batch work: two at once would already exceed the interactive class's TTFT SLO.
    let options = Options { prefill: 1, prefill_args: vec!["--kv-blocks".into(), "48".into()], ..Options::default() };
    let cluster = Cluster::start_with(options).await;
    let url = cluster.url("/v1/completions");
    let prompt = "The lighthouse keeper wrote in his log every night. ".repeat(45);
    let requests: Vec<_> = (0..2)
        .map(|_| {
            let (url, prompt) = (url.clone(), prompt.clone());
            tokio::spawn(async move {
                let body = json!({ "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 2 });
                let client = reqwest::Client::new();
                let r = client.post(&url).header("x-pd-class", "batch").json(&body).send().await.expect("request");
                let status = r.status().as_u16();
                (status, r.text().await.unwrap_or_default())
            })
        })
        .collect();
    for r in requests {
        let (status, body) = r.await.expect("task");
        assert_eq!(status, 200, "both prompts are served, one after the other: {body}");
        assert!(body.contains("\"prompt_tokens\":"), "{body}");
    }
    assert_eq!(metric(&cluster.prefill_metrics[0], "pd_waiting_prefill_tokens").await, 0.0);
}

/// A document sent without a class (so in the interactive class, whose 1.5 s TTFT SLO its
/// own prefill alone exceeds here) while three interactive streams run, far below capacity:
/// served, every time, also two at once (the second waits for the first: long prompts are
/// prefilled one per prefill worker at a time), and the streams are not disturbed into
/// failing. Admission refuses only overload, not a prompt for its own length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_without_a_class_at_light_load_is_served() {
    // The shipped classes: what a long prompt is (against the tightest TTFT SLO) and when
    // admission refuses are under test.
    let cluster = Cluster::start_with(Options { prefill: 1, builtin_classes: true, ..Options::default() }).await;
    let chat = cluster.url("/v1/chat/completions");
    let completions = cluster.url("/v1/completions");
    let streams: Vec<_> = (0..3)
        .map(|i| {
            let url = chat.clone();
            tokio::spawn(async move {
                let body = json!({
                    "messages": [{"role": "user", "content": format!("Tell story number {i} about a lighthouse.")}],
                    "max_tokens": 96, "ignore_eos": true, "stream": true,
                });
                let r = reqwest::Client::new().post(&url).json(&body).send().await.expect("stream");
                let status = r.status().as_u16();
                let text = r.text().await.expect("body");
                (status, text.contains("[DONE]") && !text.contains("event: error"))
            })
        })
        .collect();
    let document =
        |n: usize| format!("Document {n}. ") + &"The lighthouse keeper wrote in his log every night. ".repeat(140);
    let send = |url: String, prompt: String| async move {
        let body = json!({ "prompt": prompt, "max_tokens": 4 });
        let r = reqwest::Client::new().post(&url).json(&body).send().await.expect("document");
        let status = r.status().as_u16();
        (status, r.text().await.unwrap_or_default())
    };
    tokio::time::sleep(Duration::from_millis(300)).await; // the streams are decoding
    for n in 0..2 {
        let (status, body) = send(completions.clone(), document(n)).await;
        assert_eq!(status, 200, "document {n} alone: {body}");
    }
    let (a, b) = tokio::join!(send(completions.clone(), document(10)), send(completions.clone(), document(11)));
    assert_eq!((a.0, b.0), (200, 200), "two documents at once: {} / {}", a.1, b.1);
    for s in streams {
        assert_eq!(s.await.expect("task"), (200, true), "an interactive stream");
    }
    cluster.wait_kv_free(Duration::from_secs(5)).await;
}
