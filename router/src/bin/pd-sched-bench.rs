//! pd-sched-bench: the router scheduler's own cost per request, without sockets, by fleet
//! size. It drives `schedule::state::State` (the scheduler's rules on an explicit clock) in
//! virtual time: every request is submitted, dispatched, has its decode reservation confirmed
//! and its prefill done, and is released `--in-flight` requests later; every worker's load is
//! refreshed each `--refresh-ms` of virtual time (what the periodic refresh does), each
//! worker reporting a slightly different load and rate, as real ones do. Prints a Markdown
//! table: microseconds per request of the request events (submit, dispatch, opened, prefill
//! done, release), and of one refresh round per worker (a cost per interval, paid whatever
//! the request rate), of a single-threaded loop (wall time: run it pinned to an idle core).
//!
//!   taskset -c 1 target/release/pd-sched-bench --workers 8,128,1000

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pd_proto::v1 as pb;
use pd_router::classes::{Classes, BUILT_IN};
use pd_router::schedule::state::State;
use pd_router::schedule::{Prompt, ScheduleConfig};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
struct Args {
    /// Fleet sizes (half prefill, half decode workers).
    #[arg(long, value_delimiter = ',', default_value = "8,128,1000")]
    workers: Vec<usize>,
    /// Requests timed per fleet size.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Requests granted and not yet released at any time.
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
    /// Virtual time between requests (microseconds).
    #[arg(long, default_value_t = 1_600)]
    gap_us: u64,
    /// Virtual time between refreshes of every worker's load (milliseconds).
    #[arg(long, default_value_t = 100)]
    refresh_ms: u64,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 48)]
    prompt: usize,
}

/// Every worker's load as a refresh reports it: decode workers, then prefill workers.
type Loads = (Vec<(String, pb::DecodeLoad)>, Vec<(String, pb::PrefillLoad)>);

fn loads(workers: usize, round: usize) -> Loads {
    let half = (workers / 2).max(1);
    // A spread that moves from round to round, as measured loads do.
    let spread = |i: usize, n: usize| ((i * 7_919 + round * 104_729) % n) as u32;
    let decode = (0..half)
        .map(|i| {
            let load = pb::DecodeLoad {
                free_blocks: 100_000 - spread(i, 2_000),
                total_blocks: 100_000,
                block_size: 16,
                max_batch: 256,
                step_ms: 5.0 + f64::from(spread(i, 100)) / 100.0,
                ..Default::default()
            };
            (format!("10.0.{}.{}:50052", i / 250, i % 250), load)
        })
        .collect();
    let prefill = (0..half)
        .map(|i| {
            let rate = 18_000.0 + f64::from(spread(i, 4_000));
            let load = pb::PrefillLoad { max_partial_prefills: 8, prefill_tokens_per_s: rate, ..Default::default() };
            (format!("10.1.{}.{}:50053", i / 250, i % 250), load)
        })
        .collect();
    (decode, prefill)
}

/// What one fleet size measured.
struct Measured {
    /// Microseconds of request events per request.
    request_us: f64,
    /// Microseconds of one refresh round per worker.
    refresh_us_per_worker: f64,
    /// Microseconds of everything per request, refreshes included.
    total_us: f64,
    granted: usize,
    refused: usize,
}

fn run(args: &Args, workers: usize) -> anyhow::Result<Measured> {
    let classes = Classes::parse(BUILT_IN).map_err(anyhow::Error::msg)?;
    let class = classes.default_class().clone();
    let mut state: State<()> = State::new(&classes, ScheduleConfig::default(), true);
    let t0 = Instant::now();
    let (decode, prefill) = loads(workers, 0);
    state.refreshed(decode, prefill, t0);
    let prompts: Vec<Arc<Prompt>> = (0..256u32)
        .map(|k| {
            Arc::new(Prompt::new((0..args.prompt as u32).map(|t| 1000 + (t * 7919 + k * 104_729) % 40_000).collect()))
        })
        .collect();
    let (gap, refresh) = (Duration::from_micros(args.gap_us), Duration::from_millis(args.refresh_ms));
    let mut open: VecDeque<u64> = VecDeque::new();
    let (mut granted, mut refused, mut next_refresh) = (0, 0, t0 + refresh);
    let (mut rounds, mut refreshing) = (0, Duration::ZERO);
    let started = Instant::now();
    for i in 0..args.requests {
        let now = t0 + gap * (i as u32 + 1);
        if now >= next_refresh {
            rounds += 1;
            let (decode, prefill) = loads(workers, rounds);
            let began = Instant::now();
            state.refreshed(decode, prefill, now);
            refreshing += began.elapsed();
            next_refresh = now + refresh;
        }
        if state.submit(&class, prompts[i % prompts.len()].clone(), 16, (), now).is_err() {
            refused += 1;
        }
        for (_, placement) in state.dispatch(now) {
            state.decode_opened(placement.seq);
            state.prefill_done(placement.seq);
            open.push_back(placement.seq);
            granted += 1;
        }
        while open.len() > args.in_flight {
            if let Some(seq) = open.pop_front() {
                state.release(seq, true, now);
            }
        }
    }
    let requests = started.elapsed().saturating_sub(refreshing);
    Ok(Measured {
        request_us: requests.as_secs_f64() * 1e6 / args.requests as f64,
        refresh_us_per_worker: refreshing.as_secs_f64() * 1e6 / (rounds.max(1) * workers) as f64,
        total_us: (requests + refreshing).as_secs_f64() * 1e6 / args.requests as f64,
        granted,
        refused,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    println!(
        "{} requests per fleet size, {} in flight, one every {} us of virtual time, every worker's load refreshed each {} ms\n",
        args.requests, args.in_flight, args.gap_us, args.refresh_ms
    );
    println!(
        "| workers | scheduler us per request | refresh us per worker per round | all us per request, refreshes included | granted | refused |"
    );
    println!("|---|---|---|---|---|---|");
    for &w in &args.workers {
        let m = run(&args, w)?;
        println!(
            "| {w} | {:.1} | {:.2} | {:.1} | {} | {} |",
            m.request_us, m.refresh_us_per_worker, m.total_us, m.granted, m.refused
        );
    }
    Ok(())
}
