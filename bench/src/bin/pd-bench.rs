//! pd-bench: load generator and reports for any OpenAI-compatible server.
//!
//!   pd-bench run --url URL --scenario FILE --out DIR [--label NAME]
//!   pd-bench matrix --url URL --out DIR [--inputs 128,512,2048 --outputs 32,128,512 --concurrency 1,4,16]
//!   pd-bench compare --out DIR --class interactive RUN_DIR...
//!   pd-bench hostile --url URL --out FILE [--idle 500 --slow 20 --duration-s 60]
//!   pd-bench profile --prefill ADDR --decode ADDR --out COST.json
//!   pd-bench roofline --hardware h200 --model llama-8b --out COST.json
//!   pd-bench simulate --scenario FILE --cost COST.json --prefill N --decode M --out DIR
//!   pd-bench plan --cost COST.json (--requests RUN/requests.json | --traffic FILE) --out DIR
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

/// The router's allocator: `simulate` runs the router's own scheduler, and its speed is
/// measured with the allocator the router runs with.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Measures a prefill + decode worker pair over pd.v1 and fits its cost model (JSON, for
    /// pd-sim-worker and `plan`).
    Profile {
        /// host:port of the prefill worker.
        #[arg(long)]
        prefill: String,
        /// host:port of the decode worker.
        #[arg(long)]
        decode: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_delimiter = ',', default_value = "8,16,32,64,128,512,1024,2048")]
        prefill_lengths: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        batches: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_value = "128,1024")]
        contexts: Vec<usize>,
        #[arg(long, default_value_t = 40)]
        decode_tokens: u32,
        /// The model's context length.
        #[arg(long, default_value_t = 8192)]
        max_position: u32,
        /// The prefill worker's --step-target-ms and --chunk (to count its steps). Profile a
        /// prefill worker started with a step target this large (60 s) and --chunk 128, so
        /// that a lone prompt goes in whole 128-token chunks (the size steps have in service)
        /// and the fit tells a prompt's setup from a step's fixed cost.
        #[arg(long, default_value_t = 60_000)]
        step_target_ms: u64,
        #[arg(long, default_value_t = 128)]
        chunk: usize,
        /// Named in the cost model's source.
        #[arg(long, default_value = "this machine")]
        machine: String,
    },
    /// A capacity plan from a load test or a traffic description and a cost model: capacity
    /// table per class, replicas per pool, the loss of one replica, autoscaler targets
    /// (plan.md, plan.json, rates.svg).
    Plan {
        #[arg(long)]
        cost: PathBuf,
        /// A pd-bench run's requests.json.
        #[arg(long, conflicts_with = "traffic", required_unless_present = "traffic")]
        requests: Option<PathBuf>,
        /// A traffic description (JSON: window_s, classes with rates, lengths and SLOs).
        #[arg(long)]
        traffic: Option<PathBuf>,
        #[arg(long)]
        out: PathBuf,
        /// SLO targets of a class, CLASS=TTFT_MS:ITL_MS (repeatable; defaults: the router's
        /// built-in classes, interactive=1500:100 and batch=600000:1000).
        #[arg(long)]
        slo: Vec<String>,
        #[arg(long, default_value_t = 300.0)]
        window_s: f64,
        #[arg(long, default_value_t = 120.0)]
        scale_out_s: f64,
        /// Replicas kept spare per pool for the loss of one.
        #[arg(long, default_value_t = 1)]
        spare: u32,
        #[arg(long, default_value_t = 0.7)]
        prefill_utilization: f64,
        #[arg(long, default_value_t = 0.8)]
        decode_utilization: f64,
        /// Decode is sized for the sequences open at once at this quantile over time (0: at
        /// their mean).
        #[arg(long, default_value_t = 0.95)]
        decode_percentile: f64,
        /// The prefill workers' step policy (their flags).
        #[command(flatten)]
        step: pd_prefill::step::StepArgs,
    },
    /// Runs a scenario in virtual time: the real scheduler and planners against simulated
    /// workers with the cost model's timing, in this process (no server, no socket).
    Simulate {
        #[arg(long)]
        scenario: PathBuf,
        /// The workers' cost model (`profile` or `roofline`).
        #[arg(long)]
        cost: PathBuf,
        #[arg(long, default_value_t = 1)]
        prefill: usize,
        #[arg(long, default_value_t = 1)]
        decode: usize,
        /// Output folder (summary.json, requests.json, report.md, *.svg, virtual.json).
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        label: Option<String>,
        /// One-way time of a message between client, router and workers (milliseconds).
        #[arg(long, default_value_t = 0.2)]
        hop_ms: f64,
        /// The router's traffic classes (its --classes file; default: the built-in ones).
        #[arg(long)]
        classes: Option<PathBuf>,
        /// Override the scenario's duration (seconds).
        #[arg(long)]
        duration_s: Option<f64>,
        /// Write only the summary (no requests.json, plots or per-request samples kept):
        /// for long runs with millions of requests.
        #[arg(long)]
        summary_only: bool,
        /// Runs again with message times jittered around --hop-ms (this many runs in all) and
        /// reports how far each percentile spreads over them.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
        replicas: u64,
        /// The prefill workers' step policy (their flags).
        #[command(flatten)]
        step: pd_prefill::step::StepArgs,
    },
    /// A cost model from a roofline: named hardware (h100, h200) and a model, with the
    /// efficiencies assumed.
    Roofline {
        #[arg(long)]
        hardware: String,
        /// GPUs per worker (tensor parallel).
        #[arg(long, default_value_t = 1)]
        gpus: u32,
        /// A named model (llama-8b, llama-70b, qwen3-8b, gemma-2-9b, ...), or any model pd
        /// serves given by its config: a GGUF file, a Hugging Face folder or its config.json
        /// (no weights needed).
        #[arg(long)]
        model: String,
        #[arg(long)]
        out: PathBuf,
        /// Fraction of peak FLOP/s reached by prefill.
        #[arg(long, default_value_t = 0.5)]
        mfu: f64,
        /// Fraction of peak bandwidth reached by decode.
        #[arg(long, default_value_t = 0.7)]
        mbu: f64,
        #[arg(long, default_value_t = 16)]
        block_size: u32,
        #[arg(long, default_value_t = 256)]
        max_batch: u32,
    },
}

/// `CLASS=TTFT_MS:ITL_MS`.
fn parse_slo(s: &str) -> anyhow::Result<(String, pd_bench::plan::Targets)> {
    let bad = || anyhow::anyhow!("--slo {s:?}: expected CLASS=TTFT_MS:ITL_MS, e.g. interactive=1500:100");
    let (class, rest) = s.split_once('=').ok_or_else(bad)?;
    let (ttft, itl) = rest.split_once(':').ok_or_else(bad)?;
    let ttft_ms: f64 = ttft.parse().map_err(|_| bad())?;
    let itl_ms: f64 = itl.parse().map_err(|_| bad())?;
    anyhow::ensure!(ttft_ms > 0.0 && itl_ms > 0.0 && !class.is_empty(), bad());
    Ok((class.to_string(), pd_bench::plan::Targets { ttft_ms, itl_ms }))
}

fn write_json<T: serde::Serialize>(out: &std::path::Path, value: &T) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(value)?;
    std::fs::write(out, &json).with_context(|| format!("writing {}", out.display()))?;
    println!("{json}");
    Ok(())
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
        Command::Profile {
            prefill,
            decode,
            out,
            prefill_lengths,
            batches,
            contexts,
            decode_tokens,
            max_position,
            step_target_ms,
            chunk,
            machine,
        } => {
            let step = pd_prefill::step::StepArgs { chunk, step_target_ms, ..Default::default() }
                .config()
                .map_err(anyhow::Error::msg)?;
            let plan = pd_bench::profile::Plan {
                prefill_lengths,
                batches,
                contexts,
                decode_tokens,
                step,
                max_position,
                machine,
            };
            let profile = pd_bench::profile::run(&prefill, &decode, &plan).await?;
            write_json(&out, &profile)?;
        }
        Command::Simulate {
            scenario,
            cost,
            prefill,
            decode,
            out,
            label,
            hop_ms,
            classes,
            duration_s,
            summary_only,
            replicas,
            step,
        } => {
            let text = std::fs::read_to_string(&scenario).with_context(|| format!("reading {}", scenario.display()))?;
            let mut parsed = Scenario::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", scenario.display()))?;
            if let Some(d) = duration_s {
                parsed.duration_s = d;
            }
            anyhow::ensure!(decode > 0, "--decode must be at least 1");
            anyhow::ensure!(hop_ms.is_finite() && hop_ms >= 0.0, "--hop-ms must be a non-negative number");
            let cost = pd_sim::cost::WorkerCost::load(&cost.to_string_lossy())?;
            let config = pd_sim::vtime::Config {
                cost: std::sync::Arc::new(cost),
                step: step.config().map_err(anyhow::Error::msg)?,
                prefill,
                decode,
                schedule: pd_sim::vtime::ScheduleConfig::default(),
                classes: pd_sim::vtime::Classes::load(classes.as_deref())?,
                hop: Duration::from_secs_f64(hop_ms / 1e3),
                jitter: None,
            };
            let label = label
                .unwrap_or_else(|| scenario.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
            let run = pd_bench::simulate::simulate(&parsed, config, !summary_only, replicas as usize);
            run.write(&label, &parsed, &out)?;
            println!("{}", run.markdown(&label, &parsed));
            println!("written to {}", out.display());
        }
        Command::Roofline { hardware, gpus, model, out, mfu, mbu, block_size, max_batch } => {
            let mut hw = pd_sim::roofline::hardware(&hardware, gpus)
                .with_context(|| format!("--hardware {hardware:?}: known are h100, h200"))?;
            hw.mfu = mfu;
            hw.mbu = mbu;
            let m = pd_bench::roofline::model_shape(&model)?;
            let cost = pd_sim::roofline::roofline(&hw, &m, block_size, max_batch)?;
            write_json(&out, &cost)?;
        }
        Command::Plan {
            cost,
            requests,
            traffic,
            out,
            slo,
            window_s,
            scale_out_s,
            spare,
            prefill_utilization,
            decode_utilization,
            decode_percentile,
            step,
        } => {
            use pd_bench::plan::{self, traffic::Traffic, PlanConfig, Targets};
            let cost = pd_sim::cost::WorkerCost::load(&cost.to_string_lossy())?;
            let mut cfg = PlanConfig {
                window_s,
                scale_out_s,
                spare,
                prefill_utilization,
                decode_utilization,
                decode_percentile: (decode_percentile != 0.0).then_some(decode_percentile),
                step: step.config().map_err(anyhow::Error::msg)?,
                ..PlanConfig::default()
            };
            cfg.slos.insert("interactive".into(), Targets { ttft_ms: 1500.0, itl_ms: 100.0 });
            cfg.slos.insert("batch".into(), Targets { ttft_ms: 600_000.0, itl_ms: 1000.0 });
            let (samples, duration) = match (&requests, &traffic) {
                (Some(path), _) => {
                    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                    let samples: Vec<pd_bench::loadgen::stats::RequestSample> = serde_json::from_str(&text)
                        .with_context(|| format!("{} is not a pd-bench requests.json", path.display()))?;
                    (samples, None)
                }
                (None, Some(path)) => {
                    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                    let t = Traffic::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                    cfg.window_s = t.window_s;
                    cfg.slos.extend(t.targets());
                    let windows = t.classes.iter().map(|c| c.rates_per_s.len()).max().unwrap_or(0).max(1);
                    (t.samples(), Some(windows as f64 * t.window_s))
                }
                (None, None) => anyhow::bail!("give --requests or --traffic"),
            };
            for s in &slo {
                let (class, t) = parse_slo(s)?;
                cfg.slos.insert(class, t);
            }
            let p = plan::plan(&samples, duration, &cost, &cfg)?;
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            let md = plan::render::markdown(&p);
            std::fs::write(out.join("plan.md"), &md)?;
            std::fs::write(out.join("plan.json"), serde_json::to_string_pretty(&p)?)?;
            std::fs::write(out.join("rates.svg"), plan::render::svg(&p))?;
            println!("{md}");
            println!("written to {}", out.display());
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
