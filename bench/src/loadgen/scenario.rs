//! Workloads: traffic classes with their arrival process, length distributions, SLOs and
//! prefix sharing, read from a scenario file or built for the input x output x concurrency
//! matrix. Every length is an exact token count (see `prompt`).
//!
//! Scenario file: one setting per line, `#` starts a comment.
//!
//! ```text
//! duration=60 max_requests=400 seed=7
//! class interactive concurrency=4 input=64..128 output=128..256 ttft_p95_ms=2000 itl_p95_ms=150
//! class documents every=8 input=2048 output=16 start=2 ttft_p95_ms=20000
//! class chat-rag rate=0.5 input=512 output=64 prefix=384
//! class support concurrency=2 input=1550 output=16 prefix=1500 prefixes=2 hot=0.8
//! ```
//!
//! A class's arrivals are `concurrency=N` (closed loop: N clients, each sends its next
//! request when the last one ends), `rate=R` (Poisson, R requests/s) or `every=S` (one
//! request every S seconds). `input`/`output` are `N` or `A..B` (uniform). `prefix=P`: every
//! request of the class starts with the same P tokens; `prefixes=K`: one of K different such
//! prefixes, uniformly, or with `hot=F` the first one for a fraction F of the requests (a hot
//! prefix). The report splits a class with a prefix into warm (the server's prefix cache served
//! part of the prompt) and cold requests. `start=S` delays the class;
//! `requests=N` caps it. Requests carry the class name as `x-pd-class` (the router's traffic
//! class), or `as=NAME` when the report's name differs from the server's class.

use serde::Serialize;

use crate::loadgen::stats::Slo;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Arrival {
    Concurrency(usize),
    Poisson { rate_per_s: f64 },
    Every { period_s: f64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Length {
    Fixed(usize),
    Uniform(usize, usize),
}

impl Length {
    /// A length drawn with `u` uniform in [0, 1).
    pub fn draw(&self, u: f64) -> usize {
        match *self {
            Length::Fixed(n) => n,
            Length::Uniform(a, b) => a + ((b - a + 1) as f64 * u).floor().min((b - a) as f64) as usize,
        }
    }

    pub fn max(&self) -> usize {
        match *self {
            Length::Fixed(n) | Length::Uniform(_, n) => n,
        }
    }

    pub fn min(&self) -> usize {
        match *self {
            Length::Fixed(n) | Length::Uniform(n, _) => n,
        }
    }
}

/// One traffic class.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassSpec {
    pub name: String,
    pub arrival: Arrival,
    pub input: Length,
    pub output: Length,
    pub slo: Slo,
    pub prefix_tokens: usize,
    /// How many different shared prefixes (1 unless `prefixes=`).
    pub prefixes: usize,
    /// Fraction of requests on the first prefix (`hot=`); None: uniform.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hot: Option<f64>,
    pub start_s: f64,
    pub max_requests: Option<usize>,
    /// The `x-pd-class` sent (`as=NAME`); None: the class's own name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_class: Option<String>,
}

impl ClassSpec {
    /// The traffic class the server is asked for.
    pub fn header(&self) -> &str {
        self.server_class.as_deref().unwrap_or(&self.name)
    }
}

/// A whole workload, bounded in time and count.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scenario {
    pub duration_s: f64,
    pub max_requests: usize,
    pub seed: u64,
    pub classes: Vec<ClassSpec>,
}

fn err(line: usize, text: &str, why: impl std::fmt::Display) -> String {
    format!("scenario line {line}: `{text}`: {why}")
}

fn number<T: std::str::FromStr>(line: usize, key: &str, value: &str) -> Result<T, String> {
    value.parse().map_err(|_| err(line, &format!("{key}={value}"), "not a number"))
}

fn positive(line: usize, key: &str, value: &str) -> Result<f64, String> {
    let v: f64 = number(line, key, value)?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(err(line, &format!("{key}={value}"), "must be a positive number"))
    }
}

fn length(line: usize, key: &str, value: &str) -> Result<Length, String> {
    let bad = || err(line, &format!("{key}={value}"), "not a token count (N or A..B, at least 1)");
    let parse = |s: &str| s.parse::<usize>().ok().filter(|n| *n >= 1);
    match value.split_once("..") {
        None => parse(value).map(Length::Fixed).ok_or_else(bad),
        Some((a, b)) => match (parse(a), parse(b)) {
            (Some(a), Some(b)) if a <= b => Ok(Length::Uniform(a, b)),
            _ => Err(bad()),
        },
    }
}

impl Scenario {
    /// Parses a scenario file; errors name the line.
    pub fn parse(text: &str) -> Result<Scenario, String> {
        let mut scenario = Scenario { duration_s: 60.0, max_requests: 1000, seed: 1, classes: Vec::new() };
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.split('#').next().unwrap_or("").trim();
            if content.is_empty() {
                continue;
            }
            let mut words = content.split_whitespace();
            if content.starts_with("class ") || content == "class" {
                words.next();
                let name = words.next().ok_or_else(|| err(line, content, "a class needs a name"))?;
                if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
                    || name.len() > 32
                {
                    return Err(err(
                        line,
                        name,
                        "class names are 1-32 characters of a-z, 0-9, `-`, `_` (they become the x-pd-class header)",
                    ));
                }
                if scenario.classes.iter().any(|c| c.name == name) {
                    return Err(err(line, name, "class defined twice"));
                }
                let mut class = ClassSpec {
                    name: name.to_string(),
                    arrival: Arrival::Concurrency(1),
                    input: Length::Fixed(128),
                    output: Length::Fixed(128),
                    slo: Slo::default(),
                    prefix_tokens: 0,
                    prefixes: 1,
                    hot: None,
                    start_s: 0.0,
                    max_requests: None,
                    server_class: None,
                };
                let mut arrivals = 0;
                for word in words {
                    let (key, value) = word.split_once('=').ok_or_else(|| err(line, word, "expected key=value"))?;
                    match key {
                        "concurrency" => {
                            let n: usize = number(line, key, value)?;
                            if n == 0 {
                                return Err(err(line, word, "concurrency must be at least 1"));
                            }
                            class.arrival = Arrival::Concurrency(n);
                            arrivals += 1;
                        }
                        "rate" => {
                            class.arrival = Arrival::Poisson { rate_per_s: positive(line, key, value)? };
                            arrivals += 1;
                        }
                        "every" => {
                            class.arrival = Arrival::Every { period_s: positive(line, key, value)? };
                            arrivals += 1;
                        }
                        "input" => class.input = length(line, key, value)?,
                        "output" => class.output = length(line, key, value)?,
                        "prefix" => class.prefix_tokens = number(line, key, value)?,
                        "prefixes" => {
                            class.prefixes = number(line, key, value)?;
                            if class.prefixes == 0 {
                                return Err(err(line, word, "prefixes must be at least 1"));
                            }
                        }
                        "hot" => {
                            let f: f64 = number(line, key, value)?;
                            if !(0.0..=1.0).contains(&f) {
                                return Err(err(line, word, "hot is a fraction between 0 and 1"));
                            }
                            class.hot = Some(f);
                        }
                        "start" => class.start_s = number(line, key, value)?,
                        "requests" => class.max_requests = Some(number(line, key, value)?),
                        "as" => class.server_class = Some(value.to_string()),
                        "ttft_p95_ms" => class.slo.ttft_p95_ms = Some(positive(line, key, value)?),
                        "itl_p95_ms" => class.slo.itl_p95_ms = Some(positive(line, key, value)?),
                        other => return Err(err(line, word, format!("unknown setting `{other}`"))),
                    }
                }
                if arrivals > 1 {
                    return Err(err(line, content, "give one of concurrency=, rate=, every="));
                }
                if class.prefix_tokens > 0 && class.prefix_tokens >= class.input.min() {
                    return Err(err(line, content, "prefix must be shorter than the shortest input"));
                }
                scenario.classes.push(class);
            } else {
                for word in words {
                    let (key, value) = word
                        .split_once('=')
                        .ok_or_else(|| err(line, word, "expected key=value or `class NAME ...`"))?;
                    match key {
                        "duration" => scenario.duration_s = positive(line, key, value)?,
                        "max_requests" => scenario.max_requests = number(line, key, value)?,
                        "seed" => scenario.seed = number(line, key, value)?,
                        other => return Err(err(line, word, format!("unknown setting `{other}`"))),
                    }
                }
            }
        }
        if scenario.classes.is_empty() {
            return Err("scenario: no `class` line".into());
        }
        Ok(scenario)
    }

    /// One cell of the input x output x concurrency matrix: `requests` closed-loop requests.
    pub fn matrix_cell(input: usize, output: usize, concurrency: usize, requests: usize, duration_s: f64) -> Scenario {
        Scenario {
            duration_s,
            max_requests: requests,
            seed: 1,
            classes: vec![ClassSpec {
                name: format!("in{input}-out{output}-c{concurrency}"),
                arrival: Arrival::Concurrency(concurrency),
                input: Length::Fixed(input),
                output: Length::Fixed(output),
                slo: Slo::default(),
                prefix_tokens: 0,
                prefixes: 1,
                hot: None,
                start_s: 0.0,
                max_requests: Some(requests),
                // Capacity cells: the router's batch class (long TTFT SLO) queues instead of
                // refusing, so a cell measures the servers, not interactive admission.
                server_class: Some("batch".into()),
            }],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_scenario() {
        let s = Scenario::parse(
            "# interference\nduration=30 max_requests=50 seed=3\n\
             class interactive concurrency=4 input=64..128 output=128 ttft_p95_ms=2000 itl_p95_ms=150\n\
             class documents every=8 input=2048 output=16 start=2  # periodic\n\
             class rag rate=0.5 input=512 output=64 prefix=384 requests=10 as=batch\n",
        )
        .expect("valid");
        assert_eq!((s.duration_s, s.max_requests, s.seed), (30.0, 50, 3));
        assert_eq!(s.classes.len(), 3);
        assert_eq!(s.classes[0].arrival, Arrival::Concurrency(4));
        assert_eq!(s.classes[0].input, Length::Uniform(64, 128));
        assert_eq!(s.classes[0].slo, Slo { ttft_p95_ms: Some(2000.0), itl_p95_ms: Some(150.0) });
        assert_eq!(s.classes[1].arrival, Arrival::Every { period_s: 8.0 });
        assert_eq!(s.classes[1].start_s, 2.0);
        assert_eq!(s.classes[2].arrival, Arrival::Poisson { rate_per_s: 0.5 });
        assert_eq!((s.classes[2].prefix_tokens, s.classes[2].max_requests), (384, Some(10)));
        assert_eq!((s.classes[0].header(), s.classes[2].header()), ("interactive", "batch"));
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("class a concurrency=2\nclass b input=12x", "line 2", "input=12x"),
            ("duration=10\n\nclass a rate=-1", "line 3", "positive"),
            ("class a every=2 concurrency=3", "line 1", "one of"),
            ("class A", "line 1", "class names"),
            ("class a\nclass a", "line 2", "twice"),
            ("class a colour=blue", "line 1", "unknown setting `colour`"),
            ("class a input=100..50", "line 1", "A..B"),
            ("class a input=64 prefix=64", "line 1", "prefix"),
            ("class a input=64 prefix=8 hot=2", "line 1", "fraction"),
            ("class a input=64 prefix=8 prefixes=0", "line 1", "at least 1"),
            ("speed=3\nclass a", "line 1", "unknown setting `speed`"),
            ("# nothing", "", "no `class`"),
        ];
        for (text, line, what) in cases {
            let e = Scenario::parse(text).expect_err(text);
            assert!(e.contains(line) && e.contains(what), "{text:?} -> {e}");
        }
    }

    #[test]
    fn uniform_lengths_stay_in_range() {
        let l = Length::Uniform(10, 12);
        assert_eq!(l.draw(0.0), 10);
        assert_eq!(l.draw(0.999_999), 12);
        assert_eq!(l.draw(0.5), 11);
        assert_eq!(Length::Fixed(7).draw(0.3), 7);
    }
}
