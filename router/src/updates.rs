//! The client's side of a relay: the updates of one request, ending with exactly one `Done`
//! or one error. The relay hands updates over a bounded channel; when it has to give up on a
//! client that stopped reading (the channel stayed full past the send timeout), it cannot
//! queue its error, so it leaves it here as its last word and the stream yields it after the
//! queued updates. A relay that ends without any end at all yields a generic error: a front
//! end never closes a stream silently or reports success for it.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;

use crate::error::RouterError;
use crate::relay::Update;

/// Where the relay leaves the error it could not queue.
#[derive(Debug, Clone, Default)]
pub struct LastWord(Arc<Mutex<Option<RouterError>>>);

impl LastWord {
    pub fn set(&self, e: RouterError) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(e);
        }
    }

    fn take(&self) -> Option<RouterError> {
        self.0.lock().ok().and_then(|mut slot| slot.take())
    }
}

/// The stream of a request's updates, as the front ends read it.
pub struct Updates {
    rx: ReceiverStream<Result<Update, RouterError>>,
    last_word: LastWord,
    ended: bool,
}

impl Updates {
    pub fn new(rx: mpsc::Receiver<Result<Update, RouterError>>, last_word: LastWord) -> Self {
        Updates { rx: ReceiverStream::new(rx), last_word, ended: false }
    }
}

impl Stream for Updates {
    type Item = Result<Update, RouterError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.rx).poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(item)) => {
                self.ended = matches!(item, Ok(Update::Done { .. }) | Err(_));
                Poll::Ready(Some(item))
            }
            Poll::Ready(None) => {
                self.ended = true;
                let e = self.last_word.take().unwrap_or_else(|| RouterError::Worker {
                    stage: "relay",
                    message: "the stream ended without its end".into(),
                });
                Poll::Ready(Some(Err(e)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    use super::*;

    fn token(id: u32) -> Result<Update, RouterError> {
        Ok(Update::Token { index: 0, token_id: id, text: String::new(), logprobs: None })
    }

    #[tokio::test]
    async fn a_relay_that_gave_up_ends_the_stream_with_its_last_word() {
        let (tx, rx) = mpsc::channel(4);
        let last_word = LastWord::default();
        tx.send(token(1)).await.expect("send");
        last_word.set(RouterError::ClientTooSlow("too slow".into()));
        drop(tx);
        let got: Vec<_> = Updates::new(rx, last_word).collect().await;
        assert_eq!(got, vec![token(1), Err(RouterError::ClientTooSlow("too slow".into()))]);
    }

    #[tokio::test]
    async fn a_stream_without_an_end_ends_with_an_error_and_nothing_follows_an_end() {
        let (tx, rx) = mpsc::channel(4);
        drop(tx);
        let got: Vec<_> = Updates::new(rx, LastWord::default()).collect().await;
        assert!(matches!(got.as_slice(), [Err(RouterError::Worker { stage: "relay", .. })]), "{got:?}");

        let (tx, rx) = mpsc::channel(4);
        let done = Update::Done { prompt_tokens: 1, completion_tokens: 1, cached_tokens: 0 };
        tx.send(Ok(done.clone())).await.expect("send");
        drop(tx);
        let got: Vec<_> = Updates::new(rx, LastWord::default()).collect().await;
        assert_eq!(got, vec![Ok(done)]);
    }
}
