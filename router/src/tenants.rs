//! Tenants of the public API: who a request comes from, decided by its API key
//! (`Authorization: Bearer KEY`), declared in the class file as `[tenants.NAME]` tables with
//! their keys, an optional traffic class (a tenant's requests cannot claim another one) and an
//! optional request rate (a token bucket: `requests_per_s`, `burst`). With
//! `require_api_key = true` a request without a known key gets 401. Over its rate a tenant gets
//! 429 with Retry-After. Keys are compared whole; they are never logged.

use std::sync::Mutex;
use std::time::Instant;

use serde::Deserialize;

use crate::error::RouterError;

/// One tenant as written in the file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub api_keys: Vec<String>,
    /// The class of every request of this tenant (None: header or default, as for anyone).
    #[serde(default)]
    pub class: Option<String>,
    /// Sustained requests per second (None: unlimited).
    #[serde(default)]
    pub requests_per_s: Option<f64>,
    /// Requests allowed at once above the rate (default: one second's worth, at least 1).
    #[serde(default)]
    pub burst: Option<f64>,
}

/// A tenant ready for use: its spec and its rate limiter.
#[derive(Debug)]
pub struct Tenant {
    pub name: String,
    pub spec: TenantSpec,
    /// (tokens, last refill) of the token bucket.
    bucket: Mutex<(f64, Instant)>,
}

impl Tenant {
    pub fn new(name: String, spec: TenantSpec) -> Result<Self, String> {
        if spec.api_keys.is_empty() || spec.api_keys.iter().any(|k| k.trim().is_empty()) {
            return Err(format!("tenant `{name}`: api_keys must list at least one non-empty key"));
        }
        if let Some(r) = spec.requests_per_s {
            if !(r.is_finite() && r > 0.0) {
                return Err(format!("tenant `{name}`: requests_per_s must be a positive number"));
            }
        }
        if let Some(b) = spec.burst {
            if !(b.is_finite() && b >= 1.0) {
                return Err(format!("tenant `{name}`: burst must be at least 1"));
            }
        }
        let full = Self::capacity(&spec);
        Ok(Tenant { name, spec, bucket: Mutex::new((full, Instant::now())) })
    }

    fn capacity(spec: &TenantSpec) -> f64 {
        spec.burst.unwrap_or_else(|| spec.requests_per_s.unwrap_or(1.0).max(1.0))
    }

    /// Takes one request from the bucket at `now`, or says when one will be there.
    pub fn admit(&self, now: Instant) -> Result<(), RouterError> {
        let Some(rate) = self.spec.requests_per_s else { return Ok(()) };
        let full = Self::capacity(&self.spec);
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let refilled = (b.0 + now.saturating_duration_since(b.1).as_secs_f64() * rate).min(full);
        *b = (refilled, now.max(b.1));
        if refilled >= 1.0 {
            b.0 -= 1.0;
            return Ok(());
        }
        let wait = (1.0 - refilled) / rate;
        Err(RouterError::Overloaded {
            message: format!(
                "tenant `{}` is over its rate limit of {rate} requests/s (requests_per_s, burst {full})",
                self.name
            ),
            retry_after_s: wait.ceil().max(1.0) as u64,
        })
    }
}

/// The bearer token of an `Authorization` value, if it is one.
pub fn bearer(authorization: Option<&[u8]>) -> Option<&str> {
    authorization
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn tenant(rate: Option<f64>, burst: Option<f64>) -> Tenant {
        let spec = TenantSpec { api_keys: vec!["k".into()], class: None, requests_per_s: rate, burst };
        Tenant::new("acme".into(), spec).expect("valid")
    }

    #[test]
    fn the_bucket_lets_a_burst_through_then_the_rate_and_says_when_to_retry() {
        let t = tenant(Some(2.0), Some(3.0));
        let t0 = Instant::now();
        for _ in 0..3 {
            t.admit(t0).expect("the burst");
        }
        let err = t.admit(t0).expect_err("over the rate");
        assert!(matches!(&err, RouterError::Overloaded { retry_after_s: 1, message } if message.contains("acme")));
        t.admit(t0 + Duration::from_millis(500)).expect("one more after half a second at 2/s");
        assert!(t.admit(t0 + Duration::from_millis(500)).is_err());
        assert!(tenant(None, None).admit(t0).is_ok(), "no rate: unlimited");
    }

    #[test]
    fn bad_tenants_and_bearer_values_are_told_apart() {
        let bad = TenantSpec { api_keys: vec![" ".into()], class: None, requests_per_s: None, burst: None };
        assert!(Tenant::new("x".into(), bad).expect_err("empty key").contains("api_keys"));
        let zero = TenantSpec { api_keys: vec!["k".into()], class: None, requests_per_s: Some(0.0), burst: None };
        assert!(Tenant::new("x".into(), zero).expect_err("rate 0").contains("requests_per_s"));
        assert_eq!(bearer(Some(b"Bearer abc ")), Some("abc"));
        assert_eq!(bearer(Some(b"Basic abc")), None);
        assert_eq!(bearer(Some(b"Bearer ")), None);
        assert_eq!(bearer(None), None);
    }
}
