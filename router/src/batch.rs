//! A completions request with several prompts (`prompt` as a list of strings or of token-id
//! lists, as OpenAI and evaluation harnesses send them): each prompt is its own request in
//! the cluster (validated, admitted, traced and routed on its own, with its own id), and the
//! client sees one answer whose choices are numbered prompt by prompt: prompt i's answer j is
//! choice `i * n + j`. The merged stream ends with one `Done` counting every prompt's usage,
//! after all of them; the first failure ends it (the other prompts are then cancelled).

use futures_util::stream::{self, SelectAll, StreamExt};
use futures_util::Stream;

use crate::error::RouterError;
use crate::relay::Update;

/// Most prompts in one request.
pub const MAX_PROMPTS: usize = 64;

struct Merge {
    parts: SelectAll<stream::BoxStream<'static, (u32, Result<Update, RouterError>)>>,
    /// Prompts not done yet.
    left: usize,
    n: u32,
    usage: (u32, u32, u32),
    ended: bool,
}

/// The updates of `parts` (one per prompt, each with `n` answers) as one request's.
pub fn merge<S>(parts: Vec<S>, n: usize) -> impl Stream<Item = Result<Update, RouterError>> + Send
where
    S: Stream<Item = Result<Update, RouterError>> + Send + 'static,
{
    let left = parts.len();
    let parts =
        stream::select_all(parts.into_iter().enumerate().map(|(i, u)| u.map(move |update| (i as u32, update)).boxed()));
    let state = Merge { parts, left, n: n as u32, usage: (0, 0, 0), ended: false };
    stream::unfold(state, |mut m| async move {
        loop {
            if m.ended {
                return None;
            }
            let Some((prompt, update)) = m.parts.next().await else {
                m.ended = true;
                let e =
                    RouterError::Worker { stage: "relay", message: "a prompt's stream ended without its end".into() };
                return Some((Err(e), m));
            };
            let base = prompt * m.n;
            let out = match update {
                Ok(Update::Token { index, token_id, text, logprobs }) => {
                    Ok(Update::Token { index: base + index, token_id, text, logprobs })
                }
                Ok(Update::Finished { index, finish_reason, completion_tokens }) => {
                    Ok(Update::Finished { index: base + index, finish_reason, completion_tokens })
                }
                Ok(Update::Done { prompt_tokens, completion_tokens, cached_tokens }) => {
                    m.usage.0 += prompt_tokens;
                    m.usage.1 += completion_tokens;
                    m.usage.2 += cached_tokens;
                    m.left -= 1;
                    if m.left > 0 {
                        continue;
                    }
                    m.ended = true;
                    let (prompt_tokens, completion_tokens, cached_tokens) = m.usage;
                    Ok(Update::Done { prompt_tokens, completion_tokens, cached_tokens })
                }
                Err(e) => {
                    m.ended = true;
                    Err(e)
                }
            };
            return Some((out, m));
        }
    })
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::updates::{LastWord, Updates};

    fn part(updates: Vec<Update>) -> Updates {
        let (tx, rx) = mpsc::channel(16);
        for u in updates {
            tx.try_send(Ok(u)).expect("room");
        }
        Updates::new(rx, LastWord::default())
    }

    fn token(index: u32, id: u32) -> Update {
        Update::Token { index, token_id: id, text: String::new(), logprobs: None }
    }

    fn end(index: u32, tokens: u32) -> [Update; 1] {
        [Update::Finished { index, finish_reason: "length".into(), completion_tokens: tokens }]
    }

    fn done(prompt: u32, completion: u32) -> Update {
        Update::Done { prompt_tokens: prompt, completion_tokens: completion, cached_tokens: 1 }
    }

    #[tokio::test]
    async fn prompts_number_their_choices_in_turn_and_end_once_with_every_usage() {
        let a =
            part([vec![token(0, 5), token(1, 6)], end(0, 1).to_vec(), end(1, 1).to_vec(), vec![done(3, 2)]].concat());
        let b = part([vec![token(0, 7)], end(0, 1).to_vec(), end(1, 0).to_vec(), vec![done(4, 1)]].concat());
        let got: Vec<_> = merge(vec![a, b], 2).collect().await;
        let indexes: Vec<u32> = got
            .iter()
            .filter_map(|u| match u {
                Ok(Update::Token { index, .. }) => Some(*index),
                _ => None,
            })
            .collect();
        assert_eq!(indexes.iter().filter(|&&i| i >= 2).count(), 1, "prompt 1's answers are 2 and 3: {got:?}");
        let mut finished: Vec<u32> = got
            .iter()
            .filter_map(|u| match u {
                Ok(Update::Finished { index, .. }) => Some(*index),
                _ => None,
            })
            .collect();
        finished.sort_unstable();
        assert_eq!(finished, vec![0, 1, 2, 3]);
        assert_eq!(got.last(), Some(&Ok(Update::Done { prompt_tokens: 7, completion_tokens: 3, cached_tokens: 2 })));
        assert_eq!(got.iter().filter(|u| matches!(u, Ok(Update::Done { .. }))).count(), 1);
    }

    #[tokio::test]
    async fn the_first_failure_ends_the_request() {
        let (tx, rx) = mpsc::channel(4);
        tx.try_send(Err(RouterError::NoWorker("decode"))).expect("room");
        let failing = Updates::new(rx, LastWord::default());
        let fine = part(vec![token(0, 1)]);
        let got: Vec<_> = merge(vec![failing, fine], 1).collect().await;
        assert!(got.iter().any(|u| u.is_err()), "{got:?}");
        assert!(matches!(got.last(), Some(Err(_))), "nothing after the failure: {got:?}");
    }
}
