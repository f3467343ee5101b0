//! Tool calls as a stream, the way OpenAI streams them: the answer's text as it comes (less
//! what may still open a call), then per call a first delta with its id and name once the
//! name is complete, then its arguments as the model writes them. The deltas of one call's
//! arguments add up to exactly what the whole (non-streamed) answer gives.

use std::sync::Arc;

use super::scan::{arguments, scan};
use super::Tools;

/// What to send next.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    /// A call begins (OpenAI's first `delta.tool_calls[i]`, with `arguments: ""`).
    Call {
        index: u32,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments.
    Arguments {
        index: u32,
        text: String,
    },
}

/// One answer's stream of content and calls.
#[derive(Debug)]
pub struct CallStream {
    tools: Arc<Tools>,
    text: String,
    /// Bytes of `text` sent as content.
    sent: usize,
    /// Bytes of each started call's arguments sent.
    sent_args: Vec<usize>,
    /// The answer turned out not to be calls: everything is content from here on.
    plain: bool,
}

impl CallStream {
    pub fn new(tools: Arc<Tools>) -> Self {
        CallStream { tools, text: String::new(), sent: 0, sent_args: Vec::new(), plain: false }
    }

    /// The next piece of the answer's text; what can be sent now.
    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        self.text.push_str(delta);
        self.advance(false)
    }

    /// The answer ended: the rest, and whether it made calls (its finish reason is then
    /// `tool_calls`: every call complete).
    pub fn finish(&mut self) -> (Vec<Piece>, bool) {
        let out = self.advance(true);
        let s = scan(&self.text, &self.tools);
        let complete = !self.sent_args.is_empty() && !s.broken && s.calls.iter().all(|c| c.done);
        (out, complete)
    }

    fn advance(&mut self, last: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        if !self.plain {
            let s = scan(&self.text, &self.tools);
            if self.sent_args.is_empty() && (s.broken || last) {
                self.plain = true;
            } else {
                if s.content > self.sent && self.sent_args.is_empty() {
                    out.push(Piece::Content(self.text[self.sent..s.content].to_string()));
                    self.sent = s.content;
                }
                for (i, call) in s.calls.iter().enumerate() {
                    let Some(name) = &call.name else { break };
                    if i == self.sent_args.len() {
                        let id = format!("call_{}", uuid::Uuid::now_v7().simple());
                        out.push(Piece::Call { index: i as u32, id, name: name.clone() });
                        self.sent_args.push(0);
                    }
                    let Some((a, b)) = call.args else { continue };
                    let text = &self.text[a..b];
                    // A JSON string's content is the arguments: sent once it is complete.
                    let more = if text.starts_with('"') {
                        if !call.args_done || self.sent_args[i] > 0 {
                            continue;
                        }
                        arguments(&self.text, call).unwrap_or_default()
                    } else {
                        text[self.sent_args[i]..].to_string()
                    };
                    if !more.is_empty() {
                        self.sent_args[i] += if text.starts_with('"') { text.len() } else { more.len() };
                        out.push(Piece::Arguments { index: i as u32, text: more });
                    }
                }
                if last {
                    // Calls without arguments get OpenAI's `{}`.
                    for (i, call) in s.calls.iter().enumerate().take(self.sent_args.len()) {
                        if call.args.is_none() && call.done && self.sent_args[i] == 0 {
                            out.push(Piece::Arguments { index: i as u32, text: "{}".into() });
                        }
                    }
                }
            }
        }
        if self.plain && self.text.len() > self.sent {
            out.push(Piece::Content(self.text[self.sent..].to_string()));
            self.sent = self.text.len();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::ToolFormat;
    use super::super::tests::tools;
    use super::super::{parse, ToolChoice};
    use super::*;

    /// Streams `text` in pieces of `step` bytes (at char boundaries) and puts the pieces
    /// back together: (content, calls as (name, arguments), made calls, argument deltas).
    fn stream(text: &str, format: ToolFormat, step: usize) -> (String, Vec<(String, String)>, bool, usize) {
        let mut t = tools(ToolChoice::Auto);
        t.format = format;
        let mut s = CallStream::new(Arc::new(t));
        let mut pieces = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(step) {
            pieces.extend(s.push(&chunk.iter().collect::<String>()));
        }
        let (rest, made) = s.finish();
        pieces.extend(rest);
        let (mut content, mut calls, mut deltas) = (String::new(), Vec::<(String, String)>::new(), 0);
        for p in pieces {
            match p {
                Piece::Content(c) => content.push_str(&c),
                Piece::Call { index, name, .. } => {
                    assert_eq!(index as usize, calls.len());
                    calls.push((name, String::new()));
                }
                Piece::Arguments { index, text } => {
                    calls[index as usize].1.push_str(&text);
                    deltas += 1;
                }
            }
        }
        (content, calls, made, deltas)
    }

    #[test]
    fn streamed_calls_add_up_to_the_whole_answer() {
        let answers = [
            ("I will check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"get_time\"}</tool_call>", ToolFormat::Hermes),
            ("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {}}", ToolFormat::Llama3Json),
            ("[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]", ToolFormat::Mistral),
            ("[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}", ToolFormat::Mistral),
            ("<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}</tool_call>", ToolFormat::Hermes),
            ("Checking.\nfunctools[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]", ToolFormat::Phi4Mini),
            ("<|tool_call|>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}<|/tool_call|><|tool_call|>{\"name\": \"get_time\"}<|/tool_call|>", ToolFormat::Phi4Mini),
            ("[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]", ToolFormat::Phi4Mini),
        ];
        for (text, format) in answers {
            let mut t = tools(ToolChoice::Auto);
            t.format = format;
            let (content, whole) = parse(text, &t);
            let whole: Vec<(String, String)> = whole.into_iter().map(|c| (c.name, c.arguments)).collect();
            assert!(!whole.is_empty(), "{text}");
            for step in [1, 3, 7, 1000] {
                let (c, calls, made, deltas) = stream(text, format, step);
                assert_eq!((c.as_str(), &calls, made), (content.as_str(), &whole, true), "{text} by {step}");
                if step == 1 && !text.contains("\\\"") {
                    assert!(deltas > whole.len(), "arguments arrive in pieces: {text}");
                }
            }
        }
    }

    #[test]
    fn an_answer_that_is_not_a_call_streams_whole_as_text() {
        for (text, format) in [
            ("The weather in Paris is <b>fine</b>.", ToolFormat::Hermes),
            ("<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>", ToolFormat::Hermes),
            ("{\"answer\": 42}", ToolFormat::Llama3Json),
            ("Sunny. <tool_", ToolFormat::Hermes),
            ("Sunny. functool", ToolFormat::Phi4Mini),
            ("[1] is a citation.", ToolFormat::Phi4Mini),
        ] {
            for step in [1, 4, 1000] {
                let (content, calls, made, _) = stream(text, format, step);
                assert_eq!((content.as_str(), calls.len(), made), (text, 0, false), "{text} by {step}");
            }
        }
    }

    #[test]
    fn a_call_cut_short_is_not_a_finished_call() {
        let (_, calls, made, _) =
            stream("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par", ToolFormat::Hermes, 2);
        assert_eq!(calls, vec![("get_weather".to_string(), "{\"city\": \"Par".to_string())]);
        assert!(!made, "the finish reason stays the engine's (length)");
    }
}
