//! Log output: human-readable lines for people, JSON lines for log pipelines (one object per
//! event, the per-request record included). `RUST_LOG` filters as usual (default `info`).

use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// How log lines are written (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Human,
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "human" | "text" => Ok(LogFormat::Human),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("log format `{other}` is not `human` or `json`")),
        }
    }
}

/// Installs the global subscriber; a second call (tests) keeps the first.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.with_ansi(false).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_bad_ones_are_named() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!("human".parse::<LogFormat>(), Ok(LogFormat::Human));
        let err = "xml".parse::<LogFormat>().expect_err("xml is no format");
        assert!(err.contains("xml"), "{err}");
    }
}
