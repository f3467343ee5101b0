//! Runs a scenario: one driver per class (closed-loop clients, or Poisson / periodic
//! arrivals), bounded by the scenario's duration and request count; requests still running
//! at the end are waited for up to the request timeout. A progress line on stderr.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::loadgen::client::{send, Target};
use crate::loadgen::prompt::{PromptBuilder, Rng};
use crate::loadgen::scenario::{Arrival, ClassSpec, Scenario};
use crate::loadgen::stats::RequestSample;

/// Retries of one refused request by a closed-loop client.
const MAX_RETRIES: u32 = 3;

/// A request ready to send.
#[derive(Debug, Clone)]
struct Job {
    class: String,
    /// The `x-pd-class` sent.
    header: String,
    prompt: String,
    input_tokens: usize,
    output_tokens: usize,
}

/// Every prompt of a class, built before the run (tokenizing during the run would load the
/// client machine while it measures).
fn jobs_for(class: &ClassSpec, builder: &PromptBuilder<'_>, seed: u64, count: usize) -> Result<Vec<Job>, String> {
    let mut rng = Rng::new(seed);
    let prefixes: Vec<String> =
        (0..class.prefixes.max(1)).map(|_| builder.words(&mut rng, class.prefix_tokens)).collect();
    (0..count)
        .map(|_| {
            let input = class.input.draw(rng.unit());
            let output = class.output.draw(rng.unit());
            let k = prefixes.len();
            let u = rng.unit();
            let which = match class.hot {
                Some(hot) if k > 1 && u >= hot => 1 + ((u - hot) / (1.0 - hot) * (k - 1) as f64) as usize,
                Some(_) => 0,
                None => (u * k as f64) as usize,
            };
            let prompt = builder.prompt(&mut rng, &prefixes[which.min(k - 1)], input)?;
            Ok(Job {
                class: class.name.clone(),
                header: class.header().to_string(),
                prompt,
                input_tokens: input,
                output_tokens: output,
            })
        })
        .collect()
}

/// What a run recorded.
#[derive(Debug)]
pub struct RunData {
    pub samples: Vec<RequestSample>,
    /// From the start to the last request's end.
    pub duration_s: f64,
}

struct Shared {
    samples: Mutex<Vec<RequestSample>>,
    issued: AtomicUsize,
    done: AtomicUsize,
    errors: AtomicUsize,
}

/// Runs `scenario` against `target`.
pub async fn run(
    target: Target,
    scenario: &Scenario,
    builder: &PromptBuilder<'_>,
    progress: bool,
) -> Result<RunData, String> {
    // Enough prompts for the most a class can send (bounded by the scenario's cap).
    let mut class_jobs = Vec::new();
    for (i, class) in scenario.classes.iter().enumerate() {
        let most = class.max_requests.unwrap_or(scenario.max_requests).min(scenario.max_requests);
        class_jobs.push(jobs_for(class, builder, scenario.seed.wrapping_add(i as u64 * 7919), most)?);
    }
    let client =
        reqwest::Client::builder().tcp_nodelay(true).pool_max_idle_per_host(256).build().map_err(|e| e.to_string())?;
    let shared = Arc::new(Shared {
        samples: Mutex::new(Vec::new()),
        issued: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        errors: AtomicUsize::new(0),
    });
    let origin = Instant::now();
    let stop_at = origin + Duration::from_secs_f64(scenario.duration_s);
    let mut drivers = Vec::new();
    for (i, (class, jobs)) in scenario.classes.iter().zip(class_jobs).enumerate() {
        let ctx = Driver {
            client: client.clone(),
            target: target.clone(),
            shared: shared.clone(),
            origin,
            stop_at,
            cap: scenario.max_requests,
            jobs: Arc::new(Mutex::new(jobs.into_iter())),
        };
        drivers.push(tokio::spawn(ctx.drive(class.clone(), scenario.seed.wrapping_add(i as u64))));
    }
    let reporter = progress.then(|| {
        let shared = shared.clone();
        let total = scenario.duration_s;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                print_progress(&shared, origin.elapsed().as_secs_f64(), total);
            }
        })
    });
    for d in drivers {
        let _ = d.await;
    }
    if let Some(r) = reporter {
        r.abort();
        print_progress(&shared, origin.elapsed().as_secs_f64(), scenario.duration_s);
        eprintln!();
    }
    let samples = std::mem::take(&mut *shared.samples.lock().map_err(|_| "samples lock")?);
    let end = samples.iter().filter_map(|s| s.end_ms).fold(0.0, f64::max);
    Ok(RunData { samples, duration_s: (end / 1e3).max(scenario.duration_s.min(origin.elapsed().as_secs_f64())) })
}

fn print_progress(shared: &Shared, elapsed: f64, total: f64) {
    let width = 30;
    let filled = ((elapsed / total).min(1.0) * width as f64) as usize;
    eprint!(
        "\r[{}{}] {:>5.1}/{:.0} s  sent {}  done {}  errors {}   ",
        "#".repeat(filled),
        " ".repeat(width - filled),
        elapsed,
        total,
        shared.issued.load(Ordering::Relaxed),
        shared.done.load(Ordering::Relaxed),
        shared.errors.load(Ordering::Relaxed)
    );
    let _ = std::io::stderr().flush();
}

#[derive(Clone)]
struct Driver {
    client: reqwest::Client,
    target: Target,
    shared: Arc<Shared>,
    origin: Instant,
    stop_at: Instant,
    cap: usize,
    jobs: Arc<Mutex<std::vec::IntoIter<Job>>>,
}

impl Driver {
    /// The next request to send, if the run's time, count and the class's budget allow.
    fn next_job(&self) -> Option<Job> {
        if Instant::now() >= self.stop_at {
            return None;
        }
        let job = self.jobs.lock().ok()?.next()?;
        let n = self.shared.issued.fetch_add(1, Ordering::Relaxed);
        if n >= self.cap {
            self.shared.issued.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(job)
    }

    /// Sends one request; returns how long the server asked to wait (429 + Retry-After).
    async fn execute(&self, job: Job, attempt: u32) -> Option<Duration> {
        let mut sample = send(
            &self.client,
            &self.target,
            self.origin,
            (&job.class, &job.header),
            job.prompt,
            job.input_tokens,
            job.output_tokens,
        )
        .await;
        sample.attempt = attempt;
        if sample.error.is_some() {
            self.shared.errors.fetch_add(1, Ordering::Relaxed);
        }
        let retry = sample.retry_after_s.filter(|_| sample.rejected()).map(Duration::from_secs);
        self.shared.done.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut s) = self.shared.samples.lock() {
            s.push(sample);
        }
        retry
    }

    async fn drive(self, class: ClassSpec, seed: u64) {
        let start = self.origin + Duration::from_secs_f64(class.start_s);
        tokio::time::sleep_until(start.into()).await;
        match class.arrival {
            Arrival::Concurrency(n) => {
                let clients: Vec<_> = (0..n)
                    .map(|_| {
                        let me = self.clone();
                        tokio::spawn(async move {
                            // A closed-loop client behaves like a polite one: after a 429 it
                            // waits the Retry-After the server gave (bounded by the run's end)
                            // and sends the same request again, at most MAX_RETRIES times.
                            while let Some(job) = me.next_job() {
                                let mut attempt = 0;
                                while let Some(wait) = me.execute(job.clone(), attempt).await {
                                    tokio::time::sleep_until(me.stop_at.min(Instant::now() + wait).into()).await;
                                    attempt += 1;
                                    if attempt > MAX_RETRIES || Instant::now() >= me.stop_at {
                                        break;
                                    }
                                }
                            }
                        })
                    })
                    .collect();
                for c in clients {
                    let _ = c.await;
                }
            }
            Arrival::Poisson { .. } | Arrival::Every { .. } => {
                let mut rng = Rng::new(seed);
                let mut at = start;
                let mut inflight = Vec::new();
                while let Some(job) = self.next_job() {
                    let me = self.clone();
                    inflight.push(tokio::spawn(async move {
                        let _ = me.execute(job, 0).await;
                    }));
                    let gap = match class.arrival {
                        Arrival::Poisson { rate_per_s } => rng.exponential(1.0 / rate_per_s),
                        Arrival::Every { period_s } => period_s,
                        Arrival::Concurrency(_) => break, // closed loops are driven above
                    };
                    at += Duration::from_secs_f64(gap);
                    if at >= self.stop_at {
                        break;
                    }
                    tokio::time::sleep_until(at.into()).await;
                }
                for t in inflight {
                    let _ = t.await;
                }
            }
        }
    }
}
