//! What the client sees of a generation, from two sources: the prefill worker's response
//! (the first token, as soon as it exists) and the decode worker's stream (the first token
//! again, as committed with the KV, then every later token and the end). `Relay` is the
//! plain state that merges them: the first token goes out once, from whichever source has it
//! first; the decode worker continues from it; nothing is sent after the end.
//!
//! With `n` answers the decode stream interleaves them by `index`; the prefill worker's
//! first token is answer 0's (the other answers draw their own on the decode worker). Each
//! answer ends with its `Finished`; the generation ends when all have, with one `Done`
//! counting the prompt once and every answer's tokens.

use pb::decode_event::Event;
use pd_proto::v1 as pb;

use crate::error::RouterError;

/// What the client sees of a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    Token {
        /// The answer (0 .. n).
        index: u32,
        token_id: u32,
        text: String,
        /// With `logprobs`: the first token's from the prefill worker, the rest from the decode
        /// worker (token texts not yet filled in).
        logprobs: Option<pb::TokenLogprobs>,
    },
    /// One answer ended.
    Finished { index: u32, finish_reason: String, completion_tokens: u32 },
    /// The end, after every answer's `Finished`. `cached_tokens`: prompt tokens not computed
    /// for this request (the prefix cache of the worker that prefilled it).
    Done { prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32 },
}

/// What to do with one decode-stream message.
#[derive(Debug, Clone, PartialEq)]
pub enum Relayed {
    /// Send this to the client.
    Send(Update),
    /// Nothing for the client (the first token it already has, a late KV target).
    Skip,
    /// Send these (the last answer's `Finished`, then `Done`) and stop: the generation is
    /// complete.
    Finish(Vec<Update>),
    /// The generation failed: tell the client and stop.
    Fail(RouterError),
}

/// The merge of one request's two sources; see the module docs.
#[derive(Debug)]
pub struct Relay {
    /// The prefill worker computes the first token (not a prompt prefilled on the decode worker).
    remote_prefill: bool,
    /// The first token of answer 0 sent to the client, from either source.
    first_sent: Option<u32>,
    /// Answer 0's token events seen on the decode stream.
    decode_tokens: usize,
    /// Per answer: ended.
    finished: Vec<bool>,
    completion_tokens: u32,
    ended: bool,
}

/// The gRPC status of a decode worker as the router's error.
pub fn decode_error(status: tonic::Status) -> RouterError {
    worker_status_error("decode", status)
}

/// The gRPC status of a worker at `stage` as the router's error: its refusal of the request
/// (400), its lack of room (429), or its failure.
pub fn worker_status_error(stage: &'static str, status: tonic::Status) -> RouterError {
    match status.code() {
        tonic::Code::InvalidArgument => {
            RouterError::InvalidRequest { message: status.message().to_string(), param: None }
        }
        tonic::Code::ResourceExhausted => {
            RouterError::Overloaded { message: status.message().to_string(), retry_after_s: 1 }
        }
        _ => RouterError::Worker { stage, message: status.message().to_string() },
    }
}

fn worker_error(message: String) -> Relayed {
    Relayed::Fail(RouterError::Worker { stage: "decode", message })
}

impl Relay {
    /// The merge for `n` answers (at least 1).
    pub fn new(remote_prefill: bool, n: usize) -> Self {
        Relay {
            remote_prefill,
            first_sent: None,
            decode_tokens: 0,
            finished: vec![false; n.max(1)],
            completion_tokens: 0,
            ended: false,
        }
    }

    /// The prefill worker answered with answer 0's first token and its text: sent now,
    /// unless the decode stream already delivered it.
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
        Some(Update::Token { index: 0, token_id, text, logprobs })
    }

    /// One message (or the end, or an error) of the decode stream.
    pub fn on_decode_event(&mut self, message: Result<Option<pb::DecodeEvent>, tonic::Status>) -> Relayed {
        if self.ended {
            return Relayed::Skip;
        }
        let relayed = match message {
            Ok(Some(pb::DecodeEvent { event: Some(Event::Token(t)) })) => self.token(t),
            Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) })) => self.finished(f),
            Ok(Some(_)) => Relayed::Skip,
            Ok(None) => worker_error("the stream ended without finishing".into()),
            Err(status) => Relayed::Fail(decode_error(status)),
        };
        self.ended = matches!(relayed, Relayed::Finish(_) | Relayed::Fail(_));
        relayed
    }

    fn answer(&self, index: u32) -> Result<usize, Relayed> {
        match self.finished.get(index as usize) {
            Some(false) => Ok(index as usize),
            Some(true) => Err(worker_error(format!("answer {index} continued after its end"))),
            None => Err(worker_error(format!("answer {index} of a request for {}", self.finished.len()))),
        }
    }

    fn finished(&mut self, f: pb::Finished) -> Relayed {
        let i = match self.answer(f.index) {
            Ok(i) => i,
            Err(fail) => return fail,
        };
        self.finished[i] = true;
        self.completion_tokens += f.completion_tokens;
        let end =
            Update::Finished { index: f.index, finish_reason: f.finish_reason, completion_tokens: f.completion_tokens };
        if self.finished.iter().any(|done| !done) {
            return Relayed::Send(end);
        }
        let done = Update::Done {
            prompt_tokens: f.prompt_tokens,
            completion_tokens: self.completion_tokens,
            // A remote prefill's own hit arrives with its response (the decode worker's
            // hit only spared the transfer).
            cached_tokens: if self.remote_prefill { 0 } else { f.cached_tokens },
        };
        Relayed::Finish(vec![end, done])
    }

    fn token(&mut self, t: pb::TokenEvent) -> Relayed {
        if let Err(fail) = self.answer(t.index) {
            return fail;
        }
        let update = Update::Token { index: t.index, token_id: t.token_id, text: t.text, logprobs: t.logprobs };
        if t.index != 0 {
            return Relayed::Send(update);
        }
        self.decode_tokens += 1;
        let committed_first = self.remote_prefill && self.decode_tokens == 1;
        match (committed_first, self.first_sent) {
            (true, Some(sent)) if sent == t.token_id => Relayed::Skip,
            (true, Some(sent)) => worker_error(format!(
                "the decode worker committed first token {} but the prefill worker sent {sent}",
                t.token_id
            )),
            (_, _) => {
                self.first_sent.get_or_insert(t.token_id);
                Relayed::Send(update)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(id: u32, text: &str) -> Result<Option<pb::DecodeEvent>, tonic::Status> {
        token_of(0, id, text)
    }

    fn token_of(index: u32, id: u32, text: &str) -> Result<Option<pb::DecodeEvent>, tonic::Status> {
        let t = pb::TokenEvent { token_id: id, text: text.into(), index, ..Default::default() };
        Ok(Some(pb::DecodeEvent { event: Some(Event::Token(t)) }))
    }

    fn finished(n: u32) -> Result<Option<pb::DecodeEvent>, tonic::Status> {
        finished_of(0, n)
    }

    fn finished_of(index: u32, n: u32) -> Result<Option<pb::DecodeEvent>, tonic::Status> {
        let f = pb::Finished {
            finish_reason: "length".into(),
            prompt_tokens: 5,
            completion_tokens: n,
            index,
            ..Default::default()
        };
        Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) }))
    }

    fn send(id: u32, text: &str) -> Relayed {
        send_of(0, id, text)
    }

    fn send_of(index: u32, id: u32, text: &str) -> Relayed {
        Relayed::Send(Update::Token { index, token_id: id, text: text.into(), logprobs: None })
    }

    #[test]
    fn the_prefill_workers_first_token_goes_out_at_once_and_its_commit_echo_is_skipped() {
        let mut relay = Relay::new(true, 1);
        let first = Some(pb::TokenLogprobs { logprob: -0.5, ..Default::default() });
        assert_eq!(
            relay.on_prefill_done(7, "Hi".into(), first.clone()),
            Some(Update::Token { index: 0, token_id: 7, text: "Hi".into(), logprobs: first })
        );
        assert_eq!(relay.on_decode_event(token(7, "Hi")), Relayed::Skip);
        assert_eq!(relay.on_decode_event(token(8, " there")), send(8, " there"));
        assert!(matches!(
            relay.on_decode_event(finished(2)).clone(),
            Relayed::Finish(u) if matches!(u.as_slice(), [Update::Finished { index: 0, .. }, Update::Done { completion_tokens: 2, .. }])
        ));
        assert_eq!(relay.on_decode_event(token(9, "late")), Relayed::Skip, "nothing after the end");
    }

    #[test]
    fn when_the_decode_stream_is_first_the_prefill_answer_adds_nothing() {
        let mut relay = Relay::new(true, 1);
        assert_eq!(relay.on_decode_event(token(7, "Hi")), send(7, "Hi"));
        assert_eq!(relay.on_decode_event(token(8, "!")), send(8, "!"));
        assert_eq!(relay.on_prefill_done(7, "Hi".into(), None), None);
    }

    #[test]
    fn a_first_token_that_disagrees_fails_the_request() {
        let mut relay = Relay::new(true, 1);
        relay.on_prefill_done(7, "Hi".into(), None);
        assert!(matches!(relay.on_decode_event(token(3, "x")), Relayed::Fail(RouterError::Worker { .. })));
    }

    #[test]
    fn a_prompt_prefilled_on_the_decode_worker_streams_every_token_from_there() {
        let mut relay = Relay::new(false, 1);
        assert_eq!(relay.on_decode_event(token(4, "a")), send(4, "a"));
        assert_eq!(relay.on_decode_event(token(4, "a")), send(4, "a"), "a repeated token id is a real token");
    }

    #[test]
    fn stream_errors_and_early_ends_fail_with_the_decode_stage() {
        let mut relay = Relay::new(true, 1);
        let failed = relay.on_decode_event(Err(tonic::Status::unavailable("worker gone")));
        assert!(matches!(failed, Relayed::Fail(RouterError::Worker { stage: "decode", .. })));
        let mut relay = Relay::new(true, 1);
        assert!(matches!(relay.on_decode_event(Ok(None)), Relayed::Fail(RouterError::Worker { .. })));
        let mut relay = Relay::new(true, 1);
        let full = relay.on_decode_event(Err(tonic::Status::resource_exhausted("no KV blocks")));
        assert!(matches!(full, Relayed::Fail(RouterError::Overloaded { .. })));
    }

    #[test]
    fn several_answers_interleave_by_index_and_end_together_with_the_prompt_counted_once() {
        let mut relay = Relay::new(true, 3);
        relay.on_prefill_done(7, "Hi".into(), None);
        assert_eq!(relay.on_decode_event(token_of(1, 4, "a")), send_of(1, 4, "a"), "answer 1 has its own first");
        assert_eq!(relay.on_decode_event(token(7, "Hi")), Relayed::Skip, "answer 0's echo of the prefill's token");
        assert_eq!(relay.on_decode_event(token_of(2, 7, "Hi")), send_of(2, 7, "Hi"), "the same id elsewhere is real");
        let end_1 = Relayed::Send(Update::Finished { index: 1, finish_reason: "length".into(), completion_tokens: 2 });
        assert_eq!(relay.on_decode_event(finished_of(1, 2)), end_1);
        assert!(
            matches!(relay.on_decode_event(token_of(1, 5, "b")), Relayed::Fail(_)),
            "nothing after an answer's end"
        );

        let mut relay = Relay::new(false, 2);
        assert!(matches!(relay.on_decode_event(finished_of(1, 3)), Relayed::Send(Update::Finished { index: 1, .. })));
        match relay.on_decode_event(finished_of(0, 4)) {
            Relayed::Finish(u) => assert_eq!(
                u[1],
                Update::Done { prompt_tokens: 5, completion_tokens: 7, cached_tokens: 0 },
                "the prompt once, both answers' tokens"
            ),
            other => panic!("{other:?}"),
        }
        let mut relay = Relay::new(false, 2);
        assert!(matches!(relay.on_decode_event(token_of(2, 1, "x")), Relayed::Fail(_)), "an index beyond n");
    }
}
