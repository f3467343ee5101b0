//! `pd-bench simulate`: a scenario's traffic against a virtual-time fleet (`pd_sim::vtime`:
//! the real scheduler and planners, simulated workers), recorded as the same request
//! samples as `pd-bench run` records against a real server, so the same report, plots,
//! `compare` and `plan` apply. Long runs keep only a tally (`tally`): percentiles from
//! logarithmic histograms instead of every sample.

pub mod tally;
pub mod traffic;

#[cfg(test)]
mod tests;

use std::path::Path;
use std::time::Instant;

use pd_sim::vtime::{self, Totals};
use serde::Serialize;

use crate::loadgen::report::{machine, Report};
use crate::loadgen::scenario::Scenario;
use crate::loadgen::stats::RequestSample;
use tally::{spread_markdown, ClassPercentiles, Tally};
use traffic::ScenarioTraffic;

/// What a virtual-time run measured.
pub struct SimRun {
    /// Every request (empty when only the tally was kept).
    pub samples: Vec<RequestSample>,
    pub tally: Tally,
    pub totals: Totals,
    /// Wall time the run took.
    pub wall_s: f64,
    /// From the start to the last request's end (at least the scenario's duration).
    pub duration_s: f64,
    pub fleet: Fleet,
    /// Each replica's percentiles (the first is the run above, without jitter).
    pub replicas: Vec<Vec<ClassPercentiles>>,
}

/// The simulated fleet, as the summary names it.
#[derive(Debug, Clone, Serialize)]
pub struct Fleet {
    pub prefill: usize,
    pub decode: usize,
    pub hop_ms: f64,
    pub cost: String,
}

#[derive(Serialize)]
struct Summary<'a> {
    label: &'a str,
    machine: String,
    fleet: &'a Fleet,
    totals: &'a Totals,
    wall_s: f64,
    /// Virtual seconds per wall second.
    speedup: f64,
    table: String,
    /// Percentiles of each replica (the first without message-time jitter).
    replicas: &'a [Vec<ClassPercentiles>],
}

/// Runs `scenario` against `config`'s fleet; `keep`: keep every sample. With `replicas`
/// above 1, the run is repeated with message-time jitter (seeds 1, 2, ...) to show how far
/// its percentiles spread.
pub fn simulate(scenario: &Scenario, config: vtime::Config, keep: bool, replicas: usize) -> SimRun {
    let fleet = Fleet {
        prefill: config.prefill,
        decode: config.decode,
        hop_ms: config.hop.as_secs_f64() * 1e3,
        cost: config.cost.source.clone(),
    };
    let started = Instant::now();
    let (samples, tally, totals) = once(scenario, vtime::Config { jitter: None, ..config.clone() }, keep);
    let wall_s = started.elapsed().as_secs_f64();
    let mut all = vec![tally.percentiles()];
    for seed in 1..replicas as u64 {
        let (_, t, _) = once(scenario, vtime::Config { jitter: Some(seed), ..config.clone() }, false);
        all.push(t.percentiles());
    }
    SimRun {
        samples,
        tally,
        duration_s: totals.virtual_s.max(scenario.duration_s),
        totals,
        wall_s,
        fleet,
        replicas: all,
    }
}

/// One run: its samples (if kept), tally and totals.
fn once(scenario: &Scenario, config: vtime::Config, keep: bool) -> (Vec<RequestSample>, Tally, Totals) {
    let mut traffic = ScenarioTraffic::new(scenario, keep);
    let totals = vtime::run(config, &mut traffic);
    (traffic.samples, traffic.tally, totals)
}

impl SimRun {
    /// The tally's table and what the run took.
    pub fn markdown(&self, label: &str, scenario: &Scenario) -> String {
        let t = &self.totals;
        let spread = if self.replicas.len() > 1 {
            format!(
                "\nOver {} replicas (message times jittered): median (least-largest), ms:\n\n{}",
                self.replicas.len(),
                spread_markdown(&self.replicas)
            )
        } else {
            String::new()
        };
        let run = format!(
            "## {label}: virtual time, {} prefill + {} decode simulated workers\n\n{}\n{} requests over {:.0} virtual s \
             (scenario: {:.0} s) in {:.2} s of wall time: {:.0}x real time; {} events, {} refresh rounds, {} decode \
             steps (mean batch {:.1}), {} prompts prefilled on their decode worker, {} prefill steps ({} cut by a short prompt); {} KV blocks held after the last request.\n",
            self.fleet.prefill,
            self.fleet.decode,
            self.tally.markdown(self.duration_s),
            t.requests,
            t.virtual_s,
            scenario.duration_s,
            self.wall_s,
            t.virtual_s / self.wall_s.max(1e-9),
            t.events,
            t.refreshes,
            t.decode_steps,
            t.decode_rows as f64 / t.decode_steps.max(1) as f64,
            t.local_prefills,
            t.prefill_steps,
            t.preempted,
            t.held_blocks,
        );
        run + &spread
    }

    /// `virtual.json` and `virtual.md`, and with samples kept the report `pd-bench run`
    /// writes (summary.json, requests.json, report.md, plots).
    pub fn write(&self, label: &str, scenario: &Scenario, out: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(out)?;
        if !self.samples.is_empty() {
            let report = Report::build(label, "virtual-time", scenario, &self.samples, self.duration_s);
            report.write(out, &self.samples, "interactive")?;
        }
        let summary = Summary {
            label,
            machine: machine(),
            fleet: &self.fleet,
            totals: &self.totals,
            wall_s: self.wall_s,
            speedup: self.totals.virtual_s / self.wall_s.max(1e-9),
            table: self.tally.markdown(self.duration_s),
            replicas: &self.replicas,
        };
        std::fs::write(
            out.join("virtual.json"),
            serde_json::to_string_pretty(&summary).map_err(std::io::Error::other)?,
        )?;
        std::fs::write(out.join("virtual.md"), self.markdown(label, scenario))
    }
}
