//! The statistics of every report (docs/design.md's definitions): nearest-rank percentiles,
//! inter-token latency pooled over all gaps of all streams, TPOT per request, goodput
//! against a class's SLOs.

use serde::Serialize;

pub use pd_telemetry::percentile;

/// Count, p50/p95/p99 and max of a sample.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Summary {
    pub count: usize,
    pub p50: Option<f64>,
    pub p95: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Summary {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        Summary {
            count: v.len(),
            p50: percentile(&v, 0.50),
            p95: percentile(&v, 0.95),
            p99: percentile(&v, 0.99),
            max: v.last().copied(),
        }
    }
}

/// One request as the client saw it (times in ms from the run's start).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct RequestSample {
    pub class: String,
    pub input_tokens: usize,
    pub requested_output_tokens: usize,
    /// Request sent.
    pub sent_ms: f64,
    /// Arrival of every token (the first one's arrival - sent = TTFT).
    pub token_ms: Vec<f64>,
    /// The response's end (last byte), if it ended.
    pub end_ms: Option<f64>,
    /// `usage.completion_tokens` when the server reported it.
    pub reported_output_tokens: Option<usize>,
    pub error: Option<String>,
    /// HTTP status of a refused request (429: over capacity, 503: no worker).
    #[serde(default)]
    pub status: Option<u16>,
    /// Its `Retry-After` header, in seconds.
    #[serde(default)]
    pub retry_after_s: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` when the server reported it: prompt tokens
    /// a prefix cache served (> 0: a warm request).
    #[serde(default)]
    pub cached_tokens: Option<usize>,
    /// 0 for a request's first sending, n for its n-th retry after a 429 (closed-loop clients
    /// retry the same request after its Retry-After): capacity plans count demand from the
    /// first sendings only.
    #[serde(default)]
    pub attempt: u32,
}

impl RequestSample {
    /// True when a prefix cache served part of the prompt.
    pub fn warm(&self) -> bool {
        self.cached_tokens.is_some_and(|c| c > 0)
    }

    /// True when the server refused the request as over capacity (429).
    pub fn rejected(&self) -> bool {
        self.status == Some(429)
    }

    pub fn ok(&self) -> bool {
        self.error.is_none() && !self.token_ms.is_empty()
    }

    pub fn output_tokens(&self) -> usize {
        self.token_ms.len()
    }

    pub fn ttft_ms(&self) -> Option<f64> {
        self.token_ms.first().map(|t| t - self.sent_ms)
    }

    /// Gaps between consecutive tokens.
    pub fn gaps_ms(&self) -> impl Iterator<Item = f64> + '_ {
        self.token_ms.windows(2).map(|w| w[1] - w[0])
    }

    /// Request sent to last token.
    pub fn e2e_ms(&self) -> Option<f64> {
        self.token_ms.last().map(|t| t - self.sent_ms)
    }

    /// (e2e - TTFT) / (output_tokens - 1); none for a single token.
    pub fn tpot_ms(&self) -> Option<f64> {
        let n = self.token_ms.len();
        (n >= 2).then(|| (self.token_ms[n - 1] - self.token_ms[0]) / (n - 1) as f64)
    }
}

/// A class's service-level objectives (p95 targets, per request: a request meets its SLO
/// when its TTFT and its own ITL p95 are within them).
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize, PartialEq, Default)]
pub struct Slo {
    pub ttft_p95_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
}

impl Slo {
    /// Whether `r` succeeded and meets every objective.
    pub fn met_by(&self, r: &RequestSample) -> bool {
        if !r.ok() {
            return false;
        }
        let ttft_ok = match (self.ttft_p95_ms, r.ttft_ms()) {
            (Some(limit), Some(t)) => t <= limit,
            _ => true,
        };
        let itl_ok = match self.itl_p95_ms {
            Some(limit) => {
                let mut gaps: Vec<f64> = r.gaps_ms().collect();
                gaps.sort_by(f64::total_cmp);
                percentile(&gaps, 0.95).is_none_or(|p| p <= limit)
            }
            None => true,
        };
        ttft_ok && itl_ok
    }
}

/// Everything a report row says about a group of requests.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GroupStats {
    pub requests: usize,
    pub errors: usize,
    /// Errors that were 429 refusals (admission control), and how long the slowest took.
    pub rejected: usize,
    pub rejected_latency_ms_max: Option<f64>,
    pub error_rate: f64,
    pub ttft_ms: Summary,
    /// All gaps of all streams pooled.
    pub itl_ms: Summary,
    pub tpot_ms: Summary,
    pub e2e_ms: Summary,
    /// Requests per second that met every SLO of their class.
    pub goodput_rps: f64,
    pub output_tokens: usize,
    pub output_tokens_per_s: f64,
    /// Prompt tokens served from a prefix cache / prompt tokens, over answered requests.
    pub cached_fraction: f64,
}

impl GroupStats {
    /// Statistics of `requests` over a run of `duration_s` seconds, against `slo`.
    pub fn of(requests: &[&RequestSample], duration_s: f64, slo: &Slo) -> Self {
        let ok: Vec<&&RequestSample> = requests.iter().filter(|r| r.ok()).collect();
        let errors = requests.len() - ok.len();
        let output_tokens: usize = requests.iter().map(|r| r.output_tokens()).sum();
        let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
        GroupStats {
            requests: requests.len(),
            errors,
            rejected: requests.iter().filter(|r| r.rejected()).count(),
            rejected_latency_ms_max: requests
                .iter()
                .filter(|r| r.rejected())
                .filter_map(|r| r.end_ms.map(|e| e - r.sent_ms))
                .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x)))),
            error_rate: if requests.is_empty() { 0.0 } else { errors as f64 / requests.len() as f64 },
            ttft_ms: Summary::of(ok.iter().filter_map(|r| r.ttft_ms())),
            itl_ms: Summary::of(ok.iter().flat_map(|r| r.gaps_ms())),
            tpot_ms: Summary::of(ok.iter().filter_map(|r| r.tpot_ms())),
            e2e_ms: Summary::of(ok.iter().filter_map(|r| r.e2e_ms())),
            goodput_rps: per_s(requests.iter().filter(|r| slo.met_by(r)).count() as f64),
            output_tokens,
            output_tokens_per_s: per_s(output_tokens as f64),
            cached_fraction: {
                let input: usize = ok.iter().map(|r| r.input_tokens).sum();
                let cached: usize = ok.iter().filter_map(|r| r.cached_tokens).sum();
                if input > 0 {
                    cached as f64 / input as f64
                } else {
                    0.0
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(sent: f64, tokens: &[f64]) -> RequestSample {
        RequestSample {
            attempt: 0,
            cached_tokens: None,
            class: "c".into(),
            input_tokens: 10,
            requested_output_tokens: tokens.len(),
            sent_ms: sent,
            token_ms: tokens.to_vec(),
            end_ms: tokens.last().copied(),
            reported_output_tokens: None,
            error: None,
            status: None,
            retry_after_s: None,
        }
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(10.0));
        assert_eq!(percentile(&v, 0.95), Some(19.0));
        assert_eq!(percentile(&v, 0.99), Some(20.0));
        assert_eq!(percentile(&[3.0], 0.5), Some(3.0));
        assert_eq!(percentile(&[], 0.5), None);
        let s = Summary::of([5.0, 1.0, 3.0, f64::NAN]);
        assert_eq!((s.count, s.p50, s.max), (3, Some(3.0), Some(5.0)));
    }

    #[test]
    fn itl_pools_every_gap_and_tpot_is_per_request() {
        // Request a: tokens at 100, 110, 130 -> gaps 10, 20; TPOT (130-100)/2 = 15.
        // Request b: tokens at 50, 90 -> gap 40; TPOT 40.
        let a = sample(0.0, &[100.0, 110.0, 130.0]);
        let b = sample(20.0, &[50.0, 90.0]);
        let g = GroupStats::of(&[&a, &b], 2.0, &Slo::default());
        assert_eq!(g.itl_ms.count, 3, "all gaps pooled");
        assert_eq!(g.itl_ms.p50, Some(20.0));
        assert_eq!(g.itl_ms.max, Some(40.0));
        assert_eq!(g.tpot_ms.count, 2);
        assert_eq!((g.tpot_ms.p50, g.tpot_ms.max), (Some(15.0), Some(40.0)));
        assert_eq!(g.ttft_ms.p50, Some(30.0)); // a: 100, b: 30
        assert_eq!(g.e2e_ms.max, Some(130.0));
        assert_eq!(g.output_tokens, 5);
        assert_eq!(g.output_tokens_per_s, 2.5);
        assert_eq!(sample(0.0, &[7.0]).tpot_ms(), None);
    }

    #[test]
    fn goodput_counts_requests_meeting_every_slo() {
        let fast = sample(0.0, &[100.0, 110.0, 120.0]);
        let slow_start = sample(0.0, &[900.0, 910.0]);
        let stall = sample(0.0, &[100.0, 600.0]);
        let mut failed = sample(0.0, &[]);
        failed.error = Some("503".into());
        let slo = Slo { ttft_p95_ms: Some(500.0), itl_p95_ms: Some(100.0) };
        assert!(slo.met_by(&fast));
        assert!(!slo.met_by(&slow_start));
        assert!(!slo.met_by(&stall));
        assert!(!slo.met_by(&failed));
        let g = GroupStats::of(&[&fast, &slow_start, &stall, &failed], 4.0, &slo);
        assert_eq!(g.goodput_rps, 0.25);
        assert_eq!((g.errors, g.error_rate), (1, 0.25));
        assert_eq!(g.ttft_ms.count, 3, "failed requests have no latency");
    }
}
