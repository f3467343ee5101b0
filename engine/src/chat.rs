//! Chat templates: the checkpoint's own Jinja template (GGUF `tokenizer.chat_template` or
//! tokenizer_config.json) rendered with minijinja, with Python string methods available as
//! Hugging Face templates expect.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// One chat message. An assistant's earlier calls and a tool message's call id are given to
/// templates that render tools themselves, in the shape Hugging Face templates read
/// (`tool_calls[i].function.arguments` as an object, as transformers passes them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.to_string(), content: content.to_string(), tool_calls: None, tool_call_id: None }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template refers to a `tools` variable (renders tool definitions itself).
    uses_tools: bool,
    /// The template's text (which tool-call format the model was taught is read from it).
    source: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are the texts templates may refer to.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| EngineError::ChatTemplate(format!("does not compile: {e}")))?;
        let uses_tools = source.contains("tools");
        let (bos_token, eos_token, source) = (bos_token.to_string(), eos_token.to_string(), source.to_string());
        Ok(ChatTemplate { env, bos_token, eos_token, uses_tools, source })
    }

    /// Whether the template renders tool definitions itself (its `tools` variable).
    pub fn uses_tools(&self) -> bool {
        self.uses_tools
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt text for `messages`, ending with the assistant's turn opener when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// `render`, with `tools` (OpenAI's tool definitions) as the template's `tools` variable.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        if messages.is_empty() {
            return Err(EngineError::ChatTemplate("no messages to render".into()));
        }
        let template = self.env.get_template(NAME).map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| EngineError::ChatTemplate(format!("rendering failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_python_style_templates_and_reports_errors() {
        let source = "{% for m in messages %}[{{ m.role.upper() }}]{{ m.content.strip() }}\n{% endfor %}\
                      {% if add_generation_prompt %}[ASSISTANT]{% endif %}";
        let t = ChatTemplate::new(source, "<s>", "</s>").expect("compiles");
        let text = t.render(&[ChatMessage::new("user", "  hi  ")], true).expect("renders");
        assert_eq!(text, "[USER]hi\n[ASSISTANT]");
        let err = ChatTemplate::new("{% for %}", "", "").expect_err("syntax error");
        assert!(err.to_string().contains("does not compile"), "{err}");
        let raising = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").expect("compiles");
        let err = raising.render(&[ChatMessage::new("user", "x")], false).expect_err("raises");
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }
}
