//! Tool calling in the Hermes format (Qwen 2.5, Hermes and other ChatML models): the tools are
//! described to the model in the system message, the model answers with
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and those are parsed into
//! OpenAI's `tool_calls`. `tool_choice` `required` or a named function is enforced by an output
//! constraint (a Lark grammar embedding each function's JSON schema), so the arguments always
//! parse and match the schema; `auto` lets the model choose; `none` leaves the tools out.
//!
//! A chat template that renders `tools` itself gets them as its `tools` variable; for one that
//! does not (SmolLM2's), the Hermes system prompt below is added, and `tool` messages are
//! rendered as user turns holding `<tool_response>` blocks, as Qwen 2.5's template does.

use pd_engine::OutputConstraint;
use serde::Serialize;
use serde_json::{json, Value};

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
}

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

/// The text of one call as the model writes it (also how an assistant turn's earlier
/// `tool_calls` are rendered back into the prompt).
pub fn call_text(name: &str, arguments: &str) -> String {
    let arguments: Value = serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_string()));
    format!("<tool_call>\n{}\n</tool_call>", json!({"name": name, "arguments": arguments}))
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
    /// allowed functions with schema-valid arguments: for `required` and a named function.
    pub fn constraint(&self) -> Option<OutputConstraint> {
        let allowed: Vec<&Function> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.functions.iter().collect(),
            ToolChoice::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
        };
        let calls: Vec<Value> = allowed
            .iter()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": false
                })
            })
            .collect();
        let mut schema = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
        // One compact line, as the Hermes format shows it: no room for a model to wander in
        // whitespace until the length limit cuts the call.
        schema["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        let more = if self.parallel && self.choice == ToolChoice::Required { r#" ("\n" call)*"# } else { "" };
        Some(OutputConstraint::Lark(format!(
            "start: call{more}\ncall: \"<tool_call>\\n\" args \"\\n</tool_call>\"\nargs: %json {schema}\n"
        )))
    }
}

/// A call parsed from the model's text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// Splits an answer into its text before the first call and the calls (Hermes blocks whose
/// JSON names a function of `tools`). No well-formed call: the whole text, no calls.
pub fn parse(text: &str, tools: &Tools) -> (String, Vec<ParsedCall>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let Some(first) = text.find(OPEN) else { return (text.to_string(), Vec::new()) };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find(OPEN) {
        let body = &rest[start + OPEN.len()..];
        let (inner, next) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        let Ok(v) = serde_json::from_str::<Value>(inner.trim()) else { return (text.to_string(), Vec::new()) };
        let name = v["name"].as_str().unwrap_or_default();
        if !tools.functions.iter().any(|f| f.name == name) {
            return (text.to_string(), Vec::new());
        }
        let arguments = match &v["arguments"] {
            Value::String(s) => s.clone(),
            Value::Null => "{}".to_string(),
            other => other.to_string(),
        };
        calls.push(ParsedCall { name: name.to_string(), arguments });
        rest = next;
    }
    (text[..first].trim_end().to_string(), calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: ToolChoice) -> Tools {
        let weather = Function {
            name: "get_weather".into(),
            description: Some("Weather in a city".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        };
        let time = Function { name: "get_time".into(), description: None, parameters: json!({"type": "object"}) };
        Tools { functions: vec![weather, time], choice, parallel: true }
    }

    #[test]
    fn hermes_calls_are_parsed_and_anything_else_stays_text() {
        let t = tools(ToolChoice::Auto);
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"get_time\",\"arguments\":{}}</tool_call>";
        let (content, calls) = parse(text, &t);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].name.as_str(), calls[0].arguments.as_str()), ("get_weather", r#"{"city":"Paris"}"#));
        for plain in
            ["no call here", "<tool_call>{not json}</tool_call>", "<tool_call>{\"name\":\"rm_rf\"}</tool_call>"]
        {
            assert_eq!(parse(plain, &t), (plain.to_string(), Vec::new()), "{plain}");
        }
        assert_eq!(
            parse(&call_text("get_time", "{}"), &t).1,
            vec![ParsedCall { name: "get_time".into(), arguments: "{}".into() }]
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
    }
}
