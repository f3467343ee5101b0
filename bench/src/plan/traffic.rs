//! A traffic description (JSON) instead of a load test: per class a request rate, prompt and
//! output lengths and SLOs, optionally a rate per window (a daily curve). It becomes the
//! requests a load test of that traffic would have sent (evenly spaced, first sendings), so
//! the plan is computed the same way either way.

use serde::Deserialize;

use crate::loadgen::stats::RequestSample;
use crate::plan::Targets;

/// One class of the described traffic.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficClass {
    pub name: String,
    /// Requests per second (every window), unless `rates_per_s` gives one per window.
    #[serde(default)]
    pub rate_per_s: f64,
    #[serde(default)]
    pub rates_per_s: Vec<f64>,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Prompt tokens a prefix cache serves (a shared system prompt), per request.
    #[serde(default)]
    pub cached_tokens: usize,
    pub ttft_slo_ms: f64,
    pub itl_slo_ms: f64,
}

/// The whole description.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Traffic {
    /// Length of one window (and of the run when no class gives per-window rates).
    pub window_s: f64,
    pub classes: Vec<TrafficClass>,
}

impl Traffic {
    pub fn parse(text: &str) -> Result<Traffic, String> {
        let t: Traffic = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if !t.window_s.is_finite() || t.window_s <= 0.0 {
            return Err("window_s must be positive".into());
        }
        for c in &t.classes {
            let bad = |r: f64| !r.is_finite() || r < 0.0;
            if bad(c.rate_per_s) || c.rates_per_s.iter().any(|r| bad(*r)) {
                return Err(format!("class {}: rates must be >= 0", c.name));
            }
            if c.input_tokens == 0 || c.cached_tokens >= c.input_tokens {
                return Err(format!("class {}: input_tokens must be > 0 and > cached_tokens", c.name));
            }
        }
        Ok(t)
    }

    /// The SLO targets by class.
    pub fn targets(&self) -> Vec<(String, Targets)> {
        self.classes
            .iter()
            .map(|c| (c.name.clone(), Targets { ttft_ms: c.ttft_slo_ms, itl_ms: c.itl_slo_ms }))
            .collect()
    }

    /// Evenly spaced first sendings of every class over every window.
    pub fn samples(&self) -> Vec<RequestSample> {
        let windows = self.classes.iter().map(|c| c.rates_per_s.len()).max().unwrap_or(0).max(1);
        let mut out = Vec::new();
        for c in &self.classes {
            for w in 0..windows {
                let rate = c.rates_per_s.get(w).copied().unwrap_or(c.rate_per_s);
                let count = (rate * self.window_s).round() as usize;
                for k in 0..count {
                    let sent_s = w as f64 * self.window_s + (k as f64 + 0.5) * self.window_s / count as f64;
                    out.push(RequestSample {
                        class: c.name.clone(),
                        input_tokens: c.input_tokens,
                        requested_output_tokens: c.output_tokens,
                        sent_ms: sent_s * 1e3,
                        token_ms: Vec::new(),
                        end_ms: None,
                        reported_output_tokens: Some(c.output_tokens),
                        error: None,
                        status: None,
                        retry_after_s: None,
                        cached_tokens: Some(c.cached_tokens),
                        attempt: 0,
                    });
                }
            }
        }
        out
    }
}
