//! Thinking models (Qwen3, SmolLM3, DeepSeek-R1's distills) write their reasoning in a
//! `<think>...</think>` block before the answer. As vLLM's and SGLang's reasoning parsers
//! do, the router returns it apart: `message.reasoning_content` (streamed as
//! `delta.reasoning_content`), and the content is what follows the block, so a client that
//! shows or parses the answer (JSON, tool calls) gets the answer alone.
//!
//! A model's template uses the block when it mentions `</think>`. Whether the answer starts
//! inside the block depends on the prompt: DeepSeek-R1's template (and Qwen3's when thinking
//! is forced) ends the prompt with `<think>`, so the answer starts inside it with no opening
//! tag; Qwen3's default leaves the model to open the block; with thinking off its template
//! closes an empty block in the prompt, and the answer is all content.

/// The block's tags.
pub const OPEN: &str = "<think>";
pub const CLOSE: &str = "</think>";

/// Where an answer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The prompt opened the block: the answer starts inside it.
    Inside,
    /// The answer may open a block (after white space) or be all content.
    Outside,
}

impl Start {
    /// For a prompt rendered by `template_source`: None when the template writes no reasoning
    /// block.
    pub fn of(template_source: &str, prompt: &str) -> Option<Start> {
        if !template_source.contains(CLOSE) {
            return None;
        }
        Some(if prompt.trim_end().ends_with(OPEN) { Start::Inside } else { Start::Outside })
    }
}

/// A whole answer: its reasoning (None when it wrote no block, or an empty one) and its
/// content. Without the
/// closing tag (the length limit cut the reasoning) everything is reasoning.
pub fn split(text: &str, start: Start) -> (Option<String>, String) {
    let inner = match start {
        Start::Inside => text,
        Start::Outside => match text.trim_start().strip_prefix(OPEN) {
            Some(inner) => inner,
            None => return (None, text.to_string()),
        },
    };
    let (reasoning, content) = match inner.find(CLOSE) {
        Some(i) => (&inner[..i], inner[i + CLOSE.len()..].trim_start()),
        None => (inner, ""),
    };
    // An empty block is no reasoning (as its stream sends none).
    (Some(reasoning.to_string()).filter(|r| !r.is_empty()), content.to_string())
}

/// A piece of a streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Nothing but white space or the start of `<think>` yet.
    Before,
    Inside,
    /// After `</think>`, white space not yet passed.
    Closed,
    After,
}

/// One answer's stream: its text as it comes, as reasoning and content pieces that add up to
/// what `split` gives for the whole text.
#[derive(Debug)]
pub struct ReasoningStream {
    state: State,
    /// Text held back: what may still be a tag.
    held: String,
}

impl ReasoningStream {
    pub fn new(start: Start) -> Self {
        let state = if start == Start::Inside { State::Inside } else { State::Before };
        ReasoningStream { state, held: String::new() }
    }

    /// The next piece of the answer's text: what can be sent now.
    pub fn push(&mut self, delta: &str) -> Vec<Part> {
        self.held.push_str(delta);
        let mut out = Vec::new();
        loop {
            let text = std::mem::take(&mut self.held);
            match self.state {
                State::Before => {
                    let t = text.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Inside;
                        continue;
                    }
                    if t.is_empty() || OPEN.starts_with(t) {
                        self.held = text;
                    } else {
                        self.state = State::After;
                        out.push(Part::Content(text));
                    }
                }
                State::Inside => match text.find(CLOSE) {
                    Some(i) => {
                        if i > 0 {
                            out.push(Part::Reasoning(text[..i].to_string()));
                        }
                        self.held = text[i + CLOSE.len()..].to_string();
                        self.state = State::Closed;
                        continue;
                    }
                    None => {
                        let keep = (1..CLOSE.len()).rev().find(|&n| text.ends_with(&CLOSE[..n])).unwrap_or(0);
                        let (now, later) = text.split_at(text.len() - keep);
                        if !now.is_empty() {
                            out.push(Part::Reasoning(now.to_string()));
                        }
                        self.held = later.to_string();
                    }
                },
                State::Closed => {
                    let t = text.trim_start();
                    if !t.is_empty() {
                        self.state = State::After;
                        out.push(Part::Content(t.to_string()));
                    }
                }
                State::After => {
                    if !text.is_empty() {
                        out.push(Part::Content(text));
                    }
                }
            }
            return out;
        }
    }

    /// The answer ended: what was held back.
    pub fn finish(&mut self) -> Vec<Part> {
        let text = std::mem::take(&mut self.held);
        match self.state {
            _ if text.is_empty() => Vec::new(),
            State::Before | State::After => vec![Part::Content(text)],
            State::Inside => vec![Part::Reasoning(text)],
            State::Closed => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` streamed in pieces of `step` characters, put back together.
    fn streamed(text: &str, start: Start, step: usize) -> (Option<String>, String) {
        let mut s = ReasoningStream::new(start);
        let chars: Vec<char> = text.chars().collect();
        let mut parts = Vec::new();
        for chunk in chars.chunks(step) {
            parts.extend(s.push(&chunk.iter().collect::<String>()));
        }
        parts.extend(s.finish());
        let (mut reasoning, mut content) = (None::<String>, String::new());
        for p in parts {
            match p {
                Part::Reasoning(r) => reasoning.get_or_insert_with(String::new).push_str(&r),
                Part::Content(c) => content.push_str(&c),
            }
        }
        (reasoning, content)
    }

    #[test]
    fn the_block_is_split_from_the_answer_whole_and_streamed_alike() {
        let cases = [
            ("<think>\nTwo and two.\n</think>\n\nFour.", Start::Outside, Some("\nTwo and two.\n"), "Four."),
            ("\n<think>a < b</think>Yes", Start::Outside, Some("a < b"), "Yes"),
            ("Four.", Start::Outside, None, "Four."),
            ("  <thin", Start::Outside, None, "  <thin"),
            ("Use <think> tags", Start::Outside, None, "Use <think> tags"),
            ("Two and two.\n</think>\n\nFour.", Start::Inside, Some("Two and two.\n"), "Four."),
            ("<think>cut short by the length li", Start::Outside, Some("cut short by the length li"), ""),
            ("reasoning </thi", Start::Inside, Some("reasoning </thi"), ""),
            ("<think></think>Four.", Start::Outside, None, "Four."),
            ("<think>x</think>\n\n", Start::Outside, Some("x"), ""),
        ];
        for (text, start, reasoning, content) in cases {
            let whole = split(text, start);
            assert_eq!((whole.0.as_deref(), whole.1.as_str()), (reasoning, content), "{text:?}");
            for step in [1, 2, 3, 7, 1000] {
                let (r, c) = streamed(text, start, step);
                assert_eq!((r.as_deref(), c.as_str()), (reasoning, content), "{text:?} by {step}");
            }
        }
    }

    #[test]
    fn a_template_with_a_reasoning_block_is_recognized_and_the_prompt_says_where_answers_start() {
        let qwen3 = include_str!("../../engine/tests/data/chat_templates/Qwen-Qwen3-0.6B.jinja");
        let qwen25 = include_str!("../../engine/tests/data/chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja");
        let prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(Start::of(qwen3, prompt), Some(Start::Outside));
        assert_eq!(Start::of(qwen3, &format!("{prompt}<think>\n\n</think>\n\n")), Some(Start::Outside), "thinking off");
        assert_eq!(Start::of(qwen3, &format!("{prompt}<think>\n")), Some(Start::Inside), "the prompt opened it");
        assert_eq!(Start::of(qwen25, prompt), None);
    }
}
