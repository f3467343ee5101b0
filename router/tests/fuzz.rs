//! Property-based fuzzing of the public API's front door: arbitrary bytes and arbitrary JSON
//! objects (the real field names with values of every type, unknown fields, nesting) through
//! the HTTP body decoder and the validator, for completions and chat. Nothing panics; every
//! refusal is a typed error with a message (and the field, where one is at fault); every
//! accepted request is one the cluster can run: a non-empty prompt shorter than the context,
//! 1 <= max_tokens <= the limit, valid sampling. `PROPTEST_CASES` sets the number of cases
//! (256 by default here; `scripts/fuzz.sh` runs many more).

use pd_engine::{TextSide, Tokenizer};
use pd_router::api::request::decode;
use pd_router::validate::{validate, Kind, Limits};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const LIMITS: Limits = Limits { max_tokens: 40, default_completion_tokens: 16, default_chat_tokens: 512, max_n: 4 };

fn text() -> TextSide {
    TextSide { tokenizer: Tokenizer::characters().expect("tokenizer"), chat_template: None, max_position: 64 }
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// Any JSON value, a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        Just(json!(u64::MAX)),
        Just(json!(-1)),
        Just(json!(0)),
        Just(json!(1e300)),
        ".{0,40}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

const FIELDS: [&str; 18] = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "role",
    "content",
];

/// A plausible message list: roles and contents of every kind.
fn messages() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        Just(json!("system")),
        Just(json!("user")),
        Just(json!("assistant")),
        Just(json!("tool")),
        any_json()
    ];
    let message = (role, prop_oneof![".{0,30}".prop_map(Value::from), any_json()])
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    prop::collection::vec(message, 0..4).prop_map(Value::from)
}

/// An object whose keys are mostly the API's own, with values of any type.
fn request_object() -> impl Strategy<Value = Value> {
    let key = prop_oneof![4 => prop::sample::select(FIELDS.to_vec()).prop_map(String::from), 1 => ".{0,10}"];
    let value = prop_oneof![3 => any_json(), 1 => messages()];
    prop::collection::btree_map(key, value, 0..8).prop_map(|m| Value::Object(m.into_iter().collect()))
}

/// Runs one body through decode + validate and checks the outcome's invariants.
fn check(kind: Kind, body: &[u8]) -> Result<(), TestCaseError> {
    let text = text();
    let outcome = decode(kind, body).and_then(|p| validate(p, &text, "m", &LIMITS));
    match outcome {
        Ok(v) => {
            prop_assert!(!v.prompt_tokens.is_empty() && v.prompt_tokens.len() < text.max_position);
            prop_assert!(v.params.max_tokens >= 1 && v.params.max_tokens <= LIMITS.max_tokens as usize);
            prop_assert!(v.params.validate().is_ok(), "accepted invalid sampling {:?}", v.params);
            prop_assert_eq!(v.model.as_str(), "m");
        }
        Err(e) => {
            prop_assert!(!e.to_string().is_empty());
            prop_assert!(e.http_status().is_client_error(), "{e} is not the client's fault?");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes_are_refused_cleanly(body in prop::collection::vec(any::<u8>(), 0..256)) {
        check(Kind::Completion, &body)?;
        check(Kind::Chat, &body)?;
    }

    #[test]
    fn arbitrary_requests_are_accepted_only_when_runnable(object in request_object()) {
        let body = serde_json::to_vec(&object).expect("json");
        check(Kind::Completion, &body)?;
        check(Kind::Chat, &body)?;
    }
}
