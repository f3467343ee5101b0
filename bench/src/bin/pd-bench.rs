//! pd-bench: load generator and reports for any OpenAI-compatible server.
//!
//!   pd-bench run --url URL --scenario FILE --out DIR [--label NAME]
//!   pd-bench matrix --url URL --out DIR [--inputs 128,512,2048 --outputs 32,128,512 --concurrency 1,4,16]
//!   pd-bench compare --out DIR --class interactive RUN_DIR...
//!   pd-bench hostile --url URL --out FILE [--idle 500 --slow 20 --duration-s 60]
//!
//! Prompts are built to exact token counts with the model's tokenizer (`--model`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use pd_bench::loadgen::client::Target;
use pd_bench::loadgen::compare::{self, Run};
use pd_bench::loadgen::prompt::PromptBuilder;
use pd_bench::loadgen::report::Report;
use pd_bench::loadgen::runner;
use pd_bench::loadgen::scenario::Scenario;

#[derive(Debug, Parser)]
#[command(about = "Load generator and reports for OpenAI-compatible servers")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct Server {
    /// Base URL of the server, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    url: String,
    /// Model name sent in requests.
    #[arg(long, default_value = "SmolLM2-135M-Instruct")]
    model_name: String,
    /// The served model's file (its tokenizer sizes the prompts).
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Longest wait for one request.
    #[arg(long, default_value_t = 300)]
    request_timeout_s: u64,
    /// No progress line on stderr.
    #[arg(long)]
    quiet: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs a scenario file and writes its report.
    Run {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        scenario: PathBuf,
        /// Output folder (summary.json, requests.json, report.md, *.svg).
        #[arg(long)]
        out: PathBuf,
        /// Name of the run in reports (`SETUP/VARIANT` for `compare`).
        #[arg(long)]
        label: Option<String>,
        /// Override the scenario's duration (seconds).
        #[arg(long)]
        duration_s: Option<f64>,
        /// The class whose inter-token gaps the timeline plots.
        #[arg(long, default_value = "interactive")]
        timeline_class: String,
    },
    /// Runs the input x output x concurrency matrix, one closed-loop cell after another.
    Matrix {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
        inputs: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_value = "32,128,512")]
        outputs: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        concurrency: Vec<usize>,
        /// Requests per cell = concurrency x this.
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        /// Longest time per cell (seconds).
        #[arg(long, default_value_t = 120.0)]
        cell_s: f64,
    },
    /// Compares runs labelled SETUP/VARIANT: the class's p95s with and without a disturbance.
    Compare {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "interactive")]
        class: String,
        #[arg(long, default_value = "docs")]
        with_variant: String,
        #[arg(long, default_value = "base")]
        without_variant: String,
        /// Text put above the table (machine, command).
        #[arg(long, default_value = "")]
        header: String,
        runs: Vec<PathBuf>,
    },
    /// Idle connections, slow readers and a /health probe every 100 ms for a while (run it
    /// beside `run`); writes a JSON report.
    Hostile {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        out: PathBuf,
        /// Connections opened and left silent.
        #[arg(long, default_value_t = 500)]
        idle: usize,
        /// Streaming requests read one byte per second.
        #[arg(long, default_value_t = 20)]
        slow: usize,
        #[arg(long, default_value_t = 256)]
        slow_tokens: u32,
        #[arg(long, default_value_t = 60.0)]
        duration_s: f64,
    },
}

fn target(s: &Server) -> Target {
    Target { url: s.url.clone(), model: s.model_name.clone(), timeout: Duration::from_secs(s.request_timeout_s) }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Command::Run { server, scenario, out, label, duration_s, timeline_class } => {
            let text = std::fs::read_to_string(&scenario).with_context(|| format!("reading {}", scenario.display()))?;
            let mut parsed = Scenario::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", scenario.display()))?;
            if let Some(d) = duration_s {
                parsed.duration_s = d;
            }
            let text_side = pd_engine::load_text_side(&server.model)
                .with_context(|| format!("tokenizer of {}", server.model.display()))?;
            let builder = PromptBuilder::new(&text_side.tokenizer).map_err(anyhow::Error::msg)?;
            let label = label
                .unwrap_or_else(|| scenario.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
            let data =
                runner::run(target(&server), &parsed, &builder, !server.quiet).await.map_err(anyhow::Error::msg)?;
            let report = Report::build(&label, &server.url, &parsed, &data.samples, data.duration_s);
            report.write(&out, &data.samples, &timeline_class)?;
            println!("{}", report.markdown());
            println!("written to {}", out.display());
        }
        Command::Matrix { server, out, inputs, outputs, concurrency, rounds, cell_s } => {
            let text_side = pd_engine::load_text_side(&server.model)
                .with_context(|| format!("tokenizer of {}", server.model.display()))?;
            let builder = PromptBuilder::new(&text_side.tokenizer).map_err(anyhow::Error::msg)?;
            let mut all = String::new();
            for &input in &inputs {
                for &output in &outputs {
                    for &c in &concurrency {
                        let scenario = Scenario::matrix_cell(input, output, c, c * rounds, cell_s);
                        let name = scenario.classes[0].name.clone();
                        let data = runner::run(target(&server), &scenario, &builder, !server.quiet)
                            .await
                            .map_err(anyhow::Error::msg)?;
                        let report = Report::build(&name, &server.url, &scenario, &data.samples, data.duration_s);
                        report.write(&out.join(&name), &data.samples, &name)?;
                        let md = report.markdown();
                        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with(&format!("| {name}"))).collect();
                        if all.is_empty() {
                            all = md
                                .lines()
                                .take_while(|l| !l.starts_with(&format!("| {name}")))
                                .collect::<Vec<_>>()
                                .join("\n")
                                + "\n";
                        }
                        all.push_str(&(rows.join("\n") + "\n"));
                    }
                }
            }
            std::fs::write(out.join("matrix.md"), &all)?;
            println!("{all}");
        }
        Command::Hostile { server, out, idle, slow, slow_tokens, duration_s } => {
            let url = server.url.trim_start_matches("http://").trim_end_matches('/');
            let addr = tokio::net::lookup_host(url)
                .await
                .with_context(|| format!("resolving {url}"))?
                .next()
                .with_context(|| format!("no address for {url}"))?;
            let hostile = pd_bench::loadgen::hostile::Hostile {
                addr,
                model: server.model_name.clone(),
                idle,
                slow,
                slow_tokens,
                duration: Duration::from_secs_f64(duration_s),
            };
            let report = pd_bench::loadgen::hostile::run(&hostile).await;
            let json = serde_json::to_string_pretty(&report)?;
            std::fs::write(&out, &json).with_context(|| format!("writing {}", out.display()))?;
            println!("{json}");
        }
        Command::Compare { out, class, with_variant, without_variant, header, runs } => {
            let runs: Vec<Run> =
                runs.iter().map(|d| Run::load(d)).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
            let lines = compare::compare(&runs, &class, &with_variant, &without_variant);
            let path = compare::write(&out, &runs, &class, &lines, &header)?;
            println!("{}", compare::markdown(&lines, &class));
            println!("written to {}", path.display());
        }
    }
    Ok(())
}
