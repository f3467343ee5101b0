//! `validate` on a character tokenizer (no chat template, 64-token context).

use pd_engine::{TextSide, Tokenizer};

use super::*;

fn text() -> TextSide {
    TextSide { tokenizer: Tokenizer::characters().expect("tokenizer"), chat_template: None, max_position: 64 }
}

/// The character tokenizer with a BOS post-processor, as Llama's tokenizer.json has one.
fn with_bos() -> TextSide {
    use tokenizers::processors::template::TemplateProcessing;
    let mut inner = Tokenizer::characters().expect("tokenizer").inner().clone();
    let template = TemplateProcessing::builder()
        .try_single("<s> $A")
        .expect("template")
        .special_tokens(vec![("<s>", 62)])
        .build()
        .expect("template");
    inner.with_post_processor(Some(template));
    TextSide { tokenizer: Tokenizer::from_inner(inner, vec![63], Some(62)), chat_template: None, max_position: 64 }
}

const LIMITS: Limits = Limits { max_tokens: 40, default_completion_tokens: 16, default_chat_tokens: 512, max_n: 4 };

fn completion(prompt: &str) -> GenerateParams {
    GenerateParams {
        kind: Kind::Completion,
        model: None,
        input: Input::Prompt(prompt.into()),
        max_tokens: None,
        max_tokens_field: "max_tokens",
        temperature: None,
        top_p: None,
        top_k: None,
        seed: None,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        stream: false,
        include_usage: false,
        logits: LogitParams { logprobs_field: "logprobs", ..LogitParams::default() },
        user: None,
        constraint: None,
        tools: None,
        n: None,
        echo: false,
        template_kwargs: serde_json::Map::new(),
    }
}

fn param_of(p: GenerateParams) -> Option<String> {
    match validate(p, &text(), "m", &LIMITS) {
        Err(RouterError::InvalidRequest { param, .. }) => param,
        other => panic!("expected an invalid request, got {other:?}"),
    }
}

#[test]
fn defaults_are_applied_once_for_every_kind() {
    let r = validate(completion("abc"), &text(), "m", &LIMITS).expect("valid");
    assert_eq!(r.prompt_tokens, vec![0, 1, 2]);
    assert_eq!((r.params.max_tokens, r.params.temperature, r.params.top_p), (16, 0.0, None));
    assert_eq!(r.model, "m");
    let mut chat_sized = completion("abc");
    chat_sized.kind = Kind::Chat;
    chat_sized.input = Input::Prompt("abc".into());
    // The chat default (512) is capped by the context left: 64 - 3.
    assert_eq!(validate(chat_sized, &text(), "m", &LIMITS).expect("valid").params.max_tokens, 61);
}

#[test]
fn a_raw_prompt_starts_with_bos_where_the_model_puts_one() {
    assert!(with_bos().tokenizer.adds_bos() && !text().tokenizer.adds_bos());
    let r = validate(completion("abc"), &with_bos(), "m", &LIMITS).expect("valid");
    assert_eq!(r.prompt_tokens, vec![62, 0, 1, 2]);
    // A prompt written out with its BOS does not get a second one.
    let r = validate(completion("<s>abc"), &with_bos(), "m", &LIMITS).expect("valid");
    assert_eq!(r.prompt_tokens, vec![62, 0, 1, 2]);
    // Token ids are the caller's, as they are.
    let mut ids = completion("x");
    ids.input = Input::Tokens(vec![0, 1]);
    assert_eq!(validate(ids, &with_bos(), "m", &LIMITS).expect("valid").prompt_tokens, vec![0, 1]);
    // A vocabulary without it: none.
    assert_eq!(validate(completion("abc"), &text(), "m", &LIMITS).expect("valid").prompt_tokens, vec![0, 1, 2]);
}

#[test]
fn sampling_fields_are_checked_by_name() {
    type Change = Box<dyn Fn(&mut GenerateParams)>;
    let cases: Vec<(&str, Change)> = vec![
        ("temperature", Box::new(|p| p.temperature = Some(2.5))),
        ("n", Box::new(|p| p.n = Some(0))),
        ("n", Box::new(|p| p.n = Some(5))),
        ("top_p", Box::new(|p| p.top_p = Some(0.0))),
        ("top_k", Box::new(|p| p.top_k = Some(0))),
        ("stop", Box::new(|p| p.stop = vec!["a".into(); 5])),
        ("stop", Box::new(|p| p.stop = vec![String::new()])),
        ("max_tokens", Box::new(|p| p.max_tokens = Some(0))),
        ("max_tokens", Box::new(|p| p.max_tokens = Some(41))),
        ("max_tokens", Box::new(|p| p.max_tokens = Some(62))),
        ("prompt", Box::new(|p| p.input = Input::Prompt(String::new()))),
        ("prompt", Box::new(|p| p.input = Input::Prompt("a".repeat(64)))),
        ("messages", Box::new(|p| p.input = Input::Messages(Vec::new()))),
        ("messages", Box::new(|p| p.input = Input::Messages(vec![Turn::new(Role::User, "hi")]))),
        ("prompt[1]", Box::new(|p| p.input = Input::Tokens(vec![1, 64]))),
        ("stop_token_ids", Box::new(|p| p.stop_token_ids = vec![99])),
        ("frequency_penalty", Box::new(|p| p.logits.frequency_penalty = Some(2.5))),
        ("presence_penalty", Box::new(|p| p.logits.presence_penalty = Some(-2.01))),
        ("repetition_penalty", Box::new(|p| p.logits.repetition_penalty = Some(0.0))),
        ("repetition_penalty", Box::new(|p| p.logits.repetition_penalty = Some(3.0))),
        ("logit_bias", Box::new(|p| p.logits.logit_bias = vec![("64".into(), 1.0)])),
        ("logit_bias", Box::new(|p| p.logits.logit_bias = vec![("a".into(), 1.0)])),
        ("logit_bias", Box::new(|p| p.logits.logit_bias = vec![("3".into(), 100.5)])),
        ("min_tokens", Box::new(|p| (p.max_tokens, p.logits.min_tokens) = (Some(4), Some(5)))),
        ("logprobs", Box::new(|p| p.logits.logprobs = Some(21))),
    ];
    for (field, change) in cases {
        let mut p = completion("abc");
        change(&mut p);
        assert_eq!(param_of(p).as_deref(), Some(field));
    }
}

#[test]
fn the_max_tokens_error_names_the_field_the_client_used() {
    let mut p = completion("abc");
    p.max_tokens = Some(0);
    p.max_tokens_field = "sampling.max_tokens";
    assert_eq!(param_of(p).as_deref(), Some("sampling.max_tokens"));
}

#[test]
fn another_model_is_not_found_and_an_empty_name_is_the_served_one() {
    let mut p = completion("abc");
    p.model = Some("gpt-9".into());
    assert_eq!(
        validate(p, &text(), "m", &LIMITS).expect_err("other model"),
        RouterError::ModelNotFound("gpt-9".into())
    );
    let mut p = completion("abc");
    p.model = Some(String::new());
    assert_eq!(validate(p, &text(), "m", &LIMITS).expect("served").model, "m");
}

#[test]
fn a_full_request_keeps_every_sampling_field() {
    let mut p = completion("abc");
    (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) = (Some(0.7), Some(0.9), Some(5), Some(3), Some(4));
    p.stop = vec!["x".into()];
    p.ignore_eos = true;
    let r = validate(p, &text(), "m", &LIMITS).expect("valid");
    assert_eq!((r.params.top_k, r.params.seed, r.params.max_tokens, r.params.ignore_eos), (Some(5), 3, 4, true));
    assert_eq!(r.params.stop_strings, vec!["x".to_string()]);
    assert!(r.params.validate().is_ok(), "a valid request is valid for the workers too");
}

#[test]
fn penalties_biases_logprobs_and_token_prompts_reach_the_engine_parameters() {
    let mut p = completion("abc");
    p.input = Input::Tokens(vec![5, 6, 63]);
    p.max_tokens = Some(8);
    p.logits = LogitParams {
        frequency_penalty: Some(0.5),
        presence_penalty: Some(-0.25),
        repetition_penalty: Some(1.3),
        logit_bias: vec![("9".into(), -100.0), ("2".into(), 4.0)],
        min_tokens: Some(3),
        logprobs: Some(20),
        logprobs_field: "top_logprobs",
    };
    let r = validate(p, &text(), "m", &LIMITS).expect("valid");
    assert_eq!(r.prompt_tokens, vec![5, 6, 63]);
    let s = &r.params;
    assert_eq!((s.frequency_penalty, s.presence_penalty, s.repetition_penalty), (0.5, -0.25, 1.3));
    assert_eq!(s.logit_bias, vec![(2, 4.0), (9, -100.0)]);
    assert_eq!((s.min_tokens, s.logprobs, s.max_tokens), (3, Some(20), 8));
    assert!(s.validate().is_ok());
}

#[test]
fn a_request_without_a_seed_gets_a_fresh_one_and_a_given_seed_is_kept() {
    let seeds: std::collections::HashSet<u64> =
        (0..8).map(|_| validate(completion("abc"), &text(), "m", &LIMITS).expect("valid").params.seed).collect();
    assert_eq!(seeds.len(), 8, "eight unseeded requests, eight seeds: {seeds:?}");
    let mut p = completion("abc");
    p.seed = Some(0);
    assert_eq!(validate(p, &text(), "m", &LIMITS).expect("valid").params.seed, 0);
}

#[test]
fn roles_parse_by_name() {
    assert_eq!(Role::parse("assistant"), Some(Role::Assistant));
    assert_eq!(Role::parse("tool"), Some(Role::Tool));
    assert_eq!(Role::parse("robot"), None);
}

/// A short template in the manner of Llama 3.1's: tools in the prompt, earlier calls written
/// by the template from `tool_calls` (arguments as an object), tool results by role.
const LLAMA_LIKE: &str = "{%- if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. {{ tools | tojson }}\n{%- endif %}\
    {%- for m in messages %}<{{ m.role }}>\
    {%- if m.tool_calls %}{%- for c in m.tool_calls %}<|python_tag|>{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{%- endfor %}\
    {%- elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}{%- else %}{{ m.content }}{%- endif %}\n{%- endfor %}\
    {%- if add_generation_prompt %}<assistant>{%- endif %}";

/// A character tokenizer with `chat_template`.
fn templated(chat_template: pd_engine::ChatTemplate) -> TextSide {
    TextSide {
        tokenizer: Tokenizer::characters().expect("tokenizer"),
        chat_template: Some(chat_template),
        max_position: 4096,
    }
}

fn weather() -> crate::tools::Function {
    crate::tools::Function {
        name: "get_weather".into(),
        description: None,
        parameters: serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
    }
}

#[test]
fn a_template_that_renders_tools_gets_them_and_the_calls_as_fields_and_sets_the_format() {
    use crate::tools::{PastCall, ToolChoice, ToolFormat, Tools};
    let chat_template = pd_engine::ChatTemplate::new(LLAMA_LIKE, "", "").expect("compiles");
    let text = templated(chat_template);
    let weather = weather();
    let call =
        PastCall { id: Some("call_1".into()), name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() };
    let turns = vec![
        Turn::new(Role::User, "Weather in Paris?"),
        Turn { calls: vec![call], ..Turn::new(Role::Assistant, "") },
        Turn { call_id: Some("call_1".into()), ..Turn::new(Role::Tool, "sunny") },
    ];
    let tools = Tools {
        functions: vec![weather],
        choice: ToolChoice::Named("get_weather".into()),
        parallel: false,
        format: ToolFormat::Hermes,
    };
    let rendered = render_chat(&turns, Some(&tools), &serde_json::Map::new(), &text, true).expect("renders");
    assert!(
        // `tojson` writes Python's json.dumps spacing, as transformers renders it.
        rendered.contains(r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}"#),
        "{rendered}"
    );
    assert!(rendered.contains("<tool>[call_1] sunny") && rendered.contains("\"get_weather\""), "{rendered}");
    assert!(!rendered.contains("<tool_call>"), "no Hermes prompt for a template with tools: {rendered}");

    let mut p = completion("x");
    p.kind = Kind::Chat;
    p.input = Input::Messages(turns);
    p.tools = Some(tools);
    let r = validate(p, &text, "m", &LIMITS).expect("valid");
    assert_eq!(r.tools.as_ref().map(|t| t.format), Some(ToolFormat::Llama3Json));
    match &r.params.constraint {
        Some(OutputConstraint::Lark(g)) => assert!(g.contains("\"parameters\"") && !g.contains("<tool_call>"), "{g}"),
        other => panic!("a forced call is a grammar in the model's format: {other:?}"),
    }
}

#[test]
fn phi4_mini_gets_the_tools_in_its_system_message_and_calls_in_its_own_form() {
    use crate::tools::{PastCall, ToolChoice, ToolFormat, Tools};
    // The real template (tokenizer_config.json of Phi-4-mini-instruct): it never reads the
    // `tools` variable; it renders a system message's own `tools` string, as the model card
    // shows: `{"role": "system", "content": ..., "tools": json.dumps(tools)}`.
    let source = include_str!("../../../engine/tests/data/chat_templates/microsoft-Phi-4-mini-instruct.jinja");
    let chat_template = pd_engine::ChatTemplate::new(source, "<|endoftext|>", "<|endoftext|>").expect("compiles");
    assert!(!chat_template.uses_tools() && chat_template.system_tools());
    let text = templated(chat_template);
    let tools =
        Tools { functions: vec![weather()], choice: ToolChoice::Auto, parallel: false, format: ToolFormat::Hermes };
    let listed =
        r#"[{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]"#;
    let mut turns = vec![Turn::new(Role::User, "Weather in Paris?")];
    let rendered = render_chat(&turns, Some(&tools), &serde_json::Map::new(), &text, true).expect("renders");
    assert_eq!(
        rendered,
        format!(
            "<|system|>You are a helpful assistant with some tools.<|tool|>{listed}<|/tool|><|end|>\
             <|user|>Weather in Paris?<|end|><|assistant|>"
        )
    );
    // The client's own system message keeps its words; an earlier call is written back as the
    // model writes calls.
    turns.insert(0, Turn::new(Role::System, "Be brief."));
    let mut answered = Turn::new(Role::Assistant, "");
    answered.calls.push(PastCall { id: None, name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() });
    turns.push(answered);
    let rendered = render_chat(&turns, Some(&tools), &serde_json::Map::new(), &text, true).expect("renders");
    assert!(rendered.starts_with(&format!("<|system|>Be brief.<|tool|>{listed}<|/tool|><|end|>")), "{rendered}");
    assert!(
        rendered.contains(r#"<|assistant|>functools[{"name":"get_weather","arguments":{"city":"Paris"}}]<|end|>"#),
        "{rendered}"
    );
    // As transformers renders the model card's own example (json.dumps of the functions in
    // the system message), byte for byte: scripts/reference/chat_templates.py.
    let expected: serde_json::Value =
        serde_json::from_str(include_str!("../../../engine/tests/data/chat_templates/expected.json"))
            .expect("expected.json");
    let cases = &expected["templates"]["microsoft-Phi-4-mini-instruct"]["cases"];
    let f = &cases["tools"]["tools"][0]["function"];
    let function = crate::tools::Function {
        name: f["name"].as_str().expect("name").into(),
        description: f["description"].as_str().map(String::from),
        parameters: f["parameters"].clone(),
    };
    let reference =
        Tools { functions: vec![function], choice: ToolChoice::Auto, parallel: false, format: ToolFormat::Hermes };
    let case = &cases["system_message_tools"];
    let asked = vec![
        Turn::new(Role::System, case["messages"][0]["content"].as_str().expect("system")),
        Turn::new(Role::User, case["messages"][1]["content"].as_str().expect("user")),
    ];
    let rendered = render_chat(&asked, Some(&reference), &serde_json::Map::new(), &text, true).expect("renders");
    assert_eq!(rendered, case["text"].as_str().expect("text"));
    // A forced call is written `functools[...]`, which its parser reads back.
    let mut p = completion("x");
    p.kind = Kind::Chat;
    p.input = Input::Messages(vec![Turn::new(Role::User, "Weather in Paris?")]);
    let mut forced = tools.clone();
    forced.choice = ToolChoice::Required;
    p.tools = Some(forced);
    let r = validate(p, &text, "m", &LIMITS).expect("valid");
    assert_eq!(r.tools.as_ref().map(|t| t.format), Some(ToolFormat::Phi4Mini));
    match &r.params.constraint {
        Some(OutputConstraint::Lark(g)) => assert!(g.starts_with("start: \"functools[\""), "{g}"),
        other => panic!("a forced call is a grammar in the model's format: {other:?}"),
    }
}

#[test]
fn chat_template_kwargs_reach_the_template_qwen3_thinking_off() {
    let source = include_str!("../../../engine/tests/data/chat_templates/Qwen-Qwen3-0.6B.jinja");
    let text = templated(pd_engine::ChatTemplate::new(source, "", "<|im_end|>").expect("compiles"));
    let turns = vec![Turn::new(Role::User, "Hi")];
    let off = serde_json::json!({"enable_thinking": false}).as_object().cloned().expect("object");
    let plain = render_chat(&turns, None, &serde_json::Map::new(), &text, true).expect("renders");
    let thinking_off = render_chat(&turns, None, &off, &text, true).expect("renders");
    assert!(plain.ends_with("<|im_start|>assistant\n"), "{plain}");
    assert_eq!(thinking_off, format!("{plain}<think>\n\n</think>\n\n"));
}

#[test]
fn an_assistant_turns_reasoning_reaches_a_template_that_reads_it() {
    use crate::tools::PastCall;
    let source = include_str!("../../../engine/tests/data/chat_templates/Qwen-Qwen3-0.6B.jinja");
    let text = templated(pd_engine::ChatTemplate::new(source, "", "<|im_end|>").expect("compiles"));
    // Qwen3's template keeps the reasoning of the turns after the last user message (a tool
    // loop), as the model wrote it.
    let mut thought = Turn::new(Role::Assistant, "");
    thought.reasoning = Some("I need the weather tool.".into());
    thought.calls.push(PastCall { id: None, name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() });
    let turns = vec![
        Turn::new(Role::User, "Weather in Paris?"),
        thought,
        Turn { call_id: Some("c1".into()), ..Turn::new(Role::Tool, "sunny") },
    ];
    let rendered = render_chat(&turns, None, &serde_json::Map::new(), &text, true).expect("renders");
    assert!(rendered.contains("<think>\nI need the weather tool.\n</think>"), "{rendered}");
}

#[test]
fn a_prompt_that_opens_a_reasoning_block_starts_the_answer_inside_it_unless_a_grammar_writes_it() {
    use crate::reasoning::Start;
    // DeepSeek-R1's way: the generation prompt opens the block; the template drops `</think>`
    // blocks from the history, so it mentions the closing tag.
    let source =
        "{% for m in messages %}{% set c = m.content.split('</think>')[-1] %}<|{{ m.role }}|>{{ c }}{% endfor %}\
                  {% if add_generation_prompt %}<|assistant|><think>\n{% endif %}";
    let text = templated(pd_engine::ChatTemplate::new(source, "", "").expect("compiles"));
    let chat = || {
        let mut p = completion("x");
        p.kind = Kind::Chat;
        p.input = Input::Messages(vec![Turn::new(Role::User, "Hi")]);
        p
    };
    assert_eq!(validate(chat(), &text, "m", &LIMITS).expect("valid").reasoning, Some(Start::Inside));
    let mut constrained = chat();
    constrained.constraint = Some((OutputConstraint::Lark("start: \"Hi\"".into()), "guided_grammar"));
    assert_eq!(validate(constrained, &text, "m", &LIMITS).expect("valid").reasoning, None);
    let mut plain = completion("x");
    plain.kind = Kind::Completion;
    assert_eq!(validate(plain, &text, "m", &LIMITS).expect("valid").reasoning, None, "completions are text");
}
