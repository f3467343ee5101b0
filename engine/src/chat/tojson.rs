//! transformers' `tojson` filter for chat templates: Python's `json.dumps`, whose output
//! templates put in prompts (tool definitions, call arguments), byte for byte: its
//! separators, `indent`, `ensure_ascii`, `sort_keys` and float spelling. minijinja's own
//! filter writes compact JSON with HTML characters escaped, which changes the prompt.

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error as JinjaError, ErrorKind, Value};

/// transformers' `tojson` filter: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, arguments by position or name in that order. Unlike
/// minijinja's own filter it escapes no HTML characters and writes Python's separators
/// (`", "` and `": "`; `","` between items when indenting).
pub(super) fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> std::result::Result<String, JinjaError> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(JinjaError::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"));
    }
    let mut given: [Option<Value>; 4] = Default::default();
    for (slot, arg) in given.iter_mut().zip(args.0) {
        *slot = Some(arg);
    }
    for (slot, name) in given.iter_mut().zip(NAMES) {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slot.is_some() {
                return Err(JinjaError::new(ErrorKind::InvalidOperation, format!("tojson got {name} twice")));
            }
            *slot = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = given.map(|v| v.filter(|v| !v.is_none()));
    let indent = match indent {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => Some(" ".repeat(usize::try_from(i64::try_from(v)?.max(0)).unwrap_or(0))),
    };
    let (item_sep, key_sep) = match separators {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.as_str().unwrap_or("").to_string(), b.as_str().unwrap_or("").to_string())
                }
                _ => return Err(JinjaError::new(ErrorKind::InvalidOperation, "separators must be two strings")),
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let dumper = PyJson {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    dumper.dump(value, 0, &mut out)?;
    Ok(out)
}

/// Python's `json.dumps` options.
/// Python's `json.dumps(value)` with its defaults (`ensure_ascii`, `", "` and `": "`): how
/// a model card's example serializes what it puts in a prompt (Phi-4-mini's system `tools`).
pub fn json_dumps(value: &serde_json::Value) -> String {
    let dumper =
        PyJson { ensure_ascii: true, indent: None, item_sep: ", ".into(), key_sep: ": ".into(), sort_keys: false };
    let mut out = String::new();
    // A JSON value always dumps: every kind it holds is one Python's json writes.
    let _ = dumper.dump(&Value::from_serialize(value), 0, &mut out);
    out
}

struct PyJson {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl PyJson {
    fn dump(&self, value: &Value, depth: usize, out: &mut String) -> std::result::Result<(), JinjaError> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&py_number(value)?),
            ValueKind::String => self.string(value.as_str().unwrap_or(""), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container(['[', ']'], items.len(), depth, out, |i, out| self.dump(&items[i], depth + 1, out))?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    let key = match key.kind() {
                        ValueKind::String => key.as_str().unwrap_or("").to_string(),
                        ValueKind::None => "null".to_string(),
                        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
                        ValueKind::Number => py_number(&key)?,
                        kind => return Err(not_serializable(kind)),
                    };
                    entries.push((key, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container(['{', '}'], entries.len(), depth, out, |i, out| {
                    self.string(&entries[i].0, out);
                    out.push_str(&self.key_sep);
                    self.dump(&entries[i].1, depth + 1, out)
                })?;
            }
            kind => return Err(not_serializable(kind)),
        }
        Ok(())
    }

    /// `[...]` or `{...}` with `len` items written by `item`, newlines and indentation when
    /// indenting (empty containers stay `[]` / `{}`, as in Python).
    fn container(
        &self,
        [open, close]: [char; 2],
        len: usize,
        depth: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String) -> std::result::Result<(), JinjaError>,
    ) -> std::result::Result<(), JinjaError> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        let newline = |out: &mut String, level: usize| {
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(level));
            }
        };
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            newline(out, depth + 1);
            item(i, out)?;
        }
        newline(out, depth);
        out.push(close);
        Ok(())
    }

    /// A JSON string as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other
    /// control characters as `\u00XX`; with `ensure_ascii` everything outside printable ASCII
    /// as `\uXXXX` (UTF-16 surrogate pairs above the BMP).
    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !(' '..='~').contains(&c)) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

fn not_serializable(kind: ValueKind) -> JinjaError {
    JinjaError::new(ErrorKind::InvalidOperation, format!("object of type {kind} is not JSON serializable"))
}

/// A number as Python's `json.dumps` writes it: integers as they are, floats as `repr`
/// (`1.0`, `0.1`, `1e-07`, `1e+16`), non-finite ones as `NaN` / `Infinity`.
fn py_number(value: &Value) -> std::result::Result<String, JinjaError> {
    if value.is_integer() {
        return Ok(value.to_string());
    }
    let f = f64::try_from(value.clone())?;
    if f.is_nan() {
        return Ok("NaN".into());
    }
    if f.is_infinite() {
        return Ok(if f > 0.0 { "Infinity" } else { "-Infinity" }.into());
    }
    // Rust's `{:e}` gives the same shortest digits as Python's repr; Python writes them
    // positionally for exponents -4 through 15.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let plain = format!("{f}");
        Ok(if plain.contains('.') { plain } else { format!("{plain}.0") })
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        Ok(format!("{mantissa}e{sign}{:02}", exp.abs()))
    }
}
