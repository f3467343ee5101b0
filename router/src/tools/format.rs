//! The tool-call formats models are taught, and which one a checkpoint uses: read from its chat
//! template, as vLLM's and SGLang's parsers are chosen per model family.
//!
//! - **Hermes** (Qwen 2.5 / 3, Hermes, and pd's own prompt for templates without tools):
//!   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional text.
//! - **Llama 3.1 JSON** (Llama 3.1 / 3.2 / 3.3): the whole answer is
//!   `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several
//!   separated by `;`.
//! - **Mistral** (`[TOOL_CALLS]`): after optional text, `[TOOL_CALLS]` and a JSON list of
//!   `{"name": ..., "arguments": {...}}` (v3 tokenizers), or `name[ARGS]{...}` per call (v11+).
//! - **Phi-4-mini** (a template that renders the system message's own `tools` field): the
//!   tools go there as a JSON list; calls come as `functools[{...}, ...]` (vLLM's and SGLang's
//!   parsers) or `<|tool_call|>[...]<|/tool_call|>` (llama.cpp's), the markers possibly
//!   dropped as special tokens. A required call is written `functools[...]`.

use serde_json::{json, Value};

/// A tool-call format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolFormat {
    #[default]
    Hermes,
    Llama3Json,
    Mistral,
    Phi4Mini,
}

pub(super) const HERMES_OPEN: &str = "<tool_call>";
pub(super) const HERMES_CLOSE: &str = "</tool_call>";
pub(super) const PYTHON_TAG: &str = "<|python_tag|>";
pub(super) const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
pub(super) const MISTRAL_ARGS: &str = "[ARGS]";
pub(super) const FUNCTOOLS: &str = "functools";
pub(super) const PHI_CALL_OPEN: &str = "<|tool_call|>";
pub(super) const PHI_CALL_CLOSE: &str = "<|/tool_call|>";

impl ToolFormat {
    /// The format a chat template teaches: `system_tools` (it renders the system message's
    /// own `tools` field): Phi-4-mini's; else `native` false (it does not render `tools`):
    /// Hermes, whose prompt pd adds to the system message.
    pub fn of_template(source: &str, native: bool, system_tools: bool) -> Self {
        if system_tools && !native {
            ToolFormat::Phi4Mini
        } else if !native || source.contains(HERMES_OPEN) {
            ToolFormat::Hermes
        } else if source.contains(MISTRAL_CALLS) {
            ToolFormat::Mistral
        } else if source.contains(PYTHON_TAG) || source.contains("\"parameters\": dictionary") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }

    /// The keys a call object may hold its arguments under.
    pub(super) fn argument_keys(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Llama3Json => &["parameters", "arguments"],
            ToolFormat::Phi4Mini => &["arguments", "parameters"],
            ToolFormat::Hermes | ToolFormat::Mistral => &["arguments"],
        }
    }

    /// The Lark grammar of an answer that is one call of `calls` (each a JSON schema of one
    /// call object, as `call_schema` makes it), or several with `several`.
    pub(super) fn grammar(self, calls: Vec<Value>, several: bool) -> String {
        let mut schema = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
        // One compact line, as the formats show it: no room for a model to wander in
        // whitespace until the length limit cuts the call.
        schema["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        match self {
            ToolFormat::Hermes => {
                let more = if several { r#" ("\n" call)*"# } else { "" };
                format!("start: call{more}\ncall: \"<tool_call>\\n\" args \"\\n</tool_call>\"\nargs: %json {schema}\n")
            }
            ToolFormat::Llama3Json => {
                let more = if several { r#" ("; " args)*"# } else { "" };
                format!("start: args{more}\nargs: %json {schema}\n")
            }
            ToolFormat::Mistral => {
                let more = if several { r#" (", " args)*"# } else { "" };
                format!("start: \"[TOOL_CALLS][\" args{more} \"]\"\nargs: %json {schema}\n")
            }
            ToolFormat::Phi4Mini => {
                let more = if several { r#" (", " args)*"# } else { "" };
                format!("start: \"functools[\" args{more} \"]\"\nargs: %json {schema}\n")
            }
        }
    }

    /// The JSON schema of one call object of `name` with `parameters`.
    pub(super) fn call_schema(self, name: &str, parameters: &Value) -> Value {
        let key = self.argument_keys()[0];
        json!({
            "type": "object",
            "properties": {"name": {"const": name}, key: parameters},
            "required": ["name", key],
            "additionalProperties": false
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_is_read_from_the_template() {
        let qwen = "{%- if tools %}<tools>{{ tool | tojson }}</tools> <tool_call> ... {%- endif %}";
        let llama = "{%- if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.{{ '<|python_tag|>' }}{%- endif %}";
        let mistral = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]";
        assert_eq!(ToolFormat::of_template(qwen, true, false), ToolFormat::Hermes);
        assert_eq!(ToolFormat::of_template(llama, true, false), ToolFormat::Llama3Json);
        assert_eq!(ToolFormat::of_template(mistral, true, false), ToolFormat::Mistral);
        assert_eq!(ToolFormat::of_template(mistral, false, false), ToolFormat::Hermes, "pd's own prompt is Hermes");
        assert_eq!(ToolFormat::of_template("{{ tools }}", true, false), ToolFormat::Hermes);
        let phi4 = "{% if message['role'] == 'system' and 'tools' in message %}<|tool|>{{ message['tools'] }}<|/tool|>";
        assert_eq!(ToolFormat::of_template(phi4, false, true), ToolFormat::Phi4Mini);
    }
}
