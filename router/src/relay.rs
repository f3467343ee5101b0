//! What the client sees of a generation, from two sources: the prefill worker's response
//! (the first token, as soon as it exists) and the decode worker's stream (the first token
//! again, as committed with the KV, then every later token and the end). `Relay` is the
//! plain state that merges them: the first token goes out once, from whichever source has it
//! first; the decode worker continues from it; nothing is sent after the end.

use pb::decode_event::Event;
use pd_proto::v1 as pb;

use crate::error::RouterError;

/// What the client sees of a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    Token {
        token_id: u32,
        text: String,
        /// With `logprobs`: the first token's from the prefill worker, the rest from the decode
        /// worker (token texts not yet filled in).
        logprobs: Option<pb::TokenLogprobs>,
    },
    /// The end. `cached_tokens`: prompt tokens not computed for this request (the prefix
    /// cache of the worker that prefilled it).
    Done { finish_reason: String, prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32 },
}

/// What to do with one decode-stream message.
#[derive(Debug, Clone, PartialEq)]
pub enum Relayed {
    /// Send this to the client.
    Send(Update),
    /// Nothing for the client (the first token it already has, a late KV target).
    Skip,
    /// Send this and stop: the generation is complete.
    Finish(Update),
    /// The generation failed: tell the client and stop.
    Fail(RouterError),
}

/// The merge of one request's two sources; see the module docs.
#[derive(Debug)]
pub struct Relay {
    /// The prefill worker computes the first token (not a prompt prefilled on the decode worker).
    remote_prefill: bool,
    /// The first token sent to the client, from either source.
    first_sent: Option<u32>,
    /// Token events seen on the decode stream.
    decode_tokens: usize,
    ended: bool,
}

/// The gRPC status of a decode worker as the router's error.
pub fn decode_error(status: tonic::Status) -> RouterError {
    match status.code() {
        tonic::Code::InvalidArgument => {
            RouterError::InvalidRequest { message: status.message().to_string(), param: None }
        }
        tonic::Code::ResourceExhausted => {
            RouterError::Overloaded { message: status.message().to_string(), retry_after_s: 1 }
        }
        _ => RouterError::Worker { stage: "decode", message: status.message().to_string() },
    }
}

impl Relay {
    pub fn new(remote_prefill: bool) -> Self {
        Relay { remote_prefill, first_sent: None, decode_tokens: 0, ended: false }
    }

    /// The prefill worker answered with the first token and its text: sent now, unless the
    /// decode stream already delivered it.
    pub fn on_prefill_done(
        &mut self,
        token_id: u32,
        text: String,
        logprobs: Option<pb::TokenLogprobs>,
    ) -> Option<Update> {
        if self.ended || self.first_sent.is_some() {
            return None;
        }
        self.first_sent = Some(token_id);
        Some(Update::Token { token_id, text, logprobs })
    }

    /// One message (or the end, or an error) of the decode stream.
    pub fn on_decode_event(&mut self, message: Result<Option<pb::DecodeEvent>, tonic::Status>) -> Relayed {
        if self.ended {
            return Relayed::Skip;
        }
        let relayed = match message {
            Ok(Some(pb::DecodeEvent { event: Some(Event::Token(t)) })) => self.token(t),
            Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) })) => Relayed::Finish(Update::Done {
                finish_reason: f.finish_reason,
                prompt_tokens: f.prompt_tokens,
                completion_tokens: f.completion_tokens,
                // A remote prefill's own hit arrives with its response (the decode worker's
                // hit only spared the transfer).
                cached_tokens: if self.remote_prefill { 0 } else { f.cached_tokens },
            }),
            Ok(Some(_)) => Relayed::Skip,
            Ok(None) => Relayed::Fail(RouterError::Worker {
                stage: "decode",
                message: "the stream ended without finishing".into(),
            }),
            Err(status) => Relayed::Fail(decode_error(status)),
        };
        self.ended = matches!(relayed, Relayed::Finish(_) | Relayed::Fail(_));
        relayed
    }

    fn token(&mut self, t: pb::TokenEvent) -> Relayed {
        self.decode_tokens += 1;
        let committed_first = self.remote_prefill && self.decode_tokens == 1;
        match (committed_first, self.first_sent) {
            (true, Some(sent)) if sent == t.token_id => Relayed::Skip,
            (true, Some(sent)) => Relayed::Fail(RouterError::Worker {
                stage: "decode",
                message: format!(
                    "the decode worker committed first token {} but the prefill worker sent {sent}",
                    t.token_id
                ),
            }),
            (_, _) => {
                self.first_sent.get_or_insert(t.token_id);
                Relayed::Send(Update::Token { token_id: t.token_id, text: t.text, logprobs: t.logprobs })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(id: u32, text: &str) -> Result<Option<pb::DecodeEvent>, tonic::Status> {
        let t = pb::TokenEvent { token_id: id, text: text.into(), ..Default::default() };
        Ok(Some(pb::DecodeEvent { event: Some(Event::Token(t)) }))
    }

    fn finished(n: u32) -> Result<Option<pb::DecodeEvent>, tonic::Status> {
        let f = pb::Finished {
            finish_reason: "length".into(),
            prompt_tokens: 5,
            completion_tokens: n,
            ..Default::default()
        };
        Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) }))
    }

    fn send(id: u32, text: &str) -> Relayed {
        Relayed::Send(Update::Token { token_id: id, text: text.into(), logprobs: None })
    }

    #[test]
    fn the_prefill_workers_first_token_goes_out_at_once_and_its_commit_echo_is_skipped() {
        let mut relay = Relay::new(true);
        let first = Some(pb::TokenLogprobs { logprob: -0.5, ..Default::default() });
        assert_eq!(
            relay.on_prefill_done(7, "Hi".into(), first.clone()),
            Some(Update::Token { token_id: 7, text: "Hi".into(), logprobs: first })
        );
        assert_eq!(relay.on_decode_event(token(7, "Hi")), Relayed::Skip);
        assert_eq!(relay.on_decode_event(token(8, " there")), send(8, " there"));
        assert!(matches!(
            relay.on_decode_event(finished(2)),
            Relayed::Finish(Update::Done { completion_tokens: 2, .. })
        ));
        assert_eq!(relay.on_decode_event(token(9, "late")), Relayed::Skip, "nothing after the end");
    }

    #[test]
    fn when_the_decode_stream_is_first_the_prefill_answer_adds_nothing() {
        let mut relay = Relay::new(true);
        assert_eq!(relay.on_decode_event(token(7, "Hi")), send(7, "Hi"));
        assert_eq!(relay.on_decode_event(token(8, "!")), send(8, "!"));
        assert_eq!(relay.on_prefill_done(7, "Hi".into(), None), None);
    }

    #[test]
    fn a_first_token_that_disagrees_fails_the_request() {
        let mut relay = Relay::new(true);
        relay.on_prefill_done(7, "Hi".into(), None);
        assert!(matches!(relay.on_decode_event(token(3, "x")), Relayed::Fail(RouterError::Worker { .. })));
    }

    #[test]
    fn a_prompt_prefilled_on_the_decode_worker_streams_every_token_from_there() {
        let mut relay = Relay::new(false);
        assert_eq!(relay.on_decode_event(token(4, "a")), send(4, "a"));
        assert_eq!(relay.on_decode_event(token(4, "a")), send(4, "a"), "a repeated token id is a real token");
    }

    #[test]
    fn stream_errors_and_early_ends_fail_with_the_decode_stage() {
        let mut relay = Relay::new(true);
        let failed = relay.on_decode_event(Err(tonic::Status::unavailable("worker gone")));
        assert!(matches!(failed, Relayed::Fail(RouterError::Worker { stage: "decode", .. })));
        let mut relay = Relay::new(true);
        assert!(matches!(relay.on_decode_event(Ok(None)), Relayed::Fail(RouterError::Worker { .. })));
        let mut relay = Relay::new(true);
        let full = relay.on_decode_event(Err(tonic::Status::resource_exhausted("no KV blocks")));
        assert!(matches!(full, Relayed::Fail(RouterError::Overloaded { .. })));
    }
}
