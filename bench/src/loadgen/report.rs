//! A run's report: per traffic class and input-length bucket (and per class overall), the
//! statistics of `stats`, written as JSON (summary and raw per-request data), a Markdown
//! table and SVG plots (TTFT and ITL distributions per class, the ITL timeline of one class
//! with long-prompt arrivals marked).

use std::path::Path;

use serde::Serialize;

use crate::loadgen::scenario::Scenario;
use crate::loadgen::stats::{GroupStats, RequestSample, Slo, Summary};
use crate::loadgen::svg;

/// The input-length bucket of a request (the same ranges as the servers' metric labels).
pub fn bucket(input_tokens: usize) -> &'static str {
    pd_telemetry::input_bucket(input_tokens)
}

/// One row: a class and an input bucket, or a class overall (`input_bucket` = "all").
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub class: String,
    pub input_bucket: String,
    #[serde(flatten)]
    pub stats: GroupStats,
}

/// Everything a run measured, with what is needed to repeat it.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub label: String,
    pub url: String,
    pub command: String,
    pub machine: String,
    pub duration_s: f64,
    pub scenario: Scenario,
    pub rows: Vec<Row>,
}

/// The machine: CPU model and count (what a reader needs to compare numbers).
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    format!("{cpu}, {cores} cores")
}

impl Report {
    pub fn build(label: &str, url: &str, scenario: &Scenario, samples: &[RequestSample], duration_s: f64) -> Report {
        let mut rows = Vec::new();
        for class in &scenario.classes {
            let slo: Slo = class.slo;
            let mine: Vec<&RequestSample> = samples.iter().filter(|s| s.class == class.name).collect();
            // Rates of a class are over the run until its own last response, so one class's
            // slow tail (a document finishing late) does not dilute another's tokens/s.
            let class_end = mine.iter().filter_map(|s| s.end_ms).fold(0.0, f64::max) / 1e3;
            let duration_s = class_end.max(scenario.duration_s).min(duration_s);
            let mut buckets: Vec<&str> = mine.iter().map(|s| bucket(s.input_tokens)).collect();
            buckets.sort_by_key(|b| {
                b.split('-').next().and_then(|n| n.trim_end_matches('+').parse::<usize>().ok()).unwrap_or(0)
            });
            buckets.dedup();
            for b in &buckets {
                let group: Vec<&RequestSample> =
                    mine.iter().copied().filter(|s| bucket(s.input_tokens) == *b).collect();
                rows.push(Row {
                    class: class.name.clone(),
                    input_bucket: b.to_string(),
                    stats: GroupStats::of(&group, duration_s, &slo),
                });
            }
            if buckets.len() != 1 {
                rows.push(Row {
                    class: class.name.clone(),
                    input_bucket: "all".into(),
                    stats: GroupStats::of(&mine, duration_s, &slo),
                });
            }
            if class.prefix_tokens > 0 {
                // Shared-prefix traffic: requests a prefix cache served apart from the others.
                for (name, warm) in [("cold", false), ("warm", true)] {
                    let group: Vec<&RequestSample> = mine.iter().copied().filter(|s| s.warm() == warm).collect();
                    rows.push(Row {
                        class: class.name.clone(),
                        input_bucket: name.into(),
                        stats: GroupStats::of(&group, duration_s, &slo),
                    });
                }
            }
        }
        Report {
            label: label.to_string(),
            url: url.to_string(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            machine: machine(),
            duration_s,
            scenario: scenario.clone(),
            rows,
        }
    }

    /// The Markdown table.
    pub fn markdown(&self) -> String {
        let f = |v: Option<f64>| {
            v.map(|x| if x >= 100.0 { format!("{x:.0}") } else { format!("{x:.1}") }).unwrap_or_else(|| "-".into())
        };
        let trio = |s: &Summary| format!("{} / {} / {}", f(s.p50), f(s.p95), f(s.p99));
        let mut md = format!(
            "# {}\n\nServer `{}`, {:.1} s, machine: {}.\nCommand: `{}`\n\n\
             | class | input tokens | requests | errors (429) | slowest 429 ms | TTFT p50/p95/p99 ms | ITL p50/p95/p99 ms (gaps) | longest gap ms | TPOT p50/p95 ms | e2e p50/p95 ms | goodput req/s | output tok/s | prompt cached % |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            self.label, self.url, self.duration_s, self.machine, self.command
        );
        for r in &self.rows {
            let s = &r.stats;
            md.push_str(&format!(
                "| {} | {} | {} | {} ({}) | {} | {} | {} ({}) | {} | {} / {} | {} / {} | {:.3} | {:.1} | {:.0} |\n",
                r.class,
                r.input_bucket,
                s.requests,
                s.errors,
                s.rejected,
                f(s.rejected_latency_ms_max),
                trio(&s.ttft_ms),
                trio(&s.itl_ms),
                s.itl_ms.count,
                f(s.itl_ms.max),
                f(s.tpot_ms.p50),
                f(s.tpot_ms.p95),
                f(s.e2e_ms.p50),
                f(s.e2e_ms.p95),
                s.goodput_rps,
                s.output_tokens_per_s,
                s.cached_fraction * 100.0
            ));
        }
        md
    }

    /// Writes summary.json, requests.json, report.md, ttft.svg, itl.svg and (if the class
    /// exists) timeline.svg for `timeline_class`, into `dir`.
    pub fn write(&self, dir: &Path, samples: &[RequestSample], timeline_class: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("summary.json"), serde_json::to_string_pretty(self).map_err(std::io::Error::other)?)?;
        std::fs::write(dir.join("requests.json"), serde_json::to_string(samples).map_err(std::io::Error::other)?)?;
        std::fs::write(dir.join("report.md"), self.markdown())?;
        let per_class = |value: &dyn Fn(&RequestSample) -> Vec<f64>| -> Vec<(String, Vec<f64>)> {
            self.scenario
                .classes
                .iter()
                .map(|c| {
                    (c.name.clone(), samples.iter().filter(|s| s.class == c.name && s.ok()).flat_map(value).collect())
                })
                .collect()
        };
        std::fs::write(
            dir.join("ttft.svg"),
            svg::distribution(
                &format!("TTFT — {}", self.label),
                "time to first token (ms)",
                &per_class(&|s| s.ttft_ms().into_iter().collect()),
            ),
        )?;
        std::fs::write(
            dir.join("itl.svg"),
            svg::distribution(
                &format!("Inter-token latency — {}", self.label),
                "gap between tokens (ms)",
                &per_class(&|s| s.gaps_ms().collect()),
            ),
        )?;
        if let Some(t) = timeline(samples, timeline_class, &self.label) {
            std::fs::write(dir.join("timeline.svg"), t)?;
        }
        Ok(())
    }
}

/// The ITL timeline of `class` with the arrivals of long prompts (>= 1024 tokens) of the
/// other classes marked.
pub fn timeline(samples: &[RequestSample], class: &str, label: &str) -> Option<String> {
    let points: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.class == class)
        .flat_map(|s| s.token_ms.windows(2).map(|w| (w[1] / 1e3, w[1] - w[0])))
        .collect();
    if points.is_empty() {
        return None;
    }
    let marks: Vec<f64> =
        samples.iter().filter(|s| s.class != class && s.input_tokens >= 1024).map(|s| s.sent_ms / 1e3).collect();
    Some(svg::timeline(&format!("{class} inter-token gaps — {label}"), &points, &marks, "long prompt sent"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::scenario::Scenario;

    fn sample(class: &str, input: usize, tokens: &[f64]) -> RequestSample {
        RequestSample {
            attempt: 0,
            cached_tokens: None,
            class: class.into(),
            input_tokens: input,
            requested_output_tokens: tokens.len(),
            sent_ms: 0.0,
            token_ms: tokens.to_vec(),
            end_ms: tokens.last().copied(),
            reported_output_tokens: None,
            error: None,
            status: None,
            retry_after_s: None,
        }
    }

    #[test]
    fn rows_split_by_class_and_bucket_and_add_up() {
        let scenario =
            Scenario::parse("class chat concurrency=1 input=64..600\nclass docs every=5 input=2048").expect("scenario");
        let samples = vec![
            sample("chat", 64, &[100.0, 110.0]),
            sample("chat", 128, &[90.0, 95.0, 99.0]),
            sample("chat", 129, &[300.0, 310.0]),
            sample("docs", 2048, &[5000.0, 5010.0]),
        ];
        let report = Report::build("test", "http://x", &scenario, &samples, 10.0);
        let find = |c: &str, b: &str| {
            report.rows.iter().find(|r| r.class == c && r.input_bucket == b).map(|r| r.stats.requests)
        };
        assert_eq!(find("chat", "1-128"), Some(2), "128 is in the first bucket");
        assert_eq!(find("chat", "129-512"), Some(1));
        assert_eq!(find("chat", "all"), Some(3));
        assert_eq!(find("docs", "513-2048"), Some(1));
        assert_eq!(find("docs", "all"), None, "one bucket needs no total row");
        let md = report.markdown();
        assert_eq!(md.lines().filter(|l| l.starts_with("| chat") || l.starts_with("| docs")).count(), 4);
        let t = timeline(&samples, "chat", "test").expect("timeline");
        assert_eq!(t.matches("<circle").count(), 4, "one point per gap");
        assert!(t.contains("<line x1=\""), "the document arrival is marked");
    }

    #[test]
    fn a_shared_prefix_class_reports_warm_and_cold_requests_apart() {
        let scenario = Scenario::parse("class rag concurrency=1 input=600 prefix=500 prefixes=2").expect("scenario");
        let mut cold = sample("rag", 600, &[900.0, 910.0]);
        cold.cached_tokens = Some(0);
        let mut warm = sample("rag", 600, &[100.0, 110.0]);
        warm.cached_tokens = Some(496);
        let report = Report::build("test", "http://x", &scenario, &[cold, warm.clone(), warm], 10.0);
        let row = |b: &str| report.rows.iter().find(|r| r.input_bucket == b).expect(b).stats.clone();
        assert_eq!((row("cold").requests, row("warm").requests), (1, 2));
        assert_eq!(row("warm").ttft_ms.p50, Some(100.0));
        assert!((row("warm").cached_fraction - 496.0 / 600.0).abs() < 1e-9);
        assert_eq!(row("cold").cached_fraction, 0.0);
    }
}
