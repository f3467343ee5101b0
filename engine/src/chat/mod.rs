//! Chat templates: the checkpoint's own Jinja template (GGUF `tokenizer.chat_template` or
//! tokenizer_config.json) rendered with minijinja in the environment Hugging Face transformers'
//! `apply_chat_template` gives templates (transformers/utils/chat_template_utils.py):
//! `trim_blocks` and `lstrip_blocks`, Python string and dict methods, `tojson` as Python's
//! `json.dumps` (its separators, `indent`, `ensure_ascii`, `sort_keys`), `raise_exception`
//! and `strftime_now`. engine/tests/chat_templates.rs checks real models' templates against
//! transformers' rendering.

mod tojson;

pub use tojson::json_dumps;

use std::time::SystemTime;

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
    /// A system message's own tool definitions, as JSON text: the convention of templates
    /// that render them from the system message (Phi-4-mini's `<|tool|>...<|/tool|>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<String>,
    /// An assistant turn's reasoning (`reasoning_content`), which thinking models' templates
    /// read (Qwen3's renders it in a `<think>` block after the last user turn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        let (role, content) = (role.to_string(), content.to_string());
        ChatMessage { role, content, tool_calls: None, tool_call_id: None, tools: None, reasoning_content: None }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template reads the `tools` variable (renders tool definitions itself).
    uses_tools: bool,
    /// The template renders a system message's own `tools` field (`ChatMessage::tools`).
    system_tools: bool,
    /// The template's text (which tool-call format the model was taught is read from it).
    source: String,
}

const NAME: &str = "chat";

/// The template variables the renderer sets, which template arguments may not.
pub const RESERVED_TEMPLATE_VARIABLES: [&str; 6] =
    ["messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"];

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are the texts templates may refer to.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        // transformers' jinja2 environment: trim_blocks and lstrip_blocks on, a template's
        // single trailing newline dropped (jinja2's default, and minijinja's).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", tojson::tojson);
        env.add_function("strftime_now", |format: String| strftime(SystemTime::now(), &format));
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| EngineError::ChatTemplate(format!("does not compile: {e}")))?;
        // Whether the template reads the `tools` variable, not whether the word appears: Phi-4-mini's
        // template reads a system message's own `tools` field and never renders the request's.
        let uses_tools = env
            .get_template(NAME)
            .map_err(|e| EngineError::ChatTemplate(format!("does not compile: {e}")))?
            .undeclared_variables(false)
            .contains("tools");
        let (bos_token, eos_token, source) = (bos_token.to_string(), eos_token.to_string(), source.to_string());
        let mut template = ChatTemplate { env, bos_token, eos_token, uses_tools, system_tools: false, source };
        template.system_tools = !uses_tools && template.renders_system_tools();
        Ok(template)
    }

    /// Whether a system message's `tools` field reaches the prompt: a probe rendered once.
    fn renders_system_tools(&self) -> bool {
        const PROBE: &str = "\u{1}pd-system-tools-probe\u{1}";
        let mut system = ChatMessage::new("system", "");
        system.tools = Some(PROBE.to_string());
        let probe = [system, ChatMessage::new("user", "x")];
        self.render(&probe, true).is_ok_and(|text| text.contains(PROBE))
    }

    /// The same template with `strftime_now` reading `now` instead of the clock (tests, and
    /// reproducing a prompt rendered earlier).
    pub fn with_now(mut self, now: SystemTime) -> Self {
        self.env.add_function("strftime_now", move |format: String| strftime(now, &format));
        self
    }

    /// Whether the template renders tool definitions itself (its `tools` variable).
    pub fn uses_tools(&self) -> bool {
        self.uses_tools
    }

    /// Whether the template renders tool definitions given in the system message's own
    /// `tools` field (and not the `tools` variable): Phi-4-mini's convention.
    pub fn system_tools(&self) -> bool {
        self.system_tools
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
        self.render_with_kwargs(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// `render_with_tools`, with `kwargs` as further template variables, as transformers'
    /// `apply_chat_template(..., **kwargs)` passes them (Qwen3's `enable_thinking`, for
    /// one). A name the renderer sets itself (`RESERVED_TEMPLATE_VARIABLES`) is refused.
    pub fn render_with_kwargs(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        if messages.is_empty() {
            return Err(EngineError::ChatTemplate("no messages to render".into()));
        }
        if let Some(name) = kwargs.keys().find(|k| RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str())) {
            return Err(EngineError::ChatTemplate(format!("`{name}` is set by the server, not by template arguments")));
        }
        let template = self.env.get_template(NAME).map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
                documents => Option::<()>::None,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                ..minijinja::Value::from_serialize(kwargs)
            })
            .map_err(|e| EngineError::ChatTemplate(format!("rendering failed: {e}")))
    }
}

/// transformers' `strftime_now(format)`: `now` formatted as Python's `strftime` would, in UTC
/// (transformers reads the machine's local time; a server's is UTC), through chrono's
/// strftime, which has Python's directives and glibc's `-` flag (`%-d`). A format chrono
/// does not know is an error naming it.
fn strftime(now: SystemTime, format: &str) -> std::result::Result<String, JinjaError> {
    let items = chrono::format::StrftimeItems::new(format).parse().map_err(|_| {
        JinjaError::new(ErrorKind::InvalidOperation, format!("strftime_now: `{format}` is not a strftime format"))
    })?;
    Ok(chrono::DateTime::<chrono::Utc>::from(now).format_with_items(items.iter()).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

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

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let render = |source: &str| {
            let t = ChatTemplate::new(source, "", "").expect("compiles");
            t.render(&[ChatMessage::new("user", "x")], false).expect("renders")
        };
        let value = r#"{'b': [1, 2.5, 1e-7, none, true], 'a': "<it's & \"é\"\n>", 'e': {}}"#;
        assert_eq!(
            render(&format!("{{{{ {value} | tojson }}}}")),
            r#"{"b": [1, 2.5, 1e-07, null, true], "a": "<it's & \"é\"\n>", "e": {}}"#
        );
        assert_eq!(
            render(&format!("{{{{ {value} | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}}}")),
            "{\n  \"a\": \"<it's & \\\"\\u00e9\\\"\\n>\",\n  \"b\": [\n    1,\n    2.5,\n    1e-07,\n    null,\n    true\n  ],\n  \"e\": {}\n}"
        );
        assert_eq!(render("{{ [1, {'k': 'v'}] | tojson(separators=(',', ':')) }}"), r#"[1,{"k":"v"}]"#);
        assert_eq!(render("{{ 2.0 | tojson }} {{ 1e16 | tojson }} {{ 123.25 | tojson }}"), "2.0 1e+16 123.25");
        // Python's json.dumps with its defaults: ASCII only.
        let v = serde_json::json!([{"name": "météo", "n": [1, 2.5], "ok": null}]);
        assert_eq!(json_dumps(&v), r#"[{"name": "m\u00e9t\u00e9o", "n": [1, 2.5], "ok": null}]"#);
    }

    #[test]
    fn strftime_now_formats_the_given_instant_in_utc() {
        // 2025-03-07T14:05:09Z, a Friday.
        let now = UNIX_EPOCH + std::time::Duration::from_secs(1_741_356_309);
        let t = ChatTemplate::new("{{ strftime_now(fmt) }}", "", "").expect("compiles").with_now(now);
        let format = |fmt: &str| {
            let env = &t.env;
            env.get_template(NAME).expect("template").render(context! { fmt => fmt }).expect("renders")
        };
        assert_eq!(format("%d %b %Y"), "07 Mar 2025");
        assert_eq!(format("%Y-%m-%d"), "2025-03-07");
        assert_eq!(format("%A %B %-d, %H:%M:%S %p %j %y"), "Friday March 7, 14:05:09 PM 066 25");
        assert_eq!(format("%a %e %I %%"), "Fri  7 02 %");
        assert_eq!(strftime(UNIX_EPOCH, "%F %T %a").expect("formats"), "1970-01-01 00:00:00 Thu");
        let err = strftime(UNIX_EPOCH, "%Y %Q").expect_err("unknown directive");
        assert!(err.to_string().contains("%Y %Q"), "{err}");
    }

    #[test]
    fn uses_tools_means_the_template_reads_the_tools_variable() {
        let uses = |source: &str| ChatTemplate::new(source, "", "").expect("compiles").uses_tools();
        assert!(uses("{% if tools %}{{ tools | tojson }}{% endif %}"));
        assert!(uses("{% macro m() %}{{ tools | length }}{% endmacro %}{{ m() }}"));
        // Phi-4-mini's: a system message's own `tools` field, never the request's tools.
        assert!(!uses(
            "{% for message in messages %}{% if 'tools' in message and message['tools'] is not none %}\
             {{ message['tools'] }}{% endif %}{% endfor %}"
        ));
        assert!(!uses("{% set tools = [] %}{{ tools | length }}"));
    }

    #[test]
    fn a_template_that_renders_a_system_messages_own_tools_is_recognized() {
        let system_tools = |source: &str| ChatTemplate::new(source, "", "").expect("compiles").system_tools();
        let phi4_mini = include_str!("../../tests/data/chat_templates/microsoft-Phi-4-mini-instruct.jinja");
        assert!(system_tools(phi4_mini));
        let qwen = include_str!("../../tests/data/chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja");
        assert!(!system_tools(qwen), "reads the tools variable");
        let smollm2 = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        assert!(!system_tools(smollm2));
        // A template that mentions the field but never renders it.
        assert!(!system_tools("{% for m in messages %}{% if m.tools %}x{% endif %}{{ m.content }}{% endfor %}"));
        let mut system = ChatMessage::new("system", "You are a helpful assistant with some tools.");
        system.tools = Some(r#"[{"name": "f"}]"#.into());
        let t = ChatTemplate::new(phi4_mini, "", "<|endoftext|>").expect("compiles");
        assert_eq!(
            t.render(&[system, ChatMessage::new("user", "Hi")], true).expect("renders"),
            "<|system|>You are a helpful assistant with some tools.<|tool|>[{\"name\": \"f\"}]<|/tool|><|end|><|user|>Hi<|end|><|assistant|>"
        );
    }

    #[test]
    fn template_arguments_reach_the_template_and_may_not_replace_what_the_renderer_sets() {
        let source = "{% for m in messages %}{{ m.content }}{% endfor %}\
                      {% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}";
        let t = ChatTemplate::new(source, "", "").expect("compiles");
        let hi = [ChatMessage::new("user", "hi")];
        let kwargs = |v: serde_json::Value| v.as_object().cloned().expect("an object");
        assert_eq!(t.render(&hi, true).expect("renders"), "hi");
        let off = kwargs(serde_json::json!({"enable_thinking": false}));
        assert_eq!(t.render_with_kwargs(&hi, None, true, &off).expect("renders"), "hi<think></think>");
        let err =
            t.render_with_kwargs(&hi, None, true, &kwargs(serde_json::json!({"messages": []}))).expect_err("reserved");
        assert!(err.to_string().contains("`messages` is set by the server"), "{err}");
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_does() {
        let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(source, "", "").expect("compiles");
        let text = t.render(&[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")], false).expect("renders");
        assert_eq!(text, "[a]\n[b]\n");
    }
}
