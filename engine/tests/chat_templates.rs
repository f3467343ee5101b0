//! pd's chat template rendering against Hugging Face transformers' `apply_chat_template` on
//! real models' templates (data/chat_templates/*.jinja): every case in expected.json
//! (written by scripts/reference/chat_templates.py) must render byte for byte the same, or
//! fail where transformers raised. One difference is known and checked: a tool-use template
//! that loops over `tools` when a request has none raises TypeError in Python (None is not
//! iterable) while minijinja iterates None as empty; there pd must render exactly what
//! transformers renders with `tools=[]` (`text_with_empty_tools`). Whether a template reads the
//! `tools` variable (pd's `uses_tools`) is checked against jinja2's own analysis. Two cases pass
//! template arguments (`enable_thinking`, which Qwen3's and SmolLM3's templates read).

use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use pd_engine::{ChatMessage, ChatTemplate};
use serde_json::Value;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates")
}

/// The first line where `got` and `want` differ, with a little context.
fn first_difference(got: &str, want: &str) -> String {
    let at = got.bytes().zip(want.bytes()).take_while(|(a, b)| a == b).count();
    let from = got[..at].rfind('\n').map_or(0, |i| i + 1);
    let show = |s: &str| s.get(from..(at + 60).min(s.len())).unwrap_or("").to_string();
    format!("at byte {at}:\n   pd: {:?}\n   hf: {:?}", show(got), show(want))
}

#[test]
fn real_templates_render_as_transformers_does() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(data().join("expected.json")).expect("expected.json"))
            .expect("expected.json parses");
    let now = UNIX_EPOCH + Duration::from_secs(expected["now_utc_seconds"].as_u64().expect("now_utc_seconds"));
    let mut failures = Vec::new();
    let templates = expected["templates"].as_object().expect("templates");
    assert!(templates.len() >= 12, "expected.json covers {} templates", templates.len());
    for (name, spec) in templates {
        let source = std::fs::read_to_string(data().join(format!("{name}.jinja"))).expect("template file");
        let (bos, eos) = (spec["bos"].as_str().unwrap_or(""), spec["eos"].as_str().unwrap_or(""));
        let template = match ChatTemplate::new(&source, bos, eos) {
            Ok(t) => t.with_now(now),
            Err(e) => {
                failures.push(format!("{name}: does not compile: {e}"));
                continue;
            }
        };
        // Whether pd hands the request's tools to the template or describes them itself.
        if Some(template.uses_tools()) != spec["reads_tools"].as_bool() {
            failures.push(format!(
                "{name}: pd says the template reads `tools`: {}, jinja2 says {}",
                template.uses_tools(),
                spec["reads_tools"]
            ));
        }
        // Whether pd puts the tools in the system message's own `tools` field (Phi-4-mini's).
        if Some(template.system_tools()) != spec["renders_system_tools"].as_bool() {
            failures.push(format!(
                "{name}: pd says the template renders a system message's tools: {}, transformers says {}",
                template.system_tools(),
                spec["renders_system_tools"]
            ));
        }
        let (mut matched, mut total, mut lenient) = (0, 0, 0);
        for (case, c) in spec["cases"].as_object().expect("cases") {
            total += 1;
            let messages: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).expect("messages");
            let tools: Option<Vec<Value>> = serde_json::from_value(c["tools"].clone()).expect("tools");
            let add_generation_prompt = c["add_generation_prompt"].as_bool().expect("add_generation_prompt");
            // Template arguments (`chat_template_kwargs`), as apply_chat_template(**kwargs).
            let kwargs = c.get("kwargs").and_then(Value::as_object).cloned().unwrap_or_default();
            let got = template.render_with_kwargs(&messages, tools.as_deref(), add_generation_prompt, &kwargs);
            let verdict = match (&got, c.get("text").and_then(Value::as_str), c.get("error").and_then(Value::as_str)) {
                (Ok(got), Some(want), _) if got == want => Ok(()),
                (Ok(got), Some(want), _) => Err(first_difference(got, want)),
                (Err(e), Some(_), _) => Err(format!("pd failed: {e}")),
                (Ok(got), None, Some(_)) if c.get("text_with_empty_tools").and_then(Value::as_str) == Some(got) => {
                    lenient += 1;
                    Ok(())
                }
                (Ok(_), None, Some(err)) => Err(format!("pd rendered, transformers raised {err:?}")),
                (Err(e), None, Some(err)) => {
                    // A template's own raise_exception message must come through; other
                    // failures (a Python TypeError) only have to be failures.
                    if c["error_type"] == "TemplateError" && !e.to_string().contains(err) {
                        Err(format!("pd failed with {e}, transformers with {err:?}"))
                    } else {
                        Ok(())
                    }
                }
                _ => panic!("{name}/{case}: neither text nor error in expected.json"),
            };
            match verdict {
                Ok(()) => matched += 1,
                Err(why) => failures.push(format!("{name}/{case}: {why}")),
            }
        }
        let note = if lenient > 0 {
            format!(" ({lenient} rendered as with tools=[] where Python raised)")
        } else {
            String::new()
        };
        println!("{name}: {matched}/{total} cases match transformers{note}");
    }
    assert!(failures.is_empty(), "{} cases differ:\n{}", failures.len(), failures.join("\n"));
}
