//! Tool calling: the tools are described to the model, its answer is read for calls in the
//! format its chat template teaches (`format.rs`: Hermes `<tool_call>`, Llama 3.1 JSON,
//! Mistral `[TOOL_CALLS]`), whole (`scan.rs`) or as a stream of OpenAI deltas (`stream.rs`).
//! `tool_choice` `required` or a named function is enforced by an output constraint (a Lark
//! grammar embedding each function's JSON schema, in the model's format), so the arguments
//! always parse and match the schema; `auto` lets the model choose; `none` leaves the tools out.
//!
//! A chat template that renders `tools` itself gets them as its `tools` variable, and the
//! conversation's earlier calls and tool results as structured messages; for one that does
//! not (SmolLM2's), the Hermes system prompt below is added, earlier calls are written back as
//! `<tool_call>` blocks and `tool` messages as user turns holding `<tool_response>` blocks, as
//! Qwen 2.5's template does. A template that renders the system message's own `tools` field
//! (Phi-4-mini's) gets the functions there, as its model card shows, and earlier calls in its
//! `functools[...]` form.

mod format;
mod scan;
mod stream;

use pd_engine::OutputConstraint;
use serde::Serialize;
use serde_json::{json, Value};

pub use format::ToolFormat;
pub use scan::parse;
pub use stream::{CallStream, Piece};

use crate::error::RouterError;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments (an object schema).
    pub parameters: Value,
}

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools and how they may be used.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls: true` given: a `required` answer may hold several calls. Absent,
    /// a required answer is one call (a small model otherwise repeats its call until the
    /// length limit cuts it); `auto` answers are parsed for any number of calls either way.
    pub parallel: bool,
    /// How the model writes calls (set from the chat template when the request is validated).
    pub format: ToolFormat,
}

/// The system message pd adds for a template that renders the system message's `tools`
/// field when the request has none (Phi-4-mini's model card's wording).
pub const SYSTEM_WITH_TOOLS: &str = "You are a helpful assistant with some tools.";

/// Longest function name (OpenAI's limit), made of letters, digits, `_` and `-`.
const MAX_NAME: usize = 64;

/// Checks a function name.
pub fn check_name(name: &str, field: &str) -> Result<(), RouterError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(RouterError::invalid(field, format!("`{field}` must be 1 to {MAX_NAME} letters, digits, `_` or `-`")))
    }
}

/// The text of one call as a model of `format` writes it (how an assistant turn's earlier
/// `tool_calls` are rendered back into the prompt for a template that does not render them).
pub fn call_text(format: ToolFormat, name: &str, arguments: &str) -> String {
    let arguments: Value = serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_string()));
    let call = json!({"name": name, "arguments": arguments});
    match format {
        ToolFormat::Phi4Mini => format!("functools[{call}]"),
        _ => format!("<tool_call>\n{call}\n</tool_call>"),
    }
}

/// A `tool` message as a Hermes tool response.
pub fn response_text(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

impl Tools {
    /// Whether the model is told about the tools and its answer parsed for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The functions in OpenAI's tool shape (the chat template's `tools` variable).
    pub fn as_json(&self) -> Vec<Value> {
        let function = |f: &Function| {
            let mut function = json!({"name": f.name, "parameters": f.parameters});
            if let Some(d) = &f.description {
                function["description"] = Value::String(d.clone());
            }
            json!({"type": "function", "function": function})
        };
        self.functions.iter().map(function).collect()
    }

    /// The functions as a JSON list of `{name, description, parameters}`, written as Python's
    /// `json.dumps` writes it: what Phi-4-mini's model card puts in the system message's
    /// `tools` field.
    pub fn system_field(&self) -> String {
        let function = |f: &Function| {
            let mut function = json!({"name": f.name});
            if let Some(d) = &f.description {
                function["description"] = Value::String(d.clone());
            }
            function["parameters"] = f.parameters.clone();
            function
        };
        pd_engine::json_dumps(&Value::Array(self.functions.iter().map(function).collect()))
    }

    /// The Hermes tool prompt (Qwen 2.5's wording), added to the system message.
    pub fn system_prompt(&self) -> String {
        let listed: Vec<String> = self.as_json().iter().map(Value::to_string).collect();
        format!(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
             For each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
            listed.join("\n")
        )
    }

    /// The constraint that makes the answer one call (or several, with `parallel`) of the
    /// allowed functions with schema-valid arguments, in the model's format: for `required`
    /// and a named function.
    pub fn constraint(&self) -> Option<OutputConstraint> {
        let allowed: Vec<&Function> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.functions.iter().collect(),
            ToolChoice::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
        };
        let calls = allowed.iter().map(|f| self.format.call_schema(&f.name, &f.parameters)).collect();
        let several = self.parallel && self.choice == ToolChoice::Required;
        Some(OutputConstraint::Lark(self.format.grammar(calls, several)))
    }
}

/// A call parsed from the model's text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// A call in an earlier assistant turn of the conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct PastCall {
    pub id: Option<String>,
    pub name: String,
    /// JSON text, checked.
    pub arguments: String,
}

impl PastCall {
    /// The call as Hugging Face templates read it (arguments as an object).
    pub fn as_template_json(&self) -> Value {
        let arguments: Value =
            serde_json::from_str(&self.arguments).unwrap_or_else(|_| Value::String(self.arguments.clone()));
        let mut call = json!({"type": "function", "function": {"name": self.name, "arguments": arguments}});
        if let Some(id) = &self.id {
            call["id"] = Value::String(id.clone());
        }
        call
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn tools(choice: ToolChoice) -> Tools {
        let weather = Function {
            name: "get_weather".into(),
            description: Some("Weather in a city".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        };
        let time = Function { name: "get_time".into(), description: None, parameters: json!({"type": "object"}) };
        Tools { functions: vec![weather, time], choice, parallel: true, format: ToolFormat::Hermes }
    }

    #[test]
    fn a_call_written_back_parses_as_the_same_call() {
        assert_eq!(
            parse(&call_text(ToolFormat::Hermes, "get_time", "{}"), &tools(ToolChoice::Auto)).1,
            vec![ParsedCall { name: "get_time".into(), arguments: "{}".into() }]
        );
        let mut phi4 = tools(ToolChoice::Auto);
        phi4.format = ToolFormat::Phi4Mini;
        let written = call_text(ToolFormat::Phi4Mini, "get_weather", r#"{"city":"Paris"}"#);
        assert_eq!(written, r#"functools[{"name":"get_weather","arguments":{"city":"Paris"}}]"#);
        assert_eq!(
            parse(&written, &phi4).1,
            vec![ParsedCall { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }]
        );
    }

    #[test]
    fn required_and_named_choices_become_constraints_and_auto_none_do_not() {
        assert_eq!(tools(ToolChoice::Auto).constraint(), None);
        assert_eq!(tools(ToolChoice::None).constraint(), None);
        let Some(OutputConstraint::Lark(named)) = tools(ToolChoice::Named("get_time".into())).constraint() else {
            panic!("a named function is a grammar")
        };
        assert!(named.contains("\"const\":\"get_time\"") && !named.contains("get_weather"), "{named}");
        assert!(!named.contains("(\"\\n\" call)*"), "one call for a named function");
        let Some(OutputConstraint::Lark(required)) = tools(ToolChoice::Required).constraint() else {
            panic!("required is a grammar")
        };
        assert!(required.contains("anyOf") && required.contains("call)*"), "{required}");
        assert!(tools(ToolChoice::Auto).system_prompt().contains("\"name\":\"get_weather\""));
        assert!(check_name("get-weather_2", "f").is_ok() && check_name("bad name", "f").is_err());
        let mut llama = tools(ToolChoice::Named("get_weather".into()));
        llama.format = ToolFormat::Llama3Json;
        let Some(OutputConstraint::Lark(g)) = llama.constraint() else { panic!("a grammar") };
        assert!(g.contains("\"parameters\"") && !g.contains("<tool_call>"), "{g}");
    }
}
