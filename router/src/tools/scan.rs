//! Reading tool calls out of an answer that may still be growing: one scan serves the whole
//! answer (`parse`) and the stream (`stream.rs`, which scans the text so far after every
//! token and sends what is new). The scan finds where the calls start, each call's name once
//! its JSON string is complete, and the byte span of its arguments as far as they have
//! arrived; text that might still turn into a call's opening is held back.

use super::format::{
    ToolFormat, FUNCTOOLS, HERMES_CLOSE, HERMES_OPEN, MISTRAL_ARGS, MISTRAL_CALLS, PHI_CALL_CLOSE, PHI_CALL_OPEN,
    PYTHON_TAG,
};
use super::{ParsedCall, Tools};

/// One call as far as it has arrived.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Partial {
    /// Complete once its JSON string is.
    pub name: Option<String>,
    /// Byte span of the arguments' JSON value so far.
    pub args: Option<(usize, usize)>,
    /// The arguments' value is complete.
    pub args_done: bool,
    /// The whole call is complete.
    pub done: bool,
}

/// What an answer so far holds.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Scan {
    /// `text[..content]` is surely content (not the start of a call).
    pub content: usize,
    /// Where the calls begin, once they do.
    pub calls_start: Option<usize>,
    pub calls: Vec<Partial>,
    /// A call is malformed or names a function that is not offered: nothing from it on is
    /// a call.
    pub broken: bool,
}

/// Scans `text` for calls of `tools` in their format.
pub(super) fn scan(text: &str, tools: &Tools) -> Scan {
    let mut s = match tools.format {
        ToolFormat::Hermes => hermes(text),
        ToolFormat::Llama3Json => llama3(text),
        ToolFormat::Mistral => mistral(text),
        ToolFormat::Phi4Mini => phi4_mini(text),
    };
    let offered = |name: &str| tools.functions.iter().any(|f| f.name == name);
    if let Some(bad) = s.calls.iter().position(|c| match &c.name {
        Some(n) => !offered(n),
        None => c.done,
    }) {
        s.calls.truncate(bad);
        s.broken = true;
    }
    s
}

/// The whole answer: its text before the calls and the calls, when every call is complete
/// and well-formed; otherwise the whole text and no calls.
pub fn parse(text: &str, tools: &Tools) -> (String, Vec<ParsedCall>) {
    let s = scan(text, tools);
    let whole = || (text.to_string(), Vec::new());
    let (Some(start), false) = (s.calls_start, s.broken) else { return whole() };
    if s.calls.is_empty() || s.calls.iter().any(|c| !c.done) {
        return whole();
    }
    let mut calls = Vec::with_capacity(s.calls.len());
    for c in &s.calls {
        let Some(arguments) = arguments(text, c) else { return whole() };
        calls.push(ParsedCall { name: c.name.clone().unwrap_or_default(), arguments });
    }
    (text[..start].trim_end().to_string(), calls)
}

/// A complete call's arguments as OpenAI's JSON text: the model's own text of the value (so a
/// stream's argument deltas add up to it), a JSON string's content, `{}` when absent or null.
pub(super) fn arguments(text: &str, c: &Partial) -> Option<String> {
    let Some((a, b)) = c.args else { return Some("{}".to_string()) };
    match serde_json::from_str::<serde_json::Value>(&text[a..b]).ok()? {
        serde_json::Value::Null => Some("{}".to_string()),
        serde_json::Value::String(s) => Some(s),
        _ => Some(text[a..b].to_string()),
    }
}

fn hermes(t: &str) -> Scan {
    let Some(first) = t.find(HERMES_OPEN) else { return content_only(t, &[HERMES_OPEN]) };
    let mut s = Scan { content: t[..first].trim_end().len(), calls_start: Some(first), ..Scan::default() };
    let b = t.as_bytes();
    let mut at = first;
    loop {
        let j = ws(b, at + HERMES_OPEN.len());
        if j >= b.len() {
            break;
        }
        if b[j] != b'{' {
            s.broken = true;
            break;
        }
        let (call, end) = object(t, j, ToolFormat::Hermes.argument_keys());
        s.calls.push(call);
        let Some(end) = end.take(&mut s) else { break };
        let j = ws(b, end);
        if !t[j..].starts_with(HERMES_CLOSE) {
            s.broken = !HERMES_CLOSE.starts_with(&t[j..]);
            break;
        }
        match t[j..].find(HERMES_OPEN) {
            Some(k) => at = j + k,
            None => break,
        }
    }
    s
}

fn llama3(t: &str) -> Scan {
    let b = t.as_bytes();
    let hold = Scan { calls_start: Some(0), ..Scan::default() };
    let j = ws(b, 0);
    if j >= b.len() || (t[j..].len() < PYTHON_TAG.len() && PYTHON_TAG.starts_with(&t[j..])) {
        return Scan { calls_start: None, ..hold };
    }
    let tagged = t[j..].starts_with(PYTHON_TAG);
    let mut k = if tagged { ws(b, j + PYTHON_TAG.len()) } else { j };
    if k >= b.len() {
        return hold;
    }
    if b[k] != b'{' {
        return if tagged { Scan { broken: true, ..hold } } else { Scan { content: t.len(), ..Scan::default() } };
    }
    let mut s = hold;
    loop {
        let (call, end) = object(t, k, ToolFormat::Llama3Json.argument_keys());
        s.calls.push(call);
        let Some(end) = end.take(&mut s) else { break };
        k = ws(b, end);
        if k >= b.len() || b[k] != b';' {
            break;
        }
        k = ws(b, k + 1);
        if k >= b.len() {
            break;
        }
        if b[k] != b'{' {
            s.broken = true;
            break;
        }
    }
    s
}

fn mistral(t: &str) -> Scan {
    let Some(first) = t.find(MISTRAL_CALLS) else { return content_only(t, &[MISTRAL_CALLS]) };
    let mut s = Scan { content: t[..first].trim_end().len(), calls_start: Some(first), ..Scan::default() };
    let b = t.as_bytes();
    let mut j = ws(b, first + MISTRAL_CALLS.len());
    if j >= b.len() {
        return s;
    }
    if b[j] == b'[' {
        list(t, j, ToolFormat::Mistral, &mut s);
        return s;
    }
    // `name[ARGS]{...}`, each call after its own `[TOOL_CALLS]`.
    loop {
        let Some(k) = t[j..].find(MISTRAL_ARGS) else {
            let rest = &t[j..];
            let name = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-')).unwrap_or(rest.len());
            s.broken = !MISTRAL_ARGS.starts_with(&rest[name..]);
            break;
        };
        let name = t[j..j + k].trim().to_string();
        let v = ws(b, j + k + MISTRAL_ARGS.len());
        let mut call = Partial { name: Some(name), ..Partial::default() };
        if v >= b.len() {
            s.calls.push(call);
            break;
        }
        let end = value_end(b, v);
        call.args = Some((v, end.unwrap_or(b.len())));
        call.args_done = end.is_some();
        call.done = end.is_some();
        s.calls.push(call);
        let Some(end) = end else { break };
        j = ws(b, end);
        if !t[j..].starts_with(MISTRAL_CALLS) {
            break;
        }
        j = ws(b, j + MISTRAL_CALLS.len());
    }
    s
}

/// Phi-4-mini: `functools[{...}, ...]` after optional text (vLLM's and SGLang's convention),
/// or `<|tool_call|>` and a list or one object, optionally closed by `<|/tool_call|>` and
/// followed by more (llama.cpp's). Where those markers are special tokens, the answer's text
/// lacks them: an answer that opens with a JSON list is read as that list of calls.
fn phi4_mini(t: &str) -> Scan {
    let b = t.as_bytes();
    let found = [FUNCTOOLS, PHI_CALL_OPEN].into_iter().filter_map(|m| t.find(m).map(|i| (i, m))).min();
    let Some((first, marker)) = found else {
        let j = ws(b, 0);
        return match b.get(j) {
            None => Scan::default(),
            Some(b'[') => {
                let mut s = Scan { calls_start: Some(0), ..Scan::default() };
                list(t, j, ToolFormat::Phi4Mini, &mut s);
                s
            }
            Some(_) => content_only(t, &[FUNCTOOLS, PHI_CALL_OPEN]),
        };
    };
    let mut s = Scan { content: t[..first].trim_end().len(), calls_start: Some(first), ..Scan::default() };
    let mut j = ws(b, first + marker.len());
    loop {
        let end = match b.get(j) {
            None => break,
            Some(b'[') => match list(t, j, ToolFormat::Phi4Mini, &mut s) {
                Some(end) => end,
                None => break,
            },
            Some(b'{') if marker == PHI_CALL_OPEN => {
                let (call, end) = object(t, j, ToolFormat::Phi4Mini.argument_keys());
                s.calls.push(call);
                match end.take(&mut s) {
                    Some(end) => end,
                    None => break,
                }
            }
            Some(_) => {
                s.broken = true;
                break;
            }
        };
        if marker != PHI_CALL_OPEN {
            break;
        }
        // After a `<|tool_call|>` block: its optional close, then perhaps another block.
        j = ws(b, end);
        if t[j..].starts_with(PHI_CALL_CLOSE) {
            j = ws(b, j + PHI_CALL_CLOSE.len());
        }
        if !t[j..].starts_with(PHI_CALL_OPEN) {
            break;
        }
        j = ws(b, j + PHI_CALL_OPEN.len());
    }
    s
}

/// The JSON list of call objects at `t[j]` (a `[`), into `s`; where it ends once complete.
fn list(t: &str, j: usize, format: ToolFormat, s: &mut Scan) -> Option<usize> {
    let b = t.as_bytes();
    let mut j = ws(b, j + 1);
    while j < b.len() {
        if b[j] != b'{' {
            s.broken = true;
            return None;
        }
        let (call, end) = object(t, j, format.argument_keys());
        s.calls.push(call);
        j = ws(b, end.take(s)?);
        match b.get(j) {
            Some(b',') => j = ws(b, j + 1),
            Some(b']') => return Some(j + 1),
            None => return None,
            Some(_) => {
                s.broken = true;
                return None;
            }
        }
    }
    None
}

/// An answer with no call so far: everything is content except a tail that may be the
/// start of `markers` (or trailing white space, which belongs to the calls if they follow).
fn content_only(t: &str, markers: &[&str]) -> Scan {
    let held =
        markers.iter().flat_map(|m| (1..m.len()).rev().filter(move |&n| t.ends_with(&m[..n]))).max().unwrap_or(0);
    let kept = t[..t.len() - held].trim_end().len();
    Scan { content: kept, ..Scan::default() }
}

/// How a scanned JSON piece ended.
#[derive(Debug, Clone, Copy)]
enum End {
    /// Complete, ending before this byte.
    At(usize),
    /// The text stops inside it.
    More,
    /// Not well-formed.
    Bad,
}

impl End {
    /// The end of a complete piece; otherwise records a malformed one in `s` and gives None.
    fn take(self, s: &mut Scan) -> Option<usize> {
        match self {
            End::At(e) => Some(e),
            End::More => None,
            End::Bad => {
                s.broken = true;
                None
            }
        }
    }
}

fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The JSON string at `t[i]` (a `"`), decoded.
fn string(t: &str, i: usize) -> (Option<String>, End) {
    let b = t.as_bytes();
    match b.get(i) {
        None => return (None, End::More),
        Some(b'"') => {}
        Some(_) => return (None, End::Bad),
    }
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => {
                return match serde_json::from_str(&t[i..=j]) {
                    Ok(s) => (Some(s), End::At(j + 1)),
                    Err(_) => (None, End::Bad),
                }
            }
            _ => j += 1,
        }
    }
    (None, End::More)
}

/// Where the JSON value starting at `b[i]` (not white space) ends; None while it is
/// incomplete. Its inside is checked when the call is parsed whole.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b[i] {
        b'{' | b'[' => {
            let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
            for (j, &c) in b.iter().enumerate().skip(i) {
                if in_string {
                    match (escaped, c) {
                        (true, _) => escaped = false,
                        (false, b'\\') => escaped = true,
                        (false, b'"') => in_string = false,
                        _ => {}
                    }
                    continue;
                }
                match c {
                    b'"' => in_string = true,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
            }
            None
        }
        b'"' => {
            let mut j = i + 1;
            while j < b.len() {
                match b[j] {
                    b'\\' => j += 2,
                    b'"' => return Some(j + 1),
                    _ => j += 1,
                }
            }
            None
        }
        _ => (i..b.len()).find(|&j| matches!(b[j], b',' | b'}' | b']') || b[j].is_ascii_whitespace()),
    }
}

/// The call object at `t[i]` (a `{`): its name, its arguments (under one of `arg_keys`), and
/// where it ends.
fn object(t: &str, i: usize, arg_keys: &[&str]) -> (Partial, End) {
    let b = t.as_bytes();
    let mut p = Partial::default();
    let mut j = ws(b, i + 1);
    if b.get(j) == Some(&b'}') {
        p.done = true;
        return (p, End::At(j + 1));
    }
    loop {
        let (key, end) = string(t, j);
        let (Some(key), End::At(k)) = (key, end) else { return (p, end) };
        j = ws(b, k);
        match b.get(j) {
            None => return (p, End::More),
            Some(b':') => j = ws(b, j + 1),
            Some(_) => return (p, End::Bad),
        }
        if j >= b.len() {
            return (p, End::More);
        }
        if key == "name" {
            let (name, end) = string(t, j);
            match end {
                End::At(k) => {
                    p.name = name;
                    j = k;
                }
                other => return (p, other),
            }
        } else {
            let end = value_end(b, j);
            if arg_keys.contains(&key.as_str()) {
                p.args = Some((j, end.unwrap_or(b.len())));
                p.args_done = end.is_some();
            }
            match end {
                Some(e) => j = e,
                None => return (p, End::More),
            }
        }
        j = ws(b, j);
        match b.get(j) {
            None => return (p, End::More),
            Some(b',') => j = ws(b, j + 1),
            Some(b'}') => {
                p.done = true;
                return (p, End::At(j + 1));
            }
            Some(_) => return (p, End::Bad),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::tools;
    use super::*;
    use crate::tools::ToolChoice;

    fn calls(text: &str, format: ToolFormat) -> Vec<(String, String)> {
        let mut t = tools(ToolChoice::Auto);
        t.format = format;
        parse(text, &t).1.into_iter().map(|c| (c.name, c.arguments)).collect()
    }

    #[test]
    fn each_format_is_parsed() {
        let weather = ("get_weather".to_string(), r#"{"city": "Paris"}"#.to_string());
        let time = ("get_time".to_string(), "{}".to_string());
        let hermes = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"get_time\"}</tool_call>";
        assert_eq!(calls(hermes, ToolFormat::Hermes), vec![weather.clone(), time.clone()]);
        let llama = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": null}";
        assert_eq!(calls(llama, ToolFormat::Llama3Json), vec![weather.clone(), time.clone()]);
        assert_eq!(calls(&llama[PYTHON_TAG.len()..], ToolFormat::Llama3Json).len(), 2, "the tag is optional");
        let mistral = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
        assert_eq!(calls(mistral, ToolFormat::Mistral), vec![weather.clone(), time.clone()]);
        let mistral11 = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}";
        assert_eq!(calls(mistral11, ToolFormat::Mistral), vec![weather.clone(), time.clone()]);
        for phi4 in [
            "functools[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]",
            "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\"}]<|/tool_call|>",
            "<|tool_call|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|/tool_call|>\n<|tool_call|>{\"name\": \"get_time\"}<|/tool_call|>",
            // The markers were special tokens, left out of the text.
            " [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]",
        ] {
            assert_eq!(calls(phi4, ToolFormat::Phi4Mini), vec![weather.clone(), time.clone()], "{phi4}");
        }
        let mut t = tools(ToolChoice::Auto);
        t.format = ToolFormat::Phi4Mini;
        let (content, parsed) = parse("Let me look.\nfunctools[{\"name\": \"get_time\"}]", &t);
        assert_eq!((content.as_str(), parsed.len()), ("Let me look.", 1));
    }

    #[test]
    fn anything_else_is_text() {
        for (text, format) in [
            ("The weather is fine.", ToolFormat::Hermes),
            ("<tool_call>{not json}</tool_call>", ToolFormat::Hermes),
            ("<tool_call>{\"name\":\"rm_rf\",\"arguments\":{}}</tool_call>", ToolFormat::Hermes),
            ("<tool_call>{\"name\":\"get_time\",\"arguments\":{\"a\":}}</tool_call>", ToolFormat::Hermes),
            ("<tool_call>{\"name\":\"get_time\",\"arguments\":{", ToolFormat::Hermes),
            ("{\"answer\": 42}", ToolFormat::Llama3Json),
            ("Paris is sunny.", ToolFormat::Llama3Json),
            ("[TOOL_CALLS] [{\"name\": \"rm_rf\", \"arguments\": {}}]", ToolFormat::Mistral),
            ("[1] is a citation.", ToolFormat::Phi4Mini),
            ("functools[{\"name\": \"rm_rf\", \"arguments\": {}}]", ToolFormat::Phi4Mini),
            ("<|tool_call|>{\"name\": \"get_time\"", ToolFormat::Phi4Mini),
            ("It is sunny in Paris.", ToolFormat::Phi4Mini),
        ] {
            assert_eq!(calls(text, format), Vec::new(), "{text}");
            let mut t = tools(ToolChoice::Auto);
            t.format = format;
            assert_eq!(parse(text, &t).0, text, "the whole text stays: {text}");
        }
    }

    #[test]
    fn a_growing_answer_holds_back_what_may_open_a_call() {
        let t = tools(ToolChoice::Auto);
        assert_eq!(scan("Let me check. <tool_", &t).content, "Let me check.".len());
        assert_eq!(scan("Let me check <b>", &t).content, "Let me check <b>".len());
        let s = scan("Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci", &t);
        assert_eq!(s.content, "Sure.".len());
        assert_eq!(s.calls.len(), 1);
        assert_eq!(s.calls[0].name.as_deref(), Some("get_weather"));
        assert!(!s.calls[0].args_done && !s.calls[0].done && !s.broken);
        let s = scan("<tool_call>{\"name\": \"get_wea", &t);
        assert_eq!(s.calls[0].name, None, "a name counts once its string is complete");
    }
}
