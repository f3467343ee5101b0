//! Traffic classes: what a request may ask for and how long it may wait, declared in a TOML
//! file (`--classes`) or the built-in `interactive` + `batch`. A request's class comes from
//! its API key when the key is mapped to one (a class's `api_keys`, or a tenant's `class`; a
//! key cannot claim another class), else from the `x-pd-class` header or metadata (never a class
//! with `api_keys`: those are reserved for their keys, 403), else the
//! default class. The same file declares tenants (`tenants`: keys, class, rate) and whether
//! an API key is required (`require_api_key`: 401 without a known one). Limits are checked here with
//! errors that name the limit; the queue budget and SLOs are used by `schedule`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::error::RouterError;
use crate::tenants::{bearer, Tenant, TenantSpec};

/// One class as written in the file (milliseconds and token counts).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassSpec {
    /// Higher runs first.
    pub priority: i32,
    pub max_input_tokens: usize,
    pub max_output_tokens: usize,
    /// Time to first token this class is promised (p95), from arrival.
    pub ttft_slo_ms: u64,
    /// Inter-token latency this class is promised (p95), for reports and goodput.
    pub itl_slo_ms: u64,
    /// Most prompt tokens of this class waiting in the router's queue.
    pub max_queued_tokens: u64,
    /// Longest a request of this class waits in the queue before it is refused.
    pub max_queue_age_ms: u64,
    /// API keys (`Authorization: Bearer KEY`) whose requests belong to this class.
    #[serde(default)]
    pub api_keys: Vec<String>,
}

/// The file: `default = "name"` and a `[classes.NAME]` table per class.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClassFile {
    default: String,
    classes: BTreeMap<String, ClassSpec>,
    #[serde(default)]
    require_api_key: bool,
    #[serde(default)]
    tenants: BTreeMap<String, TenantSpec>,
}

/// A class ready for use.
#[derive(Debug, Clone)]
pub struct Class {
    pub name: String,
    /// Position in `Classes::all` (the scheduler's queue index).
    pub index: usize,
    pub spec: ClassSpec,
}

impl Class {
    pub fn ttft_slo(&self) -> Duration {
        Duration::from_millis(self.spec.ttft_slo_ms)
    }

    pub fn max_queue_age(&self) -> Duration {
        Duration::from_millis(self.spec.max_queue_age_ms)
    }

    /// The metric and trace label.
    pub fn label(&self) -> pd_telemetry::RequestClass {
        pd_telemetry::RequestClass::parse(&self.name).unwrap_or_else(|_| pd_telemetry::RequestClass::default_class())
    }

    /// Checks a request's sizes against this class. `max_tokens_given` is false when the
    /// output limit came from a default, which is then capped to the class instead.
    pub fn check(
        &self,
        prompt_tokens: usize,
        max_tokens: usize,
        max_tokens_given: bool,
        field: &str,
    ) -> Result<usize, RouterError> {
        let s = &self.spec;
        if prompt_tokens > s.max_input_tokens {
            return Err(RouterError::OverClassLimit(format!(
                "the prompt has {prompt_tokens} tokens; class `{}` allows at most {} (max_input_tokens)",
                self.name, s.max_input_tokens
            )));
        }
        if max_tokens > s.max_output_tokens {
            if !max_tokens_given {
                return Ok(s.max_output_tokens);
            }
            return Err(RouterError::OverClassLimit(format!(
                "`{field}` is {max_tokens}; class `{}` allows at most {} (max_output_tokens)",
                self.name, s.max_output_tokens
            )));
        }
        Ok(max_tokens)
    }
}

/// Every class, and how a request finds its own.
#[derive(Debug, Clone)]
pub struct Classes {
    all: Vec<Arc<Class>>,
    default: usize,
    tenants: Vec<Arc<Tenant>>,
    require_api_key: bool,
}

/// The header (HTTP) and metadata key (gRPC) naming a request's class.
pub const CLASS_HEADER: &str = pd_telemetry::RequestClass::HEADER;

/// The built-in classes, as a file would write them.
pub const BUILT_IN: &str = include_str!("../../deploy/classes/default.toml");

impl Classes {
    /// Reads `path`, or the built-in classes when None.
    pub fn load(path: Option<&Path>) -> anyhow::Result<Self> {
        match path {
            None => Self::parse(BUILT_IN).map_err(|e| anyhow::anyhow!("built-in classes: {e}")),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("reading {}: {e}", p.display()))?;
                Self::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
            }
        }
    }

    /// Parses and checks a class file.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: ClassFile = toml::from_str(text).map_err(|e| format!("invalid class file: {e}"))?;
        let mut all = Vec::new();
        let mut keys = BTreeMap::new();
        for (index, (name, spec)) in file.classes.into_iter().enumerate() {
            pd_telemetry::RequestClass::parse(&name).map_err(|e| format!("class `{name}`: {e}"))?;
            check_spec(&name, &spec)?;
            for key in &spec.api_keys {
                if let Some(other) = keys.insert(key.clone(), name.clone()) {
                    return Err(format!("an API key is listed under both `{other}` and `{name}`"));
                }
            }
            all.push(Arc::new(Class { name, index, spec }));
        }
        let default = all
            .iter()
            .position(|c| c.name == file.default)
            .ok_or_else(|| format!("default class `{}` is not declared", file.default))?;
        let mut tenants = Vec::new();
        for (name, spec) in file.tenants {
            if let Some(class) = &spec.class {
                if !all.iter().any(|c| &c.name == class) {
                    return Err(format!("tenant `{name}`: class `{class}` is not declared"));
                }
            }
            for key in &spec.api_keys {
                if let Some(other) = keys.insert(key.clone(), name.clone()) {
                    return Err(format!("an API key is listed under both `{other}` and `{name}`"));
                }
            }
            tenants.push(Arc::new(Tenant::new(name, spec)?));
        }
        if file.require_api_key && keys.is_empty() {
            return Err("require_api_key is set but no class or tenant lists an API key".into());
        }
        Ok(Classes { all, default, tenants, require_api_key: file.require_api_key })
    }

    pub fn all(&self) -> &[Arc<Class>] {
        &self.all
    }

    pub fn default_class(&self) -> &Arc<Class> {
        &self.all[self.default]
    }

    /// The class of a request with `header` (x-pd-class) and `authorization` values; 401
    /// without a known key when one is required, 429 when its tenant is over its rate.
    pub fn assign(&self, header: Option<&[u8]>, authorization: Option<&[u8]>) -> Result<Arc<Class>, RouterError> {
        match bearer(authorization) {
            Some(key) => {
                if let Some(c) = self.all.iter().find(|c| c.spec.api_keys.iter().any(|k| k == key)) {
                    return Ok(c.clone());
                }
                if let Some(t) = self.tenants.iter().find(|t| t.spec.api_keys.iter().any(|k| k == key)) {
                    t.admit(std::time::Instant::now())?;
                    if let Some(class) = t.spec.class.as_ref().and_then(|n| self.all.iter().find(|c| &c.name == n)) {
                        return Ok(class.clone());
                    }
                } else if self.require_api_key {
                    return Err(RouterError::Unauthorized("the API key is not known here".into()));
                }
            }
            None if self.require_api_key => {
                return Err(RouterError::Unauthorized("an API key is required (Authorization: Bearer KEY)".into()));
            }
            None => {}
        }
        self.by_header(header)
    }

    /// The tenant whose API key `authorization` carries, for the request's record.
    pub fn tenant(&self, authorization: Option<&[u8]>) -> Option<String> {
        let key = bearer(authorization)?;
        self.tenants.iter().find(|t| t.spec.api_keys.iter().any(|k| k == key)).map(|t| t.name.clone())
    }

    /// The class a header names, or the default without one. A class with `api_keys` is
    /// reserved for them: a request gets there by its key, never by naming it (403).
    fn by_header(&self, header: Option<&[u8]>) -> Result<Arc<Class>, RouterError> {
        let Some(value) = header else { return Ok(self.default_class().clone()) };
        let name = std::str::from_utf8(value).map_err(|_| RouterError::invalid(CLASS_HEADER, "is not UTF-8"))?.trim();
        let class = self.all.iter().find(|c| c.name == name).cloned().ok_or_else(|| {
            let known: Vec<&str> = self.all.iter().map(|c| c.name.as_str()).collect();
            RouterError::invalid(
                CLASS_HEADER,
                format!("unknown class `{name}`; this router serves {}", known.join(", ")),
            )
        })?;
        if !class.spec.api_keys.is_empty() {
            return Err(RouterError::Forbidden(format!(
                "class `{name}` is reserved for its own API keys; this request's key (or its absence) does not open it"
            )));
        }
        Ok(class)
    }
}

fn check_spec(name: &str, s: &ClassSpec) -> Result<(), String> {
    let zero = [
        ("max_input_tokens", s.max_input_tokens as u64),
        ("max_output_tokens", s.max_output_tokens as u64),
        ("ttft_slo_ms", s.ttft_slo_ms),
        ("itl_slo_ms", s.itl_slo_ms),
        ("max_queued_tokens", s.max_queued_tokens),
        ("max_queue_age_ms", s.max_queue_age_ms),
    ];
    match zero.iter().find(|(_, v)| *v == 0) {
        Some((field, _)) => Err(format!("class `{name}`: {field} must be at least 1")),
        None if s.max_queued_tokens < s.max_input_tokens as u64 => Err(format!(
            "class `{name}`: max_queued_tokens ({}) is below max_input_tokens ({}): its largest prompt could never queue",
            s.max_queued_tokens, s.max_input_tokens
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built_in() -> Classes {
        Classes::parse(BUILT_IN).expect("built-in classes")
    }

    #[test]
    fn built_in_has_interactive_by_default_and_batch() {
        let c = built_in();
        assert_eq!(c.default_class().name, "interactive");
        let batch = c.assign(Some(b"batch"), None).expect("batch");
        assert!(batch.spec.priority < c.default_class().spec.priority);
        assert!(batch.spec.max_queue_age_ms > c.default_class().spec.max_queue_age_ms);
    }

    #[test]
    fn an_unknown_class_is_named_with_the_known_ones() {
        let err = built_in().assign(Some(b"gold"), None).expect_err("unknown");
        assert!(matches!(&err, RouterError::InvalidRequest { param: Some(p), message }
            if p == CLASS_HEADER && message.contains("gold") && message.contains("interactive")));
    }

    #[test]
    fn an_api_key_decides_the_class_over_the_header() {
        let file = BUILT_IN.replace("[classes.batch]", "[classes.batch]\napi_keys = [\"k-batch\"]");
        let c = Classes::parse(&file).expect("classes");
        let class = c.assign(Some(b"interactive"), Some(b"Bearer k-batch")).expect("class");
        assert_eq!(class.name, "batch");
        assert_eq!(c.assign(None, Some(b"Bearer other")).expect("class").name, "interactive");
        // A class with keys is theirs: naming it in the header opens nothing.
        for key in [None, Some(&b"Bearer other"[..])] {
            let refused = c.assign(Some(b"batch"), key).expect_err("reserved");
            assert!(matches!(&refused, RouterError::Forbidden(m) if m.contains("batch")), "{refused:?}");
        }
        let tenants = file + "\n[tenants.free]\napi_keys = [\"k-free\"]\n";
        let c = Classes::parse(&tenants).expect("classes");
        assert!(matches!(c.assign(Some(b"batch"), Some(b"Bearer k-free")), Err(RouterError::Forbidden(_))));
    }

    #[test]
    fn tenants_need_their_key_get_their_class_and_are_held_to_their_rate() {
        // Top-level keys come before the tables in TOML.
        let file = BUILT_IN.replace("default = \"interactive\"", "default = \"interactive\"\nrequire_api_key = true")
            + "\n[tenants.acme]\napi_keys = [\"k-acme\"]\nclass = \"batch\"\nrequests_per_s = 1\n"
            + "\n[tenants.free]\napi_keys = [\"k-free\"]\n";
        let c = Classes::parse(&file).expect("classes");
        let missing = c.assign(None, None).expect_err("no key");
        assert!(matches!(&missing, RouterError::Unauthorized(m) if m.contains("Authorization: Bearer")));
        assert!(matches!(c.assign(None, Some(b"Bearer nope")), Err(RouterError::Unauthorized(_))));
        let acme = c.assign(Some(b"interactive"), Some(b"Bearer k-acme")).expect("acme");
        assert_eq!(acme.name, "batch", "the tenant's class, whatever the header says");
        let limited = c.assign(None, Some(b"Bearer k-acme")).expect_err("1 request/s");
        assert!(matches!(limited, RouterError::Overloaded { retry_after_s: 1, .. }));
        assert_eq!(c.assign(Some(b"batch"), Some(b"Bearer k-free")).expect("free").name, "batch");
        assert_eq!(c.assign(None, Some(b"Bearer k-free")).expect("free").name, "interactive");
        let bad = format!("{BUILT_IN}\n[tenants.x]\napi_keys = [\"k\"]\nclass = \"gold\"\n");
        assert!(Classes::parse(&bad).expect_err("unknown class").contains("class `gold`"));
    }

    #[test]
    fn limits_name_the_limit_and_defaults_are_capped() {
        let c = built_in();
        let i = c.default_class();
        let over_input = i.check(i.spec.max_input_tokens + 1, 1, true, "max_tokens").expect_err("input");
        assert!(over_input.to_string().contains("max_input_tokens"), "{over_input}");
        let over_output = i.check(1, i.spec.max_output_tokens + 1, true, "max_tokens").expect_err("output");
        assert!(over_output.to_string().contains("max_output_tokens"), "{over_output}");
        assert_eq!(i.check(1, i.spec.max_output_tokens + 1, false, "max_tokens"), Ok(i.spec.max_output_tokens));
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        for (file, says) in [
            ("default = \"x\"\n[classes]\n", "default class `x`"),
            ("default = 3", "invalid class file"),
            (&BUILT_IN.replace("ttft_slo_ms = 1500", "ttft_slo_ms = 0"), "ttft_slo_ms must be at least 1"),
            (&BUILT_IN.replace("priority = 10", "priority = 10\nspeed = 1"), "unknown field `speed`"),
        ] {
            let err = Classes::parse(file).expect_err(file);
            assert!(err.contains(says), "{err} should say {says}");
        }
    }
}
