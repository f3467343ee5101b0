//! `validate` on a character tokenizer (no chat template, 64-token context).

use pd_engine::{TextSide, Tokenizer};

use super::*;

fn text() -> TextSide {
    TextSide { tokenizer: Tokenizer::characters().expect("tokenizer"), chat_template: None, max_position: 64 }
}

const LIMITS: Limits = Limits { max_tokens: 40, default_completion_tokens: 16, default_chat_tokens: 512 };

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
fn sampling_fields_are_checked_by_name() {
    type Change = Box<dyn Fn(&mut GenerateParams)>;
    let cases: Vec<(&str, Change)> = vec![
        ("temperature", Box::new(|p| p.temperature = Some(2.5))),
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
        ("messages", Box::new(|p| p.input = Input::Messages(vec![(Role::User, "hi".into())]))),
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
fn roles_parse_by_name() {
    assert_eq!(Role::parse("assistant"), Some(Role::Assistant));
    assert_eq!(Role::parse("tool"), None);
}
