//! Percentiles of runs too long to keep every sample: each class's TTFT and pooled
//! inter-token gaps in logarithmic buckets 0.5% wide (a percentile within 0.5% of the
//! nearest-rank one), counts of served, refused and failed requests, and output tokens.

use serde::Serialize;

use crate::loadgen::stats::RequestSample;

/// Bucket width as a ratio.
const RATIO: f64 = 1.005;
/// The smallest value told apart (ms); smaller ones count as it.
const FLOOR_MS: f64 = 1e-3;

/// A logarithmic histogram of milliseconds.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

impl Histogram {
    pub fn record(&mut self, ms: f64) {
        if !ms.is_finite() {
            return;
        }
        let i = ((ms.max(FLOOR_MS) / FLOOR_MS).ln() / RATIO.ln()) as usize;
        if i >= self.counts.len() {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += 1;
        self.total += 1;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// The nearest-rank `q` quantile, as its bucket's middle.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(FLOOR_MS * RATIO.powf(i as f64 + 0.5));
            }
        }
        None
    }
}

/// One class's tally.
#[derive(Debug, Clone, Default)]
pub struct ClassTally {
    pub name: String,
    pub served: u64,
    pub refused: u64,
    pub failed: u64,
    pub output_tokens: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
}

/// Every class's tally.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    pub classes: Vec<ClassTally>,
}

impl Tally {
    pub fn new(names: impl IntoIterator<Item = String>) -> Self {
        Tally { classes: names.into_iter().map(|name| ClassTally { name, ..ClassTally::default() }).collect() }
    }

    pub fn record(&mut self, s: &RequestSample) {
        let Some(c) = self.classes.iter_mut().find(|c| c.name == s.class) else { return };
        if s.rejected() {
            c.refused += 1;
        } else if !s.ok() {
            c.failed += 1;
        } else {
            c.served += 1;
            c.output_tokens += s.output_tokens() as u64;
            if let Some(t) = s.ttft_ms() {
                c.ttft.record(t);
            }
            for g in s.gaps_ms() {
                c.itl.record(g);
            }
        }
    }

    /// A markdown table: per class, requests by outcome, TTFT and ITL p50 / p95 / p99 (ms),
    /// output tokens/s over `duration_s`.
    pub fn markdown(&self, duration_s: f64) -> String {
        let q = |h: &Histogram, p: f64| h.quantile(p).map_or("-".into(), |v| format!("{v:.1}"));
        let mut md = String::from(
            "| class | served | refused | failed | TTFT p50 | p95 | p99 | ITL p50 | p95 | p99 | output tok/s |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for c in &self.classes {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} |\n",
                c.name,
                c.served,
                c.refused,
                c.failed,
                q(&c.ttft, 0.5),
                q(&c.ttft, 0.95),
                q(&c.ttft, 0.99),
                q(&c.itl, 0.5),
                q(&c.itl, 0.95),
                q(&c.itl, 0.99),
                c.output_tokens as f64 / duration_s.max(1e-9)
            ));
        }
        md
    }
}

/// One class's percentiles (ms) in one run, for `virtual.json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClassPercentiles {
    pub class: String,
    pub served: u64,
    pub refused: u64,
    pub failed: u64,
    /// TTFT p50, p95, p99.
    pub ttft: [Option<f64>; 3],
    /// Inter-token gaps p50, p95, p99.
    pub itl: [Option<f64>; 3],
}

const QUANTILES: [f64; 3] = [0.5, 0.95, 0.99];

impl Tally {
    pub fn percentiles(&self) -> Vec<ClassPercentiles> {
        self.classes
            .iter()
            .map(|c| ClassPercentiles {
                class: c.name.clone(),
                served: c.served,
                refused: c.refused,
                failed: c.failed,
                ttft: QUANTILES.map(|q| c.ttft.quantile(q)),
                itl: QUANTILES.map(|q| c.itl.quantile(q)),
            })
            .collect()
    }
}

/// The median, least and largest of `values` (None when there are none).
pub fn spread(mut values: Vec<f64>) -> Option<(f64, f64, f64)> {
    values.retain(|v| v.is_finite());
    values.sort_by(f64::total_cmp);
    let n = values.len();
    (n > 0).then(|| (values[(n - 1) / 2], values[0], values[n - 1]))
}

/// A markdown table of each class's percentiles over replicas of one run: the median
/// replica's value, then the least and largest.
pub fn spread_markdown(replicas: &[Vec<ClassPercentiles>]) -> String {
    let mut md = String::from(
        "| class | TTFT p50 | TTFT p95 | TTFT p99 | ITL p50 | ITL p95 | ITL p99 |\n|---|---|---|---|---|---|---|\n",
    );
    let Some(first) = replicas.first() else { return md };
    for (i, c) in first.iter().enumerate() {
        let cell = |pick: &dyn Fn(&ClassPercentiles) -> Option<f64>| {
            let values = replicas.iter().filter_map(|r| r.get(i)).filter_map(pick).collect();
            spread(values).map_or("-".into(), |(m, lo, hi)| format!("{m:.1} ({lo:.1}-{hi:.1})"))
        };
        md.push_str(&format!("| {} ", c.class));
        for k in 0..3 {
            md.push_str(&format!("| {} ", cell(&|p: &ClassPercentiles| p.ttft[k])));
        }
        for k in 0..3 {
            md.push_str(&format!("| {} ", cell(&|p: &ClassPercentiles| p.itl[k])));
        }
        md.push_str("|\n");
    }
    md
}
