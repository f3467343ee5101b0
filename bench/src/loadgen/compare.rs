//! Compares runs of one workload on several setups, with and without a disturbing class:
//! run labels are `SETUP/VARIANT` (e.g. `colocated-naive/docs` and `colocated-naive/base`).
//! For the class under study it prints, per setup, TTFT and ITL p95 (and p99, the longest
//! gap, output tokens/s) with and without the disturbance and their ratios, and plots the
//! class's TTFT and ITL distributions of every run together.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::loadgen::stats::{GroupStats, RequestSample, Slo};
use crate::loadgen::svg;

/// One run read back from its folder.
#[derive(Debug)]
pub struct Run {
    pub label: String,
    pub duration_s: f64,
    pub samples: Vec<RequestSample>,
}

impl Run {
    pub fn load(dir: &Path) -> Result<Run, String> {
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name)).map_err(|e| format!("{}: {e}", dir.join(name).display()))
        };
        let summary: serde_json::Value =
            serde_json::from_str(&read("summary.json")?).map_err(|e| format!("{}: {e}", dir.display()))?;
        let samples = serde_json::from_str(&read("requests.json")?).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(Run {
            label: summary["label"].as_str().unwrap_or_default().to_string(),
            duration_s: summary["duration_s"].as_f64().unwrap_or(0.0),
            samples,
        })
    }

    fn class_stats(&self, class: &str) -> GroupStats {
        let mine: Vec<&RequestSample> = self.samples.iter().filter(|s| s.class == class).collect();
        GroupStats::of(&mine, self.duration_s, &Slo::default())
    }
}

/// One setup's line of the comparison.
#[derive(Debug, Clone, Serialize)]
pub struct SetupLine {
    pub setup: String,
    pub with: GroupStats,
    pub without: GroupStats,
    pub itl_p95_ratio: Option<f64>,
    pub ttft_p95_ratio: Option<f64>,
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Pairs `SETUP/with_variant` with `SETUP/without_variant` runs for `class`.
pub fn compare(runs: &[Run], class: &str, with_variant: &str, without_variant: &str) -> Vec<SetupLine> {
    let mut setups: Vec<&str> = Vec::new();
    for setup in runs.iter().filter_map(|r| r.label.split_once('/').map(|(s, _)| s)) {
        if !setups.contains(&setup) {
            setups.push(setup);
        }
    }
    setups
        .into_iter()
        .filter_map(|setup| {
            let find = |v: &str| runs.iter().find(|r| r.label == format!("{setup}/{v}"));
            let (with, without) = (find(with_variant)?.class_stats(class), find(without_variant)?.class_stats(class));
            Some(SetupLine {
                setup: setup.to_string(),
                itl_p95_ratio: ratio(with.itl_ms.p95, without.itl_ms.p95),
                ttft_p95_ratio: ratio(with.ttft_ms.p95, without.ttft_ms.p95),
                with,
                without,
            })
        })
        .collect()
}

/// The comparison as a Markdown table.
pub fn markdown(lines: &[SetupLine], class: &str) -> String {
    let f = |v: Option<f64>| {
        v.map(|x| if x >= 100.0 { format!("{x:.0}") } else { format!("{x:.1}") }).unwrap_or_else(|| "-".into())
    };
    let r = |v: Option<f64>| v.map(|x| format!("{x:.2}")).unwrap_or_else(|| "-".into());
    let mut md = format!(
        "`{class}` requests, with the disturbing class / without it (same workload otherwise):\n\n\
         | setup | ITL p95 ms | ratio | TTFT p95 ms | ratio | ITL p99 ms | longest gap ms | {class} tok/s | requests (errors) |\n\
         |---|---|---|---|---|---|---|---|---|\n"
    );
    for l in lines {
        md.push_str(&format!(
            "| {} | {} / {} | {} | {} / {} | {} | {} / {} | {} / {} | {:.1} / {:.1} | {} ({}) / {} ({}) |\n",
            l.setup,
            f(l.with.itl_ms.p95),
            f(l.without.itl_ms.p95),
            r(l.itl_p95_ratio),
            f(l.with.ttft_ms.p95),
            f(l.without.ttft_ms.p95),
            r(l.ttft_p95_ratio),
            f(l.with.itl_ms.p99),
            f(l.without.itl_ms.p99),
            f(l.with.itl_ms.max),
            f(l.without.itl_ms.max),
            l.with.output_tokens_per_s,
            l.without.output_tokens_per_s,
            l.with.requests,
            l.with.errors,
            l.without.requests,
            l.without.errors,
        ));
    }
    md
}

/// Writes comparison.md, comparison.json and the class's TTFT / ITL distributions of every
/// run (ttft-<class>.svg, itl-<class>.svg) into `out`.
pub fn write(out: &Path, runs: &[Run], class: &str, lines: &[SetupLine], header: &str) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(out)?;
    let md = format!("{header}{}", markdown(lines, class));
    std::fs::write(out.join("comparison.md"), &md)?;
    std::fs::write(out.join("comparison.json"), serde_json::to_string_pretty(lines).map_err(std::io::Error::other)?)?;
    let series = |value: &dyn Fn(&RequestSample) -> Vec<f64>| -> Vec<(String, Vec<f64>)> {
        runs.iter()
            .map(|r| {
                (r.label.clone(), r.samples.iter().filter(|s| s.class == class && s.ok()).flat_map(value).collect())
            })
            .collect()
    };
    std::fs::write(
        out.join(format!("ttft-{class}.svg")),
        svg::distribution(
            &format!("{class} TTFT per setup"),
            "time to first token (ms)",
            &series(&|s| s.ttft_ms().into_iter().collect()),
        ),
    )?;
    std::fs::write(
        out.join(format!("itl-{class}.svg")),
        svg::distribution(
            &format!("{class} inter-token latency per setup"),
            "gap between tokens (ms)",
            &series(&|s| s.gaps_ms().collect()),
        ),
    )?;
    Ok(out.join("comparison.md"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(label: &str, gap: f64) -> Run {
        let token_ms: Vec<f64> = (0..5).map(|i| 100.0 + gap * i as f64).collect();
        Run {
            label: label.into(),
            duration_s: 1.0,
            samples: vec![RequestSample {
                attempt: 0,
                class: "interactive".into(),
                input_tokens: 64,
                requested_output_tokens: 5,
                sent_ms: 0.0,
                token_ms,
                end_ms: None,
                reported_output_tokens: None,
                error: None,
                status: None,
                retry_after_s: None,
                cached_tokens: None,
            }],
        }
    }

    #[test]
    fn pairs_setups_and_computes_ratios() {
        let runs = vec![
            run("a/docs", 30.0),
            run("b/docs", 10.0),
            run("b/base", 10.0),
            run("a/base", 10.0),
            run("c/docs", 5.0),
        ];
        let lines = compare(&runs, "interactive", "docs", "base");
        assert_eq!(lines.len(), 2, "c has no base run");
        assert_eq!(lines[0].itl_p95_ratio, Some(3.0));
        assert_eq!(lines[1].itl_p95_ratio, Some(1.0));
        assert_eq!(lines[0].ttft_p95_ratio, Some(1.0));
        let md = markdown(&lines, "interactive");
        assert!(md.contains("| a | 30.0 / 10.0 | 3.00 |"), "{md}");
    }
}
