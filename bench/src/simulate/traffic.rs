//! A scenario's clients in virtual time, recorded as the same request samples as
//! `pd-bench run` records against a real server.
//!
//! The clients behave as `loadgen::runner`'s: closed-loop clients send their next request
//! when the last one ends and retry a refused one after its Retry-After (at most
//! `MAX_RETRIES` times); Poisson and periodic arrivals are drawn with the same generator
//! from the same seeds; the run stops sending at the scenario's duration or request cap.
//! Prompts are random token ids (the shared prefixes of a class included), of the lengths
//! the scenario draws: simulated workers only count tokens.

use std::sync::Arc;
use std::time::Duration;

use pd_sim::vtime::{Outcome, Request, Traffic};

use crate::loadgen::prompt::Rng;
use crate::loadgen::scenario::{Arrival, ClassSpec, Scenario};
use crate::loadgen::stats::RequestSample;
use crate::simulate::tally::Tally;

/// Retries of one refused request by a closed-loop client (as `loadgen::runner`).
pub const MAX_RETRIES: u32 = 3;

/// Token ids of generated prompts are drawn from this many ids (a vocabulary's size).
const VOCABULARY: u64 = 32_000;

/// One class's clients.
struct Clients {
    spec: ClassSpec,
    /// Draws prompt lengths and prefixes (as `runner::jobs_for`).
    jobs: Rng,
    /// Draws arrival gaps (as the runner's driver).
    gaps: Rng,
    prefixes: Vec<Vec<u32>>,
    /// Requests of this class sent (first sendings).
    sent: usize,
    /// Next open-loop arrival.
    next_at: Duration,
    /// Closed loop: clients started.
    started: bool,
}

/// A scenario's clients, and what they saw: every request (`keep`), and a tally.
pub struct ScenarioTraffic {
    classes: Vec<Clients>,
    stop_at: Duration,
    cap: usize,
    issued: usize,
    keep: bool,
    pub samples: Vec<RequestSample>,
    /// Every ended request, kept or not.
    pub tally: Tally,
    /// The sample `ended` fills when samples are not kept.
    scratch: RequestSample,
}

fn tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % VOCABULARY) as u32).collect()
}

impl ScenarioTraffic {
    /// The clients of `scenario`; `keep`: keep every sample (else only the tally counts them).
    pub fn new(scenario: &Scenario, keep: bool) -> Self {
        let classes = scenario
            .classes
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let mut jobs = Rng::new(scenario.seed.wrapping_add(i as u64 * 7919));
                let prefixes = (0..spec.prefixes.max(1)).map(|_| tokens(&mut jobs, spec.prefix_tokens)).collect();
                Clients {
                    spec: spec.clone(),
                    jobs,
                    gaps: Rng::new(scenario.seed.wrapping_add(i as u64)),
                    prefixes,
                    sent: 0,
                    next_at: Duration::from_secs_f64(spec.start_s),
                    started: false,
                }
            })
            .collect();
        ScenarioTraffic {
            classes,
            stop_at: Duration::from_secs_f64(scenario.duration_s),
            cap: scenario.max_requests,
            issued: 0,
            keep,
            samples: Vec::new(),
            tally: Tally::new(scenario.classes.iter().map(|c| c.name.clone())),
            scratch: RequestSample::default(),
        }
    }

    /// The next first sending of class `c` (client `client`), if the run's time and count and
    /// the class's cap allow.
    fn job(&mut self, c: usize, client: u64, now: Duration) -> Option<Request> {
        let class = &mut self.classes[c];
        let most = class.spec.max_requests.unwrap_or(self.cap);
        if now >= self.stop_at || self.issued >= self.cap || class.sent >= most {
            return None;
        }
        self.issued += 1;
        class.sent += 1;
        let rng = &mut class.jobs;
        let input = class.spec.input.draw(rng.unit());
        let output = class.spec.output.draw(rng.unit());
        let k = class.prefixes.len();
        let u = rng.unit();
        let which = match class.spec.hot {
            Some(hot) if k > 1 && u >= hot => 1 + ((u - hot) / (1.0 - hot) * (k - 1) as f64) as usize,
            Some(_) => 0,
            None => (u * k as f64) as usize,
        };
        let prefix = &class.prefixes[which.min(k - 1)];
        let mut prompt: Vec<u32> = prefix.iter().copied().take(input).collect();
        let rest = input - prompt.len();
        prompt.extend(tokens(rng, rest));
        Some(Request {
            client: ((c as u64) << 32) | client,
            class: class.spec.header().to_string(),
            prompt: Arc::new(prompt),
            max_tokens: output,
            attempt: 0,
        })
    }

    /// The client's view of `o`, written over `s` (whose buffers a run of millions of
    /// requests reuses when it keeps no samples).
    fn sample_into(&self, o: &Outcome, end: Duration, s: &mut RequestSample) {
        let c = (o.request.client >> 32) as usize;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let ok = o.error.is_none();
        s.class.clone_from(&self.classes[c].spec.name);
        s.input_tokens = o.request.prompt.len();
        s.requested_output_tokens = o.request.max_tokens;
        s.sent_ms = ms(o.sent);
        s.token_ms.clear();
        s.token_ms.extend(o.tokens.iter().map(|&t| ms(t)));
        s.end_ms = Some(ms(end));
        s.reported_output_tokens = ok.then_some(o.tokens.len());
        s.error.clone_from(&o.error);
        s.status = o.status;
        s.retry_after_s = o.retry_after_s;
        s.cached_tokens = None;
        s.attempt = o.request.attempt;
    }
}

impl Traffic for ScenarioTraffic {
    fn arrivals(&mut self, now: Duration, until: Duration) -> (Vec<(Duration, Request)>, bool) {
        let mut out = Vec::new();
        let mut more = false;
        for c in 0..self.classes.len() {
            let class = &self.classes[c];
            let at = class.next_at;
            match class.spec.arrival {
                Arrival::Concurrency(n) => {
                    if class.started {
                        continue;
                    }
                    if at >= until {
                        more = true;
                        continue;
                    }
                    self.classes[c].started = true;
                    for client in 0..n as u64 {
                        if let Some(r) = self.job(c, client, at.max(now)) {
                            out.push((at.max(now), r));
                        }
                    }
                }
                Arrival::Poisson { .. } | Arrival::Every { .. } => {
                    while self.classes[c].next_at < until {
                        let at = self.classes[c].next_at;
                        let Some(r) = self.job(c, u64::from(u32::MAX), at) else { break };
                        out.push((at, r));
                        let class = &mut self.classes[c];
                        let gap = match class.spec.arrival {
                            Arrival::Poisson { rate_per_s } => class.gaps.exponential(1.0 / rate_per_s),
                            Arrival::Every { period_s } => period_s,
                            Arrival::Concurrency(_) => 0.0,
                        };
                        class.next_at += Duration::from_secs_f64(gap);
                    }
                    let class = &self.classes[c];
                    let most = class.spec.max_requests.unwrap_or(self.cap);
                    more |= class.next_at < self.stop_at && self.issued < self.cap && class.sent < most;
                }
            }
        }
        (out, more)
    }

    fn ended(&mut self, outcome: Outcome, now: Duration) -> Vec<(Duration, Request)> {
        let mut sample = std::mem::take(&mut self.scratch);
        self.sample_into(&outcome, now, &mut sample);
        self.tally.record(&sample);
        if self.keep {
            self.samples.push(sample);
        } else {
            self.scratch = sample;
        }
        let c = (outcome.request.client >> 32) as usize;
        let Arrival::Concurrency(_) = self.classes[c].spec.arrival else { return Vec::new() };
        // A refused request is sent again after its Retry-After, like a polite client.
        if outcome.status == Some(429) && outcome.request.attempt < MAX_RETRIES {
            let wait = Duration::from_secs(outcome.retry_after_s.unwrap_or(1));
            let at = self.stop_at.min(now + wait);
            if at < self.stop_at {
                let mut again = outcome.request;
                again.attempt += 1;
                return vec![(at, again)];
            }
            return Vec::new();
        }
        let client = outcome.request.client & u64::from(u32::MAX);
        self.job(c, client, now).map(|r| vec![(now, r)]).unwrap_or_default()
    }
}
