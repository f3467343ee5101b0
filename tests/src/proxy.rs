//! A user-space TCP fault proxy for the KV path. This kernel has no `netem`, so delay, stalls
//! and lost connections are made here: a decode worker advertises the proxy's address as its
//! KV endpoint, prefill workers send their KV transfers through it, and the test switches its
//! mode while transfers run. `Delay` holds every forwarded chunk for a while (a slow, far
//! link), `Stall` forwards nothing until the mode changes (a link that stops moving bytes
//! without closing), and `cut` resets every open connection mid-transfer (what a lossy link
//! looks like once TCP gives up). New connections are accepted in every mode.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How the proxy forwards bytes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Each chunk waits this long before it is forwarded.
    Delay(Duration),
    /// Nothing is forwarded (connections stay open).
    Stall,
}

#[derive(Debug, Clone, Copy)]
struct State {
    mode: Mode,
    /// Bumped by `cut`: connections opened before the bump are reset.
    generation: u64,
}

/// A running proxy from `addr` to one upstream address; stops when dropped.
pub struct FaultProxy {
    pub addr: SocketAddr,
    state: watch::Sender<State>,
    accept: tokio::task::JoinHandle<()>,
    accepted: Arc<AtomicUsize>,
}

impl FaultProxy {
    /// Listens on `listen` (port 0 picks one) and forwards every connection to `upstream`.
    /// Must run inside a tokio runtime; its sockets live in the calling thread's namespace.
    pub async fn start(listen: &str, upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (state, rx) = watch::channel(State { mode: Mode::Pass, generation: 0 });
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        let accept = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::Relaxed);
                let rx = rx.clone();
                tokio::spawn(async move {
                    if let Ok(up) = TcpStream::connect(upstream).await {
                        connection(down, up, rx).await;
                    }
                });
            }
        });
        Ok(FaultProxy { addr, state, accept, accepted })
    }

    /// Connections accepted so far (a test checks that traffic really went through).
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    pub fn set(&self, mode: Mode) {
        self.state.send_modify(|s| s.mode = mode);
    }

    /// Resets every connection open now (the peers see a reset, not a clean close).
    pub fn cut(&self) {
        self.state.send_modify(|s| s.generation += 1);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn connection(mut down: TcpStream, mut up: TcpStream, rx: watch::Receiver<State>) {
    let born = rx.borrow().generation;
    let _ = down.set_nodelay(true);
    let _ = up.set_nodelay(true);
    let cut = {
        // Borrowed halves: dropping them shuts nothing down (an owned write half would send
        // a FIN as it drops, and a cut would look like a clean close).
        let (mut down_r, mut down_w) = down.split();
        let (mut up_r, mut up_w) = up.split();
        // Either direction ending (EOF, error, or a cut) ends the connection.
        tokio::select! {
            c = pump(&mut down_r, &mut up_w, rx.clone(), born) => c,
            c = pump(&mut up_r, &mut down_w, rx.clone(), born) => c,
        }
    };
    if cut {
        // Linger 0: closing each socket sends an RST, what a lossy link's peers see.
        let _ = socket_linger_zero(&down);
        let _ = socket_linger_zero(&up);
    }
}

/// Copies `from` to `to` under the proxy's mode; returns when either side ends (false) or a
/// cut reaches this connection (true).
async fn pump<R, W>(from: &mut R, to: &mut W, mut rx: watch::Receiver<State>, born: u64) -> bool
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return false,
                Ok(n) => n,
            },
            _ = cut(&mut rx, born) => return true,
        };
        // Hold the chunk as the mode says; a cut meanwhile ends the connection.
        loop {
            let state = *rx.borrow_and_update();
            if state.generation != born {
                return true;
            }
            match state.mode {
                Mode::Pass => break,
                Mode::Delay(d) => {
                    tokio::select! {
                        _ = tokio::time::sleep(d) => break,
                        _ = cut(&mut rx, born) => return true,
                    }
                }
                Mode::Stall => {
                    if rx.changed().await.is_err() {
                        return false;
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return false;
        }
    }
}

/// Resolves once a cut newer than `born` happens.
async fn cut(rx: &mut watch::Receiver<State>, born: u64) {
    let mut rx = rx.clone();
    if rx.wait_for(|s| s.generation != born).await.is_err() {
        std::future::pending::<()>().await;
    }
}

fn socket_linger_zero(stream: &TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid open socket and a correctly sized linger struct.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("test socket");
        let addr = l.local_addr().expect("test socket");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg).await?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await?;
        Ok(got)
    }

    #[tokio::test]
    async fn passes_delays_stalls_and_cuts() {
        let proxy = FaultProxy::start("127.0.0.1:0", echo_server().await).await.expect("test socket");
        let mut s = TcpStream::connect(proxy.addr).await.expect("test socket");
        assert_eq!(roundtrip(&mut s, b"hello").await.expect("test socket"), b"hello");

        proxy.set(Mode::Delay(Duration::from_millis(100)));
        let t = std::time::Instant::now();
        assert_eq!(roundtrip(&mut s, b"slow").await.expect("test socket"), b"slow");
        assert!(t.elapsed() >= Duration::from_millis(200), "two delayed hops: {:?}", t.elapsed());

        proxy.set(Mode::Stall);
        s.write_all(b"held").await.expect("test socket");
        let mut got = [0u8; 4];
        let stalled = tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut got)).await;
        assert!(stalled.is_err(), "nothing passes a stall");
        proxy.set(Mode::Pass);
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
            .await
            .expect("test socket")
            .expect("test socket");
        assert_eq!(&got, b"held");

        proxy.cut();
        // A reset, not a clean close: the next read fails with ECONNRESET instead of an EOF.
        let mut byte = [0u8; 1];
        let after = tokio::time::timeout(Duration::from_secs(5), s.read(&mut byte)).await.expect("test socket");
        let err = after.expect_err("a cut connection fails");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "a reset, not a clean close: {err:?}");
        // New connections work after a cut.
        let mut s2 = TcpStream::connect(proxy.addr).await.expect("test socket");
        assert_eq!(roundtrip(&mut s2, b"again").await.expect("test socket"), b"again");
        assert_eq!(proxy.accepted(), 2);
    }
}
