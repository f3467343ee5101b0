//! pd-sim-worker: many simulated prefill and decode workers in one process, for running the
//! real pd-router against a fleet (`bench/fleet.sh`). Each worker serves the real pd.v1 APIs
//! on its own port with timing from a cost model (`--cost FILE`, from `pd-bench profile` or
//! `pd-bench roofline`); the addresses go to `--addresses FILE` as the router's
//! PD_PREFILL_WORKERS / PD_DECODE_WORKERS lines. With `--kv-transport ucx` the decode
//! workers take KV over UCX (`UCX_TLS` required), every frame moved for real. On SIGINT or
//! SIGTERM it prints the KV hand-offs by transport and exits.

use clap::Parser;
use pd_kv_transfer::transport::Transport;
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
    /// How KV reaches the decode workers: `grpc` (control messages only, the hand-off time
    /// from the cost model) or `ucx` (every frame over UCX; needs UCX_TLS).
    #[arg(long, default_value = "grpc")]
    kv_transport: Transport,
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
    let fleet = Fleet::start(cost, step, &args.host, args.prefill, args.decode, args.kv_transport).await?;
    let lines = fleet.env_lines();
    match &args.addresses {
        Some(path) => {
            std::fs::write(path, &lines).map_err(|e| anyhow::anyhow!("cannot write --addresses {path}: {e}"))?
        }
        None => print!("{lines}"),
    }
    eprintln!(
        "pd-sim-worker: {} prefill + {} decode workers on {}, KV over {}",
        args.prefill,
        args.decode,
        args.host,
        args.kv_transport.name()
    );
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        () = lose_on_schedule(&fleet, args.lose.clone()) => {}
        r = tokio::signal::ctrl_c() => r?,
        _ = terminate.recv() => {}
    }
    eprintln!("pd-sim-worker: {}; {} blocks held by UCX reservations", fleet.handoffs(), fleet.ucx_held_blocks());
    Ok(())
}

/// Loses the workers `losses` name, each at its time into the run; never returns.
async fn lose_on_schedule(fleet: &Fleet, mut losses: Vec<Loss>) {
    let started = tokio::time::Instant::now();
    losses.sort_by_key(|l| l.after);
    for loss in losses {
        tokio::time::sleep_until(started + loss.after).await;
        if fleet.lose(loss.role, loss.index) {
            eprintln!("pd-sim-worker: lost {:?} worker {} at {:.1} s", loss.role, loss.index, loss.after.as_secs_f64());
        } else {
            eprintln!("pd-sim-worker: --lose names no such worker: {:?} {}", loss.role, loss.index);
        }
    }
    std::future::pending::<()>().await;
}
