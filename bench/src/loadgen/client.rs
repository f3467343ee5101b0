//! One streaming completion request against an OpenAI-compatible server, read as it arrives
//! (no client-side backpressure): the arrival time of every token, the end, the error.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use crate::loadgen::stats::RequestSample;

/// Where and what to ask.
#[derive(Debug, Clone)]
pub struct Target {
    pub url: String,
    pub model: String,
    pub timeout: Duration,
}

/// Sends `prompt` (of `input_tokens` tokens) asking for exactly `output_tokens` tokens
/// (`ignore_eos`); `class` is (the class it is reported under, the `x-pd-class` it is sent
/// as); times are ms since `origin`.
#[allow(clippy::too_many_arguments)] // one request's fields, at the load generator's call sites
pub async fn send(
    client: &reqwest::Client,
    target: &Target,
    origin: Instant,
    (class, header): (&str, &str),
    prompt: String,
    input_tokens: usize,
    output_tokens: usize,
) -> RequestSample {
    let ms = |t: Instant| (t - origin).as_secs_f64() * 1e3;
    let mut sample = RequestSample {
        class: class.to_string(),
        input_tokens,
        requested_output_tokens: output_tokens,
        sent_ms: ms(Instant::now()),
        token_ms: Vec::new(),
        end_ms: None,
        reported_output_tokens: None,
        error: None,
        status: None,
        retry_after_s: None,
        cached_tokens: None,
        attempt: 0,
    };
    let body = json!({
        "model": target.model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": { "include_usage": true },
    });
    let request = client
        .post(format!("{}/v1/completions", target.url.trim_end_matches('/')))
        .header("x-pd-class", header)
        .timeout(target.timeout)
        .json(&body);
    let response = match request.send().await {
        Ok(r) => r,
        Err(e) => {
            sample.error = Some(format!("sending: {e}"));
            return sample;
        }
    };
    if !response.status().is_success() {
        let status = response.status();
        sample.status = Some(status.as_u16());
        sample.retry_after_s =
            response.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        sample.end_ms = Some(ms(Instant::now()));
        let text = response.text().await.unwrap_or_default();
        sample.error = Some(format!("HTTP {status}: {}", text.chars().take(200).collect::<String>()));
        return sample;
    }
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                sample.error = Some(format!("reading the stream: {e}"));
                return sample;
            }
        };
        let now = ms(Instant::now());
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let mut is_error = false;
            for line in event.lines() {
                if line == "event: error" {
                    is_error = true;
                } else if let Some(data) = line.strip_prefix("data: ") {
                    if data == "[DONE]" {
                        done = true;
                    } else if is_error {
                        sample.error = Some(format!("error event: {data}"));
                    } else if let Ok(v) = serde_json::from_str::<Value>(data) {
                        if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
                            sample.reported_output_tokens = Some(u as usize);
                            sample.cached_tokens = Some(
                                v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize,
                            );
                        }
                        let choice = &v["choices"][0];
                        if choice.is_object() && choice["finish_reason"].is_null() {
                            sample.token_ms.push(now);
                        }
                    }
                }
            }
        }
    }
    sample.end_ms = Some(ms(Instant::now()));
    if sample.error.is_none() && !done {
        sample.error = Some("the stream ended without [DONE]".into());
    }
    sample
}
