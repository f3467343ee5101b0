//! pd-sim-worker: many simulated prefill and decode workers in one process, for running the
//! real pd-router against a fleet (`bench/fleet.sh`). Each worker serves the real pd.v1 APIs
//! on its own port with timing from a cost model (`--cost FILE`, from `pd-bench profile` or
//! `pd-bench roofline`); the addresses go to `--addresses FILE` as the router's
//! PD_PREFILL_WORKERS / PD_DECODE_WORKERS lines.

use clap::Parser;
use pd_prefill::step::{StepArgs, StepConfig};
use pd_sim::cost::WorkerCost;
use pd_sim::fleet::{Fleet, Loss};
use std::sync::Arc;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Simulated pd workers.
#[derive(Debug, Parser)]
struct Args {
    /// Cost model (JSON).
    #[arg(long)]
    cost: String,
    /// Simulated prefill workers.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Simulated decode workers.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Address the workers listen on (each on a port of its own).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Where to write the workers' addresses (PD_PREFILL_WORKERS=... / PD_DECODE_WORKERS=...).
    #[arg(long)]
    addresses: Option<String>,
    /// Lose a worker during the run: prefill:INDEX@SECONDS or decode:INDEX@SECONDS (repeatable).
    #[arg(long)]
    lose: Vec<Loss>,
    /// Prefill step policy: the real prefill worker's flags.
    #[command(flatten)]
    step: StepArgs,
    /// Runtime threads (the workers are tasks).
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.prefill + args.decode > 0, "--prefill and --decode are both 0: nothing to run");
    anyhow::ensure!(args.threads > 0, "--threads must be at least 1");
    let cost = Arc::new(WorkerCost::load(&args.cost)?);
    let step = args.step.config().map_err(anyhow::Error::msg)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()?
        .block_on(run(args, cost, step))
}

async fn run(args: Args, cost: Arc<WorkerCost>, step: StepConfig) -> anyhow::Result<()> {
    let fleet = Fleet::start(cost, step, &args.host, args.prefill, args.decode).await?;
    let lines = fleet.env_lines();
    match &args.addresses {
        Some(path) => {
            std::fs::write(path, &lines).map_err(|e| anyhow::anyhow!("cannot write --addresses {path}: {e}"))?
        }
        None => print!("{lines}"),
    }
    eprintln!("pd-sim-worker: {} prefill + {} decode workers on {}", args.prefill, args.decode, args.host);
    let started = tokio::time::Instant::now();
    let mut losses = args.lose.clone();
    losses.sort_by_key(|l| l.after);
    for loss in losses {
        tokio::time::sleep_until(started + loss.after).await;
        if fleet.lose(loss.role, loss.index) {
            eprintln!("pd-sim-worker: lost {:?} worker {} at {:.1} s", loss.role, loss.index, loss.after.as_secs_f64());
        } else {
            eprintln!("pd-sim-worker: --lose names no such worker: {:?} {}", loss.role, loss.index);
        }
    }
    tokio::signal::ctrl_c().await?;
    Ok(())
}
